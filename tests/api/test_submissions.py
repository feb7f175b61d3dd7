"""Storing submissions in batches (kembed_api.jobs.submissions.submit_many, what the intake's writer calls): each submission of a
batch gets the outcome it would have had alone."""

from __future__ import annotations

from kembed_api.jobs import errors, reads, submissions
from kembed_api.platform.storage import PlatformStorage
from kembed_api.tenants.service import ensure_tenant
from kembed_contract.spec import JobSpec
from tests.builders import make_spec

_STORAGE = PlatformStorage(checkpoint_root="file:///c")


def _submission(tenant, name: str, priority: int = 0, key: str | None = None,
                checkpoint_uri: str | None = None) -> submissions.Submission:
    spec = make_spec(name).with_priority(priority).build()
    spec["trainer"]["checkpoint"]["uri"] = checkpoint_uri
    return submissions.Submission(tenant.id, JobSpec.model_validate(spec), key)


def test_a_batch_numbers_queue_positions_by_priority_then_age(db):
    with db.session(write=True) as session:
        tenant = ensure_tenant(session, name="default")
        submissions.submit(session, tenant=tenant, spec=_submission(tenant, "old").spec, storage=_STORAGE)
        outcomes = submissions.submit_many(session, [
            _submission(tenant, "low-1"), _submission(tenant, "high-1", 5),
            _submission(tenant, "low-2"), _submission(tenant, "high-2", 5),
        ], storage=_STORAGE)
    # admission order: high-1, high-2, old, low-1, low-2
    assert [(read.name, read.queue_position, created) for read, created in outcomes] == [
        ("low-1", 4, True), ("high-1", 1, True), ("low-2", 5, True), ("high-2", 2, True)]
    with db.session() as session:
        polled = {read.name: reads.read_job(session, tenant=tenant, job_id=read.id,
                                              forecast=reads.no_forecast).queue_position
                  for read, _ in outcomes}
    assert polled == {"low-1": 4, "high-1": 1, "low-2": 5, "high-2": 2}  # what a later read counts
    with db.session(write=True) as session:  # a batch that lands between the priorities already queued
        (middle, _), (top, _) = submissions.submit_many(
            session, [_submission(tenant, "middle", 3), _submission(tenant, "top", 9)], storage=_STORAGE)
    assert (middle.queue_position, top.queue_position) == (4, 1)  # behind high-1 and high-2, ahead of old


def test_one_refused_submission_does_not_fail_the_rest_of_its_batch(db):
    with db.session(write=True) as session:
        tenant = ensure_tenant(session, name="default")
        outcomes = submissions.submit_many(session, [
            _submission(tenant, "fine"),
            _submission(tenant, "foreign", checkpoint_uri="file:///c/other-team/x"),
            _submission(tenant, "also-fine", key="k"),
            _submission(tenant, "also-fine", key="k"),
            _submission(tenant, "other-spec", key="k"),
        ], storage=_STORAGE)
    fine, foreign, keyed, repeated, reused = outcomes
    assert fine[1] and keyed[1] and fine[0].spec.trainer.checkpoint.uri.startswith("file:///c/default/fine-")
    assert isinstance(foreign, errors.CannotRun) and "trainer.checkpoint.uri" in str(foreign)
    assert repeated == (keyed[0], False)  # the same key within one batch: the first's job, not a second one
    assert isinstance(reused, errors.KeyReused)  # ... unless the spec differs
    with db.session() as session:
        stored = reads.list_jobs(session, tenant=tenant, forecast=dict).items
    assert [job.name for job in stored] == ["also-fine", "fine"]
