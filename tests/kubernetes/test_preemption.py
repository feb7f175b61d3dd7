"""Checkpoint-aware preemption on the test control plane, through the API: one team borrows its cohort's idle
quota, the lender's job arrives and reclaims it; the borrower's gang is suspended (spec.suspend), saves on
SIGTERM, stops, waits at its place in the queue and resumes from that checkpoint, losing no step. The Tenant
resources show who borrows and who lends while it happens. Real API (Kubernetes backend), real operator, real
trainers on the test kubelet's local node, checkpoints in S3 (moto)."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from kembed_api.app import create_app
from kembed_api.backends.kubernetes import KubernetesBackend
from kembed_api.platform.ports import free_port
from kembed_api.platform.settings import Settings
from kembed_contract import resources
from tests.api.conftest import ThreadedServer, bearer, wait_state
from tests.builders import make_spec
from tests.cluster import controlplane
from tests.cluster.fixture import Cluster, wait_for
from tests.e2e.conftest import frozen
from tests.operator import harness

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

_LOCAL_NODE = {"trainer_node_selector": {controlplane.LOCAL_NODE_LABEL: "true"},
               "trainer_tolerations": [{"key": controlplane.LOCAL_NODE_TAINT_KEY, "operator": "Exists",
                                        "effect": "NoSchedule"}]}



@pytest.fixture(scope="module")
def platform(cluster: Cluster) -> Cluster:
    harness.install_platform(cluster)
    return cluster


@pytest.fixture
def operator(platform: Cluster, s3_server, tmp_path):
    process = harness.OperatorProcess(platform, tmp_path, name="preemption-operator", **_LOCAL_NODE,
                                      s3_endpoint_url=s3_server.endpoint_url, rendezvous_port=free_port(),
                                      rendezvous_timeout_s=120).start()
    yield process
    process.stop()
    assert not process.forbidden_lines(), process.forbidden_lines()


@pytest.fixture
def api(platform: Cluster, operator, s3_server, tmp_path):
    """The API on the Kubernetes backend, with two tenants of one cohort of its own: `lender` (1 CPU, lends it
    when idle) and `borrower` (1 CPU, may borrow 1 more). Yields (url, {tenant: token headers}, names)."""
    bucket = s3_server.create_bucket("kembed-test")
    settings = Settings(data_dir=tmp_path / "api", dispatch_interval_s=0.2, backend="kubernetes",
                        checkpoint_root=f"{bucket}/preemption-{uuid.uuid4().hex[:6]}")
    app = create_app(settings, backend=KubernetesBackend(api_client=platform.api_client()))
    server = ThreadedServer(app)
    settings.public_url = server.url  # where the trainers report: read when the server starts (its dispatcher)
    names = {"lender": harness.tenant_name(), "borrower": harness.tenant_name()}
    cohort = f"c{uuid.uuid4().hex[:8]}"
    with server:
        admin = bearer((settings.data_dir / "admin-token").read_text().strip())
        tokens = {}
        for role, limit in (("lender", {}), ("borrower", {"cpu": 1})):
            created = httpx.post(f"{server.url}/v1/tenants", headers=admin, json={
                "name": names[role], "quota": {"cpu": 1},
                "sharing": {"cohort": cohort, "borrowing_limit": limit}})
            assert created.status_code == 201, created.text
            tokens[role] = bearer(httpx.post(f"{server.url}/v1/tenants/{names[role]}/tokens", headers=admin,
                                             json={"name": "t", "role": "member"}).json()["token"])
        try:
            yield server.url, tokens, names
        finally:
            for name in names.values():
                harness.remove_tenant(platform, name)


# Steps of the preempted job: it is held still (SIGSTOP) from step 5 until it is asked to stop, so it needs
# only a few more than that.
_STEPS = 60


def _job(name: str, *, cpu: float, steps: int) -> dict:
    spec = make_spec(name).with_steps(steps, checkpoint_every=0).with_trainer(
        training={"log_every": 1, "threads": 1}).build()
    spec["resources"] = {"nodes": 1, "procs_per_node": 1, "gpus_per_node": 0, "cpu_per_node": cpu,
                         "memory_per_node": "2Gi"}
    return spec


def _losses(url: str, token: dict, job_id: str) -> dict[int, float]:
    """The job's loss at each step; a step reported twice (a rerun) must report the same loss."""
    records = httpx.get(f"{url}/v1/jobs/{job_id}/metrics", headers=token,
                        params={"event": "progress", "limit": 5000}).json()
    losses: dict[int, float] = {}
    for record in records:
        assert losses.setdefault(record["step"], record["values"]["loss"]) == record["values"]["loss"]
    return losses


