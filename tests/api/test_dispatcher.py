"""The dispatcher's decisions: admission order and capacity, gang restarts, cancellation, recovery."""

from __future__ import annotations

import itertools
import time

import pytest

from kembed_api.jobs import cancel, queue_forecast, reads, submissions
from kembed_api.jobs.models import Job
from kembed_api.platform.storage import PlatformStorage
from kembed_api.scheduling.dispatcher import Dispatcher
from kembed_api.tenants.service import ensure_tenant
from kembed_contract.lifecycle import JobState
from kembed_contract.spec import JobSpec
from tests.builders import make_spec


@pytest.fixture
def dispatcher(db, backend):
    return Dispatcher(db=db, backend=backend, public_url="http://127.0.0.1:1")


def submit(db, builder) -> str:
    # A write session, as the API's: a unit that reads and then writes beside a running dispatcher thread must hold
    # SQLite's write lock from the start, or it fails "database is locked" when a pass commits in between.
    with db.session(write=True) as session:
        tenant = ensure_tenant(session, name="default")
        job, _ = submissions.submit(session, tenant=tenant, spec=JobSpec.model_validate(builder.build()),
                                storage=PlatformStorage(checkpoint_root="file:///tmp/ckpt"))
        return job.id


def state_of(db, job_id: str) -> tuple[JobState, str]:
    with db.session() as session:
        job = session.query(Job).filter_by(id=job_id).one()
        return JobState(job.state), job.reason


def event_reasons(db, job_id: str) -> list[str]:
    with db.session() as session:
        job = session.query(Job).filter_by(id=job_id).one()
        return [e.reason for e in reads.list_events(session, job=job)]


def test_jobs_run_by_priority_then_fifo_within_capacity(db, backend, dispatcher):
    first = submit(db, make_spec("first").with_nodes(1, 2))
    second = submit(db, make_spec("second").with_nodes(1, 2))
    urgent = submit(db, make_spec("urgent").with_nodes(1, 2).with_priority(10))
    third = submit(db, make_spec("third").with_nodes(1, 2))

    dispatcher.run_once()
    assert backend.started_ids() == [urgent, first]  # 4 slots: two 2-process jobs
    assert state_of(db, second)[0] is JobState.QUEUED
    assert state_of(db, urgent) == (JobState.RUNNING, "Started")

    backend.finish(urgent)
    dispatcher.run_once()
    assert state_of(db, urgent) == (JobState.SUCCEEDED, "Completed")
    assert backend.started_ids() == [urgent, first, second]
    assert state_of(db, third)[0] is JobState.QUEUED
    assert event_reasons(db, urgent) == ["Submitted", "Admitted", "Started", "Completed"]


def test_the_head_of_the_queue_is_never_overtaken_by_a_smaller_job(db, backend, dispatcher):
    running = submit(db, make_spec("running").with_nodes(1, 3))
    big = submit(db, make_spec("big").with_nodes(2, 2))
    small = submit(db, make_spec("small"))
    dispatcher.run_once()
    assert backend.started_ids() == [running]
    assert state_of(db, big)[0] is JobState.QUEUED and state_of(db, small)[0] is JobState.QUEUED


def test_a_pass_reads_the_queue_a_page_at_a_time_and_stops_once_every_tenant_waits(db, backend):
    """Jobs on later pages are reached; but once every tenant with jobs waiting has its head blocked, nothing
    further can be admitted, and a long queue costs the pass no more pages."""
    from sqlalchemy import event

    dispatcher = Dispatcher(db=db, backend=backend, public_url="http://127.0.0.1:1", queue_page=2)

    def submit_as(tenant_name: str, job_name: str) -> str:
        with db.session() as session:
            tenant = ensure_tenant(session, name=tenant_name)
            tenant.quota_max_running_jobs = 1
            job, _ = submissions.submit(session, tenant=tenant, spec=JobSpec.model_validate(make_spec(job_name).build()),
                                    storage=PlatformStorage(checkpoint_root="file:///tmp/ckpt"))
            return job.id

    b_jobs = [submit_as("b", f"b-{i}") for i in range(2)]
    a_jobs = [submit_as("a", f"a-{i}") for i in range(8)]  # five pages of the queue in all
    pages: list[str] = []
    event.listen(db.engine, "before_cursor_execute", lambda _c, _cur, statement, *_: pages.append(statement)
                 if "FROM jobs" in statement and "LIMIT" in statement else None)
    dispatcher.run_once()
    states = [state_of(db, job_id)[0] for job_id in [*b_jobs, *a_jobs]]
    assert states == [JobState.RUNNING, JobState.QUEUED, JobState.RUNNING] + [JobState.QUEUED] * 7
    assert len(pages) == 2  # b's jobs, then a's first two: both tenants wait for a running job to end


