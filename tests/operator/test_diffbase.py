"""Kopf's diff base: built for Tenants (their update handler needs the spec diff), empty for everything else."""

from __future__ import annotations

import kopf

from kembed_contract import resources
from kembed_operator.diffbase import ChangeHandledKindsDiffBase

STORAGE = ChangeHandledKindsDiffBase(kinds=[resources.TENANT_KIND], prefix="kembed.io",
                                     key="last-handled-configuration")


def test_a_tenant_keeps_its_spec_in_the_diff_base_so_quota_edits_are_seen():
    tenant = kopf.Body({"apiVersion": resources.API_VERSION, "kind": resources.TENANT_KIND,
                        "metadata": {"name": "acme"}, "spec": {"quota": {"gpus": 8}}, "status": {"phase": "Ready"}})
    assert STORAGE.build(body=tenant) == {"spec": {"quota": {"gpus": 8}}}


def test_pods_and_jobs_get_no_copy():
    pod = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "j-0"},
                     "spec": {"containers": [{"name": "trainer"}]}, "status": {"phase": "Running"}})
    assert STORAGE.build(body=pod) == {}
