"""Sub-commands of the ``vexpert`` CLI: one module each, exposing ``register(subparsers)``.

A module must import heavy dependencies (torch, kopf) inside its handler, not at module level,
because the parser imports every command module to build ``--help``.
"""


def shared_help(text: str) -> str:
    """``text`` as an argparse help string: argparse formats each help with ``%`` (for ``%(default)s``), so a
    description shared with the config's fields, which may hold a literal ``%``, has it doubled."""
    return text.replace("%", "%%")