def test_a_stream_of_wake_ups_is_answered_by_a_pass_at_most_every_tenth_of_a_second(db, backend):
    # Every submission wakes the dispatcher; a pass each cost a tenth of the API's CPU under a stream of them.
    dispatcher = Dispatcher(db=db, backend=backend, public_url="http://127.0.0.1:1", interval_s=60)
    passes: list[float] = []
    run_once = dispatcher.run_once

    def counted_pass() -> None:
        passes.append(time.monotonic())
        run_once()

    dispatcher.run_once = counted_pass
    dispatcher.start()
    try:
        started = time.monotonic()
        while time.monotonic() - started < 0.6:
            dispatcher.wake()
            time.sleep(0.005)
        job_id = submit(db, make_spec("after-the-stream"))
        dispatcher.wake()
        deadline = time.monotonic() + 10
        while state_of(db, job_id)[0] == JobState.QUEUED:  # the stream's last wake-up is still answered
            assert time.monotonic() < deadline, "no pass after the last wake-up"
            time.sleep(0.01)
    finally:
        dispatcher.stop()
    gaps = [later - earlier for earlier, later in itertools.pairwise(passes)]
    assert len(passes) >= 3 and min(gaps) >= 0.095


def test_a_retryable_failure_restarts_the_gang_until_max_restarts(db, backend, dispatcher):
    job_id = submit(db, make_spec().with_max_restarts(1))
    dispatcher.run_once()
    backend.finish(job_id, succeeded=False)
    dispatcher.run_once()  # -> RESTARTING, relaunched on the next pass
    assert state_of(db, job_id) == (JobState.RESTARTING, "TrainerFailed")
    dispatcher.run_once()
    assert [launch.attempt for launch in backend.started] == [1, 2]
    assert state_of(db, job_id) == (JobState.RUNNING, "Resumed")

    backend.finish(job_id, succeeded=False)
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.FAILED, "RestartLimitReached")


def test_a_permanent_failure_fails_at_once(db, backend, dispatcher):
    job_id = submit(db, make_spec().with_max_restarts(5))
    dispatcher.run_once()
    backend.finish(job_id, succeeded=False, retryable=False, reason="TrainerRejectedConfig")
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.FAILED, "TrainerRejectedConfig")
    assert len(backend.started) == 1


def test_a_backend_that_restarts_gangs_itself_is_followed_and_its_restarts_counted_once(db, backend, dispatcher):
    """Kubernetes: the operator restarts the gang (spending max_restarts); the API's job follows it."""
    job_id = submit(db, make_spec().with_max_restarts(2))
    dispatcher.run_once()
    backend.observe(job_id, JobState.RESTARTING, reason="TrainerExitedRetryably", restart_count=1)
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.RESTARTING, "TrainerExitedRetryably")
    backend.observe(job_id, JobState.RUNNING, reason="GangRunning", restart_count=1)
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.RUNNING, "Resumed")
    backend.finish(job_id, succeeded=False, retryable=False, reason="RestartLimitReached")
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.FAILED, "RestartLimitReached")
    with db.session() as session:  # the operator's count, not spent a second time by the API
        assert session.query(Job).filter_by(id=job_id).one().restart_count == 1
    assert len(backend.started) == 1  # the API never relaunched what the operator restarts


def test_a_cancel_reaches_a_backend_that_reports_its_gang_running(db, backend, dispatcher):
    job_id = submit(db, make_spec())
    dispatcher.run_once()
    with db.session() as session:
        cancel.request_cancel(session, tenant=ensure_tenant(session, name="default"), job_id=job_id)
    backend.observe(job_id, JobState.RUNNING, reason="GangRunning")
    dispatcher.run_once()
    assert backend.stopped == [job_id]


def test_a_preempted_job_holds_its_place_until_its_trainers_stop_then_queues_again(db, backend, dispatcher):
    job_id = submit(db, make_spec())
    dispatcher.run_once()
    backend.observe(job_id, JobState.PREEMPTED, reason="Suspended")
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.PREEMPTED, "Suspended")
    backend.observe(job_id, JobState.QUEUED, reason="Stopped")
    dispatcher.run_once()  # back in the queue, and admitted again on the same pass (nothing else waits)
    assert event_reasons(db, job_id)[-4:] == ["Suspended", "Requeued", "Admitted", "Started"]
    assert [launch.job_id for launch in backend.started] == [job_id, job_id]


