"""A fair API: one tenant floods the server with the heaviest requests it may send; another tenant's reads are timed.

    .venv/bin/python benchmarks/api_fairness.py [--seconds 20] [--flooders 8] [--read-rate 20]

Two `kembed serve` servers in turn (the embedded default: SQLite, one process, admission paused so no trainer
competes for the cores), one with the rate limits (the defaults of kembed_api.platform.settings) and one without them
(KEMBED_RATE_LIMITS=false): the same flood, side by side. Tenant B reads at a steady `--read-rate` (an open loop,
like dashboards polling: `GET /v1/usage` and `GET /v1/jobs` in turn, each timed from its scheduled start), first
alone (quiet) and then while tenant A floods: `--flooders` clients over 4 of A's tokens, each sending its next
request as soon as the last is answered (a hostile client does not wait for Retry-After), in turn:
- the largest valid spec the bounds allow (512 tables, 1,024 features: ~40 KB, stored as a job);
- the same spec with every table wrong (512 x `num_embeddings: 0`: validated in full, then 422);
- a body of just under 16,384 JSON values (the most the body guard parses: 422 after the parse);
- the 1,024-table x 55-feature spec of the issue (0.7 MB: 413 before it is parsed);
- `GET .../logs`, `GET .../export` of A's own jobs, and `GET /v1/jobs?limit=500` (A's queue grows as it floods).
Prints B's p50/p99/max quiet and under the flood, A's requests/s and the share of them answered 429, and the
server's CPU; the target is B's read p99 < 50 ms under the flood (DESIGN.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.api_load import _TOKEN, _pct, api_servers, cpu_seconds  # noqa: E402
from tests.builders import make_spec  # noqa: E402

_NUM_A_TOKENS = 4


def _tables(count: int, features_each: int, **table: object) -> dict:
    spec = make_spec("flood").build()
    first = spec["trainer"]["embeddings"]["tables"][0]
    spec["trainer"]["embeddings"]["tables"] = [
        dict(first, name=f"t{i}", features=[f"f{i}_{j}" for j in range(features_each)], **table)
        for i in range(count)]
    return spec


def _bodies() -> list[bytes]:
    """A's submissions, heaviest first: see the module's docstring."""
    many_values = make_spec("flood").build()
    many_values["labels"] = {"x": "y"}
    many_values["trainer"]["data"]["dense"] = [1.5] * 16_000  # not a field of synthetic data: 422 once parsed
    return [json.dumps(body).encode() for body in (
        _tables(512, 2), _tables(512, 2, num_embeddings=0), many_values, _tables(1024, 55))]


def _setup(url: str) -> tuple[list[str], str, list[str]]:
    """Tenants `a` and `b`, 4 member tokens of a, a viewer token of b, and 3 small jobs of a."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {_TOKEN}"}, timeout=60) as admin:
        for tenant in ("a", "b"):
            admin.post("/v1/tenants", json={"name": tenant}).raise_for_status()

        def token(tenant: str, role: str, i: int) -> str:
            made = admin.post(f"/v1/tenants/{tenant}/tokens", json={"name": f"{tenant}-{role}-{i}", "role": role})
            made.raise_for_status()
            return made.json()["token"]

        a_tokens = [token("a", "member", i) for i in range(_NUM_A_TOKENS)]
        b_token = token("b", "viewer", 0)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {a_tokens[0]}"}, timeout=60) as a:
        jobs = [a.post("/v1/jobs", json=make_spec(f"mine-{i}").build()).json()["id"] for i in range(3)]
        for path in _reads_of_a(jobs):  # warmed up: the first export imports the trainer's modules (seconds)
            a.get(path)
    return a_tokens, b_token, jobs


def _reads_of_a(jobs: list[str]) -> list[str]:
    return [f"/v1/jobs/{jobs[0]}/logs", f"/v1/jobs/{jobs[1]}/export?format=numpy", "/v1/jobs?limit=500"]


async def _reads(url: str, token: str, seconds: float, rate: float) -> list[float]:
    """B's reads at `rate` per second for `seconds`; latencies in seconds from each one's scheduled start."""
    latencies: list[float] = []
    paths = itertools.cycle(("/v1/usage", "/v1/jobs"))
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"},
                                     connector=aiohttp.TCPConnector(limit=64)) as client:

        async def timed(path: str, scheduled: float) -> None:
            async with client.get(url + path) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"B's GET {path}: {response.status}")
            latencies.append(time.perf_counter() - scheduled)

        tasks, begin = [], time.perf_counter()
        for i in range(int(seconds * rate)):
            scheduled = begin + i / rate
            if (delay := scheduled - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(next(paths), scheduled)))
        await asyncio.gather(*tasks)
    return latencies


