"""Fair use of the API: token buckets per token, per tenant and per job's reports, failed sign-ins per address,
and a cap on each tenant's heavy requests in flight. One member cannot stall the API for everyone else.

A plain ASGI middleware, outermost, so that a refused request costs a hash and a few dictionary lookups: nothing
of it is read, parsed, validated or looked up in the database. Who is asking is known from the request alone:
- a bearer token or a dashboard session (its SHA-256, as the token cache keys it): that token's bucket, and its
  tenant's bucket once the token has been seen to belong to one (the auth dependency notes it, `note_tenant`);
- `POST /v1/jobs/{id}/reports` (trainers, with a per-job token): that job's bucket;
- no credentials at all: the client address's bucket, at the token rate.
Every 401 also costs the client address one unit of its failures bucket; an address whose failures ran out gets
429 for any request not made with a token already seen to work, so token guessing is bounded, and a team sharing
a NAT with a guesser keeps working with the tokens it already uses.

A request's cost is one unit, plus one per 4 KiB of its declared body (validation costs by size: ~0.3 ms of
CPU per KiB of spec), or
HEAVY_COST for what reads storage or runs long (exports, neighbours, logs, checkpoint listings); once answered,
one more unit per 64 KiB of its answer (at most a burst), since building an answer costs by its size too (a page
of 500 jobs with large specs is 20 MB). Heavy requests also count against the tenant's cap in flight: they hold a
worker thread (of the 40 every tenant shares) for as long as they read, and a burst of exports could otherwise
hold them all. Submissions do not: one holds a thread for its validation only (milliseconds, bounded by the
spec's bounds), then waits for its commit without one; their rate is what is limited.

A 429 is sent after a pause of up to TARPIT_S (the wait, if shorter): a well-behaved client waits that long anyway,
and one that ignores Retry-After and asks again at once (a flood) sends a request a second per connection instead
of hundreds, each of which the server would parse and answer. A pause costs a timer, not a thread.

The buckets live in this process: with `KEMBED_WORKERS` > 1 each worker process counts for itself (the limits
apply per process, docs/api.md).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable, Callable, Hashable, MutableMapping
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any

from starlette.datastructures import Headers

from kembed_api.auth.service import hash_secret
from kembed_api.auth.sessions import COOKIE_NAME
from kembed_api.platform import errors

__all__ = ["ANSWER_BYTES_PER_UNIT", "BODY_BYTES_PER_UNIT", "HEAVY_COST", "TARPIT_S", "Buckets", "Limits", "Rate", "RateLimits", "note_tenant"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

TARPIT_S = 1.0  # the longest pause before a 429 (see above)
HEAVY_COST = 10  # units of a request that reads storage or runs long
# A unit is about a millisecond of the server's CPU: a read costs 1-2 ms, a spec of 512 tables (48 KB) 13 ms.
BODY_BYTES_PER_UNIT = 4096  # a spec of 1-3 KB costs one unit; one of 48 KB, 12 more
ANSWER_BYTES_PER_UNIT = 65_536  # a page of 50 small jobs is ~100 KB: one more unit

# Paths nothing limits: the liveness probe and the dashboard's static files.
_EXEMPT = re.compile(r"^/healthz$|^/dashboard/static/")
_REPORTS = re.compile(r"^/v1/jobs/([^/]+)/reports$")
_HEAVY_GET = re.compile(r"^/v1/jobs/[^/]+/(export|neighbours|logs|checkpoints)$")
_TENANT_NOTE = "kembed.tenant"  # where the auth dependency leaves the caller's tenant, in the request's state
_MAX_KEYS = 100_000  # buckets and known tokens remembered; past it, full buckets are forgotten first


@dataclass(frozen=True)
class Rate:
    per_s: float  # units added each second
    burst: float  # the most a bucket holds: what may be spent at once after a quiet while


class Buckets:
    """Token buckets of one rate, by key. A missing key is a full bucket; the clock is injected (tests do not
    sleep). Used from the event loop only, so nothing is locked."""

    def __init__(self, rate: Rate, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self._buckets: dict[Hashable, tuple[float, float]] = {}  # key -> (units, when)

    def level(self, key: Hashable) -> float:
        units, when = self._buckets.get(key, (self.rate.burst, 0.0))
        return min(self.rate.burst, units + (self.clock() - when) * self.rate.per_s)

    def wait_s(self, key: Hashable, cost: float) -> float:
        """Seconds until `cost` units are there (0: now). A cost above the burst waits for a full bucket."""
        missing = min(cost, self.rate.burst) - self.level(key)
        return 0.0 if missing <= 0 else missing / self.rate.per_s if self.rate.per_s > 0 else math.inf

    def take(self, key: Hashable, cost: float) -> None:
        """Spend `cost` units (at most a burst). What was spent already (an answer sent, a failed sign-in) may
        take the bucket below zero: it refills later, and the next requests wait."""
        if len(self._buckets) >= _MAX_KEYS:
            self._forget_full()
        self._buckets[key] = (self.level(key) - min(cost, self.rate.burst), self.clock())

    def _forget_full(self) -> None:
        full = [k for k in self._buckets if self.level(k) >= self.rate.burst]
        for key in full or list(self._buckets)[: _MAX_KEYS // 2]:  # none full: the oldest half
            del self._buckets[key]


@dataclass(frozen=True)
class Limits:
    """What RateLimits enforces (kembed_api.platform.settings.Settings documents each default)."""

    token: Rate
    tenant: Rate
    report: Rate
    auth_failures: Rate
    heavy_in_flight: int
    in_flight: int  # reads (GET) of one tenant under way at once
    max_body_bytes: int  # a larger body is refused unread (kembed_api.platform.bodies): it costs one unit, not its size


def note_tenant(scope: Scope, tenant_id: int) -> None:
    """Called by the auth dependency: this request's credentials belong to this tenant."""
    scope.setdefault("state", {})[_TENANT_NOTE] = tenant_id