def test_cancelling_a_running_job_stops_it_and_ends_cancelled(db, backend, dispatcher):
    job_id = submit(db, make_spec())
    dispatcher.run_once()
    with db.session() as session:
        cancel.request_cancel(session, tenant=ensure_tenant(session, name="default"), job_id=job_id)
    dispatcher.run_once()
    assert backend.stopped == [job_id]
    assert state_of(db, job_id)[0] is JobState.RUNNING  # still writing its checkpoint
    backend.finish(job_id, succeeded=False)
    dispatcher.run_once()
    assert state_of(db, job_id) == (JobState.CANCELLED, "Cancelled")


def test_cancelling_a_queued_job_is_immediate_and_frees_its_place(db, backend, dispatcher):
    job_id = submit(db, make_spec())
    with db.session() as session:
        cancel.request_cancel(session, tenant=ensure_tenant(session, name="default"), job_id=job_id)
    assert state_of(db, job_id) == (JobState.CANCELLED, "Cancelled")
    dispatcher.run_once()
    assert backend.started == []


def test_after_a_server_restart_running_jobs_resume_and_queued_jobs_stay_queued(db, backend, dispatcher):
    running = submit(db, make_spec("running").with_nodes(1, 4))
    queued = submit(db, make_spec("queued").with_nodes(1, 4))
    dispatcher.run_once()

    restarted = Dispatcher(db=db, backend=backend, public_url="http://127.0.0.1:1")
    restarted.recover()
    assert backend.reclaimed == [running]
    assert state_of(db, running) == (JobState.RESTARTING, "ServerRestarted")
    restarted.run_once()
    assert state_of(db, running) == (JobState.RUNNING, "Resumed")
    assert state_of(db, queued)[0] is JobState.QUEUED
    # a server restart is not a failure of the job: it does not use up a restart
    with db.session() as session:
        assert session.query(Job).filter_by(id=running).one().restart_count == 0


def test_an_expired_forecast_is_replayed_in_the_background_while_reads_answer_from_the_old_one(db, backend):
    import threading

    from kembed_api.jobs.forecasts import Forecasts

    job_id = submit(db, make_spec("waiting"))
    now, replays, release = [0.0], [], threading.Event()

    def slow_capacity():  # the replay of a long queue, held until the test lets it finish
        replays.append(now[0])
        if len(replays) > 1:
            assert release.wait(10)
        return backend.capacity()

    forecasts = Forecasts(db, capacity=slow_capacity, ttl_s=1.0, clock=lambda: now[0])
    with db.session() as session:
        tenant = ensure_tenant(session, name="default")
        seq = reads.get_job(session, tenant=tenant, job_id=job_id).seq

    def start() -> object:
        return forecasts.of(tenant=tenant, job_seq=seq, queue_version=0)[1]

    assert start() is None  # nothing replayed yet: no estimate, and the read did not wait for one
    forecasts.wait()
    first = start()
    assert first is not None and replays == [0.0]
    now[0] = 5.0  # it has expired: the next read starts one replay, and reads meanwhile answer from the old one
    assert start() == first and start() == first
    while len(replays) < 2:
        time.sleep(0.01)
    assert replays == [0.0, 5.0]
    release.set()
    forecasts.wait()
    forecasts.close()


def test_a_job_newer_than_the_forecast_waits_for_the_next_replay_of_the_queue(db, backend):
    """Under a stream of submissions, reading each new job must not replay the whole queue each time."""
    from kembed_api.jobs.forecasts import Forecasts

    now, replays = [0.0], []

    def counted_capacity():
        replays.append(now[0])
        return backend.capacity()

    forecasts = Forecasts(db, capacity=counted_capacity, ttl_s=5.0, new_job_ttl_s=1.0, clock=lambda: now[0])

    def read(job_id: str) -> tuple[int, object]:
        with db.session() as session:
            tenant = ensure_tenant(session, name="default")
            read = reads.read_job(session, tenant=tenant, job_id=job_id, forecast=lambda seq, version: forecasts.of(
                tenant=tenant, job_seq=seq, queue_version=version))
        forecasts.wait()
        return read.queue_position, read.estimated_start_at

    first = submit(db, make_spec("first"))
    read(first)
    assert read(first)[1] is not None and replays == [0.0]
    second = submit(db, make_spec("second"))
    now[0] = 0.5
    assert read(second) == (2, None)  # its exact position at once; no start until the forecast is replayed
    assert replays == [0.0]
    now[0] = 1.0
    assert read(second) == (2, None) and replays == [0.0, 1.0]  # this read asked for the replay
    position, start = read(second)
    assert position == 2 and start is not None and replays == [0.0, 1.0]
    forecasts.close()


