"""Who a token is, remembered for a few seconds.

Every request starts by turning its token into a tenant and a role. Asking the database each time costs a query
and a worker thread per request; remembering the answer briefly lets the request run on the event loop until its
route. Changes made through this process (revoking a token, changing a quota) clear the cache at once; another
API replica sees them within `ttl_s`, as Kubernetes' own token cache does. Unknown tokens are never remembered.

A token in use never expires under its callers' feet: past half its time an entry is looked up again in the
background while requests go on being answered from it, and requests that find no entry share one lookup. (When
every entry of a busy token expired at once, each request arriving during the lookup made its own: at 300
requests/s a burst of lookups every `ttl_s` that was the whole read p99.)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["TtlCache"]

log = logging.getLogger(__name__)

V = TypeVar("V")


class TtlCache(Generic[V]):
    def __init__(self, *, ttl_s: float, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._entries: dict[Hashable, tuple[float, V]] = {}  # key -> (time it was looked up, value)
        self._lock = threading.Lock()
        self._lookups: dict[Hashable, asyncio.Task] = {}  # under way; touched on the event loop only
        self._generation = 0  # bumped by clear(): a lookup that began before it must not put its answer back

    async def resolve(self, key: Hashable, look_up: Callable[[], Awaitable[V | None]]) -> V | None:
        """The cached value of `key`, else `await look_up()` (shared by every caller asking meanwhile)."""
        entry = self._entries.get(key)
        age = self.clock() - entry[0] if entry else None
        if age is not None and age < self.ttl_s:
            if age >= self.ttl_s / 2 and key not in self._lookups:
                self._start(key, look_up).add_done_callback(_log_failure)  # refresh ahead; answer from the entry
            return entry[1]
        lookup = self._lookups.get(key) or self._start(key, look_up)
        return await asyncio.shield(lookup)  # one caller going away does not cancel the others' lookup

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._generation += 1

    def _start(self, key: Hashable, look_up: Callable[[], Awaitable[V | None]]) -> asyncio.Task:
        generation, started = self._generation, self.clock()

        async def run() -> V | None:
            try:
                value = await look_up()
                with self._lock:
                    if value is None or self.ttl_s <= 0:
                        self._entries.pop(key, None)  # revoked or expired since: never remembered
                    elif generation == self._generation:
                        if len(self._entries) >= self.max_entries:
                            self._entries.clear()  # a flood of distinct tokens: start over, not grow unbounded
                        self._entries[key] = (started, value)
                return value
            finally:
                self._lookups.pop(key, None)

        self._lookups[key] = task = asyncio.ensure_future(run())
        return task


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("refreshing a cached token failed; the next request retries", exc_info=task.exception())
