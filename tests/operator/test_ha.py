"""Two operator replicas with Kopf peering: killing the active one mid-burst loses and duplicates nothing."""

from __future__ import annotations

import collections
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from kembed_contract import resources
from tests.builders import operator_job
from tests.cluster.fixture import Cluster, wait_for
from tests.operator import harness

pytestmark = pytest.mark.cluster

NUM_JOBS = 100


@pytest.fixture
def replicas(platform: Cluster, tmp_path):
    # The take-over itself takes up to the peering lifetime (15 s): the rendezvous time-out must leave room for it
    # on a loaded 2-core machine, or slow gangs would be restarted (correctly, but not what is tested here).
    peering = f"kembed-ha-{uuid.uuid4().hex[:6]}"  # the pair's own: no replica of another test in it
    pair = [harness.OperatorProcess(platform, tmp_path, name=f"replica-{i}", peering_name=peering,
                                    rendezvous_timeout_s=120).start()
            for i in range(2)]
    yield pair
    for replica in pair:
        replica.stop()
    for replica in pair:
        forbidden = replica.forbidden_lines()
        assert not forbidden, f"{replica.name} was refused:\n" + "\n".join(forbidden[:10])


def _peers(cluster: Cluster, name: str) -> dict:
    peering = harness.custom(cluster).get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name)
    return peering.get("status") or {}


def test_kill_9_of_the_active_replica_during_a_burst_of_100_jobs(platform: Cluster, replicas, make_tenant):
    wait_for(lambda: all(r.priority for r in replicas) and len(_peers(platform, replicas[0].settings["peering_name"])) == 2, timeout_s=30,
             what="both replicas registered in the peering")
    active, standby = sorted(replicas, key=lambda r: r.priority, reverse=True)
    tenant, namespace = make_tenant()

    builders = [operator_job(f"burst{i}").with_cpu_only() for i in range(NUM_JOBS)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(b.create, platform, tenant) for b in builders]
        # Kill the active replica while the burst is in full flight: some jobs half-reconciled, some not seen.
        wait_for(lambda: sum(f.done() for f in futures) >= NUM_JOBS // 3, timeout_s=60, what="a third created")
        active.kill9()
        killed_at = time.monotonic()
        for future in futures:
            future.result()

    def all_finished():
        items = harness.custom(platform).list_namespaced_custom_object(
            resources.GROUP, resources.VERSION, namespace, resources.EMBEDDING_JOB_PLURAL)["items"]
        phases = [(i.get("status") or {}).get("phase") for i in items]
        return items if len(items) == NUM_JOBS and all(p in harness.TERMINAL for p in phases) else None

    jobs = wait_for(all_finished, timeout_s=240, interval_s=1, what="all 100 jobs terminal after the take-over")
    assert "Resuming operations after the pause" in standby.log()
    outcomes = collections.Counter((j["status"]["phase"], j["status"].get("reason"), j["status"].get("message"))
                                   for j in jobs)
    assert set(outcomes) == {("SUCCEEDED", "Completed", "all 1 pods of the gang succeeded")}, outcomes
    restarted = {j["metadata"]["name"]: [f"{e.reason}: {e.message}" for e in harness.events_of(
        platform, namespace, j["metadata"]["name"])] for j in jobs if j["status"]["restartCount"]}
    if restarted:  # nothing may be restarted or started twice
        pytest.fail(f"{len(restarted)} jobs were restarted: " + json.dumps(dict(list(restarted.items())[:3]), indent=1))

    batch_jobs = platform.batch().list_namespaced_job(namespace).items
    owners = [j.metadata.owner_references[0].uid for j in batch_jobs]
    assert len(batch_jobs) == NUM_JOBS and len(set(owners)) == NUM_JOBS  # exactly one child Job per job
    assert {j["metadata"]["uid"] for j in jobs} == set(owners)
    assert {j.metadata.labels["kembed.io/attempt"] for j in batch_jobs} == {"0"}
    print(f"all {NUM_JOBS} jobs SUCCEEDED {time.monotonic() - killed_at:.1f}s after the kill -9")
