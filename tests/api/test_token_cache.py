"""The token cache: a busy token is never looked up by a burst of requests, and never outlives its `ttl_s`."""

from __future__ import annotations

import asyncio

from kembed_api.auth.cache import TtlCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Directory:
    """Stands in for the database: what a token resolves to now, and how often it was asked."""

    def __init__(self, answer: str | None = "tenant-a") -> None:
        self.answer, self.lookups = answer, 0
        self.release = asyncio.Event()
        self.release.set()

    async def look_up(self) -> str | None:
        self.lookups += 1
        await self.release.wait()
        return self.answer


async def let_lookups_run() -> None:
    for _ in range(5):  # a few turns of the event loop: a lookup's task starts, awaits, stores its answer
        await asyncio.sleep(0)


def test_callers_arriving_during_a_lookup_share_it():
    async def scenario():
        cache, directory = TtlCache(ttl_s=5, clock=Clock()), Directory()
        directory.release.clear()
        callers = [asyncio.ensure_future(cache.resolve("t", directory.look_up)) for _ in range(50)]
        await asyncio.sleep(0)
        directory.release.set()
        assert await asyncio.gather(*callers) == ["tenant-a"] * 50
        assert directory.lookups == 1

    asyncio.run(scenario())


def test_a_busy_token_is_refreshed_ahead_of_expiry_while_callers_are_answered_from_the_cache():
    async def scenario():
        clock = Clock()
        cache, directory = TtlCache(ttl_s=5, clock=clock), Directory()
        assert await cache.resolve("t", directory.look_up) == "tenant-a"
        clock.now = 3.0  # past half its time: one refresh starts, nobody waits for it
        directory.release.clear()
        assert [await cache.resolve("t", directory.look_up) for _ in range(20)] == ["tenant-a"] * 20
        await let_lookups_run()
        assert [await cache.resolve("t", directory.look_up) for _ in range(20)] == ["tenant-a"] * 20
        assert directory.lookups == 2
        directory.answer = "tenant-b"
        directory.release.set()
        await let_lookups_run()
        clock.now = 7.0  # past the first entry's expiry: the refreshed one answers, with no lookup
        assert await cache.resolve("t", directory.look_up) == "tenant-b"
        assert directory.lookups == 2

    asyncio.run(scenario())


def test_a_token_revoked_elsewhere_stops_resolving_within_ttl():
    async def scenario():
        clock = Clock()
        cache, directory = TtlCache(ttl_s=5, clock=clock), Directory()
        await cache.resolve("t", directory.look_up)
        directory.answer = None  # revoked through another replica
        clock.now = 3.0
        assert await cache.resolve("t", directory.look_up) == "tenant-a"  # within ttl: may still answer
        await let_lookups_run()  # the refresh ahead finds it revoked
        assert await cache.resolve("t", directory.look_up) is None
        clock.now = 5.0
        assert await cache.resolve("t", directory.look_up) is None

    asyncio.run(scenario())


def test_an_idle_token_expires_and_a_lookup_begun_before_clear_is_not_remembered():
    async def scenario():
        clock = Clock()
        cache, directory = TtlCache(ttl_s=5, clock=clock), Directory()
        await cache.resolve("t", directory.look_up)
        clock.now = 5.0
        directory.answer = "tenant-b"
        assert await cache.resolve("t", directory.look_up) == "tenant-b"  # expired: looked up, waited for

        directory.release.clear()
        directory.answer = "before-revocation"
        caller = asyncio.ensure_future(cache.resolve("u", directory.look_up))
        await let_lookups_run()
        cache.clear()  # e.g. a token revoked through this replica while the lookup was under way
        directory.release.set()
        assert await caller == "before-revocation"
        directory.answer = "after-revocation"
        assert await cache.resolve("u", directory.look_up) == "after-revocation"

    asyncio.run(scenario())
