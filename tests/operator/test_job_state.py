"""The job state machine without a cluster: decisions from observed children, the time and the settings."""

from __future__ import annotations

import dataclasses
import datetime

import pytest

from kembed_contract import runtime
from kembed_contract.resources import EmbeddingJobSpec
from kembed_operator.job_state import Action, decide
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import BatchJobView, PodView, pod_view
from tests.builders import operator_job

NOW = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.UTC)
SETTINGS = OperatorSettings(rendezvous_timeout_s=60, unschedulable_timeout_s=30, ttl_after_finished_s=100)


def spec(nodes: int = 2, max_restarts: int = 2) -> EmbeddingJobSpec:
    builder = operator_job("unit").with_nodes(nodes).with_max_restarts(max_restarts)
    return EmbeddingJobSpec.model_validate(builder.manifest("acme")["spec"])


def job(attempt: int = 0, **fields) -> BatchJobView:
    base = BatchJobView(name="j", uid="u1", attempt=attempt, deleting=False, suspended=False, complete=False,
                        failed_since=None, started=NOW, created=NOW)
    return dataclasses.replace(base, **fields)


def pod(index: int, phase: str = "Running", attempt: int = 0, **fields) -> PodView:
    base = PodView(name=f"j-{index}", attempt=attempt, index=index, phase=phase, deleting=False, disrupted=False,
                   created=NOW, unschedulable_since=None, unschedulable_message="", image_pull_failure=None,
                   image_pull_message="", exit_code=None, finished_at=None)
    return dataclasses.replace(base, **fields)


RUNNING = {"phase": "RUNNING", "attempt": 0, "restartCount": 0, "attemptStartTime": "2026-01-01T11:59:00Z"}


def test_bad_data_fails_at_once_with_the_trainers_own_reason_not_its_peers():
    reason = "data error: feature 'user': ids 1..943 outside [0, 943); set hash_ids on its table for unbounded ids"
    pods = [pod(0, "Failed", exit_code=1, finished_at=NOW),  # lost its peer
            pod(1, "Failed", exit_code=runtime.EXIT_BAD_CONFIG, finished_at=NOW, termination_message=reason)]
    plan = decide(spec=spec(), status=RUNNING, generation=1, batch_job=job(), pods=pods, now=NOW, settings=SETTINGS)
    assert (plan.status["phase"], plan.status["reason"]) == ("FAILED", "TrainerExitedPermanently")
    assert plan.status["message"] == f"pod j-1 (node rank 1) failed with exit code 2: {reason}"
    assert "restartCount" not in plan.status and plan.action is not Action.DELETE_GANG  # no restart


def test_a_pods_termination_message_is_read_from_its_terminated_container():
    view = pod_view({"metadata": {"name": "j-0"}, "status": {"phase": "Failed", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 2, "message": "data error: no files at s3://b/x\n"}}}]}})
    assert (view.exit_code, view.termination_message) == (2, "data error: no files at s3://b/x")


