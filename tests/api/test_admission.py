"""Quota arithmetic and queue forecasts (pure functions)."""

from datetime import UTC, datetime, timedelta

import pytest

from kembed_api.quota.admission import Demand, Quota, RunningJob, estimate_start_times, never_fits, shortfall

NOW = datetime(2026, 1, 1, tzinfo=UTC)
GPU8 = Demand(gpus=8, cpu=8, memory_bytes=2**30, running_jobs=1, processes=8)


@pytest.mark.parametrize(
    ("quota", "used", "fits"),
    [
        pytest.param(Quota(), Demand(), True, id="unlimited"),
        pytest.param(Quota(gpus=16), GPU8, True, id="exactly-fills"),
        pytest.param(Quota(gpus=16), GPU8 + Demand(gpus=1), False, id="one-gpu-short"),
        pytest.param(Quota(max_running_jobs=1), GPU8, False, id="job-count"),
        pytest.param(Quota(cpu=15.5), GPU8, False, id="cpu"),
        pytest.param(Quota(max_processes=16), GPU8, True, id="processes"),
    ],
)
def test_a_gang_fits_only_if_every_dimension_fits(quota, used, fits):
    assert (shortfall(quota, used=used, demand=GPU8) is None) is fits


def test_the_shortfall_names_the_quota_field_and_what_is_free():
    assert shortfall(Quota(gpus=12), used=Demand(gpus=8), demand=GPU8) == "quota.gpus: needs 8 GPUs, 4 of 12 free"


def test_a_job_larger_than_the_quota_can_never_fit_but_a_busy_tenant_can_wait():
    assert "quota.gpus" in never_fits(Quota(gpus=4), GPU8)
    assert never_fits(Quota(gpus=8, max_running_jobs=1), GPU8) is None


def test_queued_jobs_start_when_running_ones_are_expected_to_end():
    running = [RunningJob(GPU8, NOW + timedelta(minutes=10)), RunningJob(GPU8, NOW + timedelta(minutes=30))]
    starts = estimate_start_times(
        quota=Quota(gpus=16), capacity=Quota(), running=running,
        queued=[(GPU8, timedelta(minutes=5)), (GPU8, timedelta(minutes=5)), (GPU8, None)], now=NOW,
    )
    # the first waits for the 10-minute job; each next one for the queued job before it (5 minutes each),
    # which ends before the 30-minute job does
    assert starts == [NOW + timedelta(minutes=10), NOW + timedelta(minutes=15), NOW + timedelta(minutes=20)]


def test_an_unknowable_wait_is_none_for_that_job_and_all_behind_it():
    starts = estimate_start_times(quota=Quota(gpus=8), capacity=Quota(), running=[RunningJob(GPU8, None)],
                                  queued=[(GPU8, timedelta(minutes=1)), (Demand(gpus=1), None)], now=NOW)
    assert starts == []  # no estimate for either: the replay stops at the first job it cannot place


def test_other_tenants_jobs_count_against_capacity_not_quota():
    other = RunningJob(GPU8, NOW + timedelta(minutes=7), own=False)
    starts = estimate_start_times(quota=Quota(gpus=8), capacity=Quota(max_processes=8), running=[other],
                                  queued=[(GPU8, None)], now=NOW)
    assert starts == [NOW + timedelta(minutes=7)]
