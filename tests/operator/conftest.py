"""Fixtures of the operator tests: the platform as the chart installs it, and an operator process under its RBAC."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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
def make_tenant(platform: Cluster) -> Iterator[Callable[..., tuple[str, str]]]:
    """`make_tenant(**quota)` -> (name, namespace): a fresh tenant made by the operator the test runs; removed with
    its jobs and pods after the test (harness.remove_tenant), so no later test meets them."""
    names: list[str] = []

    def make(**quota: Any) -> tuple[str, str]:
        names.append(harness.tenant_name())
        return names[-1], harness.create_tenant(platform, names[-1], **quota)

    yield make
    for name in names:
        harness.remove_tenant(platform, name)


@pytest.fixture
def tenant(operator: harness.OperatorProcess, make_tenant) -> str:
    """A fresh tenant (its namespace is returned), made by the module's operator; removed after the test."""
    return make_tenant()[1]
