"""The errors the OpenAI API answers with: :class:`ApiError` (an HTTP status and an OpenAI error object naming the
field and the fix) and :func:`refusal_error` (the ranks' 429 / 503 refusals, with ``Retry-After``)."""

from __future__ import annotations

from aiohttp import web

from vexpert_runtime.serve import openai_api as oa
from vexpert_runtime.serve.events import ServeRefusal


class ApiError(Exception):
    """An error the API answers with an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = oa.error_body(message, type_, param, code)
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


def refusal_error(refusal: ServeRefusal) -> ApiError:
    """429 / 503 with ``Retry-After`` for a request the ranks cannot take now."""
    type_ = "rate_limit_error" if refusal.status == 429 else "server_error"
    headers = {"Retry-After": str(refusal.retry_after_s)}
    return ApiError(refusal.status, refusal.message, type_, None, refusal.code, headers)
