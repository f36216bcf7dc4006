"""vExpert Kubernetes operator (kopf): ``VExpertDeployment`` → a calibrated, balanced MoE decode group.

Layout (crate-operator style):

* :mod:`.api` — the custom resources as pydantic models (the CRDs in ``crds/`` are generated from
  them by :mod:`.crdgen`); the profile and runtime-config types are reused from ``vexpert_runtime``.
* pure decisions: :mod:`.nodetypes` (node typing), :mod:`.validation`, :mod:`.sizing`,
  :mod:`.calibration`, :mod:`.group` (group restarts and rolls), :mod:`.tuning` (k and Np),
  :mod:`.conditions` (the group's conditions and why its pods are Pending).
* pure builders: :mod:`.manifests` (``build_*`` functions returning manifests) and :mod:`.plan`
  (the single code path shared by the operator and ``vexpert render``).
* effects: :mod:`.kube` (the only module that talks to the API server), :mod:`.calibrator`
  (calibration Jobs and profiles), :mod:`.reconciler` (the glue), :mod:`.handlers` (thin kopf
  handlers), :mod:`.metrics` (operator metrics).

Nothing here imports torch.
"""

__version__ = "0.1.0"
