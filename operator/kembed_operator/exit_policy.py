"""Which trainer failures are worth a gang restart, and which end the job at once.

The yardstick is Kubeflow Trainer's ExitCode restart policy: exit codes 1-127 are permanent (the program itself
gave up: 1 an uncaught exception, 2 the trainer's "bad config"), 128-255 are retryable (killed by a signal:
137 SIGKILL / OOM kill, 143 SIGTERM after a checkpoint). The pods run the trainer under our launcher (see
kembed_trainer/launch.py), which exits with the first failed rank's own code rather than torchrun's blanket 1.

One gang fails together, so the collateral damage of one failure must not decide: when pod A is killed (137),
pod B's ranks lose their peer and exit 1. Hence:
- failures of pods that were being deleted (by the Job controller, the operator, an eviction) or disrupted by
  the cluster do not decide; if only such failures exist the gang counts as disrupted (retryable);
- otherwise one retryable failure makes the whole gang retryable (it explains its peers' exits);
- only a gang whose deciding failures are all permanent fails the job at once.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterable

from kembed_operator.views import PodView

__all__ = ["Verdict", "is_retryable_exit_code", "judge"]


def is_retryable_exit_code(code: int | None) -> bool:
    """None (no exit code: the node or the kubelet lost the container) counts as a disruption, so retryable."""
    return code is None or code >= 128


def _describe(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code >= 128:
        try:
            return f"exit code {code} ({signal.Signals(code - 128).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    retryable: bool
    reason: str
    message: str


def judge(failed_pods: Iterable[PodView]) -> Verdict:
    failed = sorted(failed_pods, key=lambda p: (p.finished_at is None, p.finished_at, p.index))
    deciding = [p for p in failed if not (p.deleting or p.disrupted)]
    if not deciding:
        names = ", ".join(p.name for p in failed) or "the gang's pods"
        return Verdict(True, "PodsDisrupted", f"{names} ended while being stopped or evicted")
    retryable = [p for p in deciding if is_retryable_exit_code(p.exit_code)]
    if retryable:
        first = retryable[0]
        return Verdict(True, "TrainerExitedRetryably",
                       f"pod {first.name} (node rank {first.index}) failed with {_describe(first.exit_code)}")
    first = deciding[0]
    return Verdict(False, "TrainerExitedPermanently",
                   f"pod {first.name} (node rank {first.index}) failed with {_describe(first.exit_code)}, "
                   "which is permanent (1-127); see its log")
