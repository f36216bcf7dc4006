"""Sub-commands of the ``vexpert`` CLI: one module each, exposing ``register(subparsers)``.

A module must import heavy dependencies (torch, kopf) inside its handler, not at module level,
because the parser imports every command module to build ``--help``.
"""
