"""Queue positions and estimated starts, cached per tenant for a moment.

Replaying a tenant's queue costs time in proportion to its length; reads of queued jobs come often (a CLI
following a job polls every second). So a single job's read takes its position from an exact count and its
estimated start from the tenant's forecast, recomputed at most once per `ttl_s`, or once per `new_job_ttl_s` when
the job asked about is newer than the forecast (until then its start is not estimated): a start estimated
seconds ago is as good as a fresh one, while replaying a queue of thousands for every read of a job just
submitted would cost most of a core under a stream of submissions. Lists recompute the forecast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session

from kembed_api.admission import Quota
from kembed_api.jobs import service
from kembed_api.jobs.models import Job
from kembed_api.tenants.models import Tenant

__all__ = ["Forecasts"]

Forecast = dict[int, tuple[int, datetime | None]]  # job seq -> (queue position, estimated start)


class Forecasts:
    def __init__(self, *, capacity: Callable[[], Quota], ttl_s: float = 5.0, new_job_ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.ttl_s, self.new_job_ttl_s, self.clock = capacity, ttl_s, new_job_ttl_s, clock
        self._cache: dict[int, tuple[float, Forecast]] = {}
        self._lock = threading.Lock()
        self._refreshing: set[int] = set()  # tenants whose forecast one request is recomputing right now

    def fresh(self, session: Session, *, tenant: Tenant) -> Forecast:
        forecast = service.queue_forecast(session, tenant=tenant, capacity=self.capacity())
        with self._lock:
            self._cache[tenant.id] = (self.clock(), forecast)
        return forecast

    def of_job(self, session: Session, *, tenant: Tenant, job: Job) -> tuple[int, datetime | None]:
        with self._lock:
            cached = self._cache.get(tenant.id)
            age = self.clock() - cached[0] if cached else None
            ttl = self.ttl_s if cached and job.seq in cached[1] else self.new_job_ttl_s
            # One request recomputes an expired forecast; the others meanwhile answer from the old one. Else every
            # request arriving during a long queue's replay would replay it too.
            refresh = (age is None or age >= ttl) and tenant.id not in self._refreshing
            if refresh:
                self._refreshing.add(tenant.id)
        if refresh:
            try:
                forecast = self.fresh(session, tenant=tenant)
            finally:
                with self._lock:
                    self._refreshing.discard(tenant.id)
        else:
            forecast = cached[1] if cached else {}
        # Missing even from a fresh forecast: the job left the queue since it was read (PostgreSQL reads each
        # statement at its own moment), so no start is estimated.
        _, start = forecast.get(job.seq, (None, None))
        return service.queue_position(session, job=job), start
