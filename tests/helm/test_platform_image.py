"""The chart with this tree's real images (`make images`): the API and the operator run from the platform image on
the test kubelet's local node (image mode: pulled from the local registry, run with runc), a job submitted over
HTTP trains to SUCCEEDED in the trainer image, and `helm test` passes. The API runs with the chart's own
ServiceAccount and ClusterRole here (no test credentials), so a right the chart forgets fails this test."""

from __future__ import annotations

import base64
import json
import uuid

import httpx
import pytest

from kembed_api.platform.ports import free_port
from kembed_contract import resources
from tests.api.conftest import wait_state
from tests.builders import make_spec
from tests.cluster.fixture import Cluster
from tests.fixtures.servers import PostgresServer
from tests.helm.test_chart import CHART, apply_crds, create_platform_secrets, helm_ok, wait_api_healthy
from tests.images.registry import Images, prepull
from tests.operator import harness

pytestmark = [pytest.mark.cluster, pytest.mark.images, pytest.mark.slow]


def test_the_chart_runs_the_platform_image_and_a_job_over_http_succeeds_in_the_trainer_image(
        cluster: Cluster, images: Images, postgres_server: PostgresServer, s3_server):
    release, namespace = "pi", f"platform-image-{uuid.uuid4().hex[:6]}"
    for image in (images.platform, images.trainer):
        prepull(cluster, image)
    apply_crds(cluster)
    cluster.create_namespace(namespace)
    core = cluster.core()
    create_platform_secrets(cluster, namespace, postgres_server.new_database())
    s3_server.create_bucket("kembed-test")
    # Pods share the host network here: every port a pod listens on is a free one of this machine.
    port, rendezvous_port, health_port = free_port(), free_port(), free_port()
    api = f"http://127.0.0.1:{port}"
    local = json.dumps(cluster.local_node_placement()["nodeSelector"])
    tolerate_local = json.dumps(cluster.local_node_placement()["tolerations"])
    platform_repository, platform_tag = images.platform.rsplit(":", 1)
    trainer_repository, trainer_tag = images.trainer.rsplit(":", 1)
    values = [
        "--set", "s3.bucket=kembed-test", "--set", "s3.credentials.existingSecret=kembed-s3",
        "--set", f"s3.endpoint={s3_server.endpoint_url}",
        "--set", f"image.repository={platform_repository}", "--set", f"image.tag={platform_tag}",
        "--set", f"trainer.image.repository={trainer_repository}", "--set", f"trainer.image.tag={trainer_tag}",
        "--set", "crds.install=false", "--set", "database.type=external",
        "--set", "database.external.existingSecret=kembed-database",
        "--set", "api.replicas=1", "--set", f"api.port={port}", "--set", f"api.service.port={port}",
        # The trainers report to the API's public URL; cluster DNS names are not rewritten inside annotations.
        "--set", f"api.publicUrl={api}",
        "--set", "operator.replicas=1",
        "--set-json", "operator.extraEnv=" + json.dumps([
            {"name": "KEMBED_OPERATOR_RENDEZVOUS_PORT", "value": str(rendezvous_port)},
            {"name": "KEMBED_OPERATOR_HEALTH_PORT", "value": str(health_port)}]),
        *[arg for part in ("api", "operator", "tests", "trainer") for arg in (
            "--set-json", f"{part}.nodeSelector={local}", "--set-json", f"{part}.tolerations={tolerate_local}")],
    ]
    tenant = harness.tenant_name()
    try:
        helm_ok(cluster, "install", release, str(CHART), "--namespace", namespace, *values)

        wait_api_healthy(cluster, api, release, namespace, timeout_s=240)
        # Both of the platform's pods run the platform image, pulled from the registry.
        for component in ("api", "operator"):
            pod = core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/component={component}").items
            assert pod and pod[0].status.container_statuses[0].image_id.startswith(f"{platform_repository}@sha256:"), (
                component, pod and pod[0].status)

        passed = cluster.helm("test", release, "--namespace", namespace, "--logs", "--timeout", "120s",
                              check=False, timeout_s=180)
        assert passed.returncode == 0, passed.stdout + passed.stderr

        token = base64.b64decode(core.read_namespaced_secret(f"{release}-kembed-admin-token", namespace)
                                 .data["token"]).decode()
        admin = {"Authorization": f"Bearer {token}"}
        created = httpx.post(f"{api}/v1/tenants", headers=admin, json={"name": tenant, "quota": {"gpus": 0}})
        assert created.status_code == 201, created.text
        member = httpx.post(f"{api}/v1/tenants/{tenant}/tokens", headers=admin, json={"name": "t", "role": "member"})
        headers = {"Authorization": f"Bearer {member.json()['token']}"}
        spec = make_spec("in-image").with_steps(20, checkpoint_every=10).build()
        spec["resources"] = {"nodes": 1, "procs_per_node": 1, "cpu_per_node": 1, "memory_per_node": "2Gi"}
        job = httpx.post(f"{api}/v1/jobs", json=spec, headers=headers)
        assert job.status_code in (200, 201, 202), job.text
        done = wait_state(api, headers, job.json()["id"], "SUCCEEDED", "FAILED", timeout_s=420)
        assert done["state"] == "SUCCEEDED", done
        trainer_pods = harness.job_pods(cluster, resources.tenant_namespace(tenant), job.json()["id"])
        assert trainer_pods and all(p.status.container_statuses[0].image_id.startswith(f"{trainer_repository}@sha256:")
                                    for p in trainer_pods), [p.status.container_statuses for p in trainer_pods]
    finally:
        cluster.helm("uninstall", release, "--namespace", namespace, "--wait", check=False, timeout_s=180)
        for name in (tenant, "helm-test"):
            harness.remove_tenant(cluster, name)
        cluster.delete_namespace(namespace)
