"""Error bodies in the shape each client API expects, so its official SDK raises its own types.

OpenAI: `{"error": {"message", "type", "param", "code"}}`, every malformed request a 400.
Anthropic (/v1/messages): `{"type": "error", "error": {"type", "message"}}`.
`code` (OpenAI) keeps the name of our exception class, for clients that want it.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

_OPENAI_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def is_gateway_path(path: str) -> bool:
    return "/v1/" in path and not path.startswith("/v1/traces")


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/").endswith("/v1/messages")


def openai_error_body(status: int, kind: str, message: str) -> dict:
    error_type = (
        "server_error" if status >= 500 else _OPENAI_TYPES.get(status, "invalid_request_error")
    )
    return {"error": {"message": message, "type": error_type, "param": None, "code": kind}}


def anthropic_error_body(status: int, message: str) -> dict:
    error_type = (
        "api_error" if status >= 500 else _ANTHROPIC_TYPES.get(status, "invalid_request_error")
    )
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_response(path: str, status: int, kind: str, message: str) -> JSONResponse:
    # Both APIs answer a request that does not validate with 400, never FastAPI's 422.
    status = 400 if status == 422 else status
    if is_anthropic_path(path):
        return JSONResponse(anthropic_error_body(status, message), status_code=status)
    return JSONResponse(openai_error_body(status, kind, message), status_code=status)
