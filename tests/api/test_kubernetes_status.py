"""What the API reads from an EmbeddingJob's status (the operator's report), without a cluster: the phases the
operator decides map through to the job, terminal ones end it (the real round trip: tests/kubernetes)."""

from __future__ import annotations

import pytest

from kembed_api.backends.base import Exit, Observed
from kembed_api.backends.kubernetes import KubernetesBackend
from kembed_contract.lifecycle import JobState


def backend_seeing(status: dict) -> KubernetesBackend:
    backend = KubernetesBackend.__new__(KubernetesBackend)  # no cluster: the listing is what the operator wrote
    backend._jobs = {"j-1": {"metadata": {"name": "j-1", "namespace": "kembed-a"}, "status": status}}
    backend._refresh = lambda: None
    return backend


@pytest.mark.parametrize(("phase", "state"), [
    pytest.param("RUNNING", JobState.RUNNING, id="running"),
    pytest.param("RESTARTING", JobState.RESTARTING, id="restarting"),
    pytest.param("PREEMPTED", JobState.PREEMPTED, id="suspended-and-stopping"),
    pytest.param("QUEUED", JobState.QUEUED, id="suspended-and-stopped"),
])
def test_what_the_operator_decided_maps_through_with_its_restart_count(phase, state):
    seen = backend_seeing({"phase": phase, "reason": "R", "message": "m", "restartCount": 2}).poll("j-1")
    assert seen == Observed(state=state, reason="R", message="m", restart_count=2)


def test_a_failure_the_operator_decided_is_final_and_spends_no_restart_here():
    seen = backend_seeing({"phase": "FAILED", "reason": "RestartLimitReached", "message": "m"}).poll("j-1")
    assert isinstance(seen, Exit) and not seen.succeeded and not seen.retryable
    assert seen.reason == "RestartLimitReached"


def test_pods_still_starting_change_nothing():
    assert backend_seeing({"phase": "ADMITTED"}).poll("j-1") is None
