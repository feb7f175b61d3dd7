"""Rows from Parquet, CSV or TSV files through fsspec (`file://`, `s3://`), mapped to features by the config.

Each rank reads its own shard: whole files when there are at least as many files as ranks, else every r-th row.
The shard is held in memory as CSR arrays per feature; the batch of step s is a slice of a per-epoch shuffle
seeded by (seed, rank, epoch), so resuming at step s needs only s.
"""

from __future__ import annotations

import contextlib
import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch

from kembed_contract import trainer_config as config
from kembed_trainer.data.batch import Batch
from kembed_trainer.data.synthetic import _generator
from kembed_trainer.storage import Guard

__all__ = ["TableData"]

_EVAL_CHUNK = 2048
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "csv"}


def _read(guard: Guard, uri: str, fmt: str, *, where: str) -> pa.Table:
    """One file as a table. Parse errors name the file and the problem, never its contents: pyarrow's messages
    quote the offending row, and the file could be anything the job was pointed at."""
    if fmt == "auto":
        suffix = "." + uri.rsplit(".", 1)[-1].lower() if "." in uri.rsplit("/", 1)[-1] else ""
        fmt = _SUFFIXES.get(suffix, "csv")
    with guard.open(uri, "rb", where=where) as f:
        try:
            if fmt == "parquet":
                return pq.read_table(f)
            delimiter = "\t" if fmt == "tsv" else ","
            return pa_csv.read_csv(f, parse_options=pa_csv.ParseOptions(delimiter=delimiter))
        except (pa.ArrowException, ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{where}: {uri} is not a readable {fmt} file ({type(error).__name__})") from None


def hash_string(value: str) -> int:
    """A stable 63-bit hash (the same on every rank and every run, unlike Python's hash())."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") >> 1


def _hash_strings(values: pa.Array) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(each value's hash, the distinct values, their hashes)."""
    encoded = pc.dictionary_encode(values)
    distinct = [str(v) for v in encoded.dictionary.to_pylist()]
    hashed = np.array([hash_string(v) for v in distinct], dtype=np.int64)
    return hashed[encoded.indices.to_numpy(zero_copy_only=False)], distinct, hashed


class _Rows:
    """One shard's rows as tensors: dense [N, D], labels [N], and per feature CSR (offsets [N+1], values)."""

    def __init__(self, table: pa.Table, cfg: config.TableDataConfig, features: list[str], hashed: set[str]):
        # Messages name the configured column, never the file's own header or values (they are its contents).
        def column(name: str, where: str) -> pa.ChunkedArray:
            if name not in table.column_names:
                raise ValueError(f"{where}: column {name!r} is not in the files of data.uri")
            return table.column(name)

        def floats(name: str, where: str) -> np.ndarray:
            try:
                return column(name, where).to_numpy().astype(np.float32)
            except (pa.ArrowException, ValueError, TypeError):
                raise ValueError(f"{where}: column {name!r} holds values that are not numbers") from None

        self.num_rows = table.num_rows
        self.labels = torch.from_numpy(floats(cfg.label, "data.label"))
        self.dense = torch.from_numpy(
            np.stack([floats(c, f"data.dense.{i}") for i, c in enumerate(cfg.dense)], 1)
            if cfg.dense
            else np.zeros((table.num_rows, 0), np.float32)
        )
        self.offsets, self.values = [], []
        # Hashed features: their distinct raw ids (as text) and the int64 each hashes from, for the checkpoint's
        # record of which raw id landed in which row.
        self.raw_ids: dict[str, tuple[list[str], np.ndarray]] = {}
        for feature in features:
            col = column(cfg.sparse[feature], f"data.sparse.{feature}").combine_chunks()
            if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                col = pc.split_pattern(col, cfg.multi_hot_separator)
            if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
                col = col.fill_null(pa.scalar([], col.type))
                flat = col.flatten()
                lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
            else:  # one id per row; a missing value is an empty bag
                flat = col.drop_null()
                lengths = col.is_valid().to_numpy(zero_copy_only=False).astype(np.int64)
            if pa.types.is_string(flat.type) and feature not in hashed:
                with contextlib.suppress(pa.ArrowInvalid):  # CSV multi-hot ids arrive as strings like "3|17"
                    flat = pc.cast(flat, pa.int64())
            if pa.types.is_integer(flat.type) and feature not in hashed:
                ids = flat.to_numpy(zero_copy_only=False).astype(np.int64)
            elif feature in hashed:
                if pa.types.is_integer(flat.type):
                    ids = flat.to_numpy(zero_copy_only=False).astype(np.int64)
                    distinct_ints = np.unique(ids)
                    self.raw_ids[feature] = ([str(i) for i in distinct_ints.tolist()], distinct_ints)
                else:
                    ids, distinct, distinct_hashes = _hash_strings(flat)
                    self.raw_ids[feature] = (distinct, distinct_hashes)
            else:
                raise ValueError(
                    f"data.sparse.{feature}: column {cfg.sparse[feature]!r} holds {flat.type}, not integer ids; "
                    "set hash_ids on its table"
                )
            self.offsets.append(torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)])))
            self.values.append(torch.from_numpy(ids))

    def take(self, idx: torch.Tensor) -> Batch:
        values, lengths = [], []
        for offsets, vals in zip(self.offsets, self.values, strict=True):
            starts, ends = offsets[idx], offsets[idx + 1]
            lens = ends - starts
            # Positions of every id of the chosen rows, without a Python loop over rows.
            base = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens)
            values.append(vals[base + torch.arange(int(lens.sum()))])
            lengths.append(lens)
        return Batch(self.dense[idx], torch.cat(values), torch.cat(lengths), self.labels[idx])


