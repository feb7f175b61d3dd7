"""API load: job submissions/s and read latency, the server in its own process(es), on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/api_load.py [--submissions 2000] [--reads 2000] [--concurrency 16] [--paced-rate 300]
                                            [--replicas 2] [--workers 2]

Each server is `kembed serve` with admission paused (KEMBED_ADMISSION_PAUSED), so the numbers are the API's
own (validation, auth, database) and no trainer competes for the cores. SQLite is the embedded default: one
process, then the same with `--workers` worker processes (`kembed serve --workers`). PostgreSQL is how a cluster
install runs: `--replicas` API servers on one database (the Helm chart's `api.replicas`), which the load spreads
over as a Kubernetes Service would. The load comes from this process over loopback (asyncio + aiohttp,
keep-alive: the cheapest client at hand, since it shares the machine's cores with the servers). Submissions and
reads first run saturated (`--concurrency` requests always in flight: the most the servers answer, while latency
is mostly the wait behind the others, by Little's law in-flight / rate), then the reads again at a steady
`--paced-rate` (an open loop, as from many clients polling: the latency one request sees at that load). Each
path is warmed up first. Prints one table, with the servers' own CPU time per request (from /proc: what a
request costs, whatever else the machine runs), ratios, and the targets (>= 500 submissions/s, read p99 < 50 ms)
for each server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
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

from kembed_api.platform.ports import free_port  # noqa: E402
from tests.builders import make_spec  # noqa: E402
from tests.fixtures.servers import run_postgres  # noqa: E402

# One platform-admin token for every replica (as the Helm chart hands them one from a Secret).
_TOKEN = "kmb_api-load-benchmark-token"


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far (from /proc) of a server process and its worker processes: what the server
    itself spent."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if int(_stat(int(entry))[1]) == pid:
                    children.append(int(entry))
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(map(cpu_seconds, children))


def _wait_healthy(url: str, process: subprocess.Popen, log: Path, deadline: float) -> None:
    while True:
        try:
            httpx.get(f"{url}/healthz")
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                why = f"exited with {process.returncode}" if process.poll() is not None else "is not up after 60 s"
                raise RuntimeError(f"the API server at {url} {why}; its log ends:\n"
                                   f"{log.read_text()[-2000:]}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def api_servers(database_url: str | None, data_dir: Path, replicas: int = 1, workers: int = 1,
                env: dict[str, str] | None = None) -> Iterator[tuple[list[str], list[int]]]:
    """`replicas` API servers of `workers` processes each on one database; yields their URLs and pids. Rate
    limits are off unless `env` turns them on: this benchmark sends thousands of requests with one token."""
    env = {**os.environ, "KEMBED_ADMISSION_PAUSED": "true", "KEMBED_BOOTSTRAP_ADMIN_TOKEN": _TOKEN,
           "KEMBED_RATE_LIMITS": "false", **(env or {})}
    if database_url:
        env["KEMBED_DATABASE_URL"] = database_url
    data_dir.mkdir(parents=True)
    # Migrate once first, as the chart's migration step does, so replicas do not race to create the schema.
    subprocess.run([sys.executable, "-m", "kembed_api.cli", "migrate"], env={**env, "KEMBED_DATA_DIR": str(data_dir)},
                   check=True, stdout=subprocess.DEVNULL)
    with contextlib.ExitStack() as stack:
        urls, processes, logs = [], [], []
        for _ in range(replicas):
            port = free_port()
            logs.append(data_dir.parent / f"server-{port}.log")
            log = stack.enter_context(open(logs[-1], "w"))
            process = stack.enter_context(subprocess.Popen(
                [sys.executable, "-m", "kembed_api.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
                 *(["--workers", str(workers)] if workers > 1 else [])],
                env=env, stdout=subprocess.DEVNULL, stderr=log,
            ))
            stack.callback(process.terminate)  # runs before the Popen's own exit, which waits for it
            urls.append(f"http://127.0.0.1:{port}")
            processes.append(process)
        deadline = time.monotonic() + 60
        for url, process, log in zip(urls, processes, logs, strict=True):
            _wait_healthy(url, process, log, deadline)
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


async def _run_at_rate(count: int, rate: float, call) -> list[float]:
    """`count` calls started at `rate` per second whatever the answers' pace (an open loop, like many clients
    polling); returns latencies in seconds, from the scheduled start, so waiting for a connection counts."""
    latencies: list[float] = []

    async def timed(i: int, started: float) -> None:
        await call(i)
        latencies.append(time.perf_counter() - started)

    tasks, begin = [], time.perf_counter()
    for i in range(count):
        scheduled = begin + i / rate
        if (delay := scheduled - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(i, scheduled)))
    await asyncio.gather(*tasks)
    return latencies


def _pct(latencies: list[float], q: float) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[q - 1] * 1000


async def measure(urls: list[str], pids: list[int], *, submissions: int, reads: int, concurrency: int,
                  paced_rate: float) -> dict[str, float]:
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

        # Each path is warmed up before it is measured, as a server polled all day is: connections, caches,
        # statements prepared per connection, the first replay of the queue's forecast (after a burst of 2,000
        # submissions, the first reads cost up to ~100 ms: alone almost 1% of a 2,000-read run's latencies).
        await _run(50, concurrency, submit)
        cpu = server_cpu()
        submit_rate, submit_latency = await _run(submissions, concurrency, submit)
        submit_cpu = (server_cpu() - cpu) / submissions * 1000
        await _run(100, concurrency, read_job)
        cpu = server_cpu()
        read_rate, read_latency = await _run(reads, concurrency, read_job)
        read_cpu = (server_cpu() - cpu) / reads * 1000
        await _run(100, concurrency, read_usage)
        usage_rate, usage_latency = await _run(reads // 2, concurrency, read_usage)
        # The machine's own pace: what the cheapest request (no database, no auth) costs a server. The shared
        # machine's speed drifts by tens of percent over hours; compare runs by this too.
        cpu = server_cpu()
        await _run(reads, concurrency, lambda _: call("GET", "/healthz"))
        healthz_cpu = (server_cpu() - cpu) / reads * 1000
    # The same reads at a steady offered rate, over a pool of connections that never runs short (`call` reads
    # `client` when it runs, so it uses this one).
    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=256)) as client:
        # Polling clients keep their connections open: open some first, so the run does not start with a
        # burst of connects queued behind each other.
        await asyncio.gather(*(call("GET", "/healthz") for _ in range(2 * concurrency)))
        paced_read = await _run_at_rate(reads, paced_rate, read_job)
        paced_usage = await _run_at_rate(reads // 2, paced_rate, read_usage)
    return {
        "submissions/s": submit_rate, "submit p99 ms": _pct(submit_latency, 99),
        "server CPU ms/submit": submit_cpu, "server CPU ms/GET": read_cpu, "server CPU ms/healthz": healthz_cpu,
        "GET job/s": read_rate, "GET job p50 ms": _pct(read_latency, 50), "GET job p99 ms": _pct(read_latency, 99),
        "usage p50 ms": _pct(usage_latency, 50), "usage p99 ms": _pct(usage_latency, 99),
        f"GET job p50 ms at {paced_rate:g}/s": _pct(paced_read, 50),
        f"GET job p99 ms at {paced_rate:g}/s": _pct(paced_read, 99),
        f"usage p50 ms at {paced_rate:g}/s": _pct(paced_usage, 50),
        f"usage p99 ms at {paced_rate:g}/s": _pct(paced_usage, 99),
    }


def main() -> None:
    # The client is the measuring instrument: its own collector's pauses would show up as server latency.
    gc.disable()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--submissions", type=int, default=2000)
    parser.add_argument("--reads", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16, help="Requests in flight in the saturating runs.")
    parser.add_argument("--paced-rate", type=float, default=300, help="Reads/s offered in the paced runs.")
    parser.add_argument("--replicas", type=int, default=2, help="API servers on PostgreSQL (SQLite runs one).")
    parser.add_argument("--workers", type=int, default=2,
                        help="Worker processes of the second SQLite server (`kembed serve --workers`); 1: none.")
    args = parser.parse_args()
    load = dict(submissions=args.submissions, reads=args.reads, concurrency=args.concurrency,
                paced_rate=args.paced_rate)

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in dict.fromkeys((1, args.workers)):  # `--workers 1`: the one-process server only
            with api_servers(None, Path(tmp) / f"sqlite-{workers}", workers=workers) as (urls, pids):
                results["SQLite" if workers == 1 else f"SQLite, {workers} workers"] = asyncio.run(
                    measure(urls, pids, **load))
        with run_postgres() as postgres, api_servers(postgres.new_database(), Path(tmp) / "pg",
                                                     args.replicas) as (urls, pids):
            results[f"PostgreSQL x{args.replicas}"] = asyncio.run(measure(urls, pids, **load))
    names = list(results)
    print(f"{'':<34}" + "".join(f"{name:>20}" for name in names))
    for metric in next(iter(results.values())):
        print(f"{metric:<34}" + "".join(f"{results[name][metric]:>20.1f}" for name in names))
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          f"{args.concurrency} requests in flight, then reads paced at {args.paced_rate:g}/s; server CPU ms per "
          "request is what one request costs the server, whatever else runs")
    one, postgres = results["SQLite"], results[names[-1]]
    ratios = {f"PostgreSQL x{args.replicas} / SQLite": postgres}
    if args.workers > 1:
        ratios[f"SQLite {args.workers} workers / 1"] = results[names[1]]
    print("ratios: " + "; ".join(
        f"{label}: submissions/s {row['submissions/s'] / one['submissions/s']:.2f}, "
        f"GET job/s {row['GET job/s'] / one['GET job/s']:.2f}" for label, row in ratios.items()))
    paced = f" at {args.paced_rate:g}/s"
    for name, row in results.items():
        p99 = {kind: max(row[f"{what} p99 ms{kind}"] for what in ("GET job", "usage")) for kind in ("", paced)}
        verdicts = [f">= 500 submissions/s {'met' if row['submissions/s'] >= 500 else 'NOT met'}",
                    f"read p99 < 50 ms with {args.concurrency} in flight {'met' if p99[''] < 50 else 'NOT met'}",
                    f"read p99 < 50 ms{paced} {'met' if p99[paced] < 50 else 'NOT met'}"]
        print(f"targets, {name}: " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
