"""API load: job submissions/s and read latency, the server in its own process(es), on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/api_load.py [--submissions 2000] [--reads 2000] [--concurrency 16] [--replicas 2]

Each server is `kembed serve` with admission paused (KEMBED_ADMISSION_PAUSED), so the numbers are the API's
own (validation, auth, database) and no trainer competes for the cores. SQLite is the embedded default: one
process. PostgreSQL is how a cluster install runs: `--replicas` API processes on one database (the Helm chart's
`api.replicas`), which the load spreads over as a Kubernetes Service would. The load comes from this process over
loopback (asyncio + aiohttp, keep-alive: the cheapest client at hand, since it shares the machine's cores with the
servers). Prints one table, with the servers' own CPU time per request (from /proc: what a request costs,
whatever else the machine runs); the targets are >= 500 submissions/s and a read p99 < 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kembed_api.ports import free_port  # noqa: E402
from tests.builders import make_spec  # noqa: E402
from tests.fixtures.servers import run_postgres  # noqa: E402

# One platform-admin token for every replica (as the Helm chart hands them one from a Secret).
_TOKEN = "kmb_api-load-benchmark-token"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc): what the server itself spent."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_healthy(url: str, process: subprocess.Popen, deadline: float) -> None:
    while True:
        try:
            httpx.get(f"{url}/healthz")
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the API server at {url} did not start") from None
            time.sleep(0.2)


@contextlib.contextmanager
def api_servers(database_url: str | None, data_dir: Path, replicas: int = 1) -> Iterator[tuple[list[str], list[int]]]:
    """`replicas` API processes on one database; yields their URLs and pids."""
    env = {**os.environ, "KEMBED_ADMISSION_PAUSED": "true", "KEMBED_BOOTSTRAP_ADMIN_TOKEN": _TOKEN}
    if database_url:
        env["KEMBED_DATABASE_URL"] = database_url
    data_dir.mkdir(parents=True)
    # Migrate once first, as the chart's migration step does, so replicas do not race to create the schema.
    subprocess.run([sys.executable, "-m", "kembed_api.cli", "migrate"], env={**env, "KEMBED_DATA_DIR": str(data_dir)},
                   check=True, stdout=subprocess.DEVNULL)
    with contextlib.ExitStack() as stack:
        urls, processes = [], []
        for _ in range(replicas):
            port = free_port()
            log = stack.enter_context(open(data_dir.parent / f"server-{port}.log", "w"))
            process = stack.enter_context(subprocess.Popen(
                [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(port), "--data-dir", str(data_dir)],
                env=env, stdout=subprocess.DEVNULL, stderr=log,
            ))
            stack.callback(process.terminate)  # runs before the Popen's own exit, which waits for it
            urls.append(f"http://127.0.0.1:{port}")
            processes.append(process)
        deadline = time.monotonic() + 60
        for url, process in zip(urls, processes, strict=True):
            _wait_healthy(url, process, deadline)
        yield urls, [p.pid for p in processes]


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


async def measure(urls: list[str], pids: list[int], *, submissions: int, reads: int,
                  concurrency: int) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {_TOKEN}"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    next_url = itertools.cycle(urls).__next__  # round robin over the replicas, as a Service spreads connections
    async with aiohttp.ClientSession(headers=headers, connector=connector) as client:
        spec = make_spec("load").build()
        ids: list[str] = []

        async def call(method: str, path: str, **kwargs) -> bytes:
            async with client.request(method, next_url() + path, **kwargs) as response:
                body = await response.read()
                if response.status >= 300:
                    raise RuntimeError(f"{method} {path}: {response.status} {body[:200]!r}")
                return body

        async def submit(_: int) -> None:
            async with client.post(next_url() + "/v1/jobs", json=spec) as response:
                if response.status != 201:
                    raise RuntimeError(f"submit: {response.status} {(await response.read())[:200]!r}")
                ids.append((await response.json())["id"])

        async def read_job(i: int) -> None:
            await call("GET", f"/v1/jobs/{ids[i % len(ids)]}")

        async def read_usage(_: int) -> None:
            await call("GET", "/v1/usage")

        def server_cpu() -> float:
            return sum(cpu_seconds(pid) for pid in pids)

        await _run(50, concurrency, submit)  # warm-up: connections, caches, the first calls of each code path
        cpu = server_cpu()
        submit_rate, submit_latency = await _run(submissions, concurrency, submit)
        submit_cpu, cpu = (server_cpu() - cpu) / submissions * 1000, server_cpu()
        read_rate, read_latency = await _run(reads, concurrency, read_job)
        read_cpu = (server_cpu() - cpu) / reads * 1000
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
    parser.add_argument("--replicas", type=int, default=2, help="API processes on PostgreSQL (SQLite runs one).")
    args = parser.parse_args()

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        with api_servers(None, Path(tmp) / "sqlite") as (urls, pids):
            results["SQLite"] = asyncio.run(measure(urls, pids, submissions=args.submissions, reads=args.reads,
                                                    concurrency=args.concurrency))
        with run_postgres() as postgres, api_servers(postgres.new_database(), Path(tmp) / "pg",
                                                     args.replicas) as (urls, pids):
            results[f"PostgreSQL x{args.replicas}"] = asyncio.run(measure(
                urls, pids, submissions=args.submissions, reads=args.reads, concurrency=args.concurrency))
    columns = list(next(iter(results.values())))
    print(f"{'database':<15}" + "".join(f"{c:>21}" for c in columns))
    for name, row in results.items():
        print(f"{name:<15}" + "".join(f"{row[c]:>21.1f}" for c in columns))
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          "server CPU ms per request is what one request costs the server, whatever else runs")
    sqlite, pg = results["SQLite"], results[f"PostgreSQL x{args.replicas}"]
    print(f"ratio PostgreSQL/SQLite submissions/s: {pg['submissions/s'] / sqlite['submissions/s']:.2f}; "
          f"targets: >= 500 submissions/s -> {'met' if min(sqlite['submissions/s'], pg['submissions/s']) >= 500 else 'NOT met'}, "
          f"read p99 < 50 ms -> {'met' if max(sqlite['GET job p99 ms'], pg['GET job p99 ms'], sqlite['usage p99 ms'], pg['usage p99 ms']) < 50 else 'NOT met'}")


if __name__ == "__main__":
    main()
