"""The one job lifecycle: its states, which state may follow which, and what a failed gang comes to.

Both backends and both sides of the Kubernetes backend obey this module: the API's state machine
(kembed_api.jobs.transitions.transition), its dispatcher (local processes), and the operator's EmbeddingJob state
machine (kembed_operator.job_state). docs/architecture.md draws the diagram.

    QUEUED -> ADMITTED -> RUNNING -> SUCCEEDED
                 |           |  ^
                 |           v  |
                 +------> RESTARTING           (a retryable failure: the gang restarts from its checkpoint)
       ^         |           |
       |         v           v
       +---- PREEMPTED <-----+                 (asked to save and stop; back in the queue at its old place)
    and from every non-terminal state: FAILED, CANCELLED.

Exit codes decide failures (the yardstick is Kubeflow Trainer's ExitCode restart policy): 1-127 are permanent
(the program gave up: 1 an uncaught exception, 2 a bad config, 3 over the storage quota; the codes that name
their reason are kembed_contract.runtime.EXIT_REASONS), 128-255 retryable (killed by a signal: 137
SIGKILL or the OOM killer, 143 SIGTERM after a checkpoint). One gang fails together, so collateral failures
(nodes stopped because a peer failed, pods being deleted or evicted) do not decide; one retryable failure
explains its peers' exits; only a gang whose deciding failures are all permanent fails at once. A node that ran
out of memory (killed for its memory limit, or exit 4: an allocation refused) fails the gang at once, reason
`OOMKilled`, whatever else failed: the same job at the same size would only run out again. A retryable
failure restarts the gang while restarts are left (`max_restarts`, spent by whoever restarts the gang: the
dispatcher for local processes, the operator on Kubernetes, never both).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from kembed_contract import runtime

__all__ = [
    "ACTIVE_STATES",
    "FIRST_STATES",
    "STATE_TONES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "Failure",
    "Next",
    "InvalidTransition",
    "JobState",
    "Tone",
    "OOM_KILLED",
    "Verdict",
    "after_failure",
    "check_transition",
    "describe_exit_code",
    "is_retryable_exit_code",
    "judge",
]


class JobState(StrEnum):
    QUEUED = "QUEUED"
    ADMITTED = "ADMITTED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    PREEMPTED = "PREEMPTED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class Tone(StrEnum):
    """What a state says at a glance; the CLI colours and the dashboard styles it by this, never by the state."""

    WAITING = "waiting"
    ACTIVE = "active"
    TROUBLE = "trouble"
    STOPPED = "stopped"
    GOOD = "good"
    BAD = "bad"


STATE_TONES: dict[JobState, Tone] = {
    JobState.QUEUED: Tone.WAITING,
    JobState.ADMITTED: Tone.ACTIVE,
    JobState.RUNNING: Tone.ACTIVE,
    JobState.RESTARTING: Tone.TROUBLE,
    JobState.PREEMPTED: Tone.STOPPED,
    JobState.SUCCEEDED: Tone.GOOD,
    JobState.FAILED: Tone.BAD,
    JobState.CANCELLED: Tone.STOPPED,
}
# States that hold an admission (quota, local slots) until the job ends or goes back to the queue. A PREEMPTED
# job holds its admission while its trainers save and stop: what it frees is not free before that.
ACTIVE_STATES = frozenset({JobState.ADMITTED, JobState.RUNNING, JobState.RESTARTING, JobState.PREEMPTED})

_ENDS = frozenset({JobState.FAILED, JobState.CANCELLED})
# Which state may follow which: the one table. A gang may finish between two looks at it, so ADMITTED and
# RESTARTING may go straight to SUCCEEDED. PREEMPTED goes back to the queue (keeping its place), never straight
# to ADMITTED: a preempted job is admitted again like any other, against quota. A preempted gang may still
# finish (its last step was done before it stopped) or fail.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.ADMITTED}) | _ENDS,
    JobState.ADMITTED: frozenset({JobState.RUNNING, JobState.RESTARTING, JobState.PREEMPTED,
                                  JobState.SUCCEEDED}) | _ENDS,
    JobState.RUNNING: frozenset({JobState.RESTARTING, JobState.PREEMPTED, JobState.SUCCEEDED}) | _ENDS,
    JobState.RESTARTING: frozenset({JobState.RUNNING, JobState.RESTARTING, JobState.PREEMPTED,
                                    JobState.SUCCEEDED}) | _ENDS,
    JobState.PREEMPTED: frozenset({JobState.QUEUED, JobState.SUCCEEDED}) | _ENDS,
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A move the lifecycle does not allow: a bug in the caller."""


