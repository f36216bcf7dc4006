"""kopf entry point: ``kopf run --standalone -m vexpert_operator.main --all-namespaces``."""

from . import handlers  # noqa: F401  (registers every handler with kopf's default registry)
