"""The Helm chart: lint, render validated by the 1.35 API server, refusals, a real install/upgrade/uninstall, and
`helm test` against an API that really runs."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import urllib.request

import pytest
import yaml
from kubernetes.client.rest import ApiException

from kembed_api.platform.ports import free_port
from kembed_contract import crds
from tests.builders import operator_job
from tests.cluster.fixture import Cluster, wait_for
from tests.fixtures.servers import PostgresServer
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
                                       namespace=NAMESPACE,
                                       s3_credentials_secret="kembed-s3").start()
    tenant = harness.tenant_name()
    try:
        namespace = harness.create_tenant(cluster, tenant)
        job = operator_job("helm").with_gpus(1).create(cluster, tenant)
        harness.wait_phase(cluster, namespace, job, "SUCCEEDED", timeout_s=60)
        harness.patch_job_spec(cluster, namespace, job, cancel=True)  # harmless on a finished job
    finally:
        harness.remove_tenant(cluster, tenant)
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


def create_platform_secrets(cluster: Cluster, namespace: str, database_url: str) -> None:
    """The Secrets a release names by `existingSecret`: S3 keys (`kembed-s3`) and the database URL
    (`kembed-database`)."""
    core = cluster.core()
    core.create_namespaced_secret(namespace, {"metadata": {"name": "kembed-s3"}, "stringData": {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}})
    core.create_namespaced_secret(namespace, {"metadata": {"name": "kembed-database"},
                                              "stringData": {"url": database_url}})


def api_healthy(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_api_healthy(cluster: Cluster, api: str, release: str, namespace: str, *, timeout_s: float) -> None:
    """Until the release's API pod answers `{api}/healthz`; else fails with the end of its logs."""
    try:
        wait_for(lambda: api_healthy(api), timeout_s=timeout_s, interval_s=0.5, what=f"the API pod serving {api}/healthz")
    except TimeoutError as error:
        logs = cluster.kubectl("logs", f"deploy/{release}-kembed-api", "--namespace", namespace,
                               "--all-containers", "--tail=40", check=False)
        raise AssertionError(f"{error}\n{logs.stdout}{logs.stderr}") from None


def apply_crds(cluster: Cluster) -> None:
    """The CRDs as a platform team applies them beside a release installed with crds.install=false (an earlier
    release of this test run may own them already)."""
    manifests = yaml.safe_dump_all(crds.render_crds())
    subprocess.run([str(cluster.kubectl_path), "apply", "--server-side", "--force-conflicts", "-f", "-"],
                   input=manifests, text=True, env=cluster.env, check=True, capture_output=True)
    wait_for(lambda: cluster.kubectl("get", "tenants", check=False).returncode == 0, timeout_s=30,
             what="tenants.kembed.io served")


def helm_ok(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    """helm that must succeed; its stderr says why when it did not."""
    result = cluster.helm(*args, check=False, timeout_s=180)
    assert result.returncode == 0, f"helm {args[0]}: {result.stderr}"
    return result


def _notes_commands(notes: str) -> str:
    """NOTES.txt steps 2 and 3 (read the admin token, create a tenant) as the shell lines a user would paste."""
    lines = notes.splitlines()
    token = next(line.strip() for line in lines if line.strip().startswith("TOKEN=$("))
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("curl -X POST"))
    return "\n".join([token, lines[start].strip(), lines[start + 1].strip()])