# A job with no state yet: stored by the API (QUEUED), a resource the operator sees for the first time
# (ADMITTED), or a resource whose spec the operator refuses before it ever ran (FAILED, reason InvalidSpec).
FIRST_STATES = frozenset({JobState.QUEUED, JobState.ADMITTED, JobState.FAILED})


def check_transition(current: JobState | None, new: JobState, *, job: str = "job") -> None:
    """Raise InvalidTransition unless `new` may follow `current` (None: the job has no state yet)."""
    allowed = FIRST_STATES if current is None else TRANSITIONS[current]
    if new not in allowed:
        raise InvalidTransition(f"{job}: {current} -> {new} is not allowed")


# ---- failures -----------------------------------------------------------------------------------------------
def is_retryable_exit_code(code: int | None) -> bool:
    """None (no exit code: the node or the kubelet lost the process) counts as a disruption, so retryable."""
    return code is None or code >= 128


def describe_exit_code(code: int | None) -> str:
    if code is None:
        return "no exit code"
    number = runtime.signal_of(code)
    try:
        return f"exit code {code} ({signal.Signals(number).name})" if number else f"exit code {code}"
    except ValueError:  # no such signal
        return f"exit code {code}"


OOM_KILLED = "OOMKilled"  # the reason of a gang failed for memory (Kubernetes' own word for a container's end)


@dataclass(frozen=True)
class Failure:
    """One failed node of a gang: a pod, or a local torchrun process."""

    name: str  # "pod x-1", "node 1"
    index: int  # its node rank
    exit_code: int | None
    collateral: bool = False  # it ended because it was being stopped (a peer failed, deletion, eviction)
    finished_at: datetime | None = None
    message: str = ""  # the trainer's own one-line reason (its termination log), when it wrote one
    # Killed for its memory limit (the kernel's OOM killer in its cgroup, the local backend's watchdog, a pod's
    # OOMKilled); `message` then says the limit and the peak.
    out_of_memory: bool = False

    @property
    def ran_out_of_memory(self) -> bool:
        return self.out_of_memory or self.exit_code == runtime.EXIT_OUT_OF_MEMORY


@dataclass(frozen=True)
class Verdict:
    retryable: bool
    reason: str
    message: str


def judge(failures: Iterable[Failure]) -> Verdict:
    """Whether a failed gang is worth a restart, and why (see the module's docstring)."""
    failed = sorted(failures, key=lambda f: (f.finished_at is None, f.finished_at or datetime.min, f.index))
    deciding = [f for f in failed if not f.collateral]
    if not deciding:
        names = ", ".join(f.name for f in failed) or "the gang"
        return Verdict(True, "GangDisrupted", f"{names} ended while being stopped or evicted")
    out_of_memory = [f for f in deciding if f.ran_out_of_memory]
    if out_of_memory:
        first = out_of_memory[0]
        return Verdict(False, OOM_KILLED, f"{first.name} (node rank {first.index}) ran out of memory"
                       + (f": {first.message}" if first.message else f" ({describe_exit_code(first.exit_code)})"))
    retryable = [f for f in deciding if is_retryable_exit_code(f.exit_code)]
    if retryable:
        first = retryable[0]
        return Verdict(True, "TrainerExitedRetryably",
                       f"{first.name} (node rank {first.index}) failed with {describe_exit_code(first.exit_code)}")
    # The node that says why goes first: its peers, which only lost it, say nothing.
    first = next((f for f in deciding if f.message), deciding[0])
    reason = runtime.EXIT_REASONS.get(first.exit_code, "TrainerExitedPermanently")
    if first.message:
        return Verdict(False, reason,
                       f"{first.name} (node rank {first.index}) failed with {describe_exit_code(first.exit_code)}: "
                       f"{first.message}")
    return Verdict(False, reason,
                   f"{first.name} (node rank {first.index}) failed with {describe_exit_code(first.exit_code)}, "
                   "which is permanent (1-127); see its log")


@dataclass(frozen=True)
class Next:
    """What a failed gang comes to: RESTARTING (with the restarts used after it) or FAILED."""

    state: JobState
    reason: str
    message: str
    restart_count: int


def after_failure(verdict: Verdict, *, restarts_used: int, max_restarts: int) -> Next:
    """The one rule for spending `max_restarts` (the dispatcher's for local gangs, the operator's on Kubernetes)."""
    if not verdict.retryable:
        return Next(JobState.FAILED, verdict.reason, verdict.message, restarts_used)
    if restarts_used >= max_restarts:
        return Next(JobState.FAILED, "RestartLimitReached",
                    f"{verdict.message}; no restarts left ({restarts_used} of max_restarts {max_restarts} used)",
                    restarts_used)
    return Next(JobState.RESTARTING, verdict.reason,
                f"{verdict.message}; restarting the whole gang from its last checkpoint "
                f"(restart {restarts_used + 1} of {max_restarts})", restarts_used + 1)
