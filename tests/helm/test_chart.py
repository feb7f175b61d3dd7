"""The Helm chart: lint, render validated by the 1.35 API server, refusals, and a real install/upgrade/uninstall."""

from __future__ import annotations

import pathlib
import subprocess

import pytest
from kubernetes.client.rest import ApiException

from tests.cluster.fixture import Cluster, wait_for
from tests.operator import harness

pytestmark = pytest.mark.cluster

HERE = pathlib.Path(__file__).parent
CHART = harness.CHART
MINIMAL = ["--set", "s3.bucket=kembed-test", "--set", "s3.credentials.existingSecret=kembed-s3"]
PRODUCTION = ["-f", str(HERE / "production-values.yaml")]
# Every simulated node is a tainted GPU node: the platform's pods tolerate that here, as they would a node pool.
ON_FAKE_NODES = [
    "--set-json", "api.tolerations=[{\"operator\": \"Exists\"}]",
    "--set-json", "operator.tolerations=[{\"operator\": \"Exists\"}]",
    "--set-json", "postgresql.tolerations=[{\"operator\": \"Exists\"}]",
    "--set", "postgresql.persistence.enabled=false", "--set", "api.replicas=1",
]
RELEASE, NAMESPACE = "kh", "kembed-helm"


@pytest.mark.parametrize("values", [pytest.param(MINIMAL, id="minimal"), pytest.param(PRODUCTION, id="production")])
def test_lint_and_every_rendered_object_is_valid_for_the_api_server(cluster: Cluster, values: list[str]):
    cluster.helm("lint", str(CHART), *values)
    rendered = cluster.helm("template", RELEASE, str(CHART), "--namespace", "default", "--kube-version", "1.35.4",
                             *values).stdout
    # Server-side dry run: the 1.35 API server validates each object against its schemas (CRDs included).
    result = subprocess.run([str(cluster.kubectl_path), "apply", "--dry-run=server", "--namespace", "default",
                             "-f", "-"], input=rendered, text=True, capture_output=True, env=cluster.env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("(server dry run)") == rendered.count("\nkind: ")


@pytest.mark.parametrize(("values", "message"), [
    pytest.param([], "s3.bucket is required", id="no-bucket"),
    pytest.param(["--set", "s3.bucket=bucket1"], "trainers need credentials", id="no-s3-credentials"),
    pytest.param([*MINIMAL, "--set", "database.type=external"], "database.external.existingSecret", id="no-database"),
    pytest.param([*MINIMAL, "--set", "api.ingress.enabled=true"], "needs api.ingress.host", id="ingress-no-host"),
    pytest.param([*MINIMAL, "--set", "api.replicaz=2"], "additional properties 'replicaz'", id="typo"),
    pytest.param([*MINIMAL, "--set", "operator.peering.lifetimeSeconds=5"], "lifetimeSeconds", id="short-lease"),
])
def test_impossible_values_are_refused_with_the_reason(cluster: Cluster, values: list[str], message: str):
    result = cluster.helm("template", RELEASE, str(CHART), "--kube-version", "1.35.4", *values, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def _adopt_existing_crds(cluster: Cluster) -> None:
    """CRDs applied earlier in this test run (by the operator tests) become the release's, as Helm adopts them."""
    for crd in ("tenants.kembed.io", "embeddingjobs.kembed.io", "clusterkopfpeerings.kopf.dev"):
        if cluster.kubectl("get", "crd", crd, check=False).returncode == 0:
            cluster.kubectl("label", "--overwrite", "crd", crd, "app.kubernetes.io/managed-by=Helm")
            cluster.kubectl("annotate", "--overwrite", "crd", crd, f"meta.helm.sh/release-name={RELEASE}",
                            f"meta.helm.sh/release-namespace={NAMESPACE}")


def test_install_reconcile_upgrade_uninstall(cluster: Cluster, tmp_path):
    _adopt_existing_crds(cluster)
    if cluster.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        cluster.create_namespace(NAMESPACE)
    cluster.core().create_namespaced_secret(NAMESPACE, {"metadata": {"name": "kembed-s3"}, "stringData": {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}})
    cluster.helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, *MINIMAL, *ON_FAKE_NODES,
                  "--wait", "--timeout", "120s", timeout_s=180)

    crds = cluster.kubectl("get", "crd", "-o", "name").stdout
    assert "tenants.kembed.io" in crds and "embeddingjobs.kembed.io" in crds
    apps = cluster.kubectl("get", "deploy,statefulset", "-n", NAMESPACE, "-o",
                            "jsonpath={range .items[*]}{.metadata.name}={.status.readyReplicas} {end}").stdout
    assert f"{RELEASE}-kembed-api=1" in apps and f"{RELEASE}-kembed-operator=2" in apps, apps
    pods = cluster.core().list_namespaced_pod(NAMESPACE).items
    assert pods and all(p.status.phase == "Running" for p in pods)

    # The operator, run here with the release's ServiceAccount identity, reconciles a tenant and a job.
    operator = harness.OperatorProcess(cluster, tmp_path, account=f"{RELEASE}-kembed-operator",
                                       namespace=NAMESPACE, peering_name="kembed-helm",
                                       s3_credentials_secret="kembed-s3").start()
    try:
        tenant = harness.tenant_name()
        namespace = harness.create_tenant(cluster, tenant)
        job = harness.JobBuilder("helm").gpus(1).create(cluster, tenant)
        harness.wait_phase(cluster, namespace, job, "SUCCEEDED", timeout_s=60)
        harness.patch_job_spec(cluster, namespace, job, cancel=True)  # harmless on a finished job
    finally:
        operator.stop()
    assert not operator.forbidden_lines(), operator.forbidden_lines()

    cluster.helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE, *MINIMAL, *ON_FAKE_NODES,
                  "--set", "operator.ttlAfterFinishedSeconds=60", "--set", "operator.replicas=1",
                  "--wait", "--timeout", "120s", timeout_s=180)
    deployment = cluster.kubectl("get", "deploy", f"{RELEASE}-kembed-operator", "-n", NAMESPACE, "-o", "json").stdout
    assert '"KEMBED_OPERATOR_TTL_AFTER_FINISHED_S"' in deployment and '"value": "60"' in deployment
    token_before = cluster.core().read_namespaced_secret(f"{RELEASE}-kembed-admin-token", NAMESPACE).data

    cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", timeout_s=180)

    def namespace_empty():
        left = cluster.kubectl("get", "deploy,statefulset,svc,secret,configmap,sa,role,rolebinding,pdb,"
                                "networkpolicy", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}",
                                "-o", "name").stdout
        return not left.strip()

    wait_for(namespace_empty, timeout_s=60, what="the release's objects gone")
    cluster_wide = cluster.kubectl("get", "clusterrole,clusterrolebinding", "-o", "name").stdout
    assert f"{RELEASE}-kembed" not in cluster_wide
    assert "tenants.kembed.io" in cluster.kubectl("get", "crd", "-o", "name").stdout  # kept: tenants survive
    assert token_before  # the admin token existed while installed
    with pytest.raises(ApiException):
        cluster.core().read_namespaced_secret(f"{RELEASE}-kembed-admin-token", NAMESPACE)
