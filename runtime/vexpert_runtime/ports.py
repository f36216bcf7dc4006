"""Local TCP ports: the process-group rendezvous (one definition for the node, demo, calibration,
benchmarks and tests) and the check that the API's address can be listened on."""

from __future__ import annotations

import errno
import socket

from vexpert_runtime.errors import VExpertInputError


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the gloo/NCCL rendezvous of the ranks)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def check_listen_address(host: str, port: int, reuse_port: bool = False) -> None:
    """Refuse ``host:port`` before anything loads where the API server could not listen there — a port in use, a
    privileged port, a host that is no address of this machine — by binding each of its addresses as the server
    will (``SO_REUSEADDR``, ``SO_REUSEPORT`` with ``reuse_port``, IPv6 sockets IPv6-only, as asyncio does) and
    closing them. As vLLM, which binds before it builds the engine: found only once the model has loaded, the
    error cost the whole start and came as a traceback."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise VExpertInputError("--host", f"{host!r} does not resolve to an address ({exc.strerror})",
                                "pass an address of this machine, or 0.0.0.0 for all of its interfaces") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise listen_error(host, port, exc) from None


def listen_error(host: str, port: int, exc: OSError) -> VExpertInputError:
    """Why ``host:port`` cannot be listened on, as the input error that names the flag to change."""
    if exc.errno == errno.EADDRINUSE:
        return VExpertInputError("--port", f"{host}:{port} is in use ({exc.strerror})",
                                 "pass a free port, or stop the process that listens there")
    if exc.errno == errno.EACCES:
        return VExpertInputError("--port", f"listening on {host}:{port} is not permitted ({exc.strerror})",
                                 "pass a port of 1024 or more, or run with the privilege to bind low ports")
    return VExpertInputError("--host", f"cannot listen on {host}:{port} ({exc.strerror})",
                             "pass an address of this machine, or 0.0.0.0 for all of its interfaces")
