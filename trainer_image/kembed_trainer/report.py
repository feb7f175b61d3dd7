"""Rank 0's records: one JSON line each on stdout, and POSTs to the API that are retried until acknowledged.

Reporting must never slow training, so HTTP goes through a background thread; and no record may be lost (a job
that ended SUCCEEDED with no result and an older checkpoint than its trainer wrote was the cost of dropping
them). So each record is retried, with a backoff that grows to `max_backoff_s` and no further, until the API
acknowledges it (2xx), also across an API restart; records go in order, those queued behind one another in one
POST (the API rate-limits a job's POSTs, not its records). `close()` holds the
trainer's exit until every record is delivered (bounded by `flush_s`): the final `checkpoint` and `done`
records are committed before the trainer exits, and so before the API can see it end.

A retry may reach the API twice (the first try committed, its answer was lost), so each record carries its
run (random, one per trainer process) and sequence number; the API applies a record of a run once and never
one older than the last it applied (kembed_api.jobs.reports.apply_report). The API refusing a record for good
(4xx) drops it: retrying cannot change its mind; a 401/403/404 means the job has a new token or is gone, and
ends delivery altogether.
"""

from __future__ import annotations

import json
import math
import os
import queue
import secrets
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

from kembed_contract import runtime

__all__ = ["STOPPED_FLUSH_S", "Reporter"]

STOPPED_FLUSH_S = 5.0  # how long a trainer that did not finish (stopped, failed) waits for its reports

_STOP = object()
# Answers that mean "not now" rather than "never": retried like a connection error.
_RETRYABLE_STATUSES = frozenset({408, 425, 429})
# Answers that mean this trainer may no longer report at all (a new attempt has its own token, or the job is gone).
_GONE_STATUSES = frozenset({401, 403, 404})
# What became of a POST.
_DELIVERED, _REFUSED, _GONE = "delivered", "refused", "gone"


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
        timeout_s: float = 10.0,
        max_backoff_s: float = 5.0,
        flush_s: float = 600.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`timeout_s`: one POST's wait for an answer (a busy API may take seconds; a retry after it is harmless).
        `max_backoff_s`: the longest pause between tries. `flush_s`: how long `close()` waits for the API (an API
        restart takes seconds; an API away for longer than this loses the records still queued, which stdout
        keeps)."""
        self.enabled = enabled
        self._url = url
        self._token = token
        self._out = out or sys.stdout
        self._clock = clock
        self._timeout_s = timeout_s
        self._max_backoff_s = max_backoff_s
        self._flush_s = flush_s
        self._sleep = sleep
        self._run = secrets.token_hex(8)
        self._seq = 0
        self._deadline: float | None = None  # set by close(): until then, tries go on for as long as training does
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.undelivered = 0  # records given up on (refused, or still queued when the flush ran out)
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
        self._seq += 1
        record = _finite({"event": event, "step": step, "time": self._clock(), **fields,
                          "run": self._run, "seq": self._seq})
        # One write per record, newline included: print writes the newline separately, and output of another
        # thread between the two would join this record's line and hide it from whoever parses the log.
        self._out.write(json.dumps(record, allow_nan=False) + "\n")
        self._out.flush()
        if self._thread is not None:
            self._queue.put(record)

    def close(self, *, flush_s: float | None = None) -> None:
        """Return once every record reached the API, or `flush_s` (default: the reporter's) passed; then say how
        many did not."""
        if self._thread is None:
            return
        flush_s = self._flush_s if flush_s is None else flush_s
        self._deadline = time.monotonic() + flush_s
        self._queue.put(_STOP)
        self._thread.join(timeout=flush_s + self._timeout_s)
        # Still posting after that: the record in flight and those behind it (less the stop marker) are lost.
        missing = self.undelivered + (self._queue.qsize() if self._thread.is_alive() else 0)
        self._thread = None
        if missing:
            print(f"kembed: {missing} report(s) did not reach the API ({self._url}); they are in this log",
                  file=sys.stderr, flush=True)

    def _post_loop(self) -> None:
        gone = stopping = False
        while not stopping and (record := self._queue.get()) is not _STOP:
            batch = [record]  # with the records queued behind it: one POST for all (the API limits POSTs per job)
            while len(batch) < runtime.MAX_RECORDS_PER_REPORT and not self._queue.empty():
                if (queued := self._queue.get()) is _STOP:
                    stopping = True
                    break
                batch.append(queued)
            if gone:
                self.undelivered += len(batch)
            else:
                gone = not self._deliver(batch)

    def _deliver(self, batch: list[dict[str, Any]]) -> bool:
        """Deliver `batch` in one POST, counting what does not get there; False when delivery should stop. A batch
        refused for good goes again one record at a time, so that only the record the API refuses is lost."""
        outcome = self._post(batch if len(batch) > 1 else batch[0])
        if outcome == _REFUSED and len(batch) > 1:
            for sent, record in enumerate(batch, 1):
                if not self._deliver([record]):
                    self.undelivered += len(batch) - sent
                    return False
            return True
        if outcome != _DELIVERED:
            self.undelivered += len(batch)
        return outcome != _GONE

    def _post(self, body: dict[str, Any] | list[dict[str, Any]]) -> str:
        """Post until acknowledged (_DELIVERED), refused for good (_REFUSED), or until delivery should stop: the job
        is gone, or the flush ran out (_GONE)."""
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = json.dumps(body, allow_nan=False).encode()
        backoff = 0.2
        while True:
            try:
                req = urllib.request.Request(self._url, data=data, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
                    resp.read()
                return _DELIVERED
            except urllib.error.HTTPError as exc:
                if exc.code in _GONE_STATUSES:
                    return _GONE
                if 400 <= exc.code < 500 and exc.code not in _RETRYABLE_STATUSES:
                    return _REFUSED  # refused for good; the next records may not be
            except Exception:  # noqa: BLE001,S110 - the API down, restarting or slow: try again
                pass
            if self._deadline is not None and time.monotonic() + backoff > self._deadline:
                return _GONE
            self._sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)
