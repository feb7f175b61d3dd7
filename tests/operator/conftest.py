"""Fixtures of the operator tests: the platform as the chart installs it, and an operator process under its RBAC."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.fixture import Cluster
from tests.operator import harness


@pytest.fixture(scope="session")
def platform(cluster: Cluster) -> Cluster:
    harness.install_platform(cluster)
    return cluster


@pytest.fixture(scope="module")
def operator(platform: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.OperatorProcess]:
    """One operator replica for the module's tests; the module fails if it was ever refused a permission."""
    process = harness.OperatorProcess(platform, tmp_path_factory.mktemp("operator")).start()
    yield process
    process.stop()
    forbidden = process.forbidden_lines()
    assert not forbidden, "the chart's RBAC refused the operator:\n" + "\n".join(forbidden[:10])


@pytest.fixture
def tenant(platform: Cluster, operator: harness.OperatorProcess) -> str:
    """A fresh tenant (its namespace is returned), made by the operator."""
    return harness.create_tenant(platform, harness.tenant_name())
