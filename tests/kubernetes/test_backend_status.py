"""The API's Kubernetes backend takes an EmbeddingJob's status as news only when the operator wrote it for the
latest spec. A CI run showed why: a preempted job admitted again (spec.suspend back to false) still had the
operator's "suspended and stopped" from before; the API requeued it, admitted it again, seven times in two
seconds, each time with a new report token, and the gang that finally ran held an older one, so none of its
reports counted. No operator runs in this module: the test writes the statuses an operator would."""

from __future__ import annotations

import base64
import uuid

import pytest

from kembed_api.backends.base import Exit, Launch, Observed
from kembed_api.backends.kubernetes import KubernetesBackend
from kembed_contract import resources
from kembed_contract.lifecycle import JobState
from kembed_contract.spec import JobSpec
from tests.builders import make_spec
from tests.operator import harness

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def platform(cluster):
    harness.install_platform(cluster)
    return cluster


@pytest.fixture
def tenant(platform):
    name = harness.tenant_name()
    platform.create_namespace(resources.tenant_namespace(name))
    yield name
    # Its EmbeddingJob carries the operator's finalizer: left in a terminating namespace, it would keep the next
    # module's operator trying to start its gang there (refused).
    harness.remove_tenant(platform, name)


def _launch(tenant: str, job_id: str, attempt: int, token: str) -> Launch:
    return Launch(job_id=job_id, tenant=tenant, spec=JobSpec.model_validate(make_spec("gen").build()),
                  attempt=attempt, report_url=f"http://127.0.0.1:1/v1/jobs/{job_id}/reports", report_token=token)


def _operator_writes(platform, tenant: str, job_id: str, phase: JobState, reason: str) -> None:
    """A status as the operator writes it: for the generation of the spec it acted on (the current one)."""
    api = harness.custom(platform)
    namespace = resources.tenant_namespace(tenant)
    generation = api.get_namespaced_custom_object(resources.GROUP, resources.VERSION, namespace,
                                                  resources.EMBEDDING_JOB_PLURAL, job_id)["metadata"]["generation"]
    api.patch_namespaced_custom_object_status(
        resources.GROUP, resources.VERSION, namespace, resources.EMBEDDING_JOB_PLURAL, job_id,
        {"status": {"phase": phase.value, "reason": reason, "message": reason, "observedGeneration": generation}})


def test_a_stopped_status_from_before_an_admission_is_not_news(platform, tenant):
    job_id = f"gen-{uuid.uuid4().hex[:6]}"
    fresh = KubernetesBackend(api_client=platform.api_client(), cache_ttl_s=0)  # lists at every poll
    fresh.start(_launch(tenant, job_id, 0, "first-token"))
    _operator_writes(platform, tenant, job_id, JobState.RUNNING, "Started")
    assert isinstance(seen := fresh.poll(job_id), Observed) and seen.state is JobState.RUNNING

    fresh.preempt(job_id)  # spec.suspend: true
    assert fresh.poll(job_id) is None  # "running" was about the spec before: nothing to follow yet
    _operator_writes(platform, tenant, job_id, JobState.QUEUED, "Stopped")
    assert isinstance(seen := fresh.poll(job_id), Observed) and seen.state is JobState.QUEUED  # stopped: requeue

    # Admitted again. The backend that starts it lists at most every hour, and its last list shows it stopped.
    cached = KubernetesBackend(api_client=platform.api_client(), cache_ttl_s=3600)
    assert isinstance(seen := cached.poll(job_id), Observed) and seen.state is JobState.QUEUED
    cached.start(_launch(tenant, job_id, 1, "second-token"))  # spec.suspend: false again
    assert cached.poll(job_id) is None  # not the stale "stopped" of its own cache
    assert fresh.poll(job_id) is None  # nor the operator's status from before it saw the admission
    secret = platform.core().read_namespaced_secret(f"{job_id}-report-token", resources.tenant_namespace(tenant))
    assert base64.b64decode(secret.data["token"]).decode() == "second-token"

    _operator_writes(platform, tenant, job_id, JobState.RUNNING, "Resumed")
    assert isinstance(seen := fresh.poll(job_id), Observed) and seen.state is JobState.RUNNING


def test_a_machine_booted_minutes_ago_still_lists(platform, tenant, monkeypatch):
    """Monotonic time is the uptime: a backend whose cache outlives it must still list on its first poll."""
    job_id = f"boot-{uuid.uuid4().hex[:6]}"
    KubernetesBackend(api_client=platform.api_client(), cache_ttl_s=0).start(_launch(tenant, job_id, 0, "t"))
    _operator_writes(platform, tenant, job_id, JobState.RUNNING, "Started")
    monkeypatch.setattr("kembed_api.backends.kubernetes.time.monotonic", lambda: 90.0)  # booted 90 s ago
    fresh_boot = KubernetesBackend(api_client=platform.api_client(), cache_ttl_s=3600)
    assert isinstance(seen := fresh_boot.poll(job_id), Observed) and seen.state is JobState.RUNNING


def test_a_job_missing_from_a_stale_list_is_read_before_it_is_called_lost(platform, tenant):
    """Another replica (or this one before a restart) created the job after this backend's cached list."""
    early = f"early-{uuid.uuid4().hex[:6]}"
    cached = KubernetesBackend(api_client=platform.api_client(), cache_ttl_s=3600)
    cached.start(_launch(tenant, early, 0, "t"))
    assert cached.poll(early) is None  # listed now, cached for an hour

    late = f"late-{uuid.uuid4().hex[:6]}"
    KubernetesBackend(api_client=platform.api_client(), cache_ttl_s=0).start(_launch(tenant, late, 0, "t"))
    _operator_writes(platform, tenant, late, JobState.RUNNING, "Started")
    assert isinstance(seen := cached.poll(late), Observed) and seen.state is JobState.RUNNING  # not Lost

    gone = f"gone-{uuid.uuid4().hex[:6]}"  # never created: really lost, after one read
    lost = cached.poll(gone)
    assert isinstance(lost, Exit) and lost.reason == "Lost"