def test_a_pod_the_kubelet_killed_for_memory_fails_the_job_oomkilled_without_a_restart():
    view = pod_view({"metadata": {"name": "j-1", "annotations": {}}, "status": {"phase": "Failed", "containerStatuses": [
        {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}})
    pods = [pod(0, "Failed", exit_code=137, finished_at=NOW),
            dataclasses.replace(view, index=1, finished_at=NOW)]
    plan = decide(spec=spec(), status=RUNNING, generation=1, batch_job=job(), pods=pods, now=NOW, settings=SETTINGS)
    assert (plan.status["phase"], plan.status["reason"]) == ("FAILED", "OOMKilled")
    assert "memory limit" in plan.status["message"] and plan.action is not Action.DELETE_GANG


def test_a_new_job_creates_its_gang_and_is_admitted():
    plan = decide(spec=spec(), status={}, generation=1, batch_job=None, pods=[], now=NOW, settings=SETTINGS)
    assert plan.action is Action.CREATE_GANG
    assert plan.status["phase"] == "ADMITTED" and plan.status["restartCount"] == 0
    assert plan.event[1] == "Created"


def test_a_job_whose_first_status_was_never_written_still_ends():
    """A replica may die before it wrote a job's first status (ADMITTED is held briefly); the replica that takes
    over finds the gang finished and a job with no phase, and records its end."""
    done = job(complete=True)
    pods = [pod(i, "Succeeded", exit_code=0, finished_at=NOW) for i in range(2)]
    plan = decide(spec=spec(), status={}, generation=1, batch_job=done, pods=pods, now=NOW, settings=SETTINGS)
    assert plan.status["phase"] == "SUCCEEDED"


@pytest.mark.parametrize(("codes", "phase", "reason"), [
    pytest.param([137, 1], "RESTARTING", "TrainerExitedRetryably", id="killed-pod-and-its-collateral"),
    pytest.param([2, 2], "FAILED", "TrainerExitedPermanently", id="bad-config-everywhere"),
    pytest.param([1], "FAILED", "TrainerExitedPermanently", id="crash"),
    pytest.param([None], "RESTARTING", "TrainerExitedRetryably", id="node-lost"),
])
def test_failures_are_judged_by_the_exit_code_policy(codes, phase, reason):
    pods = [pod(i, "Failed", exit_code=c, finished_at=NOW) for i, c in enumerate(codes)]
    plan = decide(spec=spec(), status=RUNNING, generation=1, batch_job=job(), pods=pods, now=NOW, settings=SETTINGS)
    assert (plan.status["phase"], plan.status["reason"]) == (phase, reason)
    if phase == "RESTARTING":  # intent recorded: next attempt, then the old gang goes
        assert plan.status["attempt"] == 1 and plan.status["restartCount"] == 1 and plan.action is Action.DELETE_GANG


def test_a_pod_that_failed_while_being_deleted_does_not_decide():
    pods = [pod(0, "Failed", exit_code=1, deleting=True), pod(1)]
    plan = decide(spec=spec(), status=RUNNING, generation=1, batch_job=job(), pods=pods, now=NOW, settings=SETTINGS)
    assert "phase" not in plan.status and plan.action is None


def test_the_new_gang_waits_until_the_old_one_is_gone():
    status = {**RUNNING, "phase": "RESTARTING", "attempt": 1, "restartCount": 1}
    deleting = decide(spec=spec(), status=status, generation=1, batch_job=job(0, deleting=True), pods=[pod(0)],
                      now=NOW, settings=SETTINGS)
    assert deleting.action is None
    gone = decide(spec=spec(), status=status, generation=1, batch_job=None, pods=[], now=NOW, settings=SETTINGS)
    assert gone.action is Action.CREATE_GANG


def test_restarts_stop_at_max_restarts():
    status = {**RUNNING, "attempt": 2, "restartCount": 2}
    pods = [pod(0, "Failed", attempt=2, exit_code=143)]
    plan = decide(spec=spec(max_restarts=2), status=status, generation=1, batch_job=job(2), pods=pods, now=NOW,
                  settings=SETTINGS)
    assert plan.status["phase"] == "FAILED" and plan.status["reason"] == "RestartLimitReached"


def test_an_unschedulable_pod_fails_the_job_only_after_the_time_out():
    stuck = pod(1, "Pending", unschedulable_since=NOW - datetime.timedelta(seconds=10),
                unschedulable_message="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    admitted = {**RUNNING, "phase": "ADMITTED", "attemptStartTime": "2026-01-01T11:59:50Z"}
    early = decide(spec=spec(), status=admitted, generation=1, batch_job=job(), pods=[pod(0), stuck], now=NOW,
                   settings=SETTINGS)
    assert "phase" not in early.status
    late = decide(spec=spec(), status=admitted, generation=1, batch_job=job(), pods=[pod(0), stuck],
                  now=NOW + datetime.timedelta(seconds=25), settings=SETTINGS)
    assert late.status["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in late.status["message"]


def test_an_image_pull_error_is_in_the_jobs_status_at_once_and_fails_it_after_the_time_out():
    pulling = pod(1, "Pending", image_pull_failure="ImagePullBackOff",
                  image_pull_message="Back-off pulling image: manifest unknown")
    admitted = {**RUNNING, "phase": "ADMITTED", "attemptStartTime": "2026-01-01T12:00:00Z"}
    early = decide(spec=spec(), status=admitted, generation=1, batch_job=job(), pods=[pod(0), pulling],
                   now=NOW + datetime.timedelta(seconds=2), settings=SETTINGS)
    assert "phase" not in early.status
    ready = next(c for c in early.status["conditions"] if c["type"] == "PodsReady")
    assert (ready["status"], ready["reason"]) == ("False", "ImagePullBackOff")
    assert ready["message"] == "pod j-1: Back-off pulling image: manifest unknown"
    late = decide(spec=spec(), status=admitted, generation=1, batch_job=job(), pods=[pod(0), pulling],
                  now=NOW + datetime.timedelta(seconds=SETTINGS.image_pull_timeout_s), settings=SETTINGS)
    assert (late.status["phase"], late.status["reason"]) == ("FAILED", "ImagePullFailed")
    assert "manifest unknown" in late.status["message"]
    assert SETTINGS.image_pull_timeout_s <= 60, "the job's status must say why within a minute"


def test_a_gang_that_ran_is_never_restarted_for_a_rendezvous_time_out():
    long_ago = {**RUNNING, "attemptStartTime": "2026-01-01T10:00:00Z"}
    plan = decide(spec=spec(), status=long_ago, generation=1, batch_job=job(),
                  pods=[pod(0, "Succeeded"), pod(1, "Succeeded")], now=NOW, settings=SETTINGS)
    assert plan.action is None and plan.status.get("phase") is None


def test_children_go_after_the_ttl_and_the_status_stays():
    finished = {**RUNNING, "phase": "SUCCEEDED", "completionTime": "2026-01-01T11:59:00Z"}
    early = decide(spec=spec(), status=finished, generation=1, batch_job=job(complete=True), pods=[], now=NOW,
                   settings=SETTINGS)
    assert early.action is None
    late = decide(spec=spec(), status=finished, generation=1, batch_job=job(complete=True), pods=[],
                  now=NOW + datetime.timedelta(seconds=100), settings=SETTINGS)
    assert late.action is Action.REMOVE_CHILDREN
    assert {c["type"]: c["reason"] for c in late.status["conditions"]}["CleanedUp"] == "TTLExpired"


def test_suspension_is_preempted_while_the_pods_stop_then_queued_then_admitted_again():
    suspended = spec().model_copy(update={"suspend": True})
    stopping = decide(spec=suspended, status=RUNNING, generation=2, batch_job=job(), pods=[pod(0), pod(1)], now=NOW,
                      settings=SETTINGS)
    assert stopping.status["phase"] == "PREEMPTED" and stopping.action is Action.SUSPEND_GANG
    preempted = {**RUNNING, **stopping.status}
    stopped = decide(spec=suspended, status=preempted, generation=2, batch_job=job(suspended=True), pods=[],
                     now=NOW, settings=SETTINGS)
    assert (stopped.status["phase"], stopped.status["reason"]) == ("QUEUED", "Stopped")
    queued = {**preempted, **stopped.status}
    resumed = decide(spec=spec(), status=queued, generation=3, batch_job=job(suspended=True), pods=[], now=NOW,
                     settings=SETTINGS)
    assert resumed.status["phase"] == "ADMITTED" and resumed.action is Action.RESUME_GANG
    assert "restartCount" not in resumed.status  # a preemption is not a failure