def test_a_read_takes_a_position_from_the_forecast_only_while_the_queue_has_not_moved(db, backend):
    """Counting a position costs as much as the jobs ahead: a read takes it from the cached forecast instead, but
    only while no job left the queue or went ahead in it since the replay; otherwise it counts."""
    from sqlalchemy import event

    from kembed_api.jobs.forecasts import Forecasts

    forecasts = Forecasts(db, capacity=backend.capacity, ttl_s=3600, new_job_ttl_s=3600)
    first, _, third = (submit(db, make_spec(name)) for name in ("first", "second", "third"))
    counts: list[str] = []
    event.listen(db.engine, "before_cursor_execute",
                 lambda _c, _cur, statement, *_: counts.append(statement) if "count(" in statement else None)

    def position(job_id: str) -> tuple[int, bool]:
        """(queue position, whether the read counted it)"""
        counts.clear()
        with db.session() as session:
            read = reads.read_job(session, tenant=tenant, job_id=job_id, forecast=lambda seq, version: forecasts.of(
                tenant=tenant, job_seq=seq, queue_version=version))
        return read.queue_position, bool(counts)

    with db.session() as session:
        tenant = ensure_tenant(session, name="default")
        forecasts.fresh(session, tenant=tenant)
    assert position(third) == (3, False)
    submit(db, make_spec("fourth"))  # joins behind: nobody ahead moved
    assert position(third) == (3, False)
    submit(db, make_spec("urgent").with_priority(5))  # goes ahead of the queue
    assert position(third) == (4, True)
    with db.session() as session:
        forecasts.fresh(session, tenant=tenant)
    assert position(third) == (4, False)
    with db.session(write=True) as session:
        cancel.request_cancel(session, tenant=tenant, job_id=first)  # leaves the queue
    assert position(third) == (3, True)
    forecasts.close()


def test_the_tenants_queue_length_follows_every_change_to_its_queue(db, backend, dispatcher):
    """The usage endpoint reads the queue's length from the tenant's row, kept by the changes themselves."""
    from kembed_api.tenants.service import usage

    def lengths() -> tuple[int, int]:
        """(the tenant's own count, a count of its QUEUED jobs)"""
        with db.session() as session:
            tenant = ensure_tenant(session, name="default")
            counted = session.query(Job).filter_by(tenant_id=tenant.id, state=JobState.QUEUED).count()
            return usage(session, tenant=tenant).queued_jobs, counted

    ids = [submit(db, make_spec(f"job-{i}").with_nodes(1, 2)) for i in range(5)]  # 4 slots: two run at once
    assert lengths() == (5, 5)
    dispatcher.run_once()
    assert lengths() == (3, 3)
    with db.session(write=True) as session:
        cancel.request_cancel(session, tenant=ensure_tenant(session, name="default"), job_id=ids[-1])
    assert lengths() == (2, 2)
    submit(db, make_spec("urgent").with_nodes(1, 2).with_priority(5))
    backend.finish(ids[0])
    dispatcher.run_once()  # one ends, the urgent one takes its place
    assert lengths() == (2, 2)


def test_a_forecast_places_every_queued_job_and_estimates_only_what_can_be_known(db):
    """The replay stops at the first job that waits behind one of unknown duration; positions cover the queue."""
    from kembed_api.quota.admission import Quota

    ids = [submit(db, make_spec(f"never-run-{i}")) for i in range(4)]  # no run of these names ever finished
    urgent = submit(db, make_spec("urgent").with_priority(5))
    with db.session() as session:
        tenant = ensure_tenant(session, name="default")
        _, forecast = queue_forecast.queue_forecast(session, tenant=tenant, capacity=Quota(max_processes=2))
        seqs = {job_id: reads.get_job(session, tenant=tenant, job_id=job_id).seq for job_id in [urgent, *ids]}
    placed = [forecast[seqs[job_id]] for job_id in [urgent, *ids]]
    assert [position for position, _ in placed] == [1, 2, 3, 4, 5]
    # two trainer processes fit at once (one each): the first two start now; the others wait for jobs nobody
    # can say when will end
    assert [start is not None for _, start in placed] == [True, True, False, False, False]


