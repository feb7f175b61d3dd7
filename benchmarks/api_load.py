"""API load: job submissions/s and read latency, the server in its own process, on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/api_load.py [--submissions 2000] [--reads 2000] [--concurrency 16]

The server is `kembed serve` with admission paused (KEMBED_ADMISSION_PAUSED), so the numbers are the API's
own (validation, auth, database) and no trainer competes for the cores. The load comes from this process over
loopback (asyncio + httpx, keep-alive), so client and server share the machine's cores: on 2 cores the figures
are a floor. Prints one table, with the server's own CPU time per request (from /proc: independent of what else
the machine runs); the targets are >= 500 submissions/s and a read p99 < 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kembed_api.ports import free_port  # noqa: E402
from tests.builders import make_spec  # noqa: E402
from tests.fixtures.servers import run_postgres  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc): what the server itself spent."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def api_server(database_url: str | None, data_dir: Path) -> Iterator[tuple[str, str, int]]:
    port = free_port()
    env = {**os.environ, "KEMBED_ADMISSION_PAUSED": "true"}
    if database_url:
        env["KEMBED_DATABASE_URL"] = database_url
    process = subprocess.Popen(
        [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=open(data_dir.parent / f"server-{port}.log", "w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/healthz")
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("the API server did not start") from None
                time.sleep(0.2)
        yield url, (data_dir / "admin-token").read_text().strip(), process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)


async def _run(count: int, concurrency: int, call) -> tuple[float, list[float]]:
    """`count` calls, `concurrency` at a time; returns (calls/s, latencies in seconds)."""
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count / (time.perf_counter() - started), latencies


def _pct(latencies: list[float], q: float) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[q - 1] * 1000


async def measure(url: str, token: str, pid: int, *, submissions: int, reads: int,
                  concurrency: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=60) as client:
        spec = make_spec("load").build()
        ids: list[str] = []

        async def submit(_: int) -> None:
            response = await client.post("/v1/jobs", json=spec)
            response.raise_for_status()
            ids.append(response.json()["id"])

        async def read_job(i: int) -> None:
            (await client.get(f"/v1/jobs/{ids[i % len(ids)]}")).raise_for_status()

        async def read_usage(_: int) -> None:
            (await client.get("/v1/usage")).raise_for_status()

        await _run(50, concurrency, submit)  # warm-up: connections, caches, JIT-less Python's first calls
        cpu = cpu_seconds(pid)
        submit_rate, submit_latency = await _run(submissions, concurrency, submit)
        submit_cpu, cpu = (cpu_seconds(pid) - cpu) / submissions * 1000, cpu_seconds(pid)
        read_rate, read_latency = await _run(reads, concurrency, read_job)
        read_cpu = (cpu_seconds(pid) - cpu) / reads * 1000
        usage_rate, usage_latency = await _run(reads // 2, concurrency, read_usage)
    return {
        "submissions/s": submit_rate, "submit p99 ms": _pct(submit_latency, 99),
        "server CPU ms/submit": submit_cpu, "server CPU ms/GET": read_cpu,
        "GET job/s": read_rate, "GET job p50 ms": _pct(read_latency, 50), "GET job p99 ms": _pct(read_latency, 99),
        "usage p50 ms": _pct(usage_latency, 50), "usage p99 ms": _pct(usage_latency, 99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submissions", type=int, default=2000)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with api_server(None, Path(tmp) / "sqlite") as (url, token, pid):
            results["SQLite"] = asyncio.run(measure(url, token, pid, submissions=args.submissions, reads=args.reads,
                                                    concurrency=args.concurrency))
        with run_postgres() as postgres, api_server(postgres.new_database(), Path(tmp) / "pg") as (url, token, pid):
            results["PostgreSQL"] = asyncio.run(measure(url, token, pid, submissions=args.submissions,
                                                        reads=args.reads, concurrency=args.concurrency))
    columns = list(next(iter(results.values())))
    print(f"{'database':<11}" + "".join(f"{c:>21}" for c in columns))
    for name, row in results.items():
        print(f"{name:<11}" + "".join(f"{row[c]:>21.1f}" for c in columns))
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          "server CPU ms per request is what one request costs the server, whatever else runs")
    sqlite, pg = results["SQLite"], results["PostgreSQL"]
    print(f"ratio PostgreSQL/SQLite submissions/s: {pg['submissions/s'] / sqlite['submissions/s']:.2f}; "
          f"targets: >= 500 submissions/s -> {'met' if min(sqlite['submissions/s'], pg['submissions/s']) >= 500 else 'NOT met'}, "
          f"read p99 < 50 ms -> {'met' if max(sqlite['GET job p99 ms'], pg['GET job p99 ms'], sqlite['usage p99 ms'], pg['usage p99 ms']) < 50 else 'NOT met'}")


if __name__ == "__main__":
    main()
