"""What the job reconciler needs to know of a batch Job or a pod, read from their API objects (pure).

The reconciler works on these small frozen views instead of raw dicts, so its decisions are cheap to test and
the operator keeps only this much per pod in memory.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from kembed_contract import lifecycle

__all__ = ["ATTEMPT_LABEL", "INDEX_ANNOTATION", "JOB_LABEL", "BatchJobView", "PodView", "batch_job_view",
           "parse_time", "pod_view"]

JOB_LABEL = "kembed.io/job"
ATTEMPT_LABEL = "kembed.io/attempt"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
IMAGE_PULL_FAILURES = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})


def parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


@dataclasses.dataclass(frozen=True)
class PodView:
    name: str
    attempt: int
    index: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    deleting: bool
    disrupted: bool  # the cluster ended it (eviction, preemption, node loss), not the trainer
    created: datetime.datetime | None
    unschedulable_since: datetime.datetime | None
    unschedulable_message: str
    image_pull_failure: str | None  # waiting reason, e.g. ImagePullBackOff
    image_pull_message: str
    exit_code: int | None  # of the first terminated container, once Failed/Succeeded
    finished_at: datetime.datetime | None
    termination_message: str = ""  # what that container wrote to its terminationMessagePath (why it failed)
    oom_killed: bool = False  # the kubelet says that container was killed for its memory limit

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting

    def failure(self) -> lifecycle.Failure:
        """This failed pod as the lifecycle's exit policy sees it (a pod being deleted or evicted is collateral)."""
        return lifecycle.Failure(name=f"pod {self.name}", index=self.index, exit_code=self.exit_code,
                                 collateral=self.deleting or self.disrupted, finished_at=self.finished_at,
                                 message=self.termination_message or (
                                     "killed for its memory limit (resources.memory_per_node)" if self.oom_killed
                                     else ""),
                                 out_of_memory=self.oom_killed)


@dataclasses.dataclass(frozen=True)
class BatchJobView:
    name: str
    uid: str
    attempt: int
    deleting: bool
    suspended: bool
    complete: bool
    failed_since: datetime.datetime | None
    started: datetime.datetime | None  # status.startTime (reset by Kubernetes when a Job is resumed)
    created: datetime.datetime | None


def _label_int(meta: dict[str, Any], key: str, default: int = 0) -> int:
    try:
        return int((meta.get("labels") or {}).get(key, default))
    except ValueError:
        return default


def pod_view(pod: dict[str, Any]) -> PodView:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    pull_failure, pull_message, exit_code, finished_at, termination_message = None, "", None, None, ""
    oom_killed = False
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL_FAILURES:
            pull_failure, pull_message = waiting["reason"], waiting.get("message", "")
        terminated = state.get("terminated")
        if terminated and exit_code is None:
            exit_code, finished_at = terminated.get("exitCode"), parse_time(terminated.get("finishedAt"))
            termination_message = (terminated.get("message") or "").strip()
            oom_killed = terminated.get("reason") == lifecycle.OOM_KILLED
    disrupted = (conditions.get("DisruptionTarget") or {}).get("status") == "True" or status.get("reason") in (
        "Evicted", "NodeLost", "Preempting", "Terminated", "Shutdown")
    try:
        index = int((meta.get("annotations") or {}).get(INDEX_ANNOTATION, "-1"))
    except ValueError:
        index = -1
    return PodView(
        name=meta.get("name", ""), attempt=_label_int(meta, ATTEMPT_LABEL), index=index,
        phase=status.get("phase", "Pending"), deleting=bool(meta.get("deletionTimestamp")), disrupted=disrupted,
        created=parse_time(meta.get("creationTimestamp")),
        unschedulable_since=parse_time(scheduled.get("lastTransitionTime")) if unschedulable else None,
        unschedulable_message=scheduled.get("message", "") if unschedulable else "",
        image_pull_failure=pull_failure, image_pull_message=pull_message,
        exit_code=exit_code, finished_at=finished_at, termination_message=termination_message,
        oom_killed=oom_killed,
    )


def batch_job_view(job: dict[str, Any]) -> BatchJobView:
    meta, spec, status = job.get("metadata", {}), job.get("spec") or {}, job.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    failed = conditions.get("Failed") or conditions.get("FailureTarget")
    return BatchJobView(
        name=meta.get("name", ""), uid=meta.get("uid", ""), attempt=_label_int(meta, ATTEMPT_LABEL),
        deleting=bool(meta.get("deletionTimestamp")), suspended=bool(spec.get("suspend")),
        complete="Complete" in conditions,
        failed_since=parse_time(failed.get("lastTransitionTime")) if failed else None,
        started=parse_time(status.get("startTime")), created=parse_time(meta.get("creationTimestamp")),
    )
