"""One error shape for every answer that is not a success, and the statuses each route documents.

Every 4xx (and the rare 5xx) is `{"detail": "<one line per problem, naming the field>", "errors": [...]}`:
`detail` is for people (the CLI prints it), `errors` for programs (one entry per field at fault, empty when the
problem is not about a field). FastAPI's own validation answer (`detail` as a list) and Starlette's
(`detail` as a string) are both turned into it here, so a client parses one schema whatever went wrong.
Errors never carry the offending input back: it may be large, or a secret sent by mistake.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

__all__ = [
    "ErrorBody",
    "ErrorItem",
    "error_response",
    "install",
    "issue_location",
    "responses",
]

# What each documented status means, in the words every route shares (a route may add its own, more precise).
_MEANING = {
    400: "The request is malformed (a body that is not JSON where JSON is expected).",
    401: "Missing, invalid, expired or revoked token.",
    403: "The token's role may not do this.",
    404: "No such object for this tenant (another tenant's is not found either).",
    409: "Conflicts with what exists.",
    413: "The request body is larger than the server accepts (KEMBED_MAX_BODY_BYTES), or holds more JSON values "
         "than any request needs.",
    422: "The request is invalid; `detail` names the field at fault (NaN and Infinity are never numbers).",
    429: "Too many requests: a rate limit (`Retry-After` says in how many seconds to try again), or for a "
         "submission the tenant's queue is full (quota.max_queued_jobs).",
}
# Statuses any route can answer whatever it does: a body too large, invalid input (query, headers or body), a
# rate limit.
_ALWAYS = (413, 422, 429)
_MAX_ITEMS = 20  # a body with thousands of mistakes gets the first ones, not an answer as large as itself


class ErrorItem(BaseModel):
    loc: list[str | int] = Field(description="Where: `body`, `query`, `header` or `path`, then the field's path.")
    msg: str
    type: str = Field(description="Machine-readable kind, e.g. `greater_than`, `finite_number`, `missing`.")


class ErrorBody(BaseModel):
    detail: str = Field(description="What went wrong, one line per problem, each naming its field.")
    errors: list[ErrorItem] = Field(default_factory=list, description="One entry per field at fault.")


def issue_location(loc: Sequence[str | int]) -> str:
    """`trainer.training.steps` for a body field; `query.limit`, `header.idempotency-key` for the others."""
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    return ".".join(str(part) for part in parts)


# Pydantic's messages that quote the input, said without it.
_WITHOUT_INPUT = {
    "union_tag_invalid": "Input tag does not match any of the expected tags: {expected_tags}",
}
_MAX_LOC_PART = 64  # a key of the body is part of `loc`; one of a megabyte is shortened, not echoed whole


def _message(error: dict[str, Any]) -> str:
    """The error's message, never quoting the input: what a field held may be large, or a secret."""
    kind = str(error.get("type", "value_error"))
    if kind in _WITHOUT_INPUT:
        return _WITHOUT_INPUT[kind].format_map(_Missing(error.get("ctx") or {}))
    msg = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    given = error.get("input")
    if isinstance(given, str) and len(given) >= 4 and given in msg:  # a message of ours that quotes its value
        msg = msg.replace(given, "(the value given)")
    return msg


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "?"


def _loc_part(part: Any) -> str | int:
    if isinstance(part, int):
        return part
    text = str(part)
    return text if len(text) <= _MAX_LOC_PART else text[:_MAX_LOC_PART] + "..."


def _items(raw: Iterable[dict[str, Any]]) -> list[ErrorItem]:
    return [ErrorItem(loc=[_loc_part(p) for p in error.get("loc", ())], msg=_message(error),
                      type=str(error.get("type", "value_error"))) for error in list(raw)[:_MAX_ITEMS]]


def _summary(items: list[ErrorItem], total: int) -> str:
    lines = [f"{where}: {item.msg}" if (where := issue_location(item.loc)) else item.msg for item in items]
    if total > len(items):
        lines.append(f"(and {total - len(items)} more)")
    return "\n".join(lines) or "invalid request"


def error_response(status_code: int, detail: str, *, errors: Sequence[ErrorItem] = (),
                   headers: dict[str, str] | None = None) -> Response:
    body = ErrorBody(detail=detail, errors=list(errors))
    return Response(body.model_dump_json().encode(), status_code=status_code, headers=headers,
                    media_type="application/json")


def validation_response(raw: Sequence[dict[str, Any]]) -> Response:
    items = _items(raw)
    return error_response(422, _summary(items, len(raw)), errors=items)


async def _on_validation_error(_request: Request, exc: RequestValidationError) -> Response:
    return validation_response(exc.errors())


async def _on_http_error(_request: Request, exc: StarletteHTTPException) -> Response:
    if isinstance(exc.detail, ErrorBody):
        return error_response(exc.status_code, exc.detail.detail, errors=exc.detail.errors, headers=exc.headers)
    return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


def install(app: FastAPI) -> None:
    """Answer every error of `app` in the one shape; validation errors of FastAPI's too."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)


def responses(*statuses: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route: these statuses (plus those every route can answer), each with the one error
    shape. `descriptions` override a meaning by status, e.g. `responses(404, s404="No such job.")`."""
    documented: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, *_ALWAYS}):
        documented[status] = {"model": ErrorBody,
                              "description": descriptions.get(f"s{status}", _MEANING.get(status, "Error."))}
    return documented
