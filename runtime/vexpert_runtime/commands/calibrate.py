"""``vexpert calibrate hardware|model``: measure a node type, or fit a model's Δ(L, V).

Job contract with the operator (``vexpert_operator.manifests``): the container writes the
``PerformanceProfile`` JSON (≤ 4096 bytes) as its termination message and exits 0, or exits
non-zero with a one-line reason there. ``--termination-message-path`` is accepted as an alias of
``--termination-log`` because that is what the operator's Job passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

EXIT_MEASUREMENT_FAILED = 1
DEFAULT_OUTPUT = "vexpert-hardware-profile.json"
TERMINATION_HELP = (
    "where to write the termination message (the profile JSON, ≤ 4096 bytes, or a one-line failure "
    "reason); default /dev/termination-log inside a Kubernetes container, else none"
)


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "calibrate",
        help="measure a node type (BW_H2D, η, compute-bound TPE) or fit a model's Δ(L, V)",
        description="Calibrate vExpert's performance model (paper §3.2): `hardware` on a GPU node, `model` on traces.",
    )
    what = parser.add_subparsers(dest="calibrate_command", metavar="WHAT", required=True)

    hw = what.add_parser(
        "hardware",
        help="H2D bandwidth under all-to-all contention, η (Eq. 7) and the MoE compute-bound threshold",
        description=(
            "On every GPU of the node at once: pinned H2D copy alone, decode-size all-to-all alone, and both "
            "concurrently; derives BW_H2D (slowest GPU under contention), η = (T*_a2a − T_a2a)/T_h2d and the "
            "tokens-per-expert knee of one expert's SwiGLU MLP. Writes a PerformanceProfile (hardware half). "
            "--cpu runs the same protocol on CPU processes over gloo (for CI; its numbers mean nothing)."
        ),
    )
    hw.add_argument("--cpu", action="store_true", help="run the CPU twin (gloo, host copies, fp32) instead of GPUs")
    hw.add_argument("--gpus", type=int, default=None,
                    help="ranks to use (default: every visible GPU; with --cpu: 2 processes)")
    hw.add_argument("--iters", type=int, default=None, help="timed iterations per measurement (default 20)")
    hw.add_argument("--expert-bytes", type=int, default=None, metavar="B",
                    help="H2D payload per GPU in bytes (default: 2 experts of the shape below, bf16; fp32 with --cpu)")
    hw.add_argument("--hidden", type=int, default=None, help="model hidden size (default 7168; 1024 with --cpu)")
    hw.add_argument("--intermediate", type=int, default=None,
                    help="expert intermediate size (default 2048; 256 with --cpu)")
    hw.add_argument("--tokens", type=int, default=None, help="decode tokens per GPU (default 256; 32 with --cpu)")
    hw.add_argument("--top-k", type=int, default=None, help="experts per token (default 8)")
    hw.add_argument("--max-tpe", type=int, default=1024, help="largest tokens-per-expert point of the compute curve")
    hw.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds (default 300)")
    hw.add_argument("--node-type", default=None, metavar="JSON",
                    help="NodeTypeKey JSON to record as provenance (the operator passes its key); default: detected")
    hw.add_argument("--output", default=None, metavar="FILE",
                    help=f"write the full result (a PerformanceProfile with details) here (default without --json: "
                         f"./{DEFAULT_OUTPUT})")
    hw.add_argument("--json", action="store_true", help="print the profile JSON on stdout instead of a summary")
    hw.add_argument("--termination-log", "--termination-message-path", dest="termination_log", default=None,
                    metavar="PATH", help=TERMINATION_HELP)
    hw.set_defaults(handler=_run_hardware)

    model = what.add_parser(
        "model",
        help="fit Δ(L, V) = α·L + β·V + intercept (Eq. 4) on expert-load traces",
        description="Fit the load-balance half of the profile from traces written by `vexpert trace build`.",
    )
    model.add_argument("--trace", action="append", required=True, metavar="FILE",
                       help="trace .npz (repeatable; all must share [layers, experts])")
    model.add_argument("--gpus", type=int, required=True, help="EP ranks the plans are made for")
    model.add_argument("--vmax", type=int, default=2, help="fit V = 1..vmax vExperts per GPU (default 2)")
    model.add_argument("--k", type=int, default=10, help="allocation window in iterations (default 10)")
    model.add_argument("--evaluate", choices=["next", "same"], default="next",
                       help="score a plan on the next window (online, default) or the same one (in-sample)")
    model.add_argument("--model", default="", help="model name recorded in the provenance")
    model.add_argument("--revision", default="", help="model revision recorded in the provenance")
    model.add_argument("--output", default=None, metavar="FILE", help="write the full result here")
    model.add_argument("--json", action="store_true", help="print the profile JSON on stdout")
    model.add_argument("--termination-log", "--termination-message-path", dest="termination_log", default=None,
                       metavar="PATH", help=TERMINATION_HELP)
    model.set_defaults(handler=_run_model)


def _with_termination_log(args: argparse.Namespace, body: Callable[[], int]) -> int:
    """Resolve the default termination log, and write a one-line reason there if ``body`` fails."""
    from vexpert_runtime.calibration.hardware import (
        CalibrationError,
        default_termination_log,
        write_termination_message,
    )
    from vexpert_runtime.errors import VExpertInputError

    if args.termination_log is None:
        args.termination_log = default_termination_log()
    try:
        return body()
    except CalibrationError as exc:
        reason = " ".join(str(exc).split())
        write_termination_message(args.termination_log, reason)
        print(f"error: {reason}", file=sys.stderr)
        return EXIT_MEASUREMENT_FAILED
    except VExpertInputError as exc:
        write_termination_message(args.termination_log, " ".join(str(exc).split()))
        raise
    except Exception as exc:
        write_termination_message(args.termination_log, " ".join(f"{type(exc).__name__}: {exc}".split()))
        raise


def _parse_node_type(text: str | None) -> Any:
    from pydantic import ValidationError

    from vexpert_runtime.errors import VExpertInputError
    from vexpert_runtime.policy.profile import NodeTypeKey

    if text is None:
        return None
    try:
        return NodeTypeKey.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise VExpertInputError("--node-type", f"not a NodeTypeKey JSON object ({type(exc).__name__})",
                                'pass e.g. {"gpu_product": "NVIDIA-H200", "gpu_count": 8}') from None


def _run_hardware(args: argparse.Namespace) -> int:
    def body() -> int:
        import torch

        from vexpert_runtime.calibration.hardware import (
            fit_to_termination_message,
            format_summary,
            run_hardware_calibration,
            settings_from_args,
            write_termination_message,
        )
        from vexpert_runtime.outputs import check_output_path

        node_type = _parse_node_type(args.node_type)
        if args.output:
            check_output_path(args.output, "--output")
        cuda = torch.cuda.is_available()
        settings = settings_from_args(args, cuda, torch.cuda.device_count() if cuda else 0)
        log = None if args.json else (lambda line: print(f"vexpert calibrate: {line}", file=sys.stderr, flush=True))
        profile, full = run_hardware_calibration(settings, node_type, log)
        output = args.output or (None if args.json else DEFAULT_OUTPUT)
        if output:
            Path(output).write_text(full.model_dump_json(indent=2) + "\n")
        write_termination_message(args.termination_log, fit_to_termination_message(profile))
        if args.json:
            print(profile.model_dump_json(indent=2))
        else:
            print(format_summary(profile))
            print(f"profile: {output}")
        return 0

    return _with_termination_log(args, body)


def _run_model(args: argparse.Namespace) -> int:
    def body() -> int:
        from vexpert_runtime.calibration.model_fit import run_model_calibration

        return int(run_model_calibration(args) or 0)

    return _with_termination_log(args, body)
