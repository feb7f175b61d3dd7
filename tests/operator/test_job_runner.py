"""The runner's writes for a new gang (no cluster: a recording stand-in for the API, the real state machine).

What the API server gets per job is what the operator costs a cluster; the end-to-end behaviour is in
test_jobs.py on the real control plane. Here: which status writes a gang's start takes, against an injected clock.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import kopf

from kembed_operator import progress
from kembed_operator.job_runner import JobRunner
from kembed_operator.observed import Observed
from kembed_operator.settings import OperatorSettings
from tests.builders import operator_job

NAMESPACE, NAME = "kembed-acme", "demo"


class RecordingKube:
    """Answers the runner's calls as the API server would and records the writes, in order."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, Any]] = []
        self.status: dict[str, Any] = {}
        self.log = ""

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

    def pod_log_tail(self, name: str, namespace: str, *, lines: int) -> str:
        self.writes.append(("log", name))
        return self.log


class Clock:
    def __init__(self) -> None:
        self.now = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)

    def __call__(self) -> datetime.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += datetime.timedelta(seconds=seconds)


def _runner(*, delay_s: float, events: list | None = None) -> tuple[JobRunner, RecordingKube, Observed, Clock]:
    spec = operator_job("demo").with_gpus(1).manifest("acme")["spec"]
    body = kopf.Body({"apiVersion": "kembed.io/v1alpha1", "kind": "EmbeddingJob", "spec": spec,
                      "metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "uid-1", "generation": 1,
                                   "labels": {"kembed.io/tenant": "acme"}}})
    kube, observed, clock = RecordingKube(), Observed(), Clock()
    runner = JobRunner(kube=kube, observed=observed, settings=OperatorSettings(first_status_delay_s=delay_s),
                       body=body, s3_prefix_of=lambda tenant: f"s3://bucket/{tenant}", logger=None, clock=clock)
    # Kopf's event queue lives only inside a running operator: the Events are recorded instead.
    runner._post = lambda event: event is not None and (events if events is not None else []).append(event[1])
    return runner, kube, observed, clock


def _running_pod(phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": f"{NAME}-0-x", "namespace": NAMESPACE,
                         "labels": {"kembed.io/job": NAME, "kembed.io/attempt": "0"},
                         "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
            "status": {"phase": phase}}


def _completed_batch_job() -> dict[str, Any]:
    return {"metadata": {"name": NAME, "namespace": NAMESPACE, "uid": "uid-Job",
                         "creationTimestamp": "2026-01-01T12:00:00Z",
                         "labels": {"kembed.io/job": NAME, "kembed.io/attempt": "0"}},
            "spec": {}, "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}


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


def test_the_created_event_goes_out_only_if_the_status_says_admitted():
    events: list[str] = []
    runner, kube, observed, clock = _runner(delay_s=5, events=events)
    asyncio.run(runner.reconcile_once())
    assert events == []  # held with its status
    clock.advance(2)
    observed.record_pod("ADDED", _running_pod())
    asyncio.run(runner.reconcile_once())
    assert events == ["GangRunning"]  # the status never said ADMITTED: no Event for it either

    events.clear()
    runner, kube, observed, clock = _runner(delay_s=5, events=events)
    asyncio.run(runner.reconcile_once())
    clock.advance(5)
    asyncio.run(runner.reconcile_once())
    assert events == ["Created"] and _status_writes(kube)[0]["phase"] == "ADMITTED"


def test_a_job_that_ends_takes_one_write_with_its_last_progress():
    runner, kube, observed, clock = _runner(delay_s=5)
    asyncio.run(runner.reconcile_once())
    observed.record_pod("ADDED", _running_pod())
    asyncio.run(runner.reconcile_once())
    kube.writes.clear()

    kube.log = ('{"event": "done", "step": 40, "total_steps": 40, "checkpoint": "s3://bucket/acme/demo/step-40", '
                '"seconds": {"process_start": 0.2, "imports": 2.5, "data": 0.4, "training": 12.0, "evaluation": 0.1, '
                '"saving": 0.3, "other": 99, "imports_extra": "x"}}\n')
    clock.advance(3)
    observed.record_pod("MODIFIED", _running_pod("Succeeded"))
    observed.record_job("MODIFIED", _completed_batch_job())
    asyncio.run(runner.reconcile_once())
    assert [kind for kind, _ in kube.writes] == ["log", "status"]
    [write] = _status_writes(kube)
    assert write["phase"] == "SUCCEEDED"
    assert write["progress"] == {"step": 40, "totalSteps": 40, "percent": 100}
    assert write["latestCheckpoint"] == {"step": 40, "uri": "s3://bucket/acme/demo/step-40"}
    # The trainer's phases as the API shows them (kembed_contract.job_seconds), what else the record says left out.
    assert write["trainerSeconds"] == {"process_start": 0.2, "imports": 2.5, "data": 0.4, "training": 12.0,
                                       "evaluation": 0.1, "saving": 0.3}


def test_the_status_names_the_last_saved_checkpoint_not_the_best_one():
    """A done record's `checkpoint` is its result's (the best eval's, with keep_best); latestCheckpoint is the
    last one saved, as the API's job says (kembed_contract.runtime.latest_checkpoint_reported)."""
    fields = progress.read_records(
        '{"event": "checkpoint", "step": 40, "uri": "s3://b/t/j/step-40"}\n'
        '{"event": "done", "step": 40, "checkpoint": "s3://b/t/j/step-10", "last_checkpoint": "s3://b/t/j/step-40"}\n')
    assert fields["latestCheckpoint"] == {"step": 40, "uri": "s3://b/t/j/step-40"}
