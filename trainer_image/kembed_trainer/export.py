"""A checkpoint's embeddings in the formats other tools load, and nearest neighbours, read offline.

Reads one complete `step-N/` folder with DCP in a single process (no process group): a table sharded row-wise
over any number of ranks reads as one, as DCP reads every rank's rows by their place in the table. What each row
stands for comes from the checkpoint's own row index (`row_index.py`). A delta (an incremental checkpoint) is read
through its chain: the table from the chain's full checkpoint (which holds the row index too), then each delta's
changed rows on it, in order.

A table is never whole in memory (a tiered table is larger than its trainers' memory, and can be larger than
this process's): `saved_table.SavedTable` reads it a range of rows at a time, and every format and the
neighbours search go through it range by range, so the peak memory is a range's, not the table's.

Formats (`FORMATS`):
- `parquet`: one row per word or id: `token` (a vocabulary's words), `id` (int64, plain tables) or `feature`,
  `id` (text) and `row` (hashed tables: one row per raw id seen in training; dynamic tables: one per row that
  holds an id, the raw id beside its vector, its text from the id index where the data had text, `feature`
  empty where the index has no entry for it), then `vector` (fixed-size list of float32); a row group per range.
- `numpy`: a `.npy` matrix, row i = table row i (the vocabulary's rows for a model with a vocabulary).
- those a model kind adds (`kembed_contract.kinds.EXPORT_FORMATS`), written by its trainer half's `writers`, for
  any job's tables.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, overload

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kembed_contract import kinds, runtime
from kembed_trainer import dcp_read, delta, dynamic, embedding, row_index, saved_table
from kembed_trainer import kinds as trainer_kinds
from kembed_trainer.data.table import hash_string

__all__ = ["FORMATS", "SUFFIXES", "ExportError", "TableRows", "neighbours", "read_table", "write"]

FORMATS = tuple(kinds.EXPORT_FORMATS)
SUFFIXES = kinds.EXPORT_FORMATS


class ExportError(ValueError):
    """The checkpoint lacks what was asked for (a table, a word, its row index)."""


class _IdTexts(Sequence[str]):
    """The keys of a table whose raw id i is row i: id i as text, made when asked (a table may have more rows
    than this process can hold strings for)."""

    def __init__(self, num_rows: int) -> None:
        self._ids = range(num_rows)

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [str(i) for i in self._ids[index]]
        return str(self._ids[index])


@dataclass
class TableRows:
    """One table's vectors and what its rows stand for. The vectors are read a range at a time (`chunks`,
    `vectors_of`); `close` (or `with`) gives back the scratch space a delta chain's table may take."""

    name: str
    meaning: str  # words | ids | hashed_ids | dynamic_ids (row_index.rows_meaning)
    vectors: saved_table.SavedTable  # the vocabulary's rows for words, else every row
    keys: Sequence[str]  # one per entry: the word, the id, or the raw id (hashed, dynamic)
    rows: Sequence[int]  # the row of each key: range(len(keys)) but for hashed and dynamic ids
    features: list[str] | None  # hashed, dynamic: each key's feature
    bias_column: bool  # the last coordinate is a per-id bias, not a factor (ModelKind.bias_column)

    def chunks(self) -> Iterator[tuple[int, int]]:
        """The entries [start, stop) a range at a time: the table's own ranges where entry i is row i."""
        if isinstance(self.rows, range):
            return self.vectors.ranges()
        step = self.vectors.chunk_rows
        return ((start, min(start + step, len(self.rows))) for start in range(0, len(self.rows), step))

    def vectors_of(self, start: int, stop: int) -> np.ndarray:
        """The vectors of entries `start`.. `stop`, [stop - start, dim] float32."""
        if isinstance(self.rows, range):  # entry i is row i
            return self.vectors.read(start, stop)
        return self.vectors.take(np.asarray(self.rows[start:stop], dtype=np.int64))

    def close(self) -> None:
        self.vectors.close()

    def __enter__(self) -> TableRows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_manifest(step_uri: str) -> dict[str, Any]:
    try:
        with fsspec.open(f"{step_uri.rstrip('/')}/{row_index.TABLES_FILE}", "r", encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{step_uri} has no {row_index.TABLES_FILE}: it was written before checkpoints "
                          "recorded what their rows stand for") from None


