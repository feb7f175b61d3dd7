"""Polled reads on PostgreSQL, run straight on the driver's cursor.

A poll of a job is one short statement, and SQLAlchemy's Core execution and result layers cost the API more CPU
than the statement itself (docs/benchmarks.md, API load). `DriverReads` stands in for the Connection that read functions take
(kembed_api.platform.db.Executor), for what they use of it: `execute(statement, parameters)` and `scalar(...)`, with
results iterated, unpacked, or taken by `one()`, `one_or_none()`, `all()`, `scalar()`, and rows read by column
name. Each statement is compiled once (they are module constants) by SQLAlchemy's own PostgreSQL compiler; one
that binds a list (`in_([...])`, expanded per execution) is refused.

This is safe for reads because psycopg already hands back what SQLAlchemy's result processing would: aware
datetimes for `timestamptz`, parsed JSON, Python numbers and booleans. Statements run as they are (no ORM
entities); errors become SQLAlchemy's DBAPIError, and a connection the server dropped is invalidated, as
SQLAlchemy would do, so that `Database.read` can run the read again on a fresh one.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, MultipleResultsFound, NoResultFound
from sqlalchemy.sql import Executable

__all__ = ["DriverReads", "Rows"]


class Rows:
    """The rows of one statement, with the parts of SQLAlchemy's Result that read functions use."""

    __slots__ = ("_rows",)

    def __init__(self, rows: list[tuple]) -> None:
        self._rows = rows

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._rows)

    def all(self) -> list[tuple]:
        return self._rows

    def one_or_none(self) -> tuple | None:
        if len(self._rows) > 1:
            raise MultipleResultsFound("more than one row where one or none was expected")
        return self._rows[0] if self._rows else None

    def one(self) -> tuple:
        if (row := self.one_or_none()) is None:
            raise NoResultFound("no row where one was expected")
        return row

    def scalar(self) -> Any:
        return self._rows[0][0] if self._rows else None


class _Compiled:
    """One statement as psycopg runs it: its SQL, the values it binds itself, and its row type (from the first
    result's column names)."""

    __slots__ = ("statement", "sql", "bound", "row")

    def __init__(self, statement: Executable, connection: Connection) -> None:
        self.statement = statement  # held, so that the id it is cached under stays its own
        compiled = statement.compile(dialect=connection.dialect)
        self.sql = str(compiled)
        if "POSTCOMPILE" in self.sql:
            raise ValueError(f"DriverReads runs statements as compiled; this one binds a list (an IN): {self.sql}")
        # The values the statement carries itself (`state == 'QUEUED'`); the caller's parameters fill the rest.
        self.bound = {compiled.bind_names[bind]: bind.effective_value
                      for bind in compiled.binds.values() if not bind.required}
        self.row: type | None = None


class DriverReads:
    """A read-only stand-in for a Connection (see the module's text); `statements` is the caller's cache of
    compiled statements (by the statement's id), shared by every read of a Database."""

    def __init__(self, connection: Connection, statements: dict[int, _Compiled]) -> None:
        self._connection, self._statements = connection, statements

    def execute(self, statement: Executable, parameters: Mapping[str, Any] | None = None) -> Rows:
        compiled = self._statements.get(id(statement))
        if compiled is None:
            compiled = self._statements[id(statement)] = _Compiled(statement, self._connection)
        values = {**compiled.bound, **parameters} if parameters else compiled.bound
        dbapi_connection = self._connection.connection.dbapi_connection
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(compiled.sql, values)
            if compiled.row is None:
                compiled.row = namedtuple("Row", [column[0] for column in cursor.description], rename=True)
            return Rows(list(map(compiled.row._make, cursor.fetchall())))
        except self._connection.dialect.loaded_dbapi.Error as error:
            disconnected = self._connection.dialect.is_disconnect(error, dbapi_connection, cursor)
            if disconnected:
                self._connection.invalidate(error)
            raise DBAPIError.instance(compiled.sql, values, error, self._connection.dialect.loaded_dbapi.Error,
                                      connection_invalidated=disconnected, dialect=self._connection.dialect) from error
        finally:
            cursor.close()

    def scalar(self, statement: Executable, parameters: Mapping[str, Any] | None = None) -> Any:
        return self.execute(statement, parameters).scalar()
