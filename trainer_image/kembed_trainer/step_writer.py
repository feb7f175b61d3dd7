"""How one rank writes its part of a checkpoint's step folder: DCP's fsspec writer, shaped for object storage.

- Large tensors are cut into row ranges of at most `ITEM_BYTES` (`RowRangePlanner`), so that one big table spreads
  over several files instead of being one file written by one thread. DCP records each range as a chunk of its
  tensor, as it does a rank's rows of a sharded one, so loading (onto any number of ranks) is unchanged.
- The ranges are grouped into files of about `FILE_BYTES`, written `WRITER_THREADS` at a time; a file on S3 is one
  PUT up to `part_upload.PART_BYTES`, and a concurrent multipart upload beyond (`PartUpload`). A small save (a
  delta) is one file, one request.
- The folder-guarding requests DCP makes for a directory in use are left out (see `StepWriter`).

The figures behind the sizes are in docs/benchmarks.md (incremental checkpoints).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import pickle
import queue
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from kembed_trainer.part_upload import PartUpload

__all__ = ["FILE_BYTES", "ITEM_BYTES", "WRITER_THREADS", "RowRangePlanner", "StepWriter", "is_placeholder",
           "placeholder"]

ITEM_BYTES = 8 * 2**20
FILE_BYTES = 16 * 2**20
WRITER_THREADS = 4


def placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` that holds one value (every element is it: strides 0), standing in a state dict for
    rows kept elsewhere, a tiered table's on local disk: DCP plans with its shape, a `RowRangePlanner` source
    gives its rows as they are written, a `dcp_read.SafeLoadPlanner` sink takes them as they are read. (A tensor
    on device `meta` would do, but DCP's load allocates a real one for each.)"""
    return torch.zeros(1).expand(shape)


def is_placeholder(tensor: torch.Tensor) -> bool:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() > 1 and all(stride == 0 for stride in local.stride())


class RowRangePlanner(DefaultSavePlanner):
    """DCP's default save planner, with every tensor item of more than `ITEM_BYTES` cut into row ranges.

    `sources`: tensors of the state that stand for rows kept elsewhere (`placeholder`s: a tiered table's fields
    on local disk), by flattened key: each item's rows are read from its source, `(first_row, count) -> tensor`,
    when the writer asks for them, so a field is streamed, never whole in memory."""

    def __init__(self, item_bytes: int = ITEM_BYTES, sources: Mapping[str, Callable[[int, int], torch.Tensor]]
                 | None = None) -> None:
        super().__init__()
        self.item_bytes = item_bytes
        self.sources = dict(sources or {})
        self._ranges: dict[MetadataIndex, tuple[MetadataIndex, int, int]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [cut for item in plan.items for cut in self._cut(item)]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | Any:
        source = self.sources.get(write_item.index.fqn)
        if source is not None:
            chunk = write_item.tensor_data.chunk
            return source(int(chunk.offsets[0]), int(chunk.sizes[0]))
        cut = self._ranges.get(write_item.index)
        if cut is None:
            return super().resolve_data(write_item)
        whole, first, rows = cut
        return self.lookup_object(whole).narrow(0, first, rows)

    def _cut(self, item: WriteItem) -> list[WriteItem]:
        data = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or data is None or len(data.chunk.sizes) == 0:
            return [item]
        rows = data.chunk.sizes[0]
        row_bytes = _bytes_of(item) // max(rows, 1)
        per_item = max(1, self.item_bytes // max(row_bytes, 1))
        if rows <= per_item:
            return [item]
        cuts = []
        for first in range(0, rows, per_item):
            count = min(per_item, rows - first)
            offsets = torch.Size([data.chunk.offsets[0] + first, *data.chunk.offsets[1:]])
            chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([count, *data.chunk.sizes[1:]]))
            index = MetadataIndex(item.index.fqn, offsets)
            self._ranges[index] = (item.index, first, count)
            cuts.append(WriteItem(index=index, type=WriteItemType.SHARD,  # one of several chunks of its tensor
                                  tensor_data=dataclasses.replace(data, chunk=chunk)))
        return cuts


class StepWriter(FsspecWriter):
    """DCP's fsspec writer for a step folder that the checkpointer has just emptied.

    It writes files of about `FILE_BYTES` (DCP's own writer makes one per thread, however large), and leaves out
    the requests that guard a folder in use: the look for an earlier checkpoint's metadata, and the metadata
    written to a temporary name then renamed (on S3 a rename is a copy and a delete). What makes a folder count
    is the COMPLETE marker, written after all of it. On the coordinator (rank 0) it also counts the bytes every
    rank wrote."""

    num_bytes = 0

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _StepFiles(self.fs.fs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.fs.mkdir(self.path)
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        files = _into_files(plan.items, FILE_BYTES)
        self.thread_count = max(1, min(WRITER_THREADS, len(files)))
        file_queue: queue.Queue = queue.Queue()
        for number, items in enumerate(files):
            name = f"{plan.storage_data.prefix}{number}{DEFAULT_SUFFIX}"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        content = pickle.dumps(metadata)
        with self.fs.create_stream(self._get_metadata_path(), "wb") as stream:
            stream.write(content)
        self.num_bytes = len(content) + sum(info.length for info in metadata.storage_data.values())


def _bytes_of(item: WriteItem) -> int:
    """The bytes of a tensor item's own chunk (DCP's `_item_size` counts its whole tensor's); a pickled object's
    are not known before it is pickled, and are small."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _into_files(items: list[WriteItem], file_bytes: int) -> list[list[WriteItem]]:
    """`items` in as few files of about `file_bytes` as hold them, the largest items first each into the file
    with the fewest bytes so far (so the files come out even), pickled objects spread one per file in turn."""
    count = max(1, math.ceil(sum(_bytes_of(item) for item in items) / file_bytes))
    files: list[list[WriteItem]] = [[] for _ in range(count)]
    sizes = [(0, n) for n in range(count)]  # a heap of (bytes so far, file)
    objects = [item for item in items if item.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(objects):
        files[n % count].append(item)
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_bytes_of, reverse=True):
        size, n = heapq.heappop(sizes)
        files[n].append(item)
        heapq.heappush(sizes, (size + _bytes_of(item), n))
    return [f for f in files if f]


class _StepFiles(FileSystem):
    """DCP's fsspec file system, whose new files on S3 are `PartUpload`s (a failed write leaves no object), and
    which makes no folders on S3."""

    def __init__(self, fs: Any) -> None:
        super().__init__()
        self.fs = fs

    @property
    def on_s3(self) -> bool:
        return "s3" in ((self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol)

    def mkdir(self, path: str) -> None:
        if not self.on_s3:  # keys need no folders; s3fs would ask whether the bucket exists, a round trip
            super().mkdir(path)

    @contextmanager
    def create_stream(self, path: str, mode: str) -> Iterator[Any]:
        if mode != "wb" or not self.on_s3:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = PartUpload(self.fs, str(path))
        try:
            yield stream
        except BaseException:
            stream.abort()
            raise
        stream.close()  # DCP has closed it already (finished the object); a file it did not close is finished here

