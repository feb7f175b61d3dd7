"""A table data set as units: the pieces a rank reads whole (a Parquet row group, a CSV/TSV block of lines).

Listing reads only what sizes the data set: Parquet footers (row counts, columns), and for CSV/TSV one pass that
cuts each file into line-aligned blocks of about `CSV_BLOCK_BYTES` and counts their rows (CSV has no footer; the
pass also finds a malformed file before the first step). Every file is opened through the storage guard, at
listing and again at every read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
from collections.abc import Iterator
from typing import BinaryIO

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from kembed_trainer.storage import Guard

__all__ = ["CSV_BLOCK_BYTES", "Unit", "UnitReader", "line_blocks", "list_units"]

CSV_BLOCK_BYTES = 64 << 20
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "csv"}
_LISTING_THREADS = 8  # footers are small reads; on S3 each is a round trip


@dataclasses.dataclass(frozen=True)
class Unit:
    uri: str  # canonical, checked against the policy when listed
    fmt: str  # parquet, csv or tsv
    part: int  # the row group (Parquet) or the block (CSV/TSV) of the file
    num_rows: int
    byte_range: tuple[int, int] = (0, 0)  # CSV/TSV: the block's bytes
    first_line: int = 0  # CSV/TSV: the file's line number of the block's first row
    column_names: tuple[str, ...] = ()  # CSV/TSV: from the header or `data.columns`

    def where(self, row: int | None = None) -> str:
        """Where a row is, for messages: the file and its row group (and row), or its line."""
        if self.fmt == "parquet":
            return f"{self.uri} row group {self.part}" + ("" if row is None else f" row {row}")
        if row is None:
            return f"{self.uri} lines {self.first_line}..{self.first_line + self.num_rows - 1}"
        return f"{self.uri} line {self.first_line + row}"


def file_format(uri: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = uri.rsplit("/", 1)[-1]
    return _SUFFIXES.get("." + name.rsplit(".", 1)[-1].lower() if "." in name else "", "csv")


def list_units(guard: Guard, uri: str, *, fmt: str, columns: list[str] | None, needed: list[str], where: str,
               csv_types: dict[str, pa.DataType]) -> list[Unit]:
    """Every unit of the files `uri` names, in file order; a file lacking a `needed` column fails here."""
    files = guard.list_files(uri, where=where)

    def units_of(file: str) -> list[Unit]:
        kind = file_format(file, fmt)
        if kind == "parquet":
            return _parquet_units(guard, file, needed, where)
        return _csv_units(guard, file, kind, columns, needed, where, csv_types)

    with concurrent.futures.ThreadPoolExecutor(min(_LISTING_THREADS, len(files))) as pool:
        return [unit for units in pool.map(units_of, files) for unit in units]


def _missing(columns: list[str], needed: list[str], file: str, where: str) -> None:
    absent = [c for c in needed if c not in columns]
    if absent:
        # Names the configured columns only, never the file's own header (its contents).
        raise ValueError(f"{where}: {file} has no column {absent[0]!r}")


def _parquet_units(guard: Guard, file: str, needed: list[str], where: str) -> list[Unit]:
    with guard.open(file, "rb", where=where) as f:
        try:
            meta = pq.ParquetFile(f).metadata
        except (pa.ArrowException, ValueError, OSError) as error:
            raise ValueError(f"{where}: {file} is not a readable parquet file ({type(error).__name__})") from None
        _missing(meta.schema.to_arrow_schema().names, needed, file, where)
        return [Unit(file, "parquet", i, meta.row_group(i).num_rows) for i in range(meta.num_row_groups)
                if meta.row_group(i).num_rows > 0]


def _csv_units(guard: Guard, file: str, fmt: str, columns: list[str] | None, needed: list[str], where: str,
               csv_types: dict[str, pa.DataType]) -> list[Unit]:
    units: list[Unit] = []
    with guard.open(file, "rb", where=where) as f:
        line, names = 1, columns
        if columns is not None:
            _missing(list(columns), needed, file, where)
        for offset, body in line_blocks(f, CSV_BLOCK_BYTES):
            if names is None:  # the header: the file's first line
                end = body.find(b"\n") + 1 or len(body)
                names = _parse(body[:end], fmt, None, None, file, where, header=True).column_names
                _missing(names, needed, file, where)
                offset, line, body = offset + end, line + 1, body[end:]
            if body.strip():
                rows = _parse(body, fmt, names, csv_types, file, where, lines=line, include=needed).num_rows
                units.append(Unit(file, fmt, len(units), rows, (offset, offset + len(body)), line, tuple(names)))
            line += body.count(b"\n")
    return units


def line_blocks(f: BinaryIO, size: int, *, cut_long_lines: bool = False) -> Iterator[tuple[int, bytes]]:
    """`f` as consecutive blocks (offset, bytes) of about `size` bytes, each ending at a line's end (`\\n`; the last
    block takes the file's unended line). A line longer than a block makes a longer block, or with
    `cut_long_lines` is cut: after its last `\\r` (old line ends), else its last ASCII space, else between two
    UTF-8 characters, so a block is at most twice `size`."""
    offset, carry = 0, b""
    while True:
        block = f.read(size)
        data = carry + block
        if not data:
            return
        if not block:
            yield offset, data
            return
        cut = data.rfind(b"\n") + 1
        if cut == 0 and cut_long_lines and len(data) >= size:
            cut = _long_line_cut(data)
        if cut == 0:  # a line longer than a block: read on
            carry = data
            continue
        yield offset, data[:cut]
        offset, carry = offset + cut, data[cut:]


def _long_line_cut(data: bytes) -> int:
    cut = data.rfind(b"\r") + 1 or max(data.rfind(c) for c in (b" ", b"\t", b"\x0b", b"\x0c")) + 1
    if cut:
        return cut
    for i in range(len(data) - 1, max(len(data) - 5, 0), -1):  # a character starts in its last 4 bytes
        if data[i] & 0xC0 != 0x80:  # not a continuation byte: cut before it
            return i
    return len(data)


def _parse(data: bytes, fmt: str, names, types, file: str, where: str, *, header: bool = False, lines: int = 1,
           include: list[str] | None = None) -> pa.Table:
    """A CSV/TSV block as a table. Errors name the file and lines, never the contents pyarrow's messages quote."""
    read = pa_csv.ReadOptions(column_names=None if header else list(names), use_threads=False)
    parse = pa_csv.ParseOptions(delimiter="\t" if fmt == "tsv" else ",")
    convert = pa_csv.ConvertOptions(column_types=types or {}, include_columns=include or [],
                                    strings_can_be_null=True)
    try:
        return pa_csv.read_csv(io.BytesIO(data), read_options=read, parse_options=parse, convert_options=convert)
    except (pa.ArrowException, ValueError, UnicodeDecodeError) as error:
        first, last = lines, lines + max(data.count(b"\n"), 1) - 1
        raise ValueError(f"{where}: {file} lines {first}..{last} are not readable {fmt} "
                         f"({type(error).__name__}; a column may hold values of another type)") from None


