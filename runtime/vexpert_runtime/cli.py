"""The ``vexpert`` command line.

Each sub-command lives in its own module under :mod:`vexpert_runtime.commands` and exposes
``register(subparsers)``; the module is imported only when its command runs, so ``vexpert render``
works without torch. Bad input (``VExpertInputError``) becomes one ``error:`` line and exit code 2.
Before any command imports torch, :func:`~vexpert_runtime.threads.configure_cpu_threads` gives it
one CPU thread whose idle waits sleep (``VEXPERT_THREADS=N`` overrides).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from vexpert_runtime import __version__, commands
from vexpert_runtime.errors import VExpertInputError
from vexpert_runtime.shm_names import name_semaphores_by_run
from vexpert_runtime.threads import THREADS_ENV, configure_cpu_threads

EXIT_BAD_INPUT = 2


def _command_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vexpert", description="vExpert: balanced expert-parallel MoE inference",
        epilog=f"CPU threads: torch gets one intra-op thread (its work here is small tensors, and spinning thread "
               f"teams collapse on a busy machine); {THREADS_ENV}=N gives it N.")
    parser.add_argument("--version", action="version", version=f"vexpert {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        module = importlib.import_module(f"{commands.__name__}.{name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        configure_cpu_threads()  # before any command imports torch
    except VExpertInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    name_semaphores_by_run()  # this run's /dev/shm objects are told apart from other programs'
    try:
        return int(args.handler(args) or 0)
    except VExpertInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
