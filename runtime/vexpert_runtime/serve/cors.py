"""Cross-origin requests (CORS), as vLLM's server answers them (its ``--allowed-origins``, ``--allowed-methods``,
``--allowed-headers``, ``--allow-credentials``, Starlette's ``CORSMiddleware``): by default any origin may call the API
from a browser — a preflight ``OPTIONS`` is answered before the API key is asked for, and every response to a request
that names an ``Origin`` says which origins may read it (streams too: the headers go out when a response is prepared).
A preflight from an origin, method or header outside the policy is a 400, and other responses then carry no CORS
headers, so the browser withholds them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

_ALL = "*"
_SIMPLE_HEADERS = frozenset({"accept", "accept-language", "content-language", "content-type"})
PREFLIGHT_MAX_AGE_S = 600


@dataclass(frozen=True)
class CorsPolicy:
    """Which browser origins may call the API, with which methods and request headers (``"*"``: any)."""

    origins: tuple[str, ...] = (_ALL,)
    methods: tuple[str, ...] = (_ALL,)
    headers: tuple[str, ...] = (_ALL,)
    credentials: bool = False

    def allows_origin(self, origin: str) -> bool:
        return _ALL in self.origins or origin in self.origins

    def origin_header(self, origin: str) -> str:
        """``Access-Control-Allow-Origin`` for an allowed ``origin``: ``*`` where any origin may read without
        credentials, else the origin itself (a browser refuses ``*`` with credentials)."""
        return _ALL if _ALL in self.origins and not self.credentials else origin

    def allows_method(self, method: str) -> bool:
        return _ALL in self.methods or method.upper() in (m.upper() for m in self.methods)

    def disallowed_headers(self, requested: Sequence[str]) -> list[str]:
        if _ALL in self.headers:
            return []
        allowed = _SIMPLE_HEADERS | {h.lower() for h in self.headers}
        return [h for h in requested if h.lower() not in allowed]


def _requested_headers(request: web.Request) -> list[str]:
    raw = request.headers.get("Access-Control-Request-Headers", "")
    return [h.strip() for h in raw.split(",") if h.strip()]


def preflight(policy: CorsPolicy) -> Callable[..., Awaitable[web.StreamResponse]]:
    """A middleware that answers CORS preflights (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
    itself, before any route or API key check; every other request goes on."""

    @web.middleware
    async def answer(request: web.Request,
                     handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return await handler(request)
        requested = _requested_headers(request)
        refused = ([] if policy.allows_origin(origin) else ["origin"]) + (
            [] if policy.allows_method(method) else ["method"]) + (
            ["headers"] if policy.disallowed_headers(requested) else [])
        if refused:
            return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}")
        headers = {
            "Access-Control-Allow-Origin": policy.origin_header(origin),
            "Access-Control-Allow-Methods": ", ".join(
                ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT") if _ALL in policy.methods
                else policy.methods),
            "Access-Control-Allow-Headers": ", ".join(requested) if _ALL in policy.headers
            else ", ".join(sorted(_SIMPLE_HEADERS | set(policy.headers))),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        if policy.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        if headers["Access-Control-Allow-Origin"] != _ALL:
            headers["Vary"] = "Origin"
        return web.Response(status=200, text="OK", headers=headers)

    return answer


def response_headers(policy: CorsPolicy) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """An ``on_response_prepare`` hook: a response to a request from an allowed ``Origin`` says it may be read (set
    as it is prepared, so a stream's first bytes carry it too)."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not policy.allows_origin(origin) or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = policy.origin_header(origin)
        if policy.credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        if response.headers["Access-Control-Allow-Origin"] != _ALL:
            response.headers.add("Vary", "Origin")

    return add


def install(app: web.Application, policy: CorsPolicy) -> None:
    """Answer preflights first (ahead of the app's other middlewares, the API key's too) and mark responses."""
    app.middlewares.insert(0, preflight(policy))
    app.on_response_prepare.append(response_headers(policy))
