"""OpenAI-style error bodies: every failure the server reports is one APIError."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger("engine.server")

# OpenAI's error "type" per status; clients (the official SDK included) branch on the status.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def overloaded(message: str) -> APIError:
    return APIError(503, message, code="server_overloaded")


async def api_error_handler(request: Request, exc: Exception) -> JSONResponse:
    return exc.response()


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    # starlette's own 404 / 405 for unknown routes and methods, in OpenAI's shape
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    if status == 404:
        detail = f"no route {request.method} {request.url.path}"
    elif status == 405:
        detail = f"{request.method} is not allowed on {request.url.path}"
    response = APIError(status, str(detail)).response()
    response.headers.update(getattr(exc, "headers", None) or {})  # 405's Allow
    return response


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception(f"internal error on {request.method} {request.url.path}")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
