"""The operator's in-memory view of the batch Jobs and pods that belong to EmbeddingJobs, fed by watch events.

Kopf delivers every watch event of those Jobs and pods to `record_*`; the reconciler of an EmbeddingJob reads
its children here instead of asking the API server on each pass (500 running jobs would otherwise mean
thousands of reads a second), and sleeps on `wakeup(key)` until one of its children changes.

Only a change of what the runner decides on wakes it: most watch events of a child (the Job controller's status
counters, a finalizer removed, a resourceVersion) leave its view as it was, and a pass over an unchanged view
would find nothing to do.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kembed_operator.views import JOB_LABEL, BatchJobView, PodView, batch_job_view, pod_view

__all__ = ["Observed"]

Key = tuple[str, str]  # (namespace, EmbeddingJob name)


class Observed:
    def __init__(self) -> None:
        self._jobs: dict[Key, BatchJobView] = {}
        self._pods: dict[Key, dict[str, PodView]] = {}
        self._wakeups: dict[Key, asyncio.Event] = {}

    @staticmethod
    def key_of(body: dict[str, Any]) -> Key | None:
        meta = body.get("metadata") or {}
        owner = (meta.get("labels") or {}).get(JOB_LABEL)
        return (meta.get("namespace", ""), owner) if owner else None

    def record_job(self, event_type: str | None, body: dict[str, Any]) -> None:
        key = self.key_of(body)
        if key is None or body["metadata"].get("name") != key[1]:
            return
        current = self._jobs.get(key)
        if event_type == "DELETED":
            if current is None or current.uid != body["metadata"].get("uid"):
                return
            del self._jobs[key]
        else:
            view = batch_job_view(body)
            if view == current:
                return
            self._jobs[key] = view
        self.wake(key)

    def record_pod(self, event_type: str | None, body: dict[str, Any]) -> None:
        key = self.key_of(body)
        if key is None:
            return
        pods = self._pods.setdefault(key, {})
        name = body["metadata"].get("name", "")
        if event_type == "DELETED":
            gone = pods.pop(name, None)
            if not pods:
                del self._pods[key]
            if gone is None:
                return
        else:
            view = pod_view(body)
            if pods.get(name) == view:
                return
            pods[name] = view
        self.wake(key)

    def batch_job(self, key: Key) -> BatchJobView | None:
        return self._jobs.get(key)

    def pods(self, key: Key) -> list[PodView]:
        return list(self._pods.get(key, {}).values())

    def wakeup(self, key: Key) -> asyncio.Event:
        return self._wakeups.setdefault(key, asyncio.Event())

    def wake(self, key: Key) -> None:
        event = self._wakeups.get(key)
        if event is not None:
            event.set()

    def forget(self, key: Key) -> None:
        self._wakeups.pop(key, None)
