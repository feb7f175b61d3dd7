"""What an incremental checkpoint holds of the tables, and how it goes back into them.

A delta (runtime.CHECKPOINT_DELTA) keeps, of each table, only the rows that changed since the checkpoint before
it: their row numbers in the table, their weights and optimizer state, and separately the rows whose admission
counts (`seen`) moved. Each rank writes what it is responsible for under keys of its own (DCP dedups equal keys
across ranks, and the ranks' row counts differ): a sharded table's changed rows that rank owns, and, of a
replicated table (the same on every rank), rank 0 everything. Keys: `delta.<table>.rank<r>.<field>`, fields
`rows`, `weight`, the optimizer's state names, `seen_rows`, `seen`. Table names have no dots, so keys split back.

Row numbers are the table's own, so a delta applies at any world size: each rank copies in the rows it holds now.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from kembed_trainer import step_writer

__all__ = ["DELTA_KEY", "TABLES_KEY", "TableChanges", "apply", "changed_rows_keys", "entries_of", "extract"]

TABLES_KEY = "embeddings"  # the top-level key of the tables in a full checkpoint's state
DELTA_KEY = "delta"  # ... and of their changed rows in a delta's, instead
_ROWS, _SEEN_ROWS, _SEEN = "rows", "seen_rows", "seen"


@dataclass(frozen=True)
class TableChanges:
    """Rows of one table (the table's row numbers) this rank writes into a delta."""

    rows: torch.Tensor  # rows whose weight and optimizer state changed
    seen_rows: torch.Tensor | None  # rows whose admission count changed (None: the table counts none)


def extract(embeddings: dict[str, torch.Tensor], changes: dict[str, TableChanges], rank: int
            ) -> dict[str, torch.Tensor]:
    """The delta entries of `embeddings` (the collection's state dict, `<table>.<field>` -> rows) for this
    rank's `changes`: copies, so training may go on changing the tables."""
    out: dict[str, torch.Tensor] = {}
    for table, change in changes.items():
        prefix = f"{table}.rank{rank}."
        if change.rows.numel():
            out[prefix + _ROWS] = change.rows.clone()
            for key, tensor in embeddings.items():
                name, _, field = key.partition(".")
                if name == table and field != _SEEN and not step_writer.is_placeholder(tensor):  # a tiered table's: streamed
                    out[prefix + field] = _rows_of(tensor, change.rows)
        if change.seen_rows is not None and change.seen_rows.numel():
            out[prefix + _SEEN_ROWS] = change.seen_rows.clone()
            out[prefix + _SEEN] = _rows_of(embeddings[f"{table}.{_SEEN}"], change.seen_rows)
    return out


def entries_of(saved) -> dict[str, torch.Tensor]:
    """Empty tensors for every delta entry of a checkpoint (its DCP metadata's `state_dict_metadata`), ready for
    `dcp.load`."""
    out = {}
    for key, entry in saved.items():
        if key.startswith(DELTA_KEY + "."):
            out[key.removeprefix(DELTA_KEY + ".")] = torch.empty(
                tuple(entry.size), dtype=entry.properties.dtype
            )
    return out


def changed_rows_keys(saved: Mapping[str, Any], table: str, field: str) -> list[tuple[str, str]]:
    """The keys, in a delta's DCP metadata (`state_dict_metadata`), of each part (a rank's) of `table`'s changed
    rows: (their row numbers, their `field`), for a reader that streams them instead of loading them (export)."""
    parts = []
    for key in saved:
        head, _, last = key.rpartition(".")
        if last == _ROWS and head.startswith(f"{DELTA_KEY}.{table}.") and f"{head}.{field}" in saved:
            parts.append((key, f"{head}.{field}"))
    return sorted(parts)


def apply(embeddings: dict[str, torch.Tensor], entries: dict[str, torch.Tensor],
          sinks: Mapping[str, Any] | None = None) -> None:
    """Copy a delta's rows into `embeddings` (a state dict as `extract` reads, or whole tables for export);
    fields `embeddings` lacks are skipped, and of a sharded table only the rows this rank holds are copied.
    `sinks`: fields held elsewhere than in a tensor (a tiered table's, by `<table>.<field>`), given the rows."""
    for key, rows in entries.items():
        table, part, field = key.split(".")
        if field not in (_ROWS, _SEEN_ROWS):
            continue
        prefix = f"{table}.{part}."
        fields = [_SEEN] if field == _SEEN_ROWS else [
            k.removeprefix(prefix) for k in entries
            if k.startswith(prefix) and k.removeprefix(prefix) not in (_ROWS, _SEEN_ROWS, _SEEN)
        ]
        for name in fields:
            if sinks and f"{table}.{name}" in sinks:
                sinks[f"{table}.{name}"].write_held(rows.numpy(), entries[prefix + name])
                continue
            target = embeddings.get(f"{table}.{name}")
            if target is not None:
                _copy_rows(target, rows, entries[prefix + name])


def _rows_of(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`tensor[rows]` (table rows) of a plain tensor or of this rank's piece of a row-sharded DTensor."""
    local, first = _local_rows(tensor)
    return local.index_select(0, rows - first).cpu()


def _copy_rows(tensor: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    local, first = _local_rows(tensor)
    held = (rows >= first) & (rows < first + local.shape[0])
    if not bool(held.all()):
        rows, values = rows[held], values[held]
    local.index_copy_(0, (rows - first).to(local.device), values.to(local.device, local.dtype))


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(the rows this rank holds, the table row of the first): a DTensor placed Shard(0) on a 1-d mesh is cut
    like `torch.chunk` (as sharding.RowLayout cuts it)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    n, ranks = tensor.shape[0], tensor.device_mesh.size()
    chunk = -(-n // ranks)
    return tensor.to_local(), min(tensor.device_mesh.get_coordinate()[0] * chunk, n)
