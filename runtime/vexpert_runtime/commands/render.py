"""``vexpert render``: print the manifests the operator would create for a VExpertDeployment."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "render",
        help="print the manifests the operator would create (for review and GitOps)",
        description="Render a VExpertDeployment into its ConfigMap, Service, StatefulSet and PodDisruptionBudget "
                    "with the operator's own code. Without a cluster, node type and profiles come from files.",
    )
    parser.add_argument("-f", "--filename", required=True, help="YAML with a VExpertDeployment (and optional profiles)")
    parser.add_argument("--node-profile", metavar="FILE",
                        help="VExpertNodeProfile YAML or PerformanceProfile JSON of the target node type")
    parser.add_argument("--model-profile", metavar="FILE",
                        help="VExpertModelProfile YAML or PerformanceProfile JSON of the model revision")
    parser.add_argument("-n", "--namespace", help="namespace (default: the object's, else 'default')")
    parser.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    parser.set_defaults(handler=_render)


def _render(args: argparse.Namespace) -> int:
    from vexpert_operator.render import dump_json, render_file

    result = render_file(args.filename, args.namespace, args.node_profile, args.model_profile)
    if args.output == "json":
        sys.stdout.write(dump_json(result.manifests) + "\n")
        for note in result.notes:
            print(note, file=sys.stderr)
    else:
        sys.stdout.write(result.to_yaml())
    return 0
