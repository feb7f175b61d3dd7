"""Database engine, sessions and the declarative base; migrations are Alembic's (kembed_api/migrations/)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, AsyncExitStack, contextmanager, nullcontext
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, DateTime, Engine, create_engine, event, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

from kembed_api.platform.pg_reads import DriverReads

__all__ = ["MIGRATIONS", "Base", "Database", "Executor", "UTCDateTime", "utcnow", "upgrade_to_head"]

# Alembic's scripts: beside the package's domains, since they import every domain's tables.
MIGRATIONS = Path(__file__).parents[1] / "migrations"

T = TypeVar("T")

# What read-only service functions take: an ORM Session, the bare Connection of `Database.read` on SQLite, or its
# stand-in on PostgreSQL (kembed_api.platform.pg_reads); all execute Core statements alike.
Executor = Session | Connection | DriverReads


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite would otherwise hand back naive ones)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to the database; use kembed_api.platform.db.utcnow()")
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value


class Base(DeclarativeBase):
    pass


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    # We emit BEGIN ourselves (see _sqlite_begin), so the driver must not.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    # WAL lets the dispatcher write while HTTP handlers read; busy_timeout turns lock contention into waiting.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(connection) -> None:
    # A deferred transaction that reads and then writes fails with "database is locked" when another writer
    # committed in between; writers therefore take the write lock up front (BEGIN IMMEDIATE) and wait for it.
    immediate = connection.get_execution_options().get("kembed_write", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class _SqliteWriterLock:
    """One SQLite writer at a time across threads and processes, handed over at once.

    SQLite itself lets one writer in at a time, but a writer that finds the file locked sleeps in SQLite's busy
    handler (up to 100 ms a try) instead of being woken when the lock is free. Writers therefore queue here
    first: on a lock of this process, then on an exclusive `flock` of a file beside the database, which the
    kernel hands to the next process the moment it is released (API worker processes, a CLI, a migration).
    """

    def __init__(self, database_path: str) -> None:
        self._threads = threading.Lock()
        self._fd = os.open(f"{database_path}.writer-lock", os.O_RDWR | os.O_CREAT, 0o600)

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # waits without the GIL
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, *_) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def close(self) -> None:
        os.close(self._fd)


# Held by a dispatcher pass (so that two API replicas on one PostgreSQL never admit at the same time) and by the
# start-up bootstrap (so that replicas starting together create the default tenant once).
_REPLICAS_LOCK_KEY = 0x6B656D62  # "kemb"


class Database:
    """One engine and session factories per process; `processes`: the server's worker processes, which share
    its PostgreSQL connections."""

    def __init__(self, url: str, *, processes: int = 1) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self._write_lock: AbstractContextManager = nullcontext()
        if self.is_sqlite:
            path = url.split("///", 1)[-1]
            on_disk = bool(path) and path != ":memory:"
            if on_disk:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.engine: Engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                                                pool_size=20, max_overflow=40)
            event.listen(self.engine, "connect", _sqlite_pragmas)
            event.listen(self.engine, "begin", _sqlite_begin)
            # SQLite has one writer at a time: writers queue on a lock that hands over at once (the busy
            # timeout is left for writers that do not take it, such as Alembic's migrations).
            self._write_lock = _SqliteWriterLock(path) if on_disk else threading.Lock()
        else:
            # Two pools per server, at most 50 connections (PostgreSQL's default max_connections is 100: two
            # replicas), shared out among its worker processes (each takes its part of the requests). The sync
            # one serves writers and sync routes (FastAPI runs those on up to 40 threads, each holding at most
            # one connection at a time); the async one serves polled reads (`read`) through the driver's asyncio
            # side, without a transaction: under READ COMMITTED each statement reads at its own moment anyway,
            # and BEGIN and COMMIT would be two more round trips. Each pool keeps what a burst needs: a
            # connection opened per request (a PostgreSQL backend process each) costs more than the read.
            # The pools hand out the connection used last (LIFO): a steady load keeps reusing the few it needs,
            # whose statements PostgreSQL has prepared, and the others only serve bursts. The read pool is opened
            # whole at start (`open_read_pool`): a poll that has to open a connection waits for a new backend
            # process and prepares its statements anew, the slowest reads a replica answered.
            def part(connections: int) -> int:
                return max(2, -(-connections // processes))

            self.engine = create_engine(url, pool_size=part(10), max_overflow=part(15), pool_pre_ping=True,
                                        pool_use_lifo=True)
            self._read_engine = create_async_engine(url, pool_size=part(20), max_overflow=part(5),
                                                    pool_use_lifo=True, isolation_level="AUTOCOMMIT")
            self._read_statements: dict = {}  # compiled once each, for DriverReads
        self._write_engine = self.engine.execution_options(kembed_write=True)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = sessionmaker(self._write_engine, expire_on_commit=False)

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A unit of work: committed when the block ends normally, rolled back on error.

        `write=True` for a unit that reads and then writes: on SQLite it holds the write lock from the start.
        """
        sessions = self._write_sessions if write else self._sessions
        with self._write_lock if write else nullcontext(), sessions() as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    @contextmanager
    def write_transaction(self) -> Iterator[Connection]:
        """A unit of work that reads and then writes with Core statements only (the intake's batches): as
        `session(write=True)`, on a bare Connection, without the ORM Session's bookkeeping (a fifth of a batch's
        CPU). Committed when the block ends normally, rolled back on error."""
        with self._write_lock, self._write_engine.begin() as connection:
            yield connection

    async def read(self, work: Callable[[Connection | DriverReads], T]) -> T:
        """`work(connection)` read-only, for the `async` routes clients poll; no worker thread, no ORM session.

        SQLite runs inside this process: such a read is a few hundred microseconds of CPU and never waits for a
        writer (WAL), less than a trip to a worker thread and back costs in CPU and context switches, so it runs
        right here on the event loop (in one transaction: one snapshot for all its statements). PostgreSQL is
        read through the async driver, so waiting for the server holds up no one, on its cursor (DriverReads:
        SQLAlchemy's execution layers cost more CPU than the read). A bare Connection on SQLite: the ORM
        Session's bookkeeping cost a third of a poll's database work, for Core statements that need none of it.
        """
        if self.is_sqlite:
            with self.engine.connect() as connection, connection.begin():
                return work(connection)
        try:
            return await self._read_through_driver(work)
        except DBAPIError as error:
            # No ping before each read (a round trip per poll): a connection the server dropped (a restart, a
            # failover) fails its first statement instead, which invalidates the pool, and a read is safe to
            # run again on a fresh connection.
            if not error.connection_invalidated:
                raise
            return await self._read_through_driver(work)

    async def open_read_pool(self) -> None:
        """Open every connection the read pool keeps (PostgreSQL; SQLite reads in this process)."""
        if self.is_sqlite:
            return
        async with AsyncExitStack() as stack:
            await asyncio.gather(*(stack.enter_async_context(self._read_engine.connect())
                                   for _ in range(self._read_engine.pool.size())))

    async def _read_through_driver(self, work: Callable[[DriverReads], T]) -> T:
        async with self._read_engine.connect() as connection:
            return await connection.run_sync(lambda sync: work(DriverReads(sync, self._read_statements)))

    def lock_across_replicas(self, session: Session) -> None:
        """Serialise this transaction with every other one holding this lock, in any process (PostgreSQL's
        advisory lock, released at commit; SQLite's write transaction already does it within its file)."""
        if not self.is_sqlite:
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _REPLICAS_LOCK_KEY})

    def dispose(self) -> None:
        """Close the connections (`aclose` inside an event loop, where the async reads' connections live)."""
        self._close_write_lock()
        self.engine.dispose()
        if not self.is_sqlite:
            self._read_engine.sync_engine.dispose(close=False)  # closing needs their event loop

    async def aclose(self) -> None:
        if not self.is_sqlite:
            await self._read_engine.dispose()
        self._close_write_lock()
        self.engine.dispose()

    def _close_write_lock(self) -> None:
        if isinstance(self._write_lock, _SqliteWriterLock):
            self._write_lock.close()
            self._write_lock = threading.Lock()  # a late writer still gets one at a time within this process


def upgrade_to_head(database_url: str) -> None:
    """The prestart step: bring the schema to the newest migration (idempotent)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    command.upgrade(config, "head")
