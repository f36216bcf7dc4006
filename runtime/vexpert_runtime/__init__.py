"""vExpert runtime: allocator, performance model, simulator, node runtime and CLI.

Importing this package is cheap and torch-free; modules that need torch import it themselves,
so the operator (which must run without torch) can share the pydantic API types in
:mod:`vexpert_runtime.policy.profile` and :mod:`vexpert_runtime.config`.
"""

__version__ = "0.1.0"
