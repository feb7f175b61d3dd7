"""The operator's view of a job's children wakes the job's runner only when what the runner decides on changed."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from kembed_operator.observed import Observed

KEY = ("kembed-acme", "demo")


def _pod(phase: str = "Pending") -> dict[str, Any]:
    return {"metadata": {"name": "demo-0-x", "namespace": KEY[0], "resourceVersion": "1",
                         "labels": {"kembed.io/job": KEY[1], "kembed.io/attempt": "0"},
                         "annotations": {"batch.kubernetes.io/job-completion-index": "0"},
                         "finalizers": ["batch.kubernetes.io/job-tracking"]},
            "status": {"phase": phase}}


def _job(active: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": KEY[1], "namespace": KEY[0], "uid": "uid-1", "resourceVersion": "1",
                         "labels": {"kembed.io/job": KEY[1], "kembed.io/attempt": "0"}},
            "spec": {}, "status": {"active": active}}


def test_a_child_event_that_changes_nothing_the_runner_reads_does_not_wake_it():
    async def scenario() -> list[bool]:
        observed = Observed()
        wakeup = observed.wakeup(KEY)
        woken = []

        def step(record) -> None:
            wakeup.clear()
            record()
            woken.append(wakeup.is_set())

        pod, job = _pod(), _job()
        step(lambda: observed.record_pod("ADDED", pod))
        same = copy.deepcopy(pod)
        same["metadata"]["resourceVersion"], same["metadata"]["finalizers"] = "2", []  # the Job controller's patch
        step(lambda: observed.record_pod("MODIFIED", same))
        step(lambda: observed.record_pod("MODIFIED", _pod("Running")))
        step(lambda: observed.record_job("ADDED", job))
        step(lambda: observed.record_job("MODIFIED", _job(active=1)))  # a counter the runner does not read
        step(lambda: observed.record_job("DELETED", {**job, "metadata": {**job["metadata"], "uid": "uid-0"}}))
        step(lambda: observed.record_job("DELETED", job))
        step(lambda: observed.record_pod("DELETED", _pod("Running")))
        step(lambda: observed.record_pod("DELETED", _pod("Running")))  # already gone
        return woken

    assert asyncio.run(scenario()) == [True, False, True, True, False, False, True, True, False]