def default_table(manifest: dict[str, Any]) -> str:
    """The table the checkpoint's model kind names (a vocabulary's word vectors), else the first."""
    kind = kinds.MODELS.get(manifest["model"], kinds.base.ModelKind)
    return kind.default_table(manifest["tables"])


def chain_uris(step_uri: str) -> list[str]:
    """The folders that make up the checkpoint at `step_uri`, its full checkpoint first (itself when full)."""
    fs, path = fsspec.core.url_to_fs(step_uri)
    root, _, name = path.rstrip("/").rpartition("/")
    scheme = step_uri.split("://", 1)[0] if "://" in step_uri else "file"
    chain: list[str] = []
    step = runtime.step_of_dir(name)
    while True:
        folder = f"{root}/{runtime.step_dir(step)}" if step is not None else path.rstrip("/")
        chain.append(f"{scheme}://{folder}")
        if step is None:  # a folder not named step-N (copied elsewhere): read as a full checkpoint
            return chain[::-1]
        try:
            marker = runtime.CheckpointMarker.parse(step, fs.cat_file(f"{folder}/{runtime.CHECKPOINT_MARKER}"))
        except FileNotFoundError:
            if len(chain) == 1:  # the folder asked for: read as it is (DCP says what is missing)
                return chain
            raise ExportError(f"{step_uri} is a delta whose chain is broken: {folder} is not complete") from None
        if marker.kind == runtime.CHECKPOINT_FULL:
            return chain[::-1]
        step = marker.parent if marker.parent is not None and marker.parent >= 0 else None
        if step is None:
            raise ExportError(f"{step_uri} is a delta whose chain is broken") from None


def read_table(step_uri: str, table: str | None = None) -> TableRows:
    chain = chain_uris(step_uri.rstrip("/"))
    step_uri = chain[0]  # the full checkpoint: the row index and the table before the deltas
    manifest = read_manifest(step_uri)
    name = table or default_table(manifest)
    spec = next((t for t in manifest["tables"] if t["name"] == name), None)
    if spec is None:
        raise ExportError(f"table: not in this checkpoint (its tables: {[t['name'] for t in manifest['tables']]})")
    readers = [dcp_read.RowRanges(uri) for uri in chain]
    key = saved_table.weight_key(name)
    if readers[0].shape(key) is None:
        raise ExportError(f"table {name!r}: no {key} in {step_uri}")
    meaning = spec["rows"]
    features = None
    if meaning == "words":
        keys: Sequence[str] = list(manifest["vocabulary"])
        vectors = saved_table.SavedTable(readers, name, num_rows=len(keys))
        rows: Sequence[int] = range(vectors.num_rows)
        keys = keys[: vectors.num_rows]
    elif meaning == "ids":
        vectors = saved_table.SavedTable(readers, name)
        keys, rows = _IdTexts(vectors.num_rows), range(vectors.num_rows)
    elif meaning == "dynamic_ids":
        vectors = saved_table.SavedTable(readers, name)
        keys, rows, features = _dynamic_keys(chain, readers, name)
    else:
        ids = _read_ids(chain, name)
        vectors = saved_table.SavedTable(readers, name)
        keys, rows, features = ids["id"].to_pylist(), ids["row"].to_numpy(), ids["feature"].to_pylist()
    return TableRows(name, meaning, vectors, keys, rows, features, bool(manifest.get("bias_column")))


