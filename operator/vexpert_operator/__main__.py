"""``python -m vexpert_operator [kopf run options]``: run the operator (default: all namespaces)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("-A", "--all-namespaces") or a.startswith(("-n", "--namespace")) for a in args):
        args.append("--all-namespaces")
    from kopf import cli

    return int(cli.main(["run", "--standalone", "-m", "vexpert_operator.main", *args], standalone_mode=False) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
