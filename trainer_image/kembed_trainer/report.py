"""Rank 0's records: one JSON line each on stdout, and best-effort POSTs to the API.

Reporting must never slow or fail training, so HTTP goes through a background thread with short timeouts and
a few retries, and records that cannot be delivered are dropped (stdout, which the launcher keeps, has them all).
"""

from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

from kembed_trainer import runtime

__all__ = ["Reporter"]

_STOP = object()


def _finite(value: Any) -> Any:
    """The record with every NaN or infinity as null: JSON has no such numbers, and the API refuses them (a
    diverged loss is reported as null, not as a record the API cannot read)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class Reporter:
    def __init__(
        self,
        *,
        enabled: bool,
        url: str | None = None,
        token: str | None = None,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
        retries: int = 3,
    ) -> None:
        self.enabled = enabled
        self._url = url
        self._token = token
        self._out = out or sys.stdout
        self._clock = clock
        self._timeout_s = timeout_s
        self._retries = retries
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        if enabled and url:
            self._thread = threading.Thread(target=self._post_loop, name="kembed-report", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, *, enabled: bool) -> Reporter:
        return cls(
            enabled=enabled,
            url=os.environ.get(runtime.ENV_REPORT_URL) or None,
            token=os.environ.get(runtime.ENV_REPORT_TOKEN) or None,
        )

    def emit(self, event: str, step: int, **fields: Any) -> None:
        if not self.enabled:
            return
        record = _finite({"event": event, "step": step, "time": self._clock(), **fields})
        print(json.dumps(record, allow_nan=False), file=self._out, flush=True)
        if self._thread is not None:
            self._queue.put(record)

    def close(self, wait_s: float = 5.0) -> None:
        """Give queued records a bounded chance to reach the API (the `done` record matters most)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout=wait_s)
        self._thread = None

    def _post_loop(self) -> None:
        while (record := self._queue.get()) is not _STOP:
            self._post(record)

    def _post(self, record: dict[str, Any]) -> None:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        body = json.dumps(record).encode()
        for attempt in range(self._retries):
            try:
                req = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
                    resp.read()
                return
            except Exception as exc:  # noqa: BLE001 - the API being down must not stop training
                if 400 <= getattr(exc, "code", 0) < 500:
                    return  # the API refused this record; retrying won't change its mind
                time.sleep(0.2 * 2**attempt)