def _printed(table: str) -> dict[str, dict[str, str]]:
    """kubectl's table, by row name and column header (values start where their header starts)."""
    header, *rows = table.splitlines()
    starts = [m.start() for m in re.finditer(r"(?<!\S)\S+(?: \S+)*", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return {row.split()[0]: {name: row[a:b].strip() for name, a, b in zip(names, starts, [*starts[1:], None],
                                                                         strict=True)} for row in rows}


def _usage(platform: Cluster, tenant: str) -> dict:
    return (harness.read_tenant(platform, tenant).get("status") or {}).get("usage") or {}


def test_a_borrowers_gang_saves_gives_the_lender_its_quota_back_and_resumes_without_losing_a_step(platform, api):
    url, tokens, names = api
    victim = httpx.post(f"{url}/v1/jobs", headers=tokens["borrower"], json=_job("victim", cpu=2, steps=_STEPS))
    assert victim.status_code == 201, victim.text
    victim = victim.json()
    running = wait_state(url, tokens["borrower"], victim["id"], "RUNNING", timeout_s=240)
    assert any("borrowing its cohort's idle quota" in e["message"] for e in running["events"])
    namespace = resources.tenant_namespace(names["borrower"])
    # Held still mid-run until it is asked to stop, so that the lender's job finds it there on any machine.
    def logs() -> str:
        return httpx.get(f"{url}/v1/jobs/{victim['id']}/logs", headers=tokens["borrower"]).text

    with frozen(victim["id"], logs, after_step=5) as (held_at, asked_to_stop):
        # The Tenant resources say who borrows from whom (status.usage, written by the API).
        wait_for(lambda: _usage(platform, names["borrower"]).get("borrowed", {}).get("cpu") == 1
                 and _usage(platform, names["lender"]).get("lent", {}).get("cpu") == 1,
                 timeout_s=30, interval_s=0.5, what="the borrowing shown in the Tenant resources")
        shown = _printed(platform.kubectl("get", "tenants", names["borrower"], names["lender"], "-o", "wide").stdout)
        assert (shown[names["borrower"]]["USED CPU"], shown[names["borrower"]]["BORROWED CPU"],
                shown[names["borrower"]]["LENT CPU"]) == ("2", "1", "0"), shown
        assert (shown[names["lender"]]["USED CPU"], shown[names["lender"]]["LENT CPU"]) == ("0", "1"), shown
        assert shown[names["lender"]]["COHORT"] == shown[names["borrower"]]["COHORT"] != "<none>"

        lender_job = httpx.post(f"{url}/v1/jobs", headers=tokens["lender"], json=_job("reclaim", cpu=1, steps=5))
        assert lender_job.status_code == 201, lender_job.text
        lender_job = lender_job.json()
        wait_for(asked_to_stop, timeout_s=120, what="the borrower's trainers asked to stop (SIGTERM)")
        assert harness.read_job(platform, namespace, victim["id"])["spec"]["suspend"] is True  # asked to save first
    finished = wait_state(url, tokens["lender"], lender_job["id"], "SUCCEEDED", "FAILED", timeout_s=240)
    assert finished["state"] == "SUCCEEDED", finished["message"]
    done = wait_state(url, tokens["borrower"], victim["id"], "SUCCEEDED", "FAILED", timeout_s=400)
    assert done["state"] == "SUCCEEDED", done["message"]

    events = [(e["state"], e["reason"], e["message"]) for e in done["events"]]
    preempted = [e for e in events if e[0] == "PREEMPTED"]  # the API's decision, then what the operator saw
    assert preempted[0][1] == "ReclaimedByLender" and "another team's job" in preempted[0][2], preempted
    assert all(lender_job["id"] not in e[2] for e in events)  # the lender's job is never named to the borrower
    assert [e[1] for e in events].count("ReclaimedByLender") == 1  # preempted once
    requeued = next(e for e in events if e[1] == "Requeued")
    assert re.search(r"lost_steps=0\b", requeued[2]), requeued  # it saved on SIGTERM within the grace period
    stopped_at = int(re.search(r"stopped at step (\d+)", requeued[2]).group(1))
    assert held_at <= stopped_at < _STEPS  # it stopped where it was held, or a step or two on
    reasons = [e[1] for e in events]
    assert reasons.index("ReclaimedByLender") < reasons.index("Requeued") < reasons.index("Resumed")
    assert reasons.count("Requeued") == reasons.count("Resumed") == 1, events  # requeued once, not on stale status
    assert reasons[-1] == "Completed" and done["restart_count"] == 0  # a preemption is not a failure
    # The cluster saw it too: the EmbeddingJob was suspended (PREEMPTED, or at once QUEUED once its pods had
    # stopped: the operator may write only the latter) and the same job ran again.
    cluster_reasons = {e.reason for e in harness.events_of(platform, namespace, victim["id"])}
    assert cluster_reasons & {"Suspended", "Stopped"}, cluster_reasons
    # Every step was trained once: the resumed run went on from the step the checkpoint was saved at.
    losses = _losses(url, tokens["borrower"], victim["id"])
    assert sorted(losses) == list(range(1, _STEPS + 1))
    started = httpx.get(f"{url}/v1/jobs/{victim['id']}/metrics", headers=tokens["borrower"],
                        params={"event": "started"}).json()
    assert [r["step"] for r in started] == [0, stopped_at]  # resumed where it stopped: its SIGTERM checkpoint

    # The same job never interrupted (its cohort idle again): the loss curve and the final metrics of the
    # preempted one are its own, bit for bit (CPU).
    reference = httpx.post(f"{url}/v1/jobs", headers=tokens["borrower"], json=_job("reference", cpu=2, steps=_STEPS))
    assert reference.status_code == 201, reference.text
    reference = wait_state(url, tokens["borrower"], reference.json()["id"], "SUCCEEDED", "FAILED", timeout_s=400)
    assert reference["state"] == "SUCCEEDED", reference["message"]
    assert losses == _losses(url, tokens["borrower"], reference["id"])
    assert done["result"] == reference["result"]