class TableData:
    def __init__(
        self,
        cfg: config.TableDataConfig,
        *,
        tables: list[config.TableConfig],
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        guard: Guard,
    ) -> None:
        self.seed, self.batch_size, self.rank = seed, batch_size, rank
        features = [f for t in sorted(tables, key=lambda t: t.embedding_dim) for f in t.features]
        hashed = {f for t in tables if t.hash_ids for f in t.features}
        # With an eval file every row of the training files trains; eval_fraction applies only without one.
        train, held_out = self._shard(guard, cfg.uri, cfg, rank, world_size, split=not cfg.eval_uri,
                                      where="data.uri")
        if cfg.eval_uri:
            held_out = self._shard(guard, cfg.eval_uri, cfg, rank, world_size, split=False, where="data.eval_uri")[0]
        if train.num_rows == 0:
            raise ValueError(f"data.uri: rank {rank} got no training rows from {cfg.uri}")
        self.train = _Rows(train, cfg, features, hashed)
        self.eval = _Rows(held_out, cfg, features, hashed)
        self._perm: tuple[int, torch.Tensor] | None = None

    @staticmethod
    def _shard(guard, uri, cfg, rank, world_size, split=True, *, where: str) -> tuple[pa.Table, pa.Table]:
        files = guard.list_files(uri, where=where)
        mine = files[rank::world_size] if len(files) >= world_size else files
        parts = [_read(guard, f, cfg.format, where=where) for f in mine]
        try:
            table = pa.concat_tables(parts, promote_options="default")
        except pa.ArrowException:
            raise ValueError(f"{where}: the files do not share one set of columns and types") from None
        if len(files) < world_size:
            table = table.take(pa.array(np.arange(rank, table.num_rows, world_size)))
        if not split or cfg.eval_fraction == 0:
            return table, table.slice(0, 0)
        # Hold out rows by a hash of their position, so the split is the same on every run.
        pos = np.arange(table.num_rows, dtype=np.uint64) + np.uint64(rank << 40)
        is_eval = _unit_hash(pos) < cfg.eval_fraction
        return table.filter(pa.array(~is_eval)), table.filter(pa.array(is_eval))

    @property
    def steps_per_epoch(self) -> int:
        """Steps of one pass over this rank's rows (the last partial batch is left out, a different one each
        epoch, as every epoch shuffles anew)."""
        return max(1, self.train.num_rows // self.batch_size)

    def raw_ids(self) -> dict[str, tuple[list[str], np.ndarray]]:
        """Per hashed feature: the distinct raw ids of this rank's training rows (as text) and the int64s they
        hash from (integer ids are their own)."""
        return self.train.raw_ids

    def counts(self) -> dict[str, int]:
        """This rank's share of the data set's size (summed over ranks for the report)."""
        return {"train_rows": self.train.num_rows, "eval_rows": self.eval.num_rows}

    def train_batch(self, step: int) -> Batch:
        per_epoch = self.steps_per_epoch
        epoch, i = divmod(step, per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            gen = _generator(self.seed, 3, self.rank, epoch)
            self._perm = (epoch, torch.randperm(self.train.num_rows, generator=gen))
        perm = self._perm[1]
        idx = perm[i * self.batch_size : (i + 1) * self.batch_size]
        if idx.numel() < self.batch_size:  # a shard smaller than a batch: sample with repetition
            idx = perm[torch.arange(self.batch_size) % perm.numel()]
        return self.train.take(idx)

    def eval_batches(self):
        for start in range(0, self.eval.num_rows, _EVAL_CHUNK):
            yield self.eval.take(torch.arange(start, min(start + _EVAL_CHUNK, self.eval.num_rows)))


def _unit_hash(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser mapped to [0, 1)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
