"""Request bodies, checked before the application parses them: their size, and numbers JSON does not have.

A plain ASGI middleware (no worker-thread trip, no copy beyond the body itself):
- a body larger than `max_bytes` is refused with 413, from its Content-Length before anything is read, or while
  it arrives when it is chunked (no Content-Length): the server never holds more than `max_bytes` of it;
- a JSON body of more than MAX_JSON_VALUES values (counted by its commas, at memory speed, before it is parsed)
  is refused with 413: parsing costs per value (1 MiB of `[1,1,...]` took 0.4 s), and no request needs so many;
  a body of more than PARSE_ASIDE_BYTES is parsed on a worker thread, so that the event loop goes on serving;
- a body that is not JSON at all (not UTF-8, malformed, nested past what can be read) is refused with 422 here,
  in the one error shape, rather than as the framework's own 400;
- a JSON body holding `NaN`, `Infinity` or `-Infinity` (Python's json accepts them, JSON does not), a number too
  large for a float (`1e400` reads as infinity) or an integer of thousands of digits is refused with 422 naming
  the field, instead of reaching the application, where such values got stored, trained on (a learning rate of
  Infinity) or broke the error answer itself (a 500 and a reset connection).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from kembed_api.platform import errors

__all__ = ["MAX_JSON_VALUES", "BodyGuard", "InvalidJson", "find_non_finite", "is_json"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_MAX_INT_DIGITS = 64  # far past any bound of the spec; Python refuses to parse more than 4300 digits at all
# Values in one JSON body: twice the largest spec the bounds allow (512 tables, 1,024 features, 4,096 dense
# columns, 64 labels: ~7,800 commas), which is also the largest body any route takes.
MAX_JSON_VALUES = 16_384
# Bodies larger than this are parsed on a worker thread: a spec is 1-3 KB, and a thread hop costs ~0.1 ms, while
# 16,000 numbers (32 KB) take 5-15 ms to parse.
PARSE_ASIDE_BYTES = 8192


class _NonFinite:
    """Stands for a number that is not a finite float, where the body holds it."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _parse_int(text: str) -> int | _NonFinite:
    return int(text) if len(text.lstrip("-")) <= _MAX_INT_DIGITS else _NonFinite(text[:12] + "...")


def _first_bad(value: Any, path: list[str | int]) -> tuple[list[str | int], str] | None:
    if isinstance(value, _NonFinite):
        return path, value.text
    if isinstance(value, dict):
        for key, item in value.items():
            if found := _first_bad(item, [*path, key]):
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if found := _first_bad(item, [*path, index]):
                return found
    return None


class InvalidJson(ValueError):
    """The body is not JSON at all (not UTF-8, not well formed, nested past what can be read)."""


def find_non_finite(body: bytes) -> tuple[list[str | int], str] | None:
    """(the path, the literal) of the first number in a JSON body that is not a finite float, or None; raises
    InvalidJson for a body that is not JSON."""
    found = False

    def mark(text: str) -> _NonFinite:
        nonlocal found
        found = True
        return _NonFinite(text)

    def check_float(text: str) -> float | _NonFinite:
        value = _parse_float(text)
        return mark(text) if isinstance(value, _NonFinite) else value

    def check_int(text: str) -> int | _NonFinite:
        value = _parse_int(text)
        return mark(value.text) if isinstance(value, _NonFinite) else value

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidJson("not UTF-8 text") from None
    try:
        parsed = json.loads(text, parse_constant=mark, parse_float=check_float, parse_int=check_int)
    except json.JSONDecodeError as error:
        raise InvalidJson(f"{error.msg} at position {error.pos}") from None
    except RecursionError:
        raise InvalidJson("nested too deeply") from None
    return _first_bad(parsed, []) if found else None


def is_json(headers: Headers) -> bool:
    """Whether FastAPI reads this body as JSON: no content type, or a JSON one."""
    content_type = headers.get("content-type")
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


class BodyGuard:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(scope, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body and is_json(headers):
            # Commas bound the values (a comma inside a string counts too: an upper bound, which is all it needs).
            if body.count(b",") >= MAX_JSON_VALUES:
                await errors.error_response(413, f"request body: more than {MAX_JSON_VALUES} JSON values")(
                    scope, receive, send)
                return
            try:
                bad = (await run_in_threadpool(find_non_finite, body) if len(body) > PARSE_ASIDE_BYTES
                       else find_non_finite(body))
            except InvalidJson as error:
                item = errors.ErrorItem(loc=["body"], type="json_invalid", msg=f"not JSON: {error}")
                await errors.validation_response([item.model_dump()])(scope, receive, send)
                return
            if bad:
                path, _literal = bad
                item = errors.ErrorItem(loc=["body", *path], type="finite_number",
                                        msg="Input should be a finite number (NaN, Infinity and numbers past a "
                                        "float's range are not JSON numbers)")
                await errors.validation_response([item.model_dump()])(scope, receive, send)
                return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, whenever it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, send: Send) -> None:
        response = errors.error_response(
            413, f"request body: larger than {self.max_bytes} bytes (KEMBED_MAX_BODY_BYTES)",
            headers={"Connection": "close"})  # the rest of the body is not read: this connection is done

        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, nothing, send)
