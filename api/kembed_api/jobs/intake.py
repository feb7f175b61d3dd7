"""Group commit of submissions: one writer thread stores what arrived meanwhile in one transaction.

A submission answered one transaction at a time costs its own BEGIN, tenant read, queue count, two inserts and
COMMIT, plus a worker-thread trip, and on SQLite every writer waits for the one write lock anyway. Here the
route hands the validated spec to the writer and awaits the outcome; the writer takes everything queued since
its last commit (up to `max_batch`) and stores it with `kembed_api.jobs.submissions.submit_many`, a few statements for the whole
batch. A lone submission is stored at once; under load, a submission waits at most for the commit before its
own. An answer is only given after its commit, so a 201 always means the job is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError

from kembed_api.jobs.errors import CannotRun
from kembed_api.jobs.schemas import JobRead
from kembed_api.jobs.submissions import Outcome, Submission, submit_many
from kembed_api.platform.db import Database
from kembed_api.platform.storage import PlatformStorage
from kembed_contract.spec import JobSpec

__all__ = ["Intake"]

log = logging.getLogger(__name__)

# Tries of a submission stored alone after its batch failed on a unique constraint: job ids are random, so a
# second clash in a row is as good as impossible.
_ALONE_TRIES = 3


@dataclass
class _Waiting:
    submission: Submission
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class Intake:
    def __init__(self, db: Database, *, storage: PlatformStorage, check_fits: Callable[[JobSpec], None],
                 max_batch: int = 256, priority_classes: dict[str, int] | None = None) -> None:
        """`check_fits` raises ValueError when the backend could never run the job (the backend's check);
        `storage` is the platform's side of the tenants' storage policies."""
        self.db, self.storage, self.check_fits, self.max_batch = db, storage, check_fits, max_batch
        self.priority_classes = priority_classes or {}
        self._arrivals: queue.SimpleQueue[_Waiting | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kembed-intake", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Store what has arrived, then stop."""
        self._arrivals.put(None)
        self._thread.join()

    async def submit(self, submission: Submission) -> tuple[JobRead, bool]:
        """(the job's answer, created); raises CannotRun or QueueFull."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._arrivals.put(_Waiting(submission, future, loop))
        return await future

    # ------------------------------------------------------------------------------------------- writer thread
    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._arrivals.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    waiting = self._arrivals.get_nowait()
                except queue.Empty:
                    break
                if waiting is None:
                    stopping = True
                    break
                batch.append(waiting)
            self._answer(batch, self._store_batch([w.submission for w in batch]))

    def _store_batch(self, submissions: list[Submission]) -> list[Outcome | Exception]:
        checked: list[Submission] = []
        refused: dict[int, Exception] = {}
        for i, submission in enumerate(submissions):
            try:
                self.check_fits(submission.spec)
                checked.append(submission)
            except ValueError as error:
                refused[i] = CannotRun(str(error))
        try:
            stored = iter(self._store(checked)) if checked else iter(())
        except IntegrityError:
            # A random id was taken, or a request with the same Idempotency-Key committed first on another
            # replica: each alone, so that one clash does not fail the others.
            stored = iter([self._store_alone(s) for s in checked])
        except Exception as error:  # the database is down, say: every request of the batch gets the error
            log.exception("storing %d submissions failed", len(checked))
            stored = iter([error] * len(checked))
        return [refused[i] if i in refused else next(stored) for i in range(len(submissions))]

    def _store(self, submissions: list[Submission]) -> list[Outcome]:
        with self.db.write_transaction() as connection:
            return submit_many(connection, submissions, storage=self.storage,
                                       priority_classes=self.priority_classes)

    def _store_alone(self, submission: Submission) -> Outcome | Exception:
        clash: Exception | None = None
        for _ in range(_ALONE_TRIES):
            try:
                return self._store([submission])[0]
            except IntegrityError as error:
                clash = error
            except Exception as error:
                return error
        return clash

    @staticmethod
    def _answer(batch: list[_Waiting], outcomes: list[Outcome | Exception]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, object]]] = {}
        for waiting, outcome in zip(batch, outcomes, strict=True):
            by_loop.setdefault(waiting.loop, []).append((waiting.future, outcome))
        for loop, answers in by_loop.items():  # one wake-up of each event loop per batch
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these answers any more
                loop.call_soon_threadsafe(_settle, answers)


def _settle(answers: list[tuple[asyncio.Future, object]]) -> None:
    for future, outcome in answers:
        if future.cancelled():  # the client went away; the job is stored all the same, as a retry will find
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
