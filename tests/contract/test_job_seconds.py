"""The split of a job's wall time by phase (kembed_contract.job_seconds): what the API shows from what it measured
and what a trainer reported, whatever the trainer reported."""

import math

import pytest

from kembed_contract import job_seconds


def test_the_split_names_every_phase_in_order_and_sums_to_the_wall_time():
    split = job_seconds.split(wall_seconds=30.0, queued_seconds=2.0,
                              trainer={"process_start": 3.0, "imports": 4.0, "data": 1.0, "training": 15.0,
                                       "evaluation": 1.5, "saving": 0.5})
    assert tuple(split) == job_seconds.PHASES
    assert split["queued"] == 2.0 and split["training"] == 15.0
    assert split["other"] == pytest.approx(3.0)
    assert sum(split.values()) == pytest.approx(30.0)


def test_the_exit_after_the_result_is_its_own_phase():
    split = job_seconds.split(wall_seconds=20.0, queued_seconds=1.0, trainer={"training": 10.0}, exit_seconds=3.0)
    assert split["exit"] == 3.0 and split["other"] == pytest.approx(6.0)
    squeezed = job_seconds.split(wall_seconds=5.0, queued_seconds=1.0, trainer={"training": 10.0}, exit_seconds=9.0)
    assert squeezed["exit"] == 4.0 and squeezed["training"] == 0.0 and sum(squeezed.values()) == pytest.approx(5.0)


def test_before_the_trainer_reports_everything_after_the_queue_is_other():
    split = job_seconds.split(wall_seconds=10.0, queued_seconds=4.0, trainer=None)
    assert split["queued"] == 4.0 and split["other"] == 6.0
    assert all(split[p] == 0.0 for p in job_seconds.TRAINER_PHASES)


def test_a_trainer_clock_ahead_of_the_server_is_scaled_down_never_past_the_wall_time():
    split = job_seconds.split(wall_seconds=10.0, queued_seconds=2.0, trainer={"training": 12.0, "imports": 4.0})
    assert split["training"] == pytest.approx(6.0) and split["imports"] == pytest.approx(2.0)
    assert split["other"] == 0.0 and sum(split.values()) == pytest.approx(10.0)


def test_a_queue_longer_than_the_wall_time_and_negative_times_are_clamped():
    split = job_seconds.split(wall_seconds=5.0, queued_seconds=9.0, trainer={"training": 1.0})
    assert split["queued"] == 5.0 and split["training"] == 0.0 and sum(split.values()) == pytest.approx(5.0)
    assert sum(job_seconds.split(wall_seconds=-1.0, queued_seconds=-1.0, trainer=None).values()) == 0.0


@pytest.mark.parametrize("reported, kept", [
    pytest.param({"training": 3, "imports": 1.5}, {"training": 3.0, "imports": 1.5}, id="numbers"),
    pytest.param({"training": -1.0, "imports": 2.0}, {"imports": 2.0}, id="negative-dropped"),
    pytest.param({"training": math.nan, "data": math.inf}, None, id="non-finite"),
    pytest.param({"training": True}, None, id="a-bool-is-no-number"),
    pytest.param({"training": "3"}, None, id="a-string-is-no-number"),
    pytest.param({"queued": 5.0, "other": 1.0, "wall": 9.0}, None, id="the-platform's-phases-are-not-the-trainer's"),
    pytest.param({"training": 1e12}, None, id="longer-than-a-year"),
    pytest.param([1, 2], None, id="not-a-mapping"),
    pytest.param(None, None, id="none"),
])
def test_a_trainer_report_is_kept_to_what_a_trainer_may_say(reported, kept):
    assert job_seconds.parse_trainer_seconds(reported) == kept
