"""The API's Kubernetes backend on the real control plane, with the real operator: jobs submitted over HTTP
become EmbeddingJobs in the tenant's namespace, and their status comes back to the API."""

from __future__ import annotations

import time

import httpx
import pytest

from kembed_api.app import create_app
from kembed_api.backends.kubernetes import KubernetesBackend
from kembed_api.platform.settings import Settings
from kembed_contract import resources
from tests.api.conftest import ThreadedServer, bearer, wait_state
from tests.builders import make_spec
from tests.operator import harness

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def platform(cluster):
    harness.install_platform(cluster)
    return cluster


@pytest.fixture(scope="module")
def node_pool(platform):
    """GPU nodes of this module alone: where its gangs land does not hang on what other tests left running."""
    pool = platform.create_node_pool(4)
    yield pool
    platform.delete_node_pool(pool)


@pytest.fixture(scope="module")
def operator(platform, node_pool, tmp_path_factory):
    process = harness.OperatorProcess(platform, tmp_path_factory.mktemp("operator"),
                                      trainer_node_selector=node_pool.node_selector,
                                      trainer_tolerations=[harness.GPU_TOLERATION, *node_pool.tolerations])
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def api_server(platform, operator, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("api")
    backend = KubernetesBackend(api_client=platform.api_client())
    app = create_app(Settings(data_dir=data_dir, dispatch_interval_s=0.2, backend="kubernetes"), backend=backend)
    with ThreadedServer(app) as server:
        yield server.url, bearer((data_dir / "admin-token").read_text().strip())


@pytest.fixture
def api(platform, api_server):
    """(url, member token, tenant): a tenant of the test's own. A tenant shared by the module's tests let the
    quota test's cancelled gangs, their pods still terminating, hold the namespace's 16 GPUs when the next test's
    gang was created (its pods refused by the ResourceQuota: seed 31337)."""
    url, admin = api_server
    tenant = harness.tenant_name()
    created = httpx.post(f"{url}/v1/tenants", headers=admin,
                         json={"name": tenant, "quota": {"gpus": 16, "max_running_jobs": 3}})
    assert created.status_code == 201, created.text
    token = bearer(httpx.post(f"{url}/v1/tenants/{tenant}/tokens", headers=admin,
                              json={"name": "t", "role": "member"}).json()["token"])
    yield url, token, tenant
    # Nothing of it left to launch (a launch would make its namespace again), then nothing of it in the cluster.
    for job in httpx.get(f"{url}/v1/jobs", params={"limit": 500}, headers=token).json()["items"]:
        if job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            httpx.post(f"{url}/v1/jobs/{job['id']}/cancel", headers=token)
    harness.remove_tenant(platform, tenant)


def gpu_job(name: str, **labels: str) -> dict:
    spec = make_spec(name).build()
    spec["resources"] = {"nodes": 2, "gpus_per_node": 8, "cpu_per_node": 2, "memory_per_node": "8Gi"}
    spec["labels"] = labels
    return spec


def test_a_job_runs_as_an_embedding_job_and_its_end_comes_back(platform, node_pool, api):
    url, token, tenant = api
    job = httpx.post(f"{url}/v1/jobs", json=gpu_job("gang"), headers=token).json()
    done = wait_state(url, token, job["id"], "SUCCEEDED", "FAILED")
    assert done["state"] == "SUCCEEDED", done["message"]

    namespace = resources.tenant_namespace(tenant)
    obj = harness.read_job(platform, namespace, job["id"])
    assert obj["spec"]["report_url"].endswith(f"/v1/jobs/{job['id']}/reports")
    assert resources.EmbeddingJobStatus.from_object(obj).phase.value == "SUCCEEDED"
    nodes = {pod.spec.node_name for pod in harness.job_pods(platform, namespace, job["id"])}
    assert len(nodes) == 2 and nodes <= set(node_pool.nodes), nodes  # the gang, one pod per node
    token_secret = platform.core().read_namespaced_secret(f"{job['id']}-report-token", namespace)
    assert "token" in token_secret.data
    quota = harness.read_tenant(platform, tenant)["spec"]["quota"]
    assert quota["gpus"] == 16 and quota["max_running_jobs"] == 3


def test_cancel_reaches_the_cluster_and_ends_cancelled(platform, api):
    url, token, tenant = api
    job = httpx.post(f"{url}/v1/jobs", json=gpu_job("forever", **harness.RUN_FOREVER), headers=token).json()
    wait_state(url, token, job["id"], "RUNNING")
    harness.wait_phase(platform, resources.tenant_namespace(tenant), job["id"], "RUNNING", timeout_s=60)
    assert httpx.post(f"{url}/v1/jobs/{job['id']}/cancel", headers=token).status_code == 202
    done = wait_state(url, token, job["id"], "CANCELLED", "FAILED", "SUCCEEDED")
    assert done["state"] == "CANCELLED"
    obj = harness.read_job(platform, resources.tenant_namespace(tenant), job["id"])
    assert obj["spec"]["cancel"] is True and obj["status"]["phase"] == "CANCELLED"


def test_a_job_larger_than_any_node_is_refused_at_submission(api):
    url, token, _ = api
    spec = gpu_job("huge")
    spec["resources"]["gpus_per_node"] = 16
    response = httpx.post(f"{url}/v1/jobs", json=spec, headers=token)
    assert response.status_code == 422
    assert "resources.gpus_per_node" in response.json()["detail"] and "largest node" in response.json()["detail"]


def test_the_api_quota_admits_no_more_than_it_allows(platform, api):
    url, token, tenant = api
    ids = [httpx.post(f"{url}/v1/jobs", json=gpu_job(f"q{i}", **harness.RUN_FOREVER), headers=token).json()["id"]
           for i in range(2)]  # 2 x 16 GPUs against a 16-GPU quota: one runs, one waits
    wait_state(url, token, ids[0], "RUNNING")
    time.sleep(1.5)
    waiting = httpx.get(f"{url}/v1/jobs/{ids[1]}", headers=token).json()
    assert waiting["state"] == "QUEUED" and "quota.gpus" in waiting["message"]
    httpx.post(f"{url}/v1/jobs/{ids[0]}/cancel", headers=token)
    wait_state(url, token, ids[1], "RUNNING")  # the freed quota admits the next job
    httpx.post(f"{url}/v1/jobs/{ids[1]}/cancel", headers=token)
    wait_state(url, token, ids[1], "CANCELLED")


def test_the_storage_budget_reaches_the_trainers_and_the_time_limit_fails_the_job(platform, api_server, api):
    """On Kubernetes as locally: the tenant's storage budget is in the EmbeddingJob (and so its pods' environment),
    and a job past its max_run_seconds is stopped through the cluster and fails DeadlineExceeded."""
    from kembed_contract import runtime

    url, token, tenant = api
    _, admin = api_server
    assert httpx.patch(f"{url}/v1/tenants/{tenant}", headers=admin,
                       json={"quota": {"storage": "1Gi"}}).status_code == 200
    spec = gpu_job("deadline", **harness.RUN_FOREVER)
    spec["max_run_seconds"] = 15
    job = httpx.post(f"{url}/v1/jobs", json=spec, headers=token).json()
    wait_state(url, token, job["id"], "RUNNING")
    namespace = resources.tenant_namespace(tenant)
    assert harness.read_job(platform, namespace, job["id"])["spec"]["storage_budget_bytes"] == 2**30
    pods = harness.job_pods(platform, namespace, job["id"])
    env = {e.name: e.value for e in pods[0].spec.containers[0].env}
    assert env[runtime.ENV_STORAGE_BUDGET] == str(2**30)
    done = wait_state(url, token, job["id"], "CANCELLED", "FAILED", "SUCCEEDED")
    assert (done["state"], done["reason"]) == ("FAILED", "DeadlineExceeded"), done
    assert harness.read_job(platform, namespace, job["id"])["spec"]["cancel"] is True