def test_helm_test_runs_against_a_real_api_and_fails_when_it_cannot(cluster: Cluster,
                                                                     postgres_server: PostgresServer):
    """`helm test` for real: the API pod (its `migrate` init container, then `kembed serve` with the kubernetes
    backend) and the test pod run on the local node, against PostgreSQL and this control plane."""
    release, namespace = "ht", "platform-helm-test"
    apply_crds(cluster)
    cluster.create_namespace(namespace)
    core = cluster.core()
    create_platform_secrets(cluster, namespace, postgres_server.new_database())
    # The test kubelet maps `<service>.svc:PORT` to 127.0.0.1:PORT, so the Service and the container share one
    # port, free on this machine.
    port = free_port()
    api = f"http://127.0.0.1:{port}"
    # In a real pod the API finds its ServiceAccount token at the in-cluster path; the test kubelet cannot put
    # files there, so the API gets the same identity (the chart's RBAC, nothing more) through KUBECONFIG. Not in
    # tmp_path: the kubelet maps paths under the pod's /tmp mount into the pod's own directory.
    api_kubeconfig = cluster.run_dir / f"{namespace}-api.kubeconfig"
    assert not api_kubeconfig.is_relative_to("/tmp"), (
        f"{api_kubeconfig}: the test kubelet rewrites paths under the API pod's /tmp mount in its env, so the API "
        "would not find this kubeconfig; run with $KEMBED_CACHE outside /tmp")
    local = cluster.local_node_placement()
    values = [
        *MINIMAL, "--set", "crds.install=false", "--set", "database.type=external",
        "--set", "database.external.existingSecret=kembed-database",
        "--set", "api.replicas=1", "--set", f"api.port={port}", "--set", f"api.service.port={port}",
        "--set-json", f"api.extraEnv={json.dumps([{'name': 'KUBECONFIG', 'value': str(api_kubeconfig)}])}",
        "--set-json", f"api.nodeSelector={json.dumps(local['nodeSelector'])}",
        "--set-json", f"api.tolerations={json.dumps(local['tolerations'])}",
        "--set-json", f"tests.nodeSelector={json.dumps(local['nodeSelector'])}",
        "--set-json", f"tests.tolerations={json.dumps(local['tolerations'])}",
        # The operator is not under test here: one replica on a fake node.
        "--set", "operator.replicas=1", "--set-json", "operator.tolerations=[{\"operator\": \"Exists\"}]",
    ]
    helm_test = ["test", release, "--namespace", namespace, "--logs", "--timeout", "90s"]

    try:
        # No --wait: the ServiceAccount's token exists only once the release does. The API pod's `migrate` init
        # container runs first, by which time the kubeconfig is in place (if not, the container restarts).
        helm_ok(cluster, "install", release, str(CHART), "--namespace", namespace, *values)
        shutil.copy(cluster.service_account_kubeconfig(namespace, f"{release}-kembed-api"), api_kubeconfig)
        # The test kubelet reports a container ready as soon as it runs (no probes): wait for what the readiness
        # probe checks before `helm test`, as a real kubelet would.
        wait_api_healthy(cluster, api, release, namespace, timeout_s=120)

        passed = cluster.helm(*helm_test, check=False, timeout_s=150)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert "tenant helm-test created and read back with the admin token" in passed.stdout, passed.stdout
        assert "dashboard signed in with the admin token" in passed.stdout, passed.stdout
        # The API really ran against this cluster with the chart's RBAC: it made the Tenant resource.
        assert cluster.kubectl("get", "tenant", "helm-test", check=False).returncode == 0
        again = cluster.helm(*helm_test, check=False, timeout_s=150)  # the tenant is kept: a rerun finds it
        assert again.returncode == 0 and "tenant helm-test already there" in again.stdout, again.stdout + again.stderr

        # NOTES.txt: the printed commands read the token and create a tenant (the Service reached directly here,
        # as the test kubelet has no port-forward), and it names this very `helm test`.
        notes = helm_ok(cluster, "get", "notes", release, "--namespace", namespace).stdout
        assert f"helm test {release} -n {namespace}" in notes, notes
        created = subprocess.run(["bash", "-euc", _notes_commands(notes) + " -sS -o /dev/null -w '%{http_code}'"],
                                 env={**cluster.env, "API": api}, capture_output=True, text=True, timeout=60)
        assert created.stdout == "201", (created.stdout, created.stderr, notes)

        # A token the API does not know: /healthz still answers, the tenant step must fail the test.
        token_secret = f"{release}-kembed-admin-token"
        real_token = core.read_namespaced_secret(token_secret, namespace).data["token"]
        core.patch_namespaced_secret(token_secret, namespace, {"stringData": {"token": "kembed-admin-not-it"}})
        wrong_token = cluster.helm(*helm_test, check=False, timeout_s=150)
        assert wrong_token.returncode != 0, wrong_token.stdout
        assert "creating tenant helm-test: 401" in wrong_token.stdout, wrong_token.stdout + wrong_token.stderr

        # The right token again, but no API pod: the health check must fail the test.
        core.patch_namespaced_secret(token_secret, namespace, {"data": {"token": real_token}})
        cluster.kubectl("scale", "deployment", f"{release}-kembed-api", "--namespace", namespace, "--replicas=0")
        wait_for(lambda: not api_healthy(api), timeout_s=60, what="the API pod gone")
        no_api = cluster.helm(*helm_test, check=False, timeout_s=150)
        assert no_api.returncode != 0, no_api.stdout
        assert "Connection refused" in no_api.stdout, no_api.stdout + no_api.stderr
    finally:
        cluster.helm("uninstall", release, "--namespace", namespace, "--wait", check=False, timeout_s=180)
        for tenant in ("helm-test", "team-a"):  # made by `helm test` and by the NOTES' commands
            harness.remove_tenant(cluster, tenant)
        cluster.delete_namespace(namespace)
