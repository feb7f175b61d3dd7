"""The images of this tree, built by `make images` (tests/images/build.sh) and served by a registry on 127.0.0.1.

    @pytest.mark.images
    def test_something(images, cluster, namespace):
        pod = {..., "image": images.trainer, ...}   # 127.0.0.1:PORT/kembed/trainer:<input hash>

`images` (session) runs build.sh first: with the images cached for this tree's inputs that takes seconds; otherwise
it builds what is missing (see docs/testing.md, "Images", for how long that takes cold), so a test never runs
against a stale image nor skips for want of one. The registry serves the storage build.sh pushed to, read-only, on
a free port, for the session.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kembed_api.platform.ports import free_port
from tests.cluster import controlplane

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = REPO / "tests" / "images" / "build.sh"


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KEMBED_CACHE", pathlib.Path.home() / ".cache" / "kembed"))


@dataclasses.dataclass(frozen=True)
class Images:
    """References of this tree's images on the session's registry."""

    registry: str  # 127.0.0.1:PORT
    tags: dict[str, str]  # name -> localhost/kembed/NAME:HASH, as build.sh tags them

    def reference(self, name: str) -> str:
        return f"{self.registry}/{self.tags[name].removeprefix('localhost/')}"

    @property
    def platform(self) -> str:
        return self.reference("platform")

    @property
    def trainer(self) -> str:
        return self.reference("trainer")

    def missing(self, name: str) -> str:
        """A reference to a tag of the same repository that was never pushed."""
        return f"{self.reference(name).rsplit(':', 1)[0]}:never-pushed"


def build() -> dict[str, str]:
    """Runs build.sh (cached: seconds) and returns the tags it built for this tree."""
    result = subprocess.run(["bash", str(BUILD)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"make images failed:\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])



@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    tags = build()
    binary = shutil.which("docker-registry")  # Debian's package, installed by `make images`
    assert binary, "docker-registry missing: run `make images`"
    port = free_port()
    config = tmp_path_factory.mktemp("registry") / "config.yml"
    # Read-only: test runs share the storage build.sh pushed to, and none of them may change it.
    config.write_text(json.dumps({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(cache_dir() / "registry")},
                    "maintenance": {"readonly": {"enabled": True}}},
        "http": {"addr": f"127.0.0.1:{port}"},
    }))
    log = open(config.with_name("registry.log"), "wb")  # noqa: SIM115 - open for the process's lifetime
    process = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2).close()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, (
                    config.with_name("registry.log").read_text()[-2000:])
                time.sleep(0.2)
        yield Images(f"127.0.0.1:{port}", tags)
    finally:
        controlplane.end_process_group(process.pid, grace_s=5.0)
        log.close()


def prepull(cluster, image: str, *, timeout_s: float = 540) -> None:
    """Pulls `image` onto the local node (a pod that runs `true` in it), as a platform team pre-pulls big images
    onto its nodes: a test that times a gang's start then does not count the first pull of 5 GB. Later pulls of
    the same layers are a manifest read."""
    namespace = cluster.create_namespace()
    try:
        cluster.core().create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "prepull"},
            "spec": {**cluster.local_node_placement(), "restartPolicy": "Never",
                     "containers": [{"name": "pull", "image": image, "command": ["true"]}]}})
        pod = cluster.wait_pod_phase(namespace, "prepull", timeout_s=timeout_s)
        assert pod.status.phase == "Succeeded", pod.status
    finally:
        cluster.delete_namespace(namespace)
