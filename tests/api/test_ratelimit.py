"""The rate limiter alone: token buckets on an injected clock (nothing sleeps), and the middleware in front of a
stand-in app whose tokens belong to tenants as the auth dependency would say."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kembed_api.auth import ratelimit
from kembed_api.auth.ratelimit import Buckets, Limits, Rate, RateLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:  # what the limiter pauses before a 429, noted, not waited
        self.slept.append(seconds)


def test_a_bucket_spends_its_burst_then_refills_at_its_rate():
    clock = Clock()
    buckets = Buckets(Rate(per_s=2, burst=10), clock=clock)
    for _ in range(10):
        assert buckets.wait_s("a", 1) == 0
        buckets.take("a", 1)
    assert buckets.wait_s("a", 1) == pytest.approx(0.5)
    assert buckets.wait_s("b", 1) == 0  # another key has its own bucket
    clock.now += 0.5
    assert buckets.wait_s("a", 1) == 0
    clock.now += 3600
    assert buckets.level("a") == 10  # never more than the burst


def test_a_cost_above_the_burst_waits_for_a_full_bucket_not_forever():
    clock = Clock()
    buckets = Buckets(Rate(per_s=1, burst=5), clock=clock)
    buckets.take("a", 2)
    assert buckets.wait_s("a", 50) == pytest.approx(2)


TENANT_OF = {"alpha-1": 1, "alpha-2": 1, "beta-1": 2}
RELEASE: asyncio.Event | None = None  # set by the test of heavy requests: what its exports wait for


async def _stand_in(scope, receive, send) -> None:
    """Answers 200 for a known token (noting its tenant, as kembed_api.auth.principal does), 401 otherwise; `/slow` waits
    until released."""
    token = dict(scope["headers"]).get(b"authorization", b"").decode().removeprefix("Bearer ")
    if token not in TENANT_OF:
        status = 401
    else:
        ratelimit.note_tenant(scope, TENANT_OF[token])
        status = 200
        if scope["path"].endswith("/export"):
            await RELEASE.wait()
    await send({"type": "http.response.start", "status": status, "headers": []})
    big = scope["method"] == "GET" and scope["path"] == "/v1/jobs" and status == 200
    size = 3 * ratelimit.ANSWER_BYTES_PER_UNIT if big else 2
    await send({"type": "http.response.body", "body": b" " * size})


def _client(clock: Clock, **overrides) -> httpx.AsyncClient:
    limits = dict(token=Rate(1, 5), tenant=Rate(1, 8), report=Rate(1, 3), auth_failures=Rate(0.1, 3),
                  heavy_in_flight=2, in_flight=3, max_body_bytes=2**20)
    app = RateLimits(_stand_in, limits=Limits(**{**limits, **overrides}), clock=clock, sleep=clock.sleep)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.1", 1234)),
                             base_url="http://kembed")


async def _get(client: httpx.AsyncClient, token: str, path: str = "/v1/usage") -> httpx.Response:
    return await client.get(path, headers={"Authorization": f"Bearer {token}"})


def test_a_flooding_token_gets_429_with_retry_after_while_another_tenant_goes_on():
    async def run() -> None:
        clock = Clock()
        async with _client(clock) as client:
            answers = [await _get(client, "alpha-1") for _ in range(7)]
            assert [a.status_code for a in answers] == [200] * 5 + [429] * 2
            refused = answers[-1]
            assert refused.headers["retry-after"] == "1"
            assert clock.slept == [1.0, 1.0]  # each 429 paused for the wait (a second at most) before it is sent
            assert "this token's requests" in refused.json()["detail"] and refused.json()["errors"] == []
            assert (refused.headers["ratelimit-limit"], refused.headers["ratelimit-remaining"]) == ("5", "0")
            assert (await _get(client, "beta-1")).status_code == 200
            clock.now += 1
            assert (await _get(client, "alpha-1")).status_code == 200

    asyncio.run(run())


def test_a_tenants_tokens_share_its_bucket():
    async def run() -> None:
        clock = Clock()
        async with _client(clock) as client:
            for token in TENANT_OF:  # each token seen once, so its tenant is known; then every bucket refills
                await _get(client, token)
            clock.now += 3600
            statuses = [(await _get(client, token)).status_code for token in ["alpha-1"] * 5 + ["alpha-2"] * 4]
            assert statuses == [200] * 8 + [429]  # the tenant's 8 units, though alpha-2 had 5 of its own
            refused = await _get(client, "alpha-2")
            assert "the tenant's requests" in refused.json()["detail"]
            assert (await _get(client, "beta-1")).status_code == 200

    asyncio.run(run())


def test_failed_sign_ins_are_bounded_per_address_and_working_tokens_go_on():
    async def run() -> None:
        clock = Clock()
        async with _client(clock, token=Rate(100, 100), tenant=Rate(100, 100)) as client:
            assert (await _get(client, "alpha-1")).status_code == 200  # a token known to work
            statuses = [(await _get(client, f"guess-{i}")).status_code for i in range(5)]
            assert statuses == [401, 401, 401, 429, 429]
            refused = await _get(client, "guess-x")
            assert refused.headers["retry-after"] == "10" and "failed sign-ins" in refused.json()["detail"]
            assert (await _get(client, "alpha-1")).status_code == 200
            assert (await _get(client, "beta-1")).status_code == 429  # not yet seen to work from anywhere
            clock.now += 10
            assert (await _get(client, "beta-1")).status_code == 200

    asyncio.run(run())


def test_a_tenants_heavy_requests_in_flight_are_capped():
    async def run() -> None:
        global RELEASE
        RELEASE = asyncio.Event()
        async with _client(Clock(), token=Rate(100, 100), tenant=Rate(100, 100)) as client:
            await _get(client, "alpha-1")
            await _get(client, "alpha-2")
            exports = [asyncio.create_task(_get(client, "alpha-1", "/v1/jobs/j/export")) for _ in range(2)]
            await asyncio.sleep(0.05)
            refused = await _get(client, "alpha-2", "/v1/jobs/j/export")  # another token, the same tenant
            assert refused.status_code == 429 and "heavy requests in flight" in refused.json()["detail"]
            assert (await _get(client, "alpha-2")).status_code == 200  # light requests are not capped
            RELEASE.set()
            assert [e.status_code for e in await asyncio.gather(*exports)] == [200, 200]
            assert (await _get(client, "alpha-2", "/v1/jobs/j/export")).status_code == 200

    asyncio.run(run())


def test_reports_are_limited_per_job_and_a_large_body_costs_more():
    async def run() -> None:
        async with _client(Clock()) as client:
            statuses = [(await client.post("/v1/jobs/j-1/reports", content=b"{}")).status_code for _ in range(4)]
            assert statuses[-1] == 429  # 3 a job (the stand-in answers 401 to these: no report token)
        clock = Clock()
        async with _client(clock, auth_failures=Rate(100, 100)) as client:
            big = b"x" * (3 * ratelimit.BODY_BYTES_PER_UNIT)  # 1 + 3 units of the token's 5
            headers = {"Authorization": "Bearer alpha-1"}
            assert (await client.post("/v1/jobs", content=big, headers=headers)).status_code == 200
            assert (await client.post("/v1/jobs", content=big, headers=headers)).status_code == 429
            # A body past the body limit is refused unread (413, by the body guard): it costs one unit.
            declared = {**headers, "Content-Length": str(2**21 + 1)}
            clock.now += 4
            assert (await client.post("/v1/jobs", content=b"{}", headers=declared)).status_code != 429
            assert [(await _get(client, "alpha-1")).status_code for _ in range(5)] == [200] * 4 + [429]

    asyncio.run(run())


def test_a_large_answer_is_paid_for_after_it_is_sent():
    async def run() -> None:
        clock = Clock()
        async with _client(clock) as client:
            assert (await _get(client, "alpha-1", "/v1/jobs")).status_code == 200  # 1 unit, then 3 for the answer
            assert (await _get(client, "alpha-1")).status_code == 200
            refused = await _get(client, "alpha-1")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            clock.now += 1
            assert (await _get(client, "alpha-1")).status_code == 200

    asyncio.run(run())


def test_the_client_waits_out_a_rate_limit_and_shows_a_full_queue():
    from kembed_api.cli.client import ApiError, Client

    answers = iter([httpx.Response(429, headers={"Retry-After": "2"}, json={"detail": "too many requests"}),
                    httpx.Response(200, json={"items": []}),
                    httpx.Response(429, json={"detail": "the queue is full"})])
    slept: list[float] = []
    client = Client("http://kembed", sleep=slept.append)
    client._http = httpx.Client(base_url="http://kembed", transport=httpx.MockTransport(lambda _: next(answers)))
    assert client.jobs() == {"items": []} and slept == [2]
    with pytest.raises(ApiError, match="queue is full"):
        client.jobs()


def test_a_tenants_reads_in_flight_are_capped_whatever_their_kind():
    async def run() -> None:
        global RELEASE
        RELEASE = asyncio.Event()
        async with _client(Clock(), token=Rate(100, 100), tenant=Rate(100, 100), heavy_in_flight=10) as client:
            await _get(client, "alpha-1")
            slow = [asyncio.create_task(_get(client, "alpha-1", "/v1/jobs/j/export")) for _ in range(3)]
            await asyncio.sleep(0.05)
            refused = await _get(client, "alpha-1")  # a light one, but the tenant has 3 under way
            assert refused.status_code == 429 and "reads in flight" in refused.json()["detail"]
            assert (await _get(client, "beta-1")).status_code == 200
            RELEASE.set()
            await asyncio.gather(*slow)
            assert (await _get(client, "alpha-1")).status_code == 200

    asyncio.run(run())