def _credentials(headers: Headers) -> Hashable | None:
    scheme, _, secret = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secret.strip():
        return ("token", hash_secret(secret.strip()))
    if cookie := headers.get("cookie"):
        jar = SimpleCookie()
        try:
            jar.load(cookie)
        except Exception:  # noqa: BLE001 - a cookie header the server cannot read signs nobody in
            return None
        if (morsel := jar.get(COOKIE_NAME)) and morsel.value:
            return ("session", hash_secret(morsel.value))
    return None


def _cost(method: str, path: str, headers: Headers, max_body_bytes: int) -> tuple[float, bool]:
    """(units, heavy) of a request."""
    if method == "GET" and _HEAVY_GET.match(path):
        return HEAVY_COST, True
    declared = headers.get("content-length", "")
    size = int(declared) if declared.isdigit() and len(declared) < 20 else 0
    return 1 + (size // BODY_BYTES_PER_UNIT if size <= max_body_bytes else 0), False


class RateLimits:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, limits: Limits,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.app, self.limits, self.clock, self.sleep = app, limits, clock, sleep
        self._callers = Buckets(limits.token, clock=clock)  # tokens, sessions, anonymous addresses
        self._tenants = Buckets(limits.tenant, clock=clock)
        self._reports = Buckets(limits.report, clock=clock)
        self._failures = Buckets(limits.auth_failures, clock=clock)
        self._known: dict[Hashable, int | None] = {}  # credentials seen to work -> their tenant (None: a job's)
        self._in_flight: dict[Hashable, int] = {}  # reads under way, by tenant (or credentials)
        self._heavy_in_flight: dict[Hashable, int] = {}  # of them, the heavy ones

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _EXEMPT.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        address = ("address", (scope.get("client") or ("?",))[0])
        method, path = scope["method"], scope["path"]
        if report := _REPORTS.match(path) if method == "POST" else None:
            who: Hashable = ("job", report.group(1))
            charged = [(self._reports, who, "this job's reports (KEMBED_RATE_REPORT_PER_S)")]
        else:
            who = _credentials(headers) or address
            charged = [(self._callers, who, "this token's requests (KEMBED_RATE_TOKEN_PER_S)"
                        if who is not address else "this address's requests (KEMBED_RATE_TOKEN_PER_S)")]
            if (tenant := self._known.get(who)) is not None:
                charged.append((self._tenants, tenant, "the tenant's requests (KEMBED_RATE_TENANT_PER_S)"))
        cost, heavy = _cost(method, path, headers, self.limits.max_body_bytes)
        if who not in self._known and (wait := self._failures.wait_s(address, 1)) > 0:
            await self._refuse(scope, send, wait, "failed sign-ins from this address (KEMBED_RATE_AUTH_FAILURES_"
                               "PER_S): tokens that worked before still do")
            return
        for buckets, key, what in charged:
            if (wait := buckets.wait_s(key, cost)) > 0:
                await self._refuse(scope, send, wait, what, limit=buckets.rate)
                return
        slot = self._known.get(who) or who
        # Reads under way are capped too: an answer is paid for after it is sent, and many reads let in at once
        # (one per connection) would each build a large answer (a page of 500 jobs) before any is paid for. Writes
        # answer in proportion to what they were sent, which was paid for before.
        read = method in ("GET", "HEAD")
        if read and self._in_flight.get(slot, 0) >= self.limits.in_flight:
            await self._refuse(scope, send, 1.0, f"reads in flight for the tenant, at most "
                               f"{self.limits.in_flight} (KEMBED_IN_FLIGHT_PER_TENANT)")
            return
        if heavy and self._heavy_in_flight.get(slot, 0) >= self.limits.heavy_in_flight:
            await self._refuse(scope, send, 1.0, f"heavy requests in flight for the tenant, at most "
                               f"{self.limits.heavy_in_flight} (KEMBED_HEAVY_IN_FLIGHT_PER_TENANT)")
            return
        for buckets, key, _ in charged:
            buckets.take(key, cost)
        # The RateLimit-* headers only come with a 429: on every answer, the count left would make two answers
        # differ that must not (another tenant's job answers exactly as a missing one, headers included).
        status, answered = 0, 0

        async def send_noting_status(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                answered += len(message.get("body", b""))
            await send(message)

        counters = [c for c, counts in ((self._in_flight, read), (self._heavy_in_flight, heavy)) if counts]
        for counter in counters:
            counter[slot] = counter.get(slot, 0) + 1
        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            for counter in counters:
                if (left := counter[slot] - 1) > 0:
                    counter[slot] = left
                else:
                    del counter[slot]
            self._learn(scope, who, address, status, report is not None)
            if extra := answered // ANSWER_BYTES_PER_UNIT:  # paid after: the next requests wait for it
                for buckets, key, _ in charged:
                    buckets.take(key, extra)

    def _learn(self, scope: Scope, who: Hashable, address: Hashable, status: int, report: bool) -> None:
        if status == 401:
            self._failures.take(address, 1)
            return
        tenant = (scope.get("state") or {}).get(_TENANT_NOTE)
        if tenant is not None or (report and 200 <= status < 300):
            if len(self._known) >= _MAX_KEYS:
                self._known.clear()  # relearned on each one's next request; meanwhile limited per token only
            self._known[who] = tenant

    async def _refuse(self, scope: Scope, send: Send, wait_s: float, what: str, *, limit: Rate | None = None) -> None:
        paused = self.clock()
        await self.sleep(min(wait_s, TARPIT_S))
        seconds = max(1, math.ceil(min(wait_s - (self.clock() - paused), 3600)))
        headers = {"Retry-After": str(seconds)}
        if limit is not None:
            headers |= {"RateLimit-Limit": str(int(limit.burst)), "RateLimit-Remaining": "0"}
        response = errors.error_response(429, f"too many requests: {what}; retry after {seconds} s",
                                         headers=headers)

        async def nothing() -> Message:
            return {"type": "http.disconnect"}

        await response(scope, nothing, send)
