"""Thin kopf handlers, one module per resource; importing this package registers them all."""

from . import calibration, deployment, lifecycle, pods  # noqa: F401  (registration side effects)
