"""Rows as tensors (dense, labels, and per sparse feature CSR offsets and ids), made from one unit's columns.

Conversion checks what the config says the columns hold and fails naming the unit (file, row group or line),
the column and the config field, never a value (a file's contents stay out of messages and logs). Missing
values (`data.missing`): with `fill` a dense null is 0 and a sparse null is the feature's own missing id when
its table hashes ids (a row it learns like any id), an empty bag otherwise; with `error` any null fails. A null
label always fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from kembed_contract import trainer_config as config
from kembed_trainer.data.batch import Batch

__all__ = ["MISSING_ID_TEXT", "Columns", "Rows", "hash_string", "missing_id", "unit_hash"]

MISSING_ID_TEXT = ""  # how a hashed feature's missing id appears in the checkpoint's id index


def hash_string(value: str) -> int:
    """A stable 63-bit hash (the same on every rank and every run, unlike Python's hash())."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") >> 1


def missing_id(feature: str) -> int:
    """The raw id a hashed feature's missing value stands for: its own, so features sharing a table do not share
    it, and no string value hashes to it but by a 63-bit collision."""
    return hash_string("\x00missing\x00" + feature)


def unit_hash(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser mapped to [0, 1)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclasses.dataclass
class Rows:
    """NumPy arrays, so the reader thread's gathers run on one core beside training's torch threads (torch's own
    ops there would compete with the step for its intra-op threads); `batch()` hands them to torch without a copy.
    A feature with exactly one id per row keeps no offsets (most click-log columns): a gather is then one take."""

    dense: np.ndarray  # [n, num_dense] float32
    labels: np.ndarray  # [n] float32
    offsets: list[np.ndarray | None]  # per feature [n + 1] int64, or None: one id per row
    values: list[np.ndarray]  # per feature [offsets[-1]] (or [n]) int64

    @property
    def num_rows(self) -> int:
        return self.labels.shape[0]

    def take(self, idx: np.ndarray) -> Rows:
        offsets, values = [], []
        for off, vals in zip(self.offsets, self.values, strict=True):
            if off is None:
                offsets.append(None)
                values.append(vals[idx])
                continue
            starts, lens = off[idx], off[idx + 1] - off[idx]
            ends = np.cumsum(lens)
            # Positions of every id of the chosen rows, without a Python loop over rows.
            base = np.repeat(starts - (ends - lens), lens)
            values.append(vals[base + np.arange(len(base))])
            offsets.append(np.concatenate([[0], ends]).astype(np.int64))
        return Rows(self.dense[idx], self.labels[idx], offsets, values)

    def slice(self, lo: int, hi: int) -> Rows:
        offsets = [None if off is None else off[lo : hi + 1] - off[lo] for off in self.offsets]
        values = [vals[lo:hi] if off is None else vals[off[lo] : off[hi]]
                  for off, vals in zip(self.offsets, self.values, strict=True)]
        return Rows(self.dense[lo:hi], self.labels[lo:hi], offsets, values)

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        if len(parts) == 1:
            return parts[0]
        offsets = []
        for f in range(len(parts[0].offsets)):
            if all(p.offsets[f] is None for p in parts):
                offsets.append(None)
                continue
            lengths = np.concatenate([p.lengths(f) for p in parts])
            offsets.append(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        return Rows(
            np.concatenate([p.dense for p in parts]),
            np.concatenate([p.labels for p in parts]),
            offsets,
            [np.concatenate([p.values[f] for p in parts]) for f in range(len(parts[0].values))],
        )

    def lengths(self, f: int) -> np.ndarray:
        off = self.offsets[f]
        return np.ones(self.num_rows, np.int64) if off is None else np.diff(off)

    def batch(self) -> Batch:
        lengths = np.concatenate([self.lengths(f) for f in range(len(self.values))])
        return Batch(torch.from_numpy(np.ascontiguousarray(self.dense)), torch.from_numpy(np.concatenate(self.values)),
                     torch.from_numpy(lengths), torch.from_numpy(np.ascontiguousarray(self.labels)))


class Columns:
    """How the config maps a unit's columns to rows; `rows(table, where)` converts and checks one unit."""

    def __init__(self, cfg: config.TableDataConfig, tables: list[config.TableConfig]) -> None:
        self.cfg = cfg
        self.features = [f for t in sorted(tables, key=lambda t: t.embedding_dim) for f in t.features]
        self.hashed = {f for t in tables if t.raw_ids for f in t.features}  # raw ids: strings become int64s
        self.num_ids = {f: t.num_embeddings for t in tables for f in t.features}

    @property
    def names(self) -> list[str]:
        """The columns read, each once."""
        return list(dict.fromkeys([self.cfg.label, *self.cfg.dense, *(self.cfg.sparse[f] for f in self.features)]))

    @property
    def csv_types(self) -> dict[str, pa.DataType]:
        """Types CSV/TSV columns are parsed as where inference could guess wrong per block (hexadecimal ids that
        happen to be all digits): numbers for the label and dense columns, text for hashed ids."""
        types = {c: pa.float64() for c in [self.cfg.label, *self.cfg.dense]}
        types.update({self.cfg.sparse[f]: pa.string() for f in self.hashed})
        return types

    def rows(self, table: pa.Table, where) -> tuple[Rows, dict[str, tuple[list[str], np.ndarray]]]:
        """The rows, and per hashed feature its distinct raw ids (as text) with the int64 each hashes from.
        `where(row=None)` says where the unit (or a row of it) is."""
        cfg = self.cfg

        def floats(name: str, field: str, *, fill: bool) -> np.ndarray:
            col = table.column(name)
            if col.null_count:
                if not fill:
                    raise ValueError(f"{field}: column {name!r} is empty at {where(_first_null(col))}")
                col = col.fill_null(0)
            try:
                return col.to_numpy().astype(np.float32)
            except (pa.ArrowException, ValueError, TypeError):
                raise ValueError(f"{field}: column {name!r} holds values that are not numbers in {where()}") from None

        fill = cfg.missing == "fill"
        labels = floats(cfg.label, "data.label", fill=False)
        dense = (np.stack([floats(c, f"data.dense.{i}", fill=fill) for i, c in enumerate(cfg.dense)], 1)
                 if cfg.dense else np.zeros((table.num_rows, 0), np.float32))
        offsets, values, raw = [], [], {}
        for feature in self.features:
            lengths, ids, raw_ids = self._ids(table, feature, where)
            single = len(ids) == len(lengths) and bool((lengths == 1).all())
            offsets.append(None if single else np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
            values.append(ids)
            if raw_ids is not None:
                raw[feature] = raw_ids
        return Rows(dense, labels, offsets, values), raw

    def _ids(self, table: pa.Table, feature: str, where):
        cfg, name = self.cfg, self.cfg.sparse[feature]
        field = f"data.sparse.{feature}"
        col = table.column(name).combine_chunks()
        hashed = feature in self.hashed
        if col.null_count and cfg.missing == "error":
            raise ValueError(f"{field}: column {name!r} is empty at {where(_first_null(col))}")
        if pa.types.is_null(col.type):  # a block where the column is empty throughout
            col = pa.array([None] * len(col), pa.int64())
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            col = pc.split_pattern(col, cfg.multi_hot_separator)
        missing = None
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            is_null = col.is_null().to_numpy(zero_copy_only=False)
            col = col.fill_null(pa.scalar([], col.type))
            flat = col.flatten()
            lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
        else:  # one id per row
            is_null = col.is_null().to_numpy(zero_copy_only=False)
            flat = col.drop_null()
            lengths = (~is_null).astype(np.int64)
        if pa.types.is_string(flat.type) and not hashed:
            with contextlib.suppress(pa.ArrowInvalid):  # CSV multi-hot ids arrive as strings like "3|17"
                flat = pc.cast(flat, pa.int64())
        raw_ids = None
        if pa.types.is_integer(flat.type):
            ids = flat.to_numpy(zero_copy_only=False).astype(np.int64)
            if hashed:
                distinct = np.unique(ids)
                raw_ids = ([str(i) for i in distinct.tolist()], distinct)
            elif len(ids) and (ids.min() < 0 or ids.max() >= self.num_ids[feature]):
                bad = int(np.flatnonzero((ids < 0) | (ids >= self.num_ids[feature]))[0])
                row = int(np.searchsorted(np.cumsum(lengths), bad, side="right"))
                raise ValueError(
                    f"feature {feature!r}: ids {int(ids.min())}..{int(ids.max())} outside [0, {self.num_ids[feature]}); "
                    f"set hash_ids on its table (column {name!r}, first at {where(row)})"
                )
        elif hashed and (pa.types.is_string(flat.type) or pa.types.is_large_string(flat.type)):
            encoded = pc.dictionary_encode(flat)
            distinct = [str(v) for v in encoded.dictionary.to_pylist()]
            hashes = np.array([hash_string(v) for v in distinct], dtype=np.int64)
            ids = hashes[encoded.indices.to_numpy(zero_copy_only=False)]
            raw_ids = (distinct, hashes)
        else:
            raise ValueError(f"{field}: column {name!r} holds {flat.type}, not integer ids, in {where()}; "
                             "set hash_ids on its table")
        if hashed and is_null.any():  # the feature's missing id, in place of the empty bag
            missing = missing_id(feature)
            ends = np.cumsum(lengths)
            ids = np.insert(ids, (ends - lengths)[is_null], missing)
            lengths = lengths + is_null
            texts, hashes = raw_ids
            raw_ids = ([*texts, MISSING_ID_TEXT], np.append(hashes, missing))
        return lengths, ids, raw_ids


def _first_null(col) -> int:
    return int(pc.index(pc.is_null(col), True).as_py())
