"""Prometheus metrics and JSON logs.

Job counts, queue depth and quota use are read from the database when Prometheus scrapes, so every API
replica reports the same truth; the admission-wait histogram is observed by the dispatcher that admits.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from datetime import datetime

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from kembed_api.jobs.models import Job
from kembed_api.platform.db import Database
from kembed_api.quota.demand import HELD_SUMS
from kembed_api.tenants.models import Tenant
from kembed_contract.lifecycle import ACTIVE_STATES, JobState
from kembed_contract.quota import QuotaSpec

__all__ = ["Metrics", "TenantTotals", "configure_json_logging"]

_ACTIVE = [s.value for s in ACTIVE_STATES]
# The quota's dimensions as kembed_quota_used / kembed_quota_limit show them (each under its `metric` name): what
# running jobs hold is summed over the active jobs; what else is used, the tenant counts itself.
_HELD = QuotaSpec.held()
_EXPORTED = tuple(d for d in QuotaSpec.dimensions() if d.metric)
_COUNTED = tuple(d for d in _EXPORTED if d.held is None and d.used)


class _DatabaseCollector(Collector):
    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("kembed_jobs", "Jobs by tenant and state.", labels=["tenant", "state"])
        depth = GaugeMetricFamily("kembed_queue_depth", "Queued jobs per tenant.", labels=["tenant"])
        used = GaugeMetricFamily("kembed_quota_used", "Resources held by admitted jobs; storage_bytes: bytes kept.",
                                 labels=["tenant", "resource"])
        limit = GaugeMetricFamily("kembed_quota_limit", "Quota per tenant (absent = unlimited).",
                                  labels=["tenant", "resource"])
        with self.db.session() as session:
            tenants = {t.id: t for t in session.scalars(select(Tenant))}
            counts = session.execute(select(Job.tenant_id, Job.state, func.count()).group_by(Job.tenant_id, Job.state))
            for tenant_id, state, count in counts:
                jobs.add_metric([tenants[tenant_id].name, state], count)
                if state == JobState.QUEUED:
                    depth.add_metric([tenants[tenant_id].name], count)
            held = session.execute(
                select(Job.tenant_id, *HELD_SUMS).where(Job.state.in_(_ACTIVE)).group_by(Job.tenant_id))
            for tenant_id, *sums in held:
                name = tenants[tenant_id].name
                for d, value in zip(_HELD, sums, strict=True):
                    if d.metric:
                        used.add_metric([name, d.metric], float(value or 0))
            for tenant in tenants.values():
                for d in _COUNTED:  # what the tenant keeps a count of (its stored bytes, ...)
                    used.add_metric([tenant.name, d.metric], float(getattr(tenant, d.used) or 0))
                for d in _EXPORTED:
                    value = getattr(tenant, f"quota_{d.amount}")
                    if value is not None:
                        limit.add_metric([tenant.name, d.metric], float(value))
        yield from (jobs, depth, used, limit)


class Metrics:
    """The metrics of one API process (its own registry, so several apps in one test process don't clash)."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_DatabaseCollector(db))
        # Several worker processes (`kembed serve --workers`): the histogram's values live in files that every
        # worker reads back, since only the worker that dispatches observes admissions.
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if shared:
            MultiProcessCollector(self.registry, path=shared)
        self.admission_wait = Histogram(
            "kembed_admission_wait_seconds", "Time from submission to admission.", ["tenant"],
            buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 24 * 3600),
            registry=None if shared else self.registry,
        )

    def observe_admission(self, *, tenant: str, created_at: datetime, admitted_at: datetime) -> None:
        self.admission_wait.labels(tenant=tenant).observe(max(0.0, (admitted_at - created_at).total_seconds()))


class TenantTotals:
    """A registry's metrics summed over the `tenant` label: what /metrics shows a caller who may not learn which
    tenants exist. Counts, gauges and histogram buckets add up across tenants, so the totals stay true."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "tenant"))
                totals[(sample.name, labels)] = totals.get((sample.name, labels), 0.0) + sample.value
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            for (name, labels), value in totals.items():
                summed.add_sample(name, dict(labels), value)
            yield summed


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_json_logging(level: str = "INFO") -> None:
    """One JSON object per line on stderr: what log collectors (Loki, CloudWatch, ...) parse without rules."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