def _flood_process(url: str, tokens: list[str], jobs: list[str], flooders: int, stop, counts) -> None:
    """A's flood in a process of its own: in B's, reading A's answers (megabytes each) would delay B's timings."""
    gc.disable()
    counts.put(dict(asyncio.run(_flood(url, tokens, jobs, flooders, stop))))


async def _flood(url: str, tokens: list[str], jobs: list[str], flooders: int, stop) -> Counter:
    """A's clients until `stop` (a multiprocessing Event) is set; counts answers by status."""
    statuses: Counter = Counter()
    bodies = _bodies()
    reads = _reads_of_a(jobs)

    async def client_loop(token: str, offset: int) -> None:
        requests = itertools.cycle([("POST", "/v1/jobs", body) for body in bodies] + [("GET", p, None) for p in reads])
        for _ in range(offset):
            next(requests)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"}) as client:
            while not stop.is_set():  # a hostile client does not wait for Retry-After
                method, path, body = next(requests)
                async with client.request(method, url + path, data=body) as response:
                    await response.read()
                    statuses[response.status] += 1

    await asyncio.gather(*(client_loop(tokens[i % len(tokens)], i) for i in range(flooders)))
    return statuses


async def measure(url: str, pid: int, *, seconds: float, flooders: int, read_rate: float) -> dict[str, float]:
    a_tokens, b_token, jobs = await asyncio.to_thread(_setup, url)
    await _reads(url, b_token, 2, read_rate)  # warm-up: connections, caches
    quiet = await _reads(url, b_token, seconds, read_rate)
    stop, counts = multiprocessing.Event(), multiprocessing.Queue()
    flood = multiprocessing.Process(target=_flood_process, args=(url, a_tokens, jobs, flooders, stop, counts))
    flood.start()
    flood_started = time.perf_counter()
    await asyncio.sleep(2)  # the flood under way (bursts spent) before B is timed
    cpu, started = cpu_seconds(pid), time.perf_counter()
    loud = await _reads(url, b_token, seconds, read_rate)
    elapsed, cpu = time.perf_counter() - started, cpu_seconds(pid) - cpu
    stop.set()
    statuses = Counter(await asyncio.to_thread(counts.get))
    flooded_s = time.perf_counter() - flood_started
    flood.join()
    total = sum(statuses.values())
    return {
        "B read p50 ms, quiet": _pct(quiet, 50), "B read p99 ms, quiet": _pct(quiet, 99),
        "B read max ms, quiet": max(quiet) * 1000,
        "B read p50 ms, A flooding": _pct(loud, 50), "B read p99 ms, A flooding": _pct(loud, 99),
        "B read max ms, A flooding": max(loud) * 1000,
        "A requests/s": total / flooded_s, "A answered 429 %": 100 * statuses[429] / max(total, 1),
        "A answered other than 429 /s": (total - statuses[429]) / flooded_s,
        "server CPU % while flooded": 100 * cpu / elapsed,
    }


def main() -> None:
    gc.disable()  # the client is the measuring instrument (benchmarks/api_load.py)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20, help="B's reads in each phase, in seconds.")
    parser.add_argument("--flooders", type=int, default=8, help="A's clients, over its 4 tokens.")
    parser.add_argument("--read-rate", type=float, default=20, help="B's reads per second (10 dashboards).")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, limits in (("rate limits (default)", "true"), ("no rate limits", "false")):
            with api_servers(None, Path(tmp) / limits, env={"KEMBED_RATE_LIMITS": limits}) as (urls, pids):
                results[name] = asyncio.run(measure(urls[0], pids[0], seconds=args.seconds, flooders=args.flooders,
                                                    read_rate=args.read_rate))
    names = list(results)
    print(f"{'':<32}" + "".join(f"{name:>24}" for name in names))
    for metric in results[names[0]]:
        print(f"{metric:<32}" + "".join(f"{results[name][metric]:>24.1f}" for name in names))
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores; "
          f"B reads {args.read_rate:g}/s for {args.seconds:g} s per phase; A: {args.flooders} clients on "
          f"{_NUM_A_TOKENS} tokens")
    on, off = results[names[0]], results[names[1]]
    print(f"ratios: B's read p99 under the flood / quiet: {on['B read p99 ms, A flooding'] / on['B read p99 ms, quiet']:.2f} "
          f"with rate limits, {off['B read p99 ms, A flooding'] / off['B read p99 ms, quiet']:.2f} without")
    verdict = "met" if on["B read p99 ms, A flooding"] < 50 else "NOT met"
    print(f"target, B's read p99 < 50 ms while A floods (rate limits on): {verdict}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