def test_a_job_past_its_time_limit_is_stopped_and_fails_counting_only_time_running(db, backend):
    """max_run_seconds counts time running over all of a job's admissions, not time queued; past it the job is
    stopped (it saves, as on cancel) and fails with DeadlineExceeded. A tenant's quota.max_run_seconds is the
    default of its jobs that set none."""
    from datetime import UTC, datetime, timedelta

    start = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)
    now = [start]
    dispatcher = Dispatcher(db=db, backend=backend, public_url="http://127.0.0.1:1", clock=lambda: now[0])

    def at(seconds: float) -> None:
        now[0] = start + timedelta(seconds=seconds)
        dispatcher.run_once()

    builder = make_spec("limited")
    builder.spec["max_run_seconds"] = 100
    job_id = submit(db, builder)
    at(0)
    at(60)
    assert state_of(db, job_id)[0] is JobState.RUNNING and backend.stopped == []

    # Preempted and back in the queue for 1000 s: that wait does not count.
    dispatcher.admission_paused = True
    backend.observe(job_id, JobState.QUEUED, reason="Stopped")
    at(70)
    assert state_of(db, job_id)[0] is JobState.QUEUED
    dispatcher.admission_paused = False
    at(1070)  # admitted and started again: 70 s used so far
    at(1099)
    assert state_of(db, job_id)[0] is JobState.RUNNING and backend.stopped == []
    at(1101)  # 101 s running
    assert backend.stopped == [job_id]
    assert state_of(db, job_id)[0] is JobState.RUNNING  # still writing its checkpoint
    backend.finish(job_id, succeeded=False, retryable=True)  # exited 143 after saving
    at(1102)
    assert state_of(db, job_id) == (JobState.FAILED, "DeadlineExceeded")
    with db.session() as session:
        message = session.query(Job).filter_by(id=job_id).one().message
    assert "past its time limit of 100 s (max_run_seconds)" in message

    with db.session() as session:
        ensure_tenant(session, name="default").quota_max_run_seconds = 50
    defaulted = submit(db, make_spec("defaulted"))
    at(2000)
    at(2049)
    assert defaulted not in backend.stopped
    at(2050)
    assert backend.stopped[-1] == defaulted
    backend.finish(defaulted, succeeded=False, retryable=True)
    at(2051)
    assert state_of(db, defaulted) == (JobState.FAILED, "DeadlineExceeded")


def test_a_job_launched_with_no_storage_left_fails_at_once_and_one_with_some_is_told_its_budget(db, backend,
                                                                                               dispatcher):
    """The budget a trainer gets is the tenant's storage quota less what it keeps besides that job's own folder;
    with nothing left the job fails StorageQuotaExceeded before it starts (a tenant already over at submission
    is refused there)."""
    from kembed_api.jobs import storage_use

    room = submit(db, make_spec("room"))
    full = submit(db, make_spec("full"))
    with db.session() as session:
        tenant = ensure_tenant(session, name="default")
        tenant.quota_storage_bytes = 1000
        other = session.query(Job).filter_by(id=full).one()
        storage_use.record_job_bytes(session, other, checkpoint_bytes=300, log_bytes=100)  # as if reported
    dispatcher.run_once()
    assert [(launch.job_id, launch.storage_budget_bytes) for launch in backend.started][0] == (room, 600)
    with db.session() as session:
        assert ensure_tenant(session, name="default").stored_bytes == 400

    late = submit(db, make_spec("late"))
    with db.session() as session:
        storage_use.record_job_bytes(session, session.query(Job).filter_by(id=room).one(), checkpoint_bytes=700)
    dispatcher.run_once()
    assert state_of(db, late) == (JobState.FAILED, "StorageQuotaExceeded")
    assert late not in backend.started_ids()


def test_a_job_the_backend_cannot_start_fails_with_its_reason_and_frees_its_admission(db, backend, dispatcher,
                                                                                      monkeypatch):
    """The embedded backend's disk filled between submission and dispatch (backends.local): the job fails, saying
    why, instead of retrying forever with its admission held; the next job starts."""
    from kembed_api.backends.base import CannotStart

    full = submit(db, make_spec("full").with_nodes(1, 4))
    after = submit(db, make_spec("after").with_nodes(1, 4))
    start = backend.start

    def refuse_full(launch):
        if launch.job_id == full:
            raise CannotStart("the job's tiered tables need 600 MiB of local disk, 1 MiB free", reason="LocalDiskFull")
        return start(launch)

    monkeypatch.setattr(backend, "start", refuse_full)
    dispatcher.run_once()
    assert state_of(db, full) == (JobState.FAILED, "LocalDiskFull")
    with db.session() as session:
        assert "600 MiB of local disk" in session.query(Job).filter_by(id=full).one().message
    dispatcher.run_once()
    assert backend.started_ids() == [after]
