"""A checkpoint's embeddings in the formats other tools load, and nearest neighbours, read offline.

Reads one complete `step-N/` folder with DCP in a single process (no process group): a table sharded row-wise
over any number of ranks is gathered whole, as DCP reads every rank's rows into one tensor. What each row stands
for comes from the checkpoint's own row index (`row_index.py`). A delta (an incremental checkpoint) is read
through its chain: the table from the chain's full checkpoint (which holds the row index too), then each delta's
changed rows on it, in order.

Formats (`FORMATS`):
- `parquet`: one row per word or id: `token` (a vocabulary's words), `id` (int64, plain tables) or `feature`,
  `id` (text) and `row` (hashed tables: one row per raw id seen in training; dynamic tables: one per row that
  holds an id, the raw id beside its vector, its text from the id index where the data had text, `feature`
  empty where the index has no entry for it), then `vector` (fixed-size list of float32).
- `numpy`: a `.npy` matrix, row i = table row i (the vocabulary's rows for a model with a vocabulary).
- those a model kind adds (`kembed_contract.kinds.EXPORT_FORMATS`), written by its trainer half's `writers`, for
  any job's tables.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kembed_contract import kinds, runtime
from kembed_trainer import dcp_read, delta, dynamic, embedding, row_index
from kembed_trainer import kinds as trainer_kinds
from kembed_trainer.data.table import hash_string

__all__ = ["FORMATS", "SUFFIXES", "ExportError", "TableRows", "neighbours", "read_table", "write"]

FORMATS = tuple(kinds.EXPORT_FORMATS)
SUFFIXES = kinds.EXPORT_FORMATS


class ExportError(ValueError):
    """The checkpoint lacks what was asked for (a table, a word, its row index)."""


@dataclass
class TableRows:
    """One table's vectors and what its rows stand for."""

    name: str
    meaning: str  # words | ids | hashed_ids | dynamic_ids (row_index.rows_meaning)
    vectors: np.ndarray  # [rows, dim] float32: the vocabulary's rows for words, else every row
    keys: list[str]  # one per entry: the word, the id, or the raw id (hashed)
    rows: np.ndarray  # the row of each key
    features: list[str] | None  # hashed: each key's feature
    bias_column: bool  # the last coordinate is a per-id bias, not a factor (ModelKind.bias_column)


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
    vectors = _load_field(step_uri, name, "weight", torch.float32)
    for delta_uri in chain[1:]:
        _apply_delta(delta_uri, name, "weight", vectors)
    meaning = spec["rows"]
    features = None
    if meaning == "words":
        keys = list(manifest["vocabulary"])
        vectors = vectors[: len(keys)]
        rows = np.arange(len(keys))
    elif meaning == "ids":
        keys = [str(i) for i in range(vectors.shape[0])]
        rows = np.arange(vectors.shape[0])
    elif meaning == "dynamic_ids":
        keys, rows, features = _dynamic_keys(chain, name)
    else:
        ids = _read_ids(chain, name)
        keys, rows, features = ids["id"].to_pylist(), ids["row"].to_numpy(), ids["feature"].to_pylist()
    return TableRows(name, meaning, vectors, keys, rows, features, bool(manifest.get("bias_column")))


def _load_field(step_uri: str, table: str, field: str, dtype: torch.dtype) -> np.ndarray:
    """Every row of one field of `table` (its weight, a dynamic table's ids) from a full checkpoint."""
    reader = dcp_read.SafeReader(step_uri)
    key = f"embeddings.{table}.{field}"
    entry = reader.read_metadata().state_dict_metadata.get(key)
    if entry is None:
        raise ExportError(f"table {table!r}: no {key} in {step_uri}")
    state = {"embeddings": {f"{table}.{field}": torch.empty(tuple(entry.size), dtype=dtype)}}
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_read.load(state, step_uri)
    return state["embeddings"][f"{table}.{field}"].numpy()