def _read_ids(chain: list[str], table: str) -> pa.Table:
    """The id index of `table` over a checkpoint's chain (a delta's files hold the ids read since the save
    before it)."""
    parts = []
    for step_uri in chain:
        fs, root = fsspec.core.url_to_fs(step_uri)
        for path in sorted(fs.glob(f"{root}/{row_index.IDS_DIR}/{table}.rank-*.parquet")):
            with fs.open(path, "rb") as f:
                parts.append(pq.read_table(f))
    if not parts:
        raise ExportError(f"table {table!r}: no ids files in {chain[-1]}")
    ids = pa.concat_tables(parts, promote_options="default")  # an older index may lack the hash column
    # Ranks that saw the same id wrote it each: keep one (feature, id) pair.
    kept = ["row", "hash"] if "hash" in ids.column_names else ["row"]  # older indexes kept no hashes
    frame = ids.group_by(["feature", "id"]).aggregate([(c, "min") for c in kept]).rename_columns(
        ["feature", "id", *kept])
    return frame.sort_by([("feature", "ascending"), ("id", "ascending")])


def dynamic_ids(readers: Sequence[dcp_read.RowRanges], table: str) -> np.ndarray:
    """A dynamic table's `ids` field (each row's raw id, or a marker: `kembed_trainer.dynamic`) after the
    chain's deltas; 8 bytes a row, read whole."""
    key = f"{delta.TABLES_KEY}.{table}.ids"
    shape = readers[0].shape(key)
    if shape is None:
        raise ExportError(f"table {table!r}: no {key} in its checkpoint")
    ids = readers[0].read(key, 0, shape[0]).numpy().copy()
    for reader in readers[1:]:
        for rows_key, ids_key in delta.changed_rows_keys(reader.saved, table, "ids"):
            count = reader.shape(rows_key)[0]
            ids[reader.read(rows_key, 0, count).numpy()] = reader.read(ids_key, 0, count).numpy()
    return ids


def _dynamic_keys(chain: list[str], readers: Sequence[dcp_read.RowRanges], table: str
                  ) -> tuple[list[str], np.ndarray, list[str]]:
    """A dynamic table's rows that hold an id: each one's raw id (its text where the id index has it: string ids
    were read as their 63-bit hashes), the row, and the feature it was read for."""
    ids = dynamic_ids(readers, table)
    rows = np.flatnonzero((ids != dynamic.EMPTY) & (ids != dynamic.SHARED))
    texts: dict[int, tuple[str, str]] = {}
    try:
        index = _read_ids(chain, table)
    except ExportError:  # data without an id index (synthetic): the ids are the int64s themselves
        index = None
    if index is not None and "hash" in index.column_names:
        texts = dict(zip(index["hash"].to_pylist(), zip(index["feature"].to_pylist(), index["id"].to_pylist(),
                                                        strict=True), strict=True))
    named = [texts.get(raw, ("", str(raw))) for raw in ids[rows].tolist()]
    return [text for _, text in named], rows, [feature for feature, _ in named]


