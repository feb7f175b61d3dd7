"""How a checkpoint's files are written: large tables cut into row ranges that load whole or onto another number of
ranks, files of a bounded size, and S3 files whose parts upload concurrently and leave nothing when a write fails."""

from __future__ import annotations

import os
import pathlib
import uuid

import boto3
import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from kembed_trainer import step_writer
from kembed_trainer.part_upload import PartUpload
from kembed_trainer.step_writer import RowRangePlanner, StepWriter

ROWS, DIM = 1001, 8  # uneven over two ranks: 501 and 500 rows
ITEM_BYTES = 4096  # 128 rows of the table per range
MIB = 2**20
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def table() -> torch.Tensor:
    return torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM)


def save(state: dict, uri: str, process_group=None) -> None:
    dcp.save(state, storage_writer=StepWriter(uri, sync_files=False), planner=RowRangePlanner(ITEM_BYTES),
             process_group=process_group)


def load(state: dict, uri: str, process_group=None) -> None:
    dcp.load(state, storage_reader=FsspecReader(uri), process_group=process_group)


@pytest.fixture(params=["file", "s3"])
def step_uri(request, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/step-1"
    request.getfixturevalue("s3_server")
    bucket = f"steps-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("s3").mkdir(bucket)
    return f"s3://{bucket}/step-1"


def test_a_large_table_is_written_as_row_ranges_in_files_of_bounded_size_and_loads_whole(step_uri, monkeypatch):
    monkeypatch.setattr(step_writer, "FILE_BYTES", 8192)
    save({"table": table(), "dense": torch.ones(5), "extra": {"note": "kept"}}, step_uri)

    metadata = FsspecReader(step_uri).read_metadata()
    assert len(metadata.state_dict_metadata["table"].chunks) == 8  # ceil(1001 / 128)
    fs, path = fsspec.core.url_to_fs(step_uri)
    files = [p for p in fs.ls(path, detail=False) if p.endswith(".distcp")]
    assert len(files) == 4  # 32 KB of tensors in files of about 8 KB

    restored = {"table": torch.zeros(ROWS, DIM), "dense": torch.zeros(5), "extra": {"note": ""}}
    load(restored, step_uri)
    assert torch.equal(restored["table"], table())
    assert torch.equal(restored["dense"], torch.ones(5))
    assert restored["extra"] == {"note": "kept"}


def _two_ranks(rank: int, init_file: str, written_by_one: str, written_by_two: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))

        def sharded(local: torch.Tensor) -> DTensor:
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(ROWS, DIM),
                                      stride=(DIM, 1))

        mine = table().chunk(2)[rank]
        restored = sharded(torch.zeros_like(mine))
        load({"table": restored}, written_by_one)
        assert torch.equal(restored.to_local(), mine), f"rank {rank} loaded other rows"
        # and a tensor every rank holds whole: its ranges are written once, each by one of the ranks
        save({"table": sharded(mine.clone()), "replicated": -table()}, written_by_two)
    finally:
        dist.destroy_process_group()


def test_row_ranges_load_onto_another_number_of_ranks(tmp_path):
    by_one, by_two = f"file://{tmp_path}/one", f"file://{tmp_path}/two"
    save({"table": table()}, by_one)
    mp.spawn(_two_ranks, args=(str(tmp_path / "pg"), by_one, by_two), nprocs=2, join=True)

    # Two ranks of 501 and 500 rows, each cut into ranges of up to 128.
    saved = FsspecReader(by_two).read_metadata().state_dict_metadata
    assert len(saved["table"].chunks) == 4 + 4
    assert len(saved["replicated"].chunks) == 8
    restored = {"table": torch.zeros(ROWS, DIM), "replicated": torch.zeros(ROWS, DIM)}
    load(restored, by_two)
    assert torch.equal(restored["table"], table())
    assert torch.equal(restored["replicated"], -table())


@pytest.fixture
def bucket(s3_server) -> str:
    name = f"parts-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("s3").mkdir(name)
    return name


def test_a_large_file_is_a_multipart_upload_a_small_one_a_single_put_and_an_unclosed_one_none(bucket):
    fs = fsspec.filesystem("s3")
    data = os.urandom(12 * MIB + 123)
    stream = PartUpload(fs, f"{bucket}/large", part_bytes=5 * MIB, in_flight=2)
    for start in range(0, len(data), 3 * MIB):  # writes that straddle the parts' bounds
        stream.write(data[start:start + 3 * MIB])
    assert stream.tell() == len(data)
    stream.close()
    small = PartUpload(fs, f"{bucket}/small", part_bytes=5 * MIB)
    small.write(b"a small file")
    small.close()
    dropped = PartUpload(fs, f"{bucket}/dropped", part_bytes=5 * MIB)
    dropped.write(b"a file never finished")
    del dropped  # neither closed nor aborted: no object

    assert fs.cat(f"{bucket}/large") == data
    assert fs.cat(f"{bucket}/small") == b"a small file"
    s3 = boto3.client("s3")
    assert s3.head_object(Bucket=bucket, Key="large")["ETag"].strip('"').endswith("-3")  # three parts
    assert "-" not in s3.head_object(Bucket=bucket, Key="small")["ETag"]
    assert not fs.exists(f"{bucket}/dropped")
    assert "Uploads" not in s3.list_multipart_uploads(Bucket=bucket)


def test_a_write_that_fails_leaves_no_object_and_no_parts(bucket):
    fs = fsspec.filesystem("s3")
    files = StepWriter(f"s3://{bucket}/step-1", sync_files=False).fs
    with (pytest.raises(RuntimeError, match="the writer failed"),
          files.create_stream(f"{bucket}/step-1/__0_0.distcp", "wb") as stream):
        stream.write(os.urandom(70 * MIB))  # more than a part: the upload has begun
        raise RuntimeError("the writer failed")
    assert not fs.exists(f"{bucket}/step-1/__0_0.distcp")
    assert "Uploads" not in boto3.client("s3").list_multipart_uploads(Bucket=bucket)


def test_a_small_save_is_one_file(tmp_path: pathlib.Path):
    save({"table": table()}, f"file://{tmp_path}/step-1")
    assert sorted(p.name for p in (tmp_path / "step-1").iterdir()) == [".metadata", "__0_0.distcp"]
