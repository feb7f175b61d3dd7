"""Queue positions and estimated starts, cached per tenant and replayed in the background.

Replaying a tenant's queue costs time in proportion to its length (tens of ms at thousands of jobs), and so
does counting one job's position (the jobs ahead of it); reads of queued jobs come often (a CLI following a job
polls every second). So a single job's read takes both from the tenant's cached forecast, which a thread of its
own replays when it is older than `ttl_s`, or older than `new_job_ttl_s` when the job asked about is newer than
it or the queue has moved since; meanwhile reads answer from the old forecast, and no read ever waits for a
replay. A position is only taken from a forecast of the tenant's current queue version (which every change
that moves queued jobs raises), so it is always exact; otherwise the read counts it (reads.read_job). A start
estimated seconds ago is as good as a fresh one (a job the forecast does not know yet has none until the replay
is done). Lists replay the forecast themselves (`fresh`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from kembed_api.jobs import queue_forecast
from kembed_api.platform.db import Database
from kembed_api.quota.admission import Quota
from kembed_api.tenants.models import Tenant

__all__ = ["Forecasts", "QueueForecasts"]

log = logging.getLogger(__name__)

Forecast = dict[int, tuple[int, datetime | None]]  # job seq -> (queue position, estimated start)
_NOTHING: Forecast = {}


class Forecasts:
    def __init__(self, db: Database, *, capacity: Callable[[], Quota], ttl_s: float = 5.0,
                 new_job_ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.db, self.capacity, self.clock = db, capacity, clock
        self.ttl_s, self.new_job_ttl_s = ttl_s, new_job_ttl_s
        self._cache: dict[int, tuple[float, int, Forecast]] = {}  # tenant id -> (taken at, queue version, forecast)
        self._lock = threading.Lock()
        self._replays: dict[int, Future] = {}  # tenant id -> its replay under way
        self._replayer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kembed-forecasts")

    def fresh(self, session: Session, *, tenant: Tenant) -> Forecast:
        """Replay the tenant's queue now (and remember it)."""
        version, forecast = queue_forecast.queue_forecast(session, tenant=tenant, capacity=self.capacity())
        with self._lock:
            self._cache[tenant.id] = (self.clock(), version, forecast)
        return forecast

    def of(self, *, tenant: Tenant, job_seq: int, queue_version: int) -> tuple[int | None, datetime | None]:
        """A queued job's (position, estimated start) as of the latest replay; the position only if the queue has
        not moved since (`queue_version`: the tenant's, read with the job). Never waits for a replay."""
        with self._lock:
            taken_at, version, forecast = self._cache.get(tenant.id, (None, None, _NOTHING))
            current = version == queue_version
            ttl = self.ttl_s if current and job_seq in forecast else self.new_job_ttl_s
            if (taken_at is None or self.clock() - taken_at >= ttl) and tenant.id not in self._replays:
                self._replays[tenant.id] = self._replayer.submit(self._replay, tenant)
        # Missing even from a fresh forecast: the job left the queue since it was replayed.
        position, start = forecast.get(job_seq, (None, None))
        return (position if current else None), start

    def latest(self, *, tenant: Tenant) -> Forecast:
        """The tenant's latest forecast for its estimated starts (positions in it may be out of date); a replay
        is started when it is older than `ttl_s`. Never waits for one (the team page polls this)."""
        with self._lock:
            taken_at, _, forecast = self._cache.get(tenant.id, (None, None, _NOTHING))
            if (taken_at is None or self.clock() - taken_at >= self.ttl_s) and tenant.id not in self._replays:
                self._replays[tenant.id] = self._replayer.submit(self._replay, tenant)
        return forecast

    def wait(self) -> None:
        """Until the replays under way are done (tests)."""
        with self._lock:
            replays = list(self._replays.values())
        for replay in replays:
            replay.result()

    def close(self) -> None:
        self._replayer.shutdown(wait=True)

    def _replay(self, tenant: Tenant) -> None:
        try:
            with self.db.session() as session:
                self.fresh(session, tenant=tenant)
        except Exception:  # the next read asks again; a forecast is never worth a failed request
            log.exception("replaying the queue of tenant %s failed", tenant.name)
        finally:
            with self._lock:
                del self._replays[tenant.id]


async def _forecasts(request: Request) -> Forecasts:
    return request.app.state.forecasts


QueueForecasts = Annotated[Forecasts, Depends(_forecasts)]
"""A route's parameter: the app's forecasts (made once at start)."""