class UnitReader:
    """Reads units' columns; keeps the last Parquet file open, as consecutive units often share it."""

    def __init__(self, guard: Guard, *, columns: list[str], csv_types: dict[str, pa.DataType], where: str) -> None:
        self.guard, self.columns, self.csv_types, self.where = guard, columns, csv_types, where
        self._open: tuple[str, object, pq.ParquetFile] | None = None

    def read(self, unit: Unit) -> pa.Table:
        if unit.fmt == "parquet":
            try:
                return self._parquet(unit.uri).read_row_group(unit.part, columns=self.columns)
            except (pa.ArrowException, ValueError, OSError) as error:
                raise ValueError(f"{self.where}: {unit.where()} is not readable ({type(error).__name__})") from None
        start, end = unit.byte_range
        with self.guard.open(unit.uri, "rb", where=self.where) as f:
            f.seek(start)
            data = f.read(end - start)
        table = _parse(data, unit.fmt, unit.column_names, self.csv_types, unit.uri, self.where,
                       lines=unit.first_line, include=self.columns)
        if table.num_rows != unit.num_rows:
            raise ValueError(f"{self.where}: {unit.where()} changed while the job ran")
        return table

    def _parquet(self, uri: str) -> pq.ParquetFile:
        if self._open is None or self._open[0] != uri:
            self.close()
            f = self.guard.open(uri, "rb", where=self.where)  # checked again: the file may have changed
            self._open = (uri, f, pq.ParquetFile(f, pre_buffer=True))
        return self._open[2]

    def close(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
