"""The trainer's clock of phases: nested phases never count a second twice, and its threads follow the launcher."""

import pytest

from kembed_contract import job_seconds, threads
from kembed_trainer import dist, phases


class _Ticks:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_second_counts_for_the_innermost_phase_open():
    ticks = _Ticks()
    clock = phases.PhaseClock(clock=ticks)
    with clock.phase("training"):
        ticks.now += 10
        with clock.phase("evaluation"):
            ticks.now += 3
            with clock.phase("saving"):
                ticks.now += 2
            ticks.now += 1
        ticks.now += 4
        assert clock.seconds()["training"] == 14  # the open phase counts up to now
    ticks.now += 100  # outside every phase: the trainer does not count it
    seconds = clock.seconds()
    assert seconds == {**dict.fromkeys(job_seconds.TRAINER_PHASES, 0.0), "training": 14.0, "evaluation": 4.0,
                       "saving": 2.0}


def test_an_unknown_phase_is_refused():
    with pytest.raises(KeyError, match="queued"), phases.PhaseClock().phase("queued"):
        pass


def test_process_start_counts_from_the_launcher_and_imports_from_the_first_line():
    import time
    entered = time.time() - 2.0
    clock = phases.PhaseClock.since_launch(entered, {job_seconds.ENV_LAUNCHED_AT: repr(entered - 3.0)})
    seconds = clock.seconds()
    assert seconds["process_start"] == pytest.approx(3.0, abs=0.01)
    assert seconds["imports"] == pytest.approx(2.0, abs=0.5)
    by_hand = phases.PhaseClock.since_launch(entered, {job_seconds.ENV_LAUNCHED_AT: "not a time"})
    assert by_hand.seconds()["process_start"] == 0.0


@pytest.mark.parametrize("configured, share, expected", [
    pytest.param(0, "2", 2, id="the-launcher's-share"),
    pytest.param(8, "2", 2, id="a-config-asking-more-is-held-to-the-share"),
    pytest.param(1, "2", 1, id="a-config-asking-fewer-gets-fewer"),
])
def test_a_rank_runs_the_threads_its_job_was_admitted_with(configured, share, expected):
    environ = {threads.ENV_THREADS_PER_RANK: share}
    assert dist.rank_threads(configured, local_world_size=1, environ=environ) == expected


def test_by_hand_a_rank_shares_the_cores_it_may_run_on():
    import os
    cores = len(os.sched_getaffinity(0))
    assert dist.rank_threads(0, local_world_size=1, environ={}) == cores
    assert dist.rank_threads(0, local_world_size=cores * 2, environ={}) == 1