def _apply_delta(delta_uri: str, table: str, field: str, values: np.ndarray) -> None:
    """Copy a delta's changed rows of one field of `table` into `values` (in place)."""
    saved = dcp_read.SafeReader(delta_uri).read_metadata().state_dict_metadata
    wanted = {k: v for k, v in delta.entries_of(saved).items()
              if k.startswith(f"{table}.") and k.rsplit(".", 1)[-1] in ("rows", field)}
    if not wanted:
        return  # no row of this table changed
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_read.load({delta.DELTA_KEY: wanted}, delta_uri)
    delta.apply({f"{table}.{field}": torch.from_numpy(values)}, wanted)


def _dynamic_keys(chain: list[str], table: str) -> tuple[list[str], np.ndarray, list[str]]:
    """A dynamic table's rows that hold an id: each one's raw id (its text where the id index has it: string ids
    were read as their 63-bit hashes), the row, and the feature it was read for."""
    ids = _load_field(chain[0], table, "ids", torch.int64)
    for delta_uri in chain[1:]:
        _apply_delta(delta_uri, table, "ids", ids)
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


# ----------------------------------------------------------------------------------------------- writing
def write(rows: TableRows, fmt: str, out: IO[bytes]) -> None:
    """Write `rows` in format `fmt` to the binary stream `out`."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt == "numpy":
        np.save(out, np.ascontiguousarray(rows.vectors, dtype=np.float32))
    elif fmt == "parquet":
        _write_parquet(rows, out)
    else:
        trainer_kinds.export_writers()[fmt](rows, out)


def _write_parquet(rows: TableRows, out: IO[bytes]) -> None:
    dim = rows.vectors.shape[1]
    if rows.meaning == "words":
        key_column = {"token": pa.array(rows.keys, pa.string())}
    elif rows.meaning == "ids":
        key_column = {"id": pa.array(rows.rows, pa.int64())}
    else:
        key_column = {"feature": pa.array(rows.features, pa.string()), "id": pa.array(rows.keys, pa.string()),
                      "row": pa.array(rows.rows, pa.int64())}
    flat = pa.array(rows.vectors[rows.rows].astype(np.float32, copy=False).reshape(-1))
    vectors = pa.FixedSizeListArray.from_arrays(flat, dim)
    pq.write_table(pa.table({**key_column, "vector": vectors}), out)


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
        if not 0 <= row < rows.vectors.shape[0]:
            raise ExportError(f"word: an id of table {rows.name!r} is in [0, {rows.vectors.shape[0]})")
        return row
    for key, row in zip(rows.keys, rows.rows.tolist(), strict=True):
        if key == query:
            return row
    if rows.meaning == "dynamic_ids":
        raise ExportError(f"word: no row of table {rows.name!r} holds that id (not admitted, or evicted)")
    # Not seen in training: it still hashes to a row (as the trainer would look it up).
    try:
        raw = int(query)
    except ValueError:
        raw = hash_string(query)
    return int(embedding.hash_rows(torch.tensor([raw]), rows.vectors.shape[0])[0])


def neighbours(rows: TableRows, query: str, k: int = 10) -> list[tuple[str, float]]:
    """The `k` keys whose vectors are nearest to `query`'s by cosine similarity (itself left out)."""
    target = _row_of(rows, query)
    vectors = torch.from_numpy(np.ascontiguousarray(rows.vectors, dtype=np.float32))
    if rows.bias_column:
        vectors = vectors[:, :-1]
    unit = torch.nn.functional.normalize(vectors, dim=1)
    scores = unit @ unit[target]
    key_rows = torch.from_numpy(np.asarray(rows.rows, dtype=np.int64).copy())
    entry_scores = scores[key_rows]
    entry_scores[key_rows == target] = -float("inf")
    top = torch.topk(entry_scores, min(k, max(0, int((key_rows != target).sum()))))
    return [(rows.keys[i], float(s)) for s, i in zip(top.values.tolist(), top.indices.tolist(), strict=True)]

