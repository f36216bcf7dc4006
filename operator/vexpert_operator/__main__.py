"""``python -m vexpert_operator [kopf run options]``: run the operator (default: all namespaces).

With ``VEXPERT_OPERATOR_LEADER_ELECTION=true`` (the chart's default, two replicas) kopf starts only
once this replica holds the Lease (``leader.py``); a standby answers the liveness probe meanwhile.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("-A", "--all-namespaces") or a.startswith(("-n", "--namespace")) for a in args):
        args.append("--all-namespaces")
    from kopf import cli

    from . import leader
    from .settings import OperatorSettings

    def run() -> int:
        return int(cli.main(["run", "--standalone", "-m", "vexpert_operator.main", *args], standalone_mode=False) or 0)

    settings = OperatorSettings.from_env()
    if not settings.leader_election:
        return run()
    return leader.run_as_leader(run, settings.lease_namespace or leader.own_namespace(), settings.lease_duration_s,
                                leader.liveness_port(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
