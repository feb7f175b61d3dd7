"""Who a token is, remembered for a few seconds.

Every request starts by turning its token into a tenant and a role. Asking the database each time costs a query
and a worker thread per request; remembering the answer briefly lets the request run on the event loop until its
route. Changes made through this process (revoking a token, changing a quota) clear the cache at once; another
API replica sees them within `ttl_s`, as Kubernetes' own token cache does. Unknown tokens are never remembered.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["TtlCache"]

V = TypeVar("V")


class TtlCache(Generic[V]):
    def __init__(self, *, ttl_s: float, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_entries, self.clock = ttl_s, max_entries, clock
        self._entries: dict[Hashable, tuple[float, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        entry = self._entries.get(key)
        if entry is None or self.clock() >= entry[0]:
            return None
        return entry[1]

    def put(self, key: Hashable, value: V) -> None:
        if self.ttl_s <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()  # a flood of distinct tokens: start over rather than grow without bound
            self._entries[key] = (self.clock() + self.ttl_s, value)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
