"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from sparse_cache import ChainError
from sparse_serve.prune import PruneError

# pydantic names union members in an error's location (``("prompt", "list[int]", 0)``); a client
# knows the field, not our type annotations, so those parts are left out of ``param``.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


class APIError(Exception):
    """An error answered to the client; ``status`` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(param: str, detail: str = "is not supported by this server") -> APIError:
    return APIError(400, f"`{param}` {detail}", param=param, code="unsupported_parameter")


def server_error(status: int, message: str, code: str | None = None, retry_after_s: int | None = None) -> APIError:
    headers = None if retry_after_s is None else {"Retry-After": str(retry_after_s)}
    return APIError(status, message, type="server_error", code=code, headers=headers)


# Chain errors that are not plain bad input: an unknown chain (404) and a second writer (409).
_CHAIN_STATUS = {"chain_not_found": 404, "chain_busy": 409}
# Prune errors that are not bad input: the pool has no room for the pruned copy now.
_PRUNE_STATUS = {"prune_no_room": 503}


def from_engine_error(error: ValueError, param: str | None = None, chain_param: str = "chain_id") -> APIError:
    """An engine's ValueError for bad input: a chain error keeps its ``code`` (404 for an unknown chain,
    409 for a busy one, 400 otherwise; ``param`` is ``chain_param``), a prune error its code and field
    (503 when the pool has no room), anything else is a 400."""
    if isinstance(error, ChainError):
        return APIError(_CHAIN_STATUS.get(error.code, 400), str(error), param=chain_param, code=error.code)
    if isinstance(error, PruneError):
        status = _PRUNE_STATUS.get(error.code, 400)
        return APIError(
            status,
            str(error),
            type="server_error" if status >= 500 else "invalid_request_error",
            param=error.param,
            code=error.code,
        )
    message = str(error)
    # The engine names the argument at fault first ("chain_append_start=9 is outside ..."): that is the field.
    named = next((f for f in _ENGINE_ARGUMENTS if message.startswith((f + "=", f + " "))), None)
    return bad_request(message, param=named or param)


# Request fields that the engine checks itself and names at the start of its error messages.
_ENGINE_ARGUMENTS = ("chain_append_start", "chain_id", "stop_token_ids", "max_tokens")


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem of a request body that failed validation, as a 400."""
    first = error.errors(include_url=False)[0]
    kind, msg = first["type"], first["msg"]
    if kind == "json_invalid":
        detail = msg.removeprefix("Invalid JSON: ")
        return bad_request(f"The request body is not valid JSON: {detail}", code="json_invalid")
    if kind == "model_type" and not first["loc"]:
        return bad_request("The request body must be a JSON object.")
    param = _param_name(first["loc"])
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    return bad_request(f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


def _param_name(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if not _is_type_tag(p))


def _is_type_tag(part) -> bool:
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part.startswith("literal"))
