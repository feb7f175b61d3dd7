"""The runner's writes for a new gang (no cluster: a recording stand-in for the API, the real state machine).

What the API server gets per job is what the operator costs a cluster; the end-to-end behaviour is in
test_jobs.py on the real control plane. Here: which status writes a gang's start takes, against an injected clock.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import kopf

from kembed_operator.job_runner import JobRunner
from kembed_operator.observed import Observed
from kembed_operator.settings import OperatorSettings
from tests.operator.harness import JobBuilder

NAMESPACE, NAME = "kembed-acme", "demo"


class RecordingKube:
    """Answers the runner's calls as the API server would and records the writes, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, Any]] = []
        self.status: dict[str, Any] = {}

    async def run(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("create", manifest["kind"]))
        return {**manifest, "metadata": {**manifest["metadata"], "uid": f"uid-{manifest['kind']}",
                                         "creationTimestamp": "2026-01-01T12:00:00Z"}}

    def create_or_apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.create(manifest)

    def patch_custom_status(self, plural: str, name: str, namespace: str, status: dict[str, Any]) -> dict[str, Any]:
        self.writes.append(("status", dict(status)))
        self.status.update(status)
        return {"status": dict(self.status)}


class Clock:
    def __init__(self) -> None:
        self.now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)

    def __call__(self) -> datetime.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)


def _runner(*, delay_s: float) -> tuple[JobRunner, RecordingKube, Observed, Clock]:
    spec = JobBuilder("demo").gpus(1).manifest("acme")["spec"]
    body = kopf.Body({"apiVersion": "kembed.io/v1alpha1", "kind": "EmbeddingJob", "spec": spec,
                      "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "uid-1", "generation": 1,
                                   "labels": {"kembed.io/tenant": "acme"}}})
    kube, observed, clock = RecordingKube(), Observed(), Clock()
    runner = JobRunner(kube=kube, observed=observed, settings=OperatorSettings(first_status_delay_s=delay_s),
                       body=body, s3_prefix_of=lambda tenant: f"s3://bucket/{tenant}", logger=None, clock=clock)
    runner._post = lambda event: None  # Kopf's event queue lives only inside a running operator
    return runner, kube, observed, clock


def _running_pod() -> dict[str, Any]:
    return {"metadata": {"name": f"{NAME}-0-x", "namespace": NAMESPACE,
                         "labels": {"kembed.io/job": NAME, "kembed.io/attempt": "0"},
                         "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
            "status": {"phase": "Running"}}


def _status_writes(kube: RecordingKube) -> list[dict[str, Any]]:
    return [w for kind, w in kube.writes if kind == "status"]


def test_a_gang_that_runs_at_once_takes_one_status_write():
    runner, kube, observed, clock = _runner(delay_s=5)
    asyncio.run(runner.reconcile_once())
    assert kube.writes == [("create", "Job")]  # the batch Job alone: a one-node job needs nothing else

    clock.advance(2)
    observed.record_pod("ADDED", _running_pod())
    asyncio.run(runner.reconcile_once())
    [write] = _status_writes(kube)
    assert write["phase"] == "RUNNING" and write["reason"] == "GangRunning"
    # What the held ADMITTED status carried goes out with it: nothing the job's status should say is lost.
    assert write["attempt"] == 0 and write["restartCount"] == 0 and write["attemptStartTime"] == "2026-01-01T12:00:00Z"
    assert {c["type"]: c["status"] for c in write["conditions"]}["PodsReady"] == "True"


def test_a_gang_that_does_not_run_within_the_delay_is_admitted():
    runner, kube, observed, clock = _runner(delay_s=5)
    sleep_s = asyncio.run(runner.reconcile_once())
    assert not _status_writes(kube) and sleep_s <= 5  # the runner wakes for it even if no pod ever changes

    clock.advance(5)
    asyncio.run(runner.reconcile_once())
    [write] = _status_writes(kube)
    assert write["phase"] == "ADMITTED" and write["reason"] == "Created"
    assert write["attemptStartTime"] == "2026-01-01T12:00:00Z"
    assert {c["type"]: c["reason"] for c in write["conditions"]}["PodsReady"] == "Waiting"


def test_without_a_delay_the_first_status_is_written_with_the_gang():
    runner, kube, _, _ = _runner(delay_s=0)
    asyncio.run(runner.reconcile_once())
    assert kube.writes[0] == ("create", "Job") and kube.writes[1][0] == "status"
    assert kube.writes[1][1]["phase"] == "ADMITTED"
