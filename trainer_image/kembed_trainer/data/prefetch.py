"""Runs an iterator in a background thread, at most `depth` items ahead of its consumer.

Reading, parsing and converting release the GIL for most of their time (pyarrow, NumPy, torch), so a reader
thread overlaps them with the training step. The bound keeps memory flat whatever the data's size. An error in
the thread is raised to the consumer at the item where it happened.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")
_END = object()
_POLL_S = 0.1  # how often a blocked reader checks whether it was closed


class Prefetcher(Generic[T]):
    def __init__(self, items: Iterator[T], *, depth: int, name: str = "data-reader") -> None:
        self._queue: queue.Queue = queue.Queue(depth)
        self._closed = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, args=(items,), name=name, daemon=True)
        self._thread.start()

    def _run(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put((item, None)):
                    return
            self._put((_END, None))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, who raises it
            self._put((None, error))

    def _put(self, entry) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._ended:
            raise StopIteration
        item, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        if item is _END:
            self._ended = True
            raise StopIteration
        return item

    def close(self) -> None:
        self._closed.set()
        self._thread.join()
