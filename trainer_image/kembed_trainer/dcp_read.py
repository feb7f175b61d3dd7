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
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = ["SafeLoadPlanner", "SafeReader", "UnsafeCheckpoint", "load", "read_metadata"]

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
