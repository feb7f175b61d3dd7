"""Reading a DCP checkpoint without running what is in it.

A checkpoint folder is written by a tenant's trainer, so whoever can write it can put anything in it. DCP reads a
checkpoint's `.metadata` with `pickle.load` and its non-tensor values with `torch.load(weights_only=False)`:
a crafted file runs code in the reader. So every read of a checkpoint (the trainer's resume, export) goes
through this module instead:

- `.metadata` through an unpickler that resolves only the classes DCP's metadata holds (the dataclasses of
  `torch.distributed.checkpoint.metadata`, DCP's `_StorageInfo`, `torch.Size`, torch's dtypes, its layout
  helper; `getattr` only as an enum member of those classes by name) and refuses anything else
  (`UnsafeCheckpoint`). Torch's own weights-only unpickler would be the
  natural choice, but it does not read pickle protocol 4 (DCP writes its metadata with the default protocol).
- non-tensor values (the optimizer's param groups) with `torch.load(weights_only=True)`, as DCP already reads
  tensor data.

The allow-list is what real checkpoints of every model kind hold (listed from saved checkpoints of each kind,
full and incremental, one and two ranks); the trainer's export and resume tests read them all
through it.

`RowRanges` reads a range of rows of a saved tensor, loading only the saved chunks that hold them (`step_writer`
saves a tensor in chunks of at most `step_writer.ITEM_BYTES`): how the export reads a table larger than memory.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

__all__ = ["RowRanges", "SafeLoadPlanner", "SafeReader", "UnsafeCheckpoint", "load", "read_metadata"]

_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = frozenset({
    *((_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                     "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                     "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided)
    ("collections", "OrderedDict"),
})


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds something a checkpoint never does (code, or objects other than DCP's)."""


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    # Every dtype (a checkpoint may hold any): plain values, nothing to call. Looked up in the module's own names
    # (a getattr could import a submodule torch loads lazily).
    return module == "torch" and isinstance(vars(torch).get(name), torch.dtype)


def _enum_member(cls: Any, name: str) -> Any:
    """`getattr` as an unpickler may call it: an enum member of an allow-listed class by its name, nothing else.
    Some Python releases pickle an enum member as `getattr(cls, name)` (the trainer image's Debian 3.11.2 does),
    others as `cls(value)`."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and _allowed(cls.__module__, cls.__qualname__)
            and isinstance(name, str) and name in cls.__members__):
        raise UnsafeCheckpoint("its .metadata asks for an attribute DCP metadata never holds; refused unread")
    return cls.__members__[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if not _allowed(module, name):
            # Not the name it asked for: that is the file's content.
            raise UnsafeCheckpoint("its .metadata refers to something DCP metadata never holds;; refused unread")
        return getattr(importlib.import_module(module), name)


def read_metadata(stream: io.IOBase | Any) -> Metadata:
    """DCP metadata from a binary stream, resolving only the allow-listed classes."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpoint:
        raise
    except Exception as error:  # noqa: BLE001 - truncated or garbage: its message may quote the bytes
        raise UnsafeCheckpoint(f"its .metadata is not DCP metadata ({type(error).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint("its .metadata is not DCP metadata")
    return metadata


class SafeReader(FsspecReader):
    """DCP's fsspec reader with `read_metadata` through the allow-listing unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            metadata = read_metadata(stream)
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner reading non-tensor values with `weights_only=True` (DCP's own uses False).

    `sinks`: tensors of the state that stand for rows kept elsewhere (a tiered table's fields on local disk, by
    their flattened key): each chunk read for one lands in a buffer of its own and goes to the sink's
    `write_local(first_row, values)`, so the whole field is never in memory."""

    def __init__(self, sinks: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.sinks = dict(sinks or {})
        self._buffers: dict[Any, torch.Tensor] = {}

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn not in self.sinks:
            return super().resolve_tensor(read_item)
        buffer = torch.empty(tuple(read_item.lengths))
        self._buffers[(read_item.dest_index, tuple(read_item.dest_offsets))] = buffer
        return buffer

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        sink = self.sinks.get(read_item.dest_index.fqn)
        if sink is None:
            return super().commit_tensor(read_item, tensor)
        self._buffers.pop((read_item.dest_index, tuple(read_item.dest_offsets)), None)
        assert all(offset == 0 for offset in read_item.dest_offsets[1:]), "chunks of rows, whole in width"
        sink.write_local(int(read_item.dest_offsets[0]), tensor)
        return None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint("a value in it holds more than plain data; refused") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load(state: dict[str, Any], step_uri: str, *, sinks: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
    """`dcp.load` of `state` from the step folder `step_uri`, through `SafeReader` and `SafeLoadPlanner`."""
    dcp.load(state, storage_reader=SafeReader(step_uri), planner=SafeLoadPlanner(sinks), **kwargs)


def quiet_load(state: dict[str, Any], **kwargs: Any) -> None:
    """`dcp.load` in a process without a process group (export: intended, so not warned about)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, **kwargs)


class _MetadataOnce(SafeReader):
    """A `SafeReader` that reads the folder's metadata once, for the many loads of `RowRanges`."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _RowRangePlanner(SafeLoadPlanner):
    """Loads each tensor of its state (rows `first_rows[key]`.. of the saved `key`) from the saved chunks that
    overlap those rows only; DCP's own planner would plan the whole saved tensor."""

    def __init__(self, first_rows: Mapping[str, int]) -> None:
        super().__init__()
        self.first_rows = dict(first_rows)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, tensor in self.state_dict.items():
            offsets = torch.Size([self.first_rows[key], *([0] * (tensor.dim() - 1))])
            wanted = ChunkStorageMetadata(offsets=offsets, sizes=tensor.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [wanted])
        self.plan = LoadPlan(items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # dest_offsets are relative to the range asked for, which is the whole of the state's tensor.
        tensor = self.state_dict[read_item.dest_index.fqn]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            tensor = tensor.narrow(dim, offset, length)
        return tensor


class RowRanges:
    """The tensors of one checkpoint folder, read a range of rows at a time: each read loads the saved chunks
    that hold its rows and no others, so no tensor is ever whole in memory."""

    def __init__(self, step_uri: str) -> None:
        self._reader = _MetadataOnce(step_uri)
        self.saved = self._reader.read_metadata().state_dict_metadata  # key -> what was saved under it

    def shape(self, key: str) -> tuple[int, ...] | None:
        """The saved tensor's shape, or None when `key` holds no tensor."""
        entry = self.saved.get(key)
        return tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None

    def chunk_starts(self, key: str) -> list[int]:
        """The first rows of the chunks `key` was saved in, in order: ranges cut there load no chunk twice."""
        return sorted({int(chunk.offsets[0]) for chunk in self.saved[key].chunks})

    def read(self, key: str, first: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `first`.. `first + count` of the saved `key`, into `out` when given (its shape: those rows)."""
        entry = self.saved[key]
        if not 0 <= first <= first + count <= entry.size[0]:
            raise IndexError(f"rows {first}..{first + count} of {key} (it has {entry.size[0]})")
        if out is None:
            out = torch.empty((count, *entry.size[1:]), dtype=entry.properties.dtype)
        if count:
            quiet_load({key: out}, storage_reader=self._reader, planner=_RowRangePlanner({key: first}))
        return out
