"""The OpenAI error answer every route raises; no other serve module is imported here, so any may import it."""

from __future__ import annotations


class ApiError(Exception):
    """An answer in the OpenAI error format: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {
        400: "invalid_request_error",
        401: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "service_unavailable",
        504: "timeout",
    }

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }
