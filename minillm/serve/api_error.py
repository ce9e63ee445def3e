"""`APIError`: an OpenAI-style error (HTTP status and JSON body), raised by the request
parsers (protocol, structured) and the handlers, answered by the app."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An OpenAI-style error: `status` is the HTTP code, `body()` the JSON object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
