"""The team dashboard on a big tenant: the team page's data size and server time, and 50 open dashboards' CPU.

    .venv/bin/python benchmarks/dashboard.py [--jobs 10000] [--dashboards 50] [--seconds 30]

One `kembed serve` (SQLite, the embedded default) with admission paused, so no trainer competes for the cores.
One tenant gets `--jobs` jobs, stored by the server's intake code before it starts; half of them then finished
over the last 30 days, so its queue and its history are both long. Then:

1. The team page's data: the size of `GET /v1/overview` (what the page polls; the page's HTML shell and script are
   static files) and its server time: the overview computed from the database in this process, by the server's
   own code on the server's database file, each call a cache miss (p50/p99 over 200), and the same endpoint
   over HTTP, requests one after another (most answered from the one-second per-tenant cache, one a second not).
2. `--dashboards` browsers' worth of sessions (each signed in through the sign-in form) polling
   `GET /v1/overview` every 2 s as the page does, for `--seconds`: the server process's CPU time over that time
   (from /proc), as a share of one core, once revalidating with If-None-Match (what a browser's fetch with
   cache "no-cache" does) and once asking for the whole body every time.

Targets (issue 17): data < 100 KB, server p99 < 50 ms, 50 dashboards < 10 % of a core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.api_load import cpu_seconds  # noqa: E402
from kembed_api.platform.ports import free_port  # noqa: E402
from tests.builders import make_spec  # noqa: E402

_TOKEN = "kmb_dashboard-benchmark-token"


def start_server(data_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # Without rate limits: the pages' own cost is measured, with more requests from one token than a person makes.
    env = {**os.environ, "KEMBED_ADMISSION_PAUSED": "true", "KEMBED_BOOTSTRAP_ADMIN_TOKEN": _TOKEN,
           "KEMBED_RATE_LIMITS": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{url}/healthz", timeout=1).raise_for_status()
            return process, url
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("kembed serve did not start") from None
            time.sleep(0.2)


def fill(data_dir: Path, num_jobs: int) -> str:
    """Tenant `big` with `num_jobs` jobs, stored by the server's own intake code before the server starts (as
    submitted over HTTP, only faster): every other one then finished over the last 30 days, with a result. Returns
    a member token of the tenant."""
    from datetime import timedelta

    from sqlalchemy import update

    from kembed_api.auth import service as auth_service
    from kembed_api.auth.roles import Role
    from kembed_api.jobs import submissions
    from kembed_api.jobs.models import Job
    from kembed_api.platform.db import Database, upgrade_to_head, utcnow
    from kembed_api.platform.storage import PlatformStorage
    from kembed_api.tenants.models import Tenant
    from kembed_api.tenants.schemas import QuotaSpec
    from kembed_api.tenants.service import create_tenant
    from kembed_contract.lifecycle import JobState
    from kembed_contract.spec import JobSpec

    data_dir.mkdir(parents=True)
    url = f"sqlite:///{data_dir / 'kembed.db'}"
    upgrade_to_head(url)
    db = Database(url)
    spec = JobSpec.model_validate(make_spec("bench").build())
    storage = PlatformStorage.of(checkpoint_root=(data_dir / "checkpoints").as_uri(), data_dir=data_dir)
    with db.session(write=True) as session:
        tenant = create_tenant(session, name="big", quota=QuotaSpec())
        session.flush()
        _, token = auth_service.create_token(session, tenant=tenant, name="bench", role=Role.MEMBER)
        tenant_id = tenant.id
    for first in range(0, num_jobs, 500):
        batch = [submissions.Submission(tenant_id=tenant_id, spec=spec) for _ in range(min(500, num_jobs - first))]
        for _attempt in range(5):  # a random job id that clashes fails the batch; the intake retries it too
            try:
                with db.session(write=True) as session:
                    submissions.submit_many(session, batch, storage=storage)
                break
            except IntegrityError:
                continue
    now = utcnow()
    with db.session(write=True) as session:
        seqs = session.scalars(select(Job.seq).where(Job.tenant_id == tenant_id).order_by(Job.seq)).all()
        for i, seq in enumerate(seqs[::2]):
            ended = now - timedelta(days=30) * (i / max(1, len(seqs) // 2))
            session.execute(update(Job).where(Job.seq == seq).values(
                state=JobState.SUCCEEDED, reason="Completed", message="", admitted_at=ended - timedelta(minutes=2),
                started_at=ended - timedelta(minutes=2), finished_at=ended, step=60, total_steps=60,
                result={"auc": 0.81, "loss": 0.52}, metrics={"loss": 0.52, "samples_per_sec": 50000.0}))
        queued = session.scalar(select(func.count()).select_from(Job).where(Job.state == JobState.QUEUED))
        session.execute(update(Tenant).where(Tenant.id == tenant_id).values(queued_jobs=queued))
    db.dispose()
    return token


def in_process_times(data_dir: Path, tenant_name: str, calls: int = 200) -> tuple[list[float], list[float]]:
    """Milliseconds per overview computed by the server's code on its database file (every call a miss): wall
    time, and the CPU time of this thread (what the computation itself costs, whatever else runs)."""
    from kembed_api.dashboard import service
    from kembed_api.jobs import queue_forecast
    from kembed_api.platform.db import Database
    from kembed_api.quota.admission import Quota
    from kembed_api.tenants.service import get_tenant

    db = Database(f"sqlite:///{data_dir / 'kembed.db'}")
    with db.session() as session:
        tenant = get_tenant(session, name=tenant_name)
        session.expunge(tenant)
        _, forecast = queue_forecast.queue_forecast(session, tenant=tenant, capacity=Quota())
    times, cpu_times = [], []
    for _ in range(calls):
        started, cpu_started = time.perf_counter(), time.thread_time()
        with db.session() as session:
            service.overview(session, tenant=tenant, forecast=lambda: forecast).model_dump_json()
        times.append((time.perf_counter() - started) * 1000)
        cpu_times.append((time.thread_time() - cpu_started) * 1000)
    db.dispose()
    return times, cpu_times


def http_times(url: str, token: str, calls: int = 400) -> tuple[list[float], int]:
    times = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as client:
        size = len(client.get("/v1/overview").content)
        for _ in range(calls):
            started = time.perf_counter()
            client.get("/v1/overview").raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
            time.sleep(0.01)
    return times, size


def sign_in(url: str, token: str) -> str:
    response = httpx.post(f"{url}/dashboard/sign-in", data={"token": token}, follow_redirects=False)
    assert response.status_code == 303, response.text
    return response.cookies["kembed_session"]


async def dashboards(url: str, cookies: list[str], seconds: float, *, revalidate: bool) -> int:
    """Each session polls like an open team page: every 2 s, started at random offsets."""
    stop_at = time.monotonic() + seconds
    count = 0

    async def one(cookie: str, offset: float) -> None:
        nonlocal count
        async with httpx.AsyncClient(base_url=url, cookies={"kembed_session": cookie}, timeout=30) as client:
            await asyncio.sleep(offset)
            etag = None
            while time.monotonic() < stop_at:
                headers = {"If-None-Match": etag} if revalidate and etag else {}
                response = await client.get("/v1/overview", headers=headers)
                assert response.status_code in (200, 304), response.status_code
                etag = response.headers.get("etag", etag)
                count += 1
                await asyncio.sleep(2.0)

    await asyncio.gather(*(one(c, 2.0 * i / len(cookies)) for i, c in enumerate(cookies)))
    return count


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--dashboards", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kembed-dashboard-bench-") as tmp:
        data_dir = Path(tmp) / "kembed"
        started = time.monotonic()
        token = fill(data_dir, args.jobs)
        print(f"{args.jobs} jobs stored (half finished) in {time.monotonic() - started:.0f} s", flush=True)
        process, url = start_server(data_dir)
        try:
            compute, compute_cpu = in_process_times(data_dir, "big")
            over_http, size = http_times(url, token)
            cookies = [sign_in(url, token) for _ in range(args.dashboards)]
            # The server's own background work (dispatcher passes, queue forecasts) with no page open: what the
            # dashboards add is the difference.
            cpu_before, wall_before = cpu_seconds(process.pid), time.monotonic()
            time.sleep(args.seconds)
            idle = (cpu_seconds(process.pid) - cpu_before) / (time.monotonic() - wall_before)
            rows = []
            for revalidate in (True, False):
                cpu_before, wall_before = cpu_seconds(process.pid), time.monotonic()
                polls = asyncio.run(dashboards(url, cookies, args.seconds, revalidate=revalidate))
                share = (cpu_seconds(process.pid) - cpu_before) / (time.monotonic() - wall_before)
                rows.append((revalidate, polls, share))
        finally:
            process.terminate()
            process.wait(timeout=60)

    print()
    print("| measure | value | target |")
    print("| --- | --- | --- |")
    print(f"| team page data (GET /v1/overview), {args.jobs} jobs | {size / 1024:.1f} KB | < 100 KB |")
    print(f"| overview computed (cache miss), p50 / p99 | {statistics.median(compute):.1f} / "
          f"{percentile(compute, 99):.1f} ms | p99 < 50 ms |")
    print(f"| overview computed (cache miss), CPU time p50 / p99 | {statistics.median(compute_cpu):.1f} / "
          f"{percentile(compute_cpu, 99):.1f} ms | |")
    print(f"| GET /v1/overview over HTTP, p50 / p99 | {statistics.median(over_http):.1f} / "
          f"{percentile(over_http, 99):.1f} ms | p99 < 50 ms |")
    print(f"| server with no dashboard open (background work): server CPU | {100 * idle:.1f} % of a core | |")
    for revalidate, polls, share in rows:
        how = "If-None-Match (304s)" if revalidate else "whole body each time"
        # Under load the client falls behind (fewer polls than 50 every 2 s): the share is scaled to the full rate.
        full_rate = args.dashboards * args.seconds / 2
        print(f"| {args.dashboards} dashboards polling every 2 s, {how}: server CPU | {100 * share:.1f} % of a core "
              f"({polls} polls in {args.seconds:.0f} s; {100 * share * full_rate / polls:.1f} % at {full_rate:.0f}); "
              f"the dashboards' own share {100 * (share - idle) * full_rate / polls:.1f} % | < 10 % |")


if __name__ == "__main__":
    main()