# ----------------------------------------------------------------------------------------------- writing
def write(rows: TableRows, fmt: str, out: IO[bytes]) -> None:
    """Write `rows` in format `fmt` to the binary stream `out`, a range of rows at a time."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "numpy":
        _write_numpy(rows, out)
    elif fmt == "parquet":
        _write_parquet(rows, out)
    else:
        trainer_kinds.export_writers()[fmt](rows, out)


def _write_numpy(rows: TableRows, out: IO[bytes]) -> None:
    """What `np.save` writes of the whole matrix: its header, then the rows in order."""
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
              "shape": rows.vectors.shape}
    np.lib.format.write_array_header_1_0(out, header)
    for start, stop in rows.vectors.ranges():
        out.write(rows.vectors.read(start, stop).tobytes())


def _write_parquet(rows: TableRows, out: IO[bytes]) -> None:
    dim = rows.vectors.dim
    if rows.meaning == "words":
        keys = [pa.field("token", pa.string())]
    elif rows.meaning == "ids":
        keys = [pa.field("id", pa.int64())]
    else:
        keys = [pa.field("feature", pa.string()), pa.field("id", pa.string()), pa.field("row", pa.int64())]
    schema = pa.schema([*keys, pa.field("vector", pa.list_(pa.float32(), dim))])
    with pq.ParquetWriter(out, schema) as writer:
        for start, stop in rows.chunks():
            if rows.meaning == "words":
                columns = [pa.array(rows.keys[start:stop], pa.string())]
            elif rows.meaning == "ids":
                columns = [pa.array(np.arange(start, stop, dtype=np.int64))]
            else:
                columns = [pa.array(rows.features[start:stop], pa.string()), pa.array(rows.keys[start:stop], pa.string()),
                           pa.array(np.asarray(rows.rows[start:stop], dtype=np.int64))]
            flat = pa.array(rows.vectors_of(start, stop).reshape(-1))
            vectors = pa.FixedSizeListArray.from_arrays(flat, dim)
            writer.write_table(pa.Table.from_arrays([*columns, vectors], schema=schema))


# ----------------------------------------------------------------------------------------------- neighbours
def _row_of(rows: TableRows, query: str) -> int:
    if rows.meaning == "words":
        try:
            return rows.keys.index(query)
        except ValueError:
            raise ExportError(f"word: not in the vocabulary ({len(rows.keys)} words)") from None
    if rows.meaning == "ids":
        try:
            row = int(query)
        except ValueError:
            raise ExportError(f"word: table {rows.name!r} has integer ids; give one") from None
        if not 0 <= row < rows.vectors.num_rows:
            raise ExportError(f"word: an id of table {rows.name!r} is in [0, {rows.vectors.num_rows})")
        return row
    for key, row in zip(rows.keys, rows.rows, strict=True):
        if key == query:
            return row
    if rows.meaning == "dynamic_ids":
        raise ExportError(f"word: no row of table {rows.name!r} holds that id (not admitted, or evicted)")
    # Not seen in training: it still hashes to a row (as the trainer would look it up).
    try:
        raw = int(query)
    except ValueError:
        raw = hash_string(query)
    return int(embedding.hash_rows(torch.tensor([raw]), rows.vectors.num_rows)[0])


def neighbours(rows: TableRows, query: str, k: int = 10) -> list[tuple[str, float]]:
    """The `k` keys whose vectors are nearest to `query`'s by cosine similarity (itself left out), the table
    scanned a range at a time."""
    target = _row_of(rows, query)
    want = _unit(rows.vectors.take([target]), rows.bias_column)[0]
    hashed = not isinstance(rows.rows, range)  # else entry i is row i
    if hashed:  # the entries of each range of rows, found by sorting them once
        entry_rows = np.asarray(rows.rows, dtype=np.int64)
        order = np.argsort(entry_rows, kind="stable")
        sorted_rows = entry_rows[order]
    best_scores, best_entries = torch.empty(0), torch.empty(0, dtype=torch.int64)
    for start, stop in rows.vectors.ranges():
        scores = _unit(rows.vectors.read(start, stop), rows.bias_column) @ want
        if hashed:
            lo, hi = np.searchsorted(sorted_rows, [start, stop])
            entries = order[lo:hi]
            at = entry_rows[entries]
        else:
            entries = at = np.arange(start, stop)
        keep = at != target
        best_scores = torch.cat([best_scores, scores[torch.from_numpy(at[keep] - start)]])
        best_entries = torch.cat([best_entries, torch.from_numpy(entries[keep].astype(np.int64))])
        if best_scores.numel() > k:
            top = torch.topk(best_scores, k)
            best_scores, best_entries = top.values, best_entries[top.indices]
    # Highest first; among equal scores the first entry first.
    ranked = sorted(zip(best_scores.tolist(), best_entries.tolist(), strict=True), key=lambda s: (-s[0], s[1]))
    return [(rows.keys[entry], score) for score, entry in ranked[:k]]


def _unit(vectors: np.ndarray, bias_column: bool) -> torch.Tensor:
    """Rows scaled to length 1 (without the bias coordinate), for cosine similarities."""
    matrix = torch.from_numpy(vectors)
    if bias_column:
        matrix = matrix[:, :-1]
    return torch.nn.functional.normalize(matrix, dim=1)
