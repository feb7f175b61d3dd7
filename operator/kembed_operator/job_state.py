"""The EmbeddingJob state machine (pure): from what is observed to what to do and what status to write.

`decide()` looks at the job's spec and status, its batch Job and the pods of its current attempt, and the time;
it returns a Plan: status fields to merge-patch, at most one action on the children, and an Event. It never
talks to the API, so every rule below is tested without a cluster (tests/operator/test_job_state.py), and the
reconciler (embeddingjob.py) only observes, calls decide(), and carries the plan out.

Persist intent before acting: a restart first writes `attempt + 1` into the status, then deletes the old gang,
then (once it is gone) creates the new one. An operator killed in between finds the status ahead of the
children and finishes the step, so nothing is lost or done twice.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Sequence
from typing import Any

from kembed_contract import lifecycle
from kembed_contract.lifecycle import TERMINAL_STATES, JobState
from kembed_contract.resources import EmbeddingJobSpec
from kembed_operator.conditions import set_condition
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import BatchJobView, PodView, parse_time

__all__ = ["Action", "Plan", "decide", "invalid_spec_plan"]


class Action(enum.Enum):
    CREATE_GANG = "create the ConfigMap, Service and batch Job of the current attempt"
    DELETE_GANG = "delete the batch Job (and its pods, gracefully) of an older attempt"
    SUSPEND_GANG = "suspend the batch Job: its pods get SIGTERM and checkpoint"
    RESUME_GANG = "resume the suspended batch Job"
    REMOVE_CHILDREN = "delete every child after the TTL"


@dataclasses.dataclass
class Plan:
    status: dict[str, Any] = dataclasses.field(default_factory=dict)
    action: Action | None = None
    event: tuple[str, str, str] | None = None  # (Normal|Warning, reason, message)

    @property
    def empty(self) -> bool:
        return not self.status and self.action is None and self.event is None


@dataclasses.dataclass(frozen=True)
class _Context:
    status: dict[str, Any]
    generation: int
    now: datetime.datetime

    @property
    def now_text(self) -> str:
        return self.now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def conditions(self, plan: Plan) -> list[dict[str, Any]]:
        return plan.status.get("conditions", self.status.get("conditions") or [])

    def set_condition(self, plan: Plan, type_: str, status: bool, reason: str, message: str) -> None:
        updated = set_condition(self.conditions(plan), type_=type_, status=status, reason=reason, message=message,
                                generation=self.generation, now=self.now_text)
        if updated != (self.status.get("conditions") or []):
            plan.status["conditions"] = updated

    def move(self, plan: Plan, phase: JobState, reason: str, message: str, *, warning: bool = False) -> None:
        """Phase change (with reason, message, an Event); a no-op when already there for the same reason."""
        current = (self.status.get("phase"), self.status.get("reason"), self.status.get("message"))
        if current == (phase.value, reason, message):
            return
        if current[0] != phase.value:
            before = JobState(current[0]) if current[0] else None
            if before is None and phase is not JobState.ADMITTED:
                # A resource with no phase yet was admitted (the API creates it on admission); its first status
                # may not have been written before a replica died, so its gang may have run or ended already.
                before = JobState.ADMITTED
            lifecycle.check_transition(before, phase)
        plan.status.update({"phase": phase.value, "reason": reason, "message": message,
                            "observedGeneration": self.generation})
        plan.event = ("Warning" if warning else "Normal", reason, f"{phase.value}: {message}")
        if phase in TERMINAL_STATES:
            plan.status["completionTime"] = self.now_text
            outcome = {JobState.SUCCEEDED: True, JobState.FAILED: False, JobState.CANCELLED: False}[phase]
            self.set_condition(plan, "Finished", True, reason, message if outcome else f"{phase.value}: {message}")
            self.set_condition(plan, "PodsReady", False, reason, "the job has finished")


def invalid_spec_plan(status: dict[str, Any], generation: int, now: datetime.datetime, message: str) -> Plan:
    plan = Plan()
    ctx = _Context(status, generation, now)
    if status.get("phase") not in {s.value for s in TERMINAL_STATES}:
        ctx.move(plan, JobState.FAILED, "InvalidSpec", message, warning=True)
    return plan


def decide(*, spec: EmbeddingJobSpec, status: dict[str, Any], generation: int, batch_job: BatchJobView | None,
           pods: Sequence[PodView], now: datetime.datetime, settings: OperatorSettings) -> Plan:
    ctx = _Context(status, generation, now)
    plan = Plan()
    phase = status.get("phase")
    attempt = int(status.get("attempt") or 0)
    any_live = any(p.phase in ("Pending", "Running") for p in pods)
    if "restartCount" not in status:  # first pass, or the first pass of a runner that died before writing it
        plan.status.update({"attempt": attempt, "restartCount": 0})

    # ---- finished: only the TTL is left to do ---------------------------------------------------------------
    if phase in {s.value for s in TERMINAL_STATES}:
        _after_finish(ctx, plan, settings)
        return plan

    # ---- cancel: stop gracefully, end CANCELLED once nothing runs ---------------------------------------------
    if spec.cancel:
        if batch_job and not batch_job.suspended and not batch_job.deleting and any_live:
            plan.action = Action.SUSPEND_GANG
        if not any_live:
            ctx.move(plan, JobState.CANCELLED, "Cancelled", "cancelled; the trainers were stopped gracefully")
        elif phase != JobState.CANCELLED:
            ctx.set_condition(plan, "PodsReady", False, "Stopping", "cancelling: the trainers are checkpointing")
        return plan

    # ---- suspend (preemption): stop gracefully, keep the job --------------------------------------------------
    # The lifecycle (kembed_contract.lifecycle): PREEMPTED while the trainers save and stop, QUEUED once nothing
    # runs (the API then frees the job's quota and queues it again at its old place), ADMITTED when the API
    # admits it again (spec.suspend false): the same attempt starts anew and resumes from its checkpoint.
    if spec.suspend:
        if batch_job and not batch_job.suspended and not batch_job.deleting:
            plan.action = Action.SUSPEND_GANG
        if phase != JobState.QUEUED:
            ctx.move(plan, JobState.PREEMPTED, "Suspended", "suspended; the trainers checkpoint and stop")
        if not any_live and phase in (JobState.PREEMPTED, JobState.QUEUED):
            ctx.move(plan, JobState.QUEUED, "Stopped", "suspended and stopped; waiting to be admitted again")
        ctx.set_condition(plan, "Suspended", True, "Suspended", "spec.suspend is true")
        ctx.set_condition(plan, "PodsReady", False, "Suspended", "the job is suspended")
        return plan
    if phase == JobState.PREEMPTED:  # resumed before its trainers had stopped: first let them stop
        if not any_live:
            ctx.move(plan, JobState.QUEUED, "Stopped", "suspended and stopped; being admitted again")
        return plan
    if phase == JobState.QUEUED:
        ctx.set_condition(plan, "Suspended", False, "Resumed", "spec.suspend is false")
        if batch_job and batch_job.suspended:
            plan.action = Action.RESUME_GANG
        ctx.move(plan, JobState.ADMITTED, "Resumed", "resumed; the gang starts again from its checkpoint")
        plan.status["attemptStartTime"] = ctx.now_text
        return plan

    # ---- the current attempt's gang must exist ------------------------------------------------------------------
    if batch_job is None:
        plan.action = Action.CREATE_GANG
        if phase is None:
            ctx.move(plan, JobState.ADMITTED, "Created", f"gang of {spec.resources.nodes} pods created")
        plan.status["attemptStartTime"] = ctx.now_text
        # The very condition the passes that follow compute while the pods start: the pass woken by the new
        # batch Job then writes nothing (one status write fewer per job).
        ctx.set_condition(plan, "PodsReady", False, "Waiting",
                          f"0/{spec.resources.nodes} pods of attempt {attempt} running")
        return plan
    if batch_job.attempt < attempt:
        if not batch_job.deleting:
            plan.action = Action.DELETE_GANG
        return plan  # the new gang starts once the old one is gone: they would share host names and S3 paths
    if batch_job.attempt > attempt:
        return plan  # our status view lags behind our own write; the next event brings it up to date

    # ---- the current attempt runs: success, failure, or is it stuck? --------------------------------------------
    if batch_job.complete:
        ctx.move(plan, JobState.SUCCEEDED, "Completed", f"all {spec.resources.nodes} pods of the gang succeeded")
        return plan
    # A pod that failed while being deleted (suspension, eviction) matters only if it failed the batch Job.
    failed = [p for p in pods if p.attempt == attempt and p.phase == "Failed"]
    failed_on_their_own = [p for p in failed if not p.deleting]
    if failed_on_their_own or batch_job.failed_since:
        if not failed_on_their_own and _age(now, batch_job.failed_since) < settings.gang_failure_settle_s:
            return plan  # the failed pods' status may still be on its way: decide when it is here
        if failed:
            verdict = lifecycle.judge(p.failure() for p in failed)
        else:
            verdict = lifecycle.Verdict(True, "GangFailed", "the batch Job failed and its pods are gone")
        _restart_or_fail(ctx, plan, spec, verdict.retryable, verdict.reason, verdict.message)
        return plan

    attempt_pods = [p for p in pods if p.attempt == attempt and not p.deleting]
    stuck = _stuck_reason(ctx, attempt_pods, batch_job, spec, settings)
    if stuck is not None:
        retryable, reason, message = stuck
        _restart_or_fail(ctx, plan, spec, retryable, reason, message)
        return plan

    running = [p for p in pods if p.attempt == attempt and (p.running or p.phase == "Succeeded")]
    if len(running) == spec.resources.nodes:
        if phase != JobState.RUNNING:
            ctx.move(plan, JobState.RUNNING, "GangRunning", f"all {spec.resources.nodes} pods are running")
        if not status.get("startTime"):
            plan.status["startTime"] = ctx.now_text
        ctx.set_condition(plan, "PodsReady", True, "GangRunning", f"{len(running)}/{spec.resources.nodes} running")
    elif phase != JobState.RUNNING:
        pulling = next((p for p in attempt_pods if p.image_pull_failure), None)
        if pulling is not None:  # said at once, not only when image_pull_timeout_s fails the job
            ctx.set_condition(plan, "PodsReady", False, pulling.image_pull_failure,
                              f"pod {pulling.name}: {pulling.image_pull_message}".rstrip(": "))
        else:
            ctx.set_condition(plan, "PodsReady", False, "Waiting",
                              f"{len(running)}/{spec.resources.nodes} pods of attempt {attempt} running")
    return plan


def _stuck_reason(ctx: _Context, pods: Sequence[PodView], batch_job: BatchJobView, spec: EmbeddingJobSpec,
                  settings: OperatorSettings) -> tuple[bool, str, str] | None:
    """(retryable, reason, message) when the gang cannot get going; None while it may still."""
    for pod in pods:
        if pod.unschedulable_since and _age(ctx.now, pod.unschedulable_since) >= settings.unschedulable_timeout_s:
            return False, "Unschedulable", (
                f"pod {pod.name} could not be scheduled for {settings.unschedulable_timeout_s:.0f}s: "
                f"{pod.unschedulable_message}")
        if pod.image_pull_failure:
            started = pod.created or batch_job.created or ctx.now
            if pod.image_pull_failure == "InvalidImageName" or _age(ctx.now, started) >= settings.image_pull_timeout_s:
                return False, "ImagePullFailed", (
                    f"pod {pod.name}: {pod.image_pull_failure}: {pod.image_pull_message}".rstrip(": "))
    if ctx.status.get("phase") == JobState.RUNNING:
        return None  # the gang got going once: from here on only failures (or success) move it
    started = parse_time(ctx.status.get("attemptStartTime")) or batch_job.started or batch_job.created
    running = sum(1 for p in pods if p.running or p.phase == "Succeeded")
    if started and running < spec.resources.nodes and _age(ctx.now, started) >= settings.rendezvous_timeout_s:
        missing = spec.resources.nodes - len(pods)
        hint = f"; {missing} pods were never created (is the namespace's quota used up?)" if missing > 0 else ""
        return True, "RendezvousTimeout", (
            f"only {running}/{spec.resources.nodes} pods running {settings.rendezvous_timeout_s:.0f}s after the "
            f"gang started{hint}")
    return None


def _restart_or_fail(ctx: _Context, plan: Plan, spec: EmbeddingJobSpec, retryable: bool, reason: str,
                     message: str) -> None:
    restarts = int(ctx.status.get("restartCount") or 0)
    verdict = lifecycle.Verdict(retryable, reason, message)
    after = lifecycle.after_failure(verdict, restarts_used=restarts, max_restarts=spec.max_restarts)
    ctx.move(plan, after.state, after.reason, after.message, warning=True)
    if after.state is JobState.RESTARTING:
        plan.status.update({"restartCount": after.restart_count, "attempt": int(ctx.status.get("attempt") or 0) + 1})
        ctx.set_condition(plan, "PodsReady", False, reason, message)
        plan.action = Action.DELETE_GANG


def _after_finish(ctx: _Context, plan: Plan, settings: OperatorSettings) -> None:
    if any(c.get("type") == "CleanedUp" and c.get("status") == "True" for c in ctx.status.get("conditions") or []):
        return
    finished = parse_time(ctx.status.get("completionTime")) or ctx.now
    if _age(ctx.now, finished) >= settings.ttl_after_finished_s:
        plan.action = Action.REMOVE_CHILDREN
        ctx.set_condition(plan, "CleanedUp", True, "TTLExpired",
                          f"pods, batch Job, Service and ConfigMap deleted {settings.ttl_after_finished_s:.0f}s "
                          "after the job finished")


def _age(now: datetime.datetime, then: datetime.datetime) -> float:
    return (now - then).total_seconds()


def is_cleaned_up(status: dict[str, Any] | None) -> bool:
    return any(c.get("type") == "CleanedUp" and c.get("status") == "True" for c in (status or {}).get("conditions") or [])


def seconds_until_ttl(status: dict[str, Any], now: datetime.datetime, settings: OperatorSettings) -> float | None:
    """For a finished job: how long until its children go (the reconciler sleeps that long)."""
    finished = parse_time(status.get("completionTime"))
    if status.get("phase") not in {s.value for s in TERMINAL_STATES} or finished is None:
        return None
    return max(0.0, settings.ttl_after_finished_s - _age(now, finished))
