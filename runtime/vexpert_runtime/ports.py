"""Local TCP ports for the process-group rendezvous (one definition for the node, demo,
calibration, benchmarks and tests)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the gloo/NCCL rendezvous of the ranks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
