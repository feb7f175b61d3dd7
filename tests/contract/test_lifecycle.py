"""The one lifecycle: its transition table and its exit-code policy, as both backends and the operator use them."""

from __future__ import annotations

import signal

import pytest

from kembed_contract import lifecycle, runtime
from kembed_contract.lifecycle import JobState


@pytest.mark.parametrize(("current", "new"), [
    pytest.param(JobState.PREEMPTED, JobState.QUEUED, id="preempted-goes-back-to-the-queue"),
    pytest.param(JobState.RUNNING, JobState.PREEMPTED, id="running-is-preempted"),
    pytest.param(JobState.RESTARTING, JobState.RUNNING, id="restarted-gang-runs"),
    pytest.param(JobState.ADMITTED, JobState.SUCCEEDED, id="gang-finished-between-two-looks"),
    pytest.param(None, JobState.ADMITTED, id="a-new-resource-starts-admitted"),
    pytest.param(None, JobState.FAILED, id="a-new-resource-with-an-invalid-spec-fails-at-once"),
])
def test_allowed_moves(current, new):
    lifecycle.check_transition(current, new)


@pytest.mark.parametrize(("current", "new"), [
    pytest.param(JobState.PREEMPTED, JobState.ADMITTED, id="preempted-is-admitted-again-only-from-the-queue"),
    pytest.param(JobState.QUEUED, JobState.RUNNING, id="no-running-without-admission"),
    pytest.param(JobState.SUCCEEDED, JobState.RUNNING, id="terminal-is-terminal"),
    pytest.param(JobState.CANCELLED, JobState.QUEUED, id="cancelled-is-terminal"),
    pytest.param(None, JobState.RUNNING, id="nothing-runs-before-it-is-admitted"),
])
def test_refused_moves(current, new):
    with pytest.raises(lifecycle.InvalidTransition, match=f"{current} -> {new}"):
        lifecycle.check_transition(current, new)


def test_terminal_states_lead_nowhere_and_every_other_state_can_end():
    for state in JobState:
        if state in lifecycle.TERMINAL_STATES:
            assert not lifecycle.TRANSITIONS[state]
        else:
            assert JobState.CANCELLED in lifecycle.TRANSITIONS[state]


def test_a_preempted_job_holds_its_admission_until_its_trainers_stop():
    assert JobState.PREEMPTED in lifecycle.ACTIVE_STATES and JobState.QUEUED not in lifecycle.ACTIVE_STATES


def _node(index: int, code: int | None, *, collateral: bool = False, oom: bool = False) -> lifecycle.Failure:
    return lifecycle.Failure(name=f"node {index}", index=index, exit_code=code, collateral=collateral,
                             out_of_memory=oom)


@pytest.mark.parametrize(("failures", "retryable", "reason"), [
    pytest.param([_node(0, 2)], False, "TrainerExitedPermanently", id="bad-config"),
    pytest.param([_node(0, 1)], False, "TrainerExitedPermanently", id="crash-is-permanent-on-every-backend"),
    pytest.param([_node(0, 137), _node(1, 1)], True, "TrainerExitedRetryably", id="a-kill-explains-its-peers"),
    pytest.param([_node(0, None)], True, "TrainerExitedRetryably", id="lost-node"),
    pytest.param([_node(0, 1, collateral=True)], True, "GangDisrupted", id="stopped-by-us-does-not-decide"),
    pytest.param([_node(0, 1), _node(1, 143, collateral=True)], False, "TrainerExitedPermanently",
                 id="collateral-sigterm-does-not-excuse-a-crash"),
    pytest.param([_node(0, 3), _node(1, 143, collateral=True)], False, "StorageQuotaExceeded",
                 id="over-the-storage-quota-names-its-reason"),
    pytest.param([_node(0, 137, oom=True)], False, "OOMKilled", id="killed-for-memory-is-not-retried"),
    pytest.param([_node(0, 4)], False, "OOMKilled", id="an-allocation-refused-is-out-of-memory"),
    pytest.param([_node(0, 137), _node(1, 137, oom=True)], False, "OOMKilled",
                 id="out-of-memory-decides-over-a-peers-kill"),
    pytest.param([_node(0, 137, oom=True, collateral=True)], True, "GangDisrupted",
                 id="a-node-stopped-by-us-decides-nothing"),
])
def test_one_exit_code_policy(failures, retryable, reason):
    verdict = lifecycle.judge(failures)
    assert (verdict.retryable, verdict.reason) == (retryable, reason)


@pytest.mark.parametrize(("returncode", "code", "judged"), [
    pytest.param(0, 0, None, id="success"),
    pytest.param(2, 2, "TrainerExitedPermanently", id="own-code-kept"),
    pytest.param(-signal.SIGKILL, 137, "TrainerExitedRetryably", id="killed"),
    pytest.param(-signal.SIGTERM, runtime.EXIT_STOPPED, "TrainerExitedRetryably", id="stopped-after-a-checkpoint"),
])
def test_a_signal_reaches_the_policy_as_128_plus_its_number(returncode, code, judged):
    """What the local backend and the launcher report of a process (subprocess says -N for signal N) is what a
    shell and Kubernetes would: one rule, kembed_contract.runtime.exit_code."""
    assert runtime.exit_code(returncode) == code
    assert runtime.signal_of(code) == (-returncode if returncode < 0 else None)
    if judged:
        assert lifecycle.judge([_node(0, code)]).reason == judged
    assert lifecycle.describe_exit_code(137) == "exit code 137 (SIGKILL)"


def test_restarts_are_spent_by_one_rule():
    retry = lifecycle.Verdict(True, "TrainerExitedRetryably", "node 0 failed")
    first = lifecycle.after_failure(retry, restarts_used=0, max_restarts=1)
    assert (first.state, first.restart_count) == (JobState.RESTARTING, 1)
    last = lifecycle.after_failure(retry, restarts_used=1, max_restarts=1)
    assert (last.state, last.reason, last.restart_count) == (JobState.FAILED, "RestartLimitReached", 1)
    permanent = lifecycle.after_failure(lifecycle.Verdict(False, "TrainerExitedPermanently", "x"),
                                        restarts_used=0, max_restarts=5)
    assert permanent.state is JobState.FAILED


def test_every_state_has_a_tone_the_cli_and_dashboard_show_it_by():
    assert set(lifecycle.STATE_TONES) == set(lifecycle.JobState)
