"""Queue positions and estimated starts, cached per tenant for a moment.

Replaying a tenant's queue costs time in proportion to its length; reads of queued jobs come often (a CLI
following a job polls every second). So a tenant's forecast is computed at most once per `ttl_s`, and again at
once for a job it does not know yet. Estimates are estimates: a second of staleness changes nothing a user sees.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime

from sqlalchemy.orm import Session

from kembed_api.admission import Quota
from kembed_api.jobs import service
from kembed_api.tenants.models import Tenant

__all__ = ["Forecasts"]

Forecast = dict[int, tuple[int, datetime | None]]  # job seq -> (queue position, estimated start)


class Forecasts:
    def __init__(self, *, capacity: Callable[[], Quota], ttl_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity, self.ttl_s, self.clock = capacity, ttl_s, clock
        self._cache: dict[int, tuple[float, Forecast]] = {}
        self._lock = threading.Lock()

    def of_tenant(self, session: Session, *, tenant: Tenant, must_include: int | None = None) -> Forecast:
        with self._lock:
            cached = self._cache.get(tenant.id)
        if cached and self.clock() - cached[0] < self.ttl_s and (must_include is None or must_include in cached[1]):
            return cached[1]
        forecast = service.queue_forecast(session, tenant=tenant, capacity=self.capacity())
        with self._lock:
            self._cache[tenant.id] = (self.clock(), forecast)
        return forecast
