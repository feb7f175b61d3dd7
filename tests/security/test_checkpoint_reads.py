"""No platform process deserialises what a tenant can write (issue 27, class 1).

A member whose storage policy lets it write a folder it can also write directly plants a checkpoint there: a
`step-N/` with a COMPLETE marker and a crafted DCP `.metadata` (a pickle), submits a job whose checkpoint folder it
is, cancels it and asks for the export or the neighbours. The API must not run the pickle: it reads checkpoints
only in a confined worker (kembed_api.jobs.checkpoint_reader), which reads DCP metadata through an allow-listing
unpickler (kembed_trainer.dcp_read). The payload here would write a marker file and copy the admin token into it.
"""

from __future__ import annotations

import builtins
import enum
import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException

from kembed_api.jobs import checkpoint_reader, exports
from kembed_contract import runtime
from kembed_contract.storage_policy import StoragePolicy
from kembed_platform import sandbox as landlock
from kembed_trainer import dcp_read, export
from kembed_trainer.checkpoint import Checkpointer
from kembed_trainer.step_writer import RowRangePlanner, StepWriter
from kembed_trainer.storage import Guard
from tests.builders import make_spec
from tests.security.storage_layout import SECRET
from tests.trainer.conftest import run_trainer, tiny_config, write_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
needs_landlock = pytest.mark.skipif(landlock.abi_version() < 1, reason="the kernel has no Landlock")


class _Payload:
    """Pickles as a call of `function(argument)`: what unpickling it runs."""

    def __init__(self, function, argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self):
        return self.function, (self.argument,)


def _exec_payload(marker: Path, token: Path) -> _Payload:
    code = (f"import pathlib; m = pathlib.Path({str(marker)!r}); m.write_text('ran')\n"
            f"try: m.write_text(pathlib.Path({str(token)!r}).read_text())\nexcept OSError: pass\n")
    return _Payload(builtins.exec, code)


def _system_payload(marker: Path, token: Path) -> _Payload:
    return _Payload(os.system, f"echo ran > {marker}; cat {token} >> {marker}")


def _plant(step: Path, genuine: Path, payload: _Payload) -> None:
    """A checkpoint folder like `genuine` (its marker, row index and shards) whose `.metadata` is `payload`."""
    shutil.copytree(genuine, step)
    (step / ".metadata").write_bytes(pickle.dumps(payload))
    (step / runtime.CHECKPOINT_MARKER).write_bytes(
        runtime.CheckpointMarker(int(step.name.removeprefix("step-")), runtime.CHECKPOINT_FULL, None, 1).to_bytes())


# ----------------------------------------------------------------------------------------------- the unpickler
def _save(state: dict, step: Path) -> None:
    dcp.save(state, storage_writer=StepWriter(f"file://{step}", sync_files=False), planner=RowRangePlanner())


def test_genuine_metadata_loads_through_the_allow_list(tmp_path):
    """Every kind of entry the trainer saves: tables of every dtype it uses, row ranges, plain values."""
    state = {"embeddings": {"t.weight": torch.randn(300, 4), "t.seen": torch.arange(300),
                            "t.mask": torch.ones(300, dtype=torch.bool), "h.weight": torch.zeros(3, dtype=torch.bfloat16)},
             "best": torch.tensor([0.5], dtype=torch.float64),
             "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": "dense", "fused": None}]}}
    _save(state, tmp_path / "step-1")
    with open(tmp_path / "step-1" / ".metadata", "rb") as f:
        safe = dcp_read.read_metadata(f)
    with open(tmp_path / "step-1" / ".metadata", "rb") as f:
        assert safe == pickle.load(f)  # noqa: S301 - our own file, the reference
    loaded = {"embeddings": {k: torch.empty_like(v) for k, v in state["embeddings"].items()},
              "best": torch.empty(1, dtype=torch.float64),
              "optimizer": {"param_groups": [dict.fromkeys(state["optimizer"]["param_groups"][0])]}}
    dcp_read.load(loaded, f"file://{tmp_path}/step-1")
    assert all(torch.equal(loaded["embeddings"][k], v) for k, v in state["embeddings"].items())
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


@pytest.mark.parametrize("function", [pytest.param(os.system, id="os.system"),
                                      pytest.param(builtins.exec, id="builtins.exec"),
                                      pytest.param(builtins.eval, id="builtins.eval")])
def test_metadata_that_calls_anything_else_is_refused_unrun(tmp_path, function):
    marker = tmp_path / "ran"
    argument = f"touch {marker}" if function is os.system else f"open({str(marker)!r}, 'w')"
    with pytest.raises(dcp_read.UnsafeCheckpoint) as refused:
        dcp_read.read_metadata(io.BytesIO(pickle.dumps(_Payload(function, argument))))
    assert not marker.exists()
    assert "system" not in str(refused.value) and "exec" not in str(refused.value) and str(marker) not in str(
        refused.value)


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as `getattr(cls, name)`, as some Python releases do (the trainer image's)."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def test_metadata_with_enum_members_by_name_loads(tmp_path):
    _save({"t.weight": torch.randn(30, 4)}, tmp_path / "step-1")
    with open(tmp_path / "step-1" / ".metadata", "rb") as f:
        reference = pickle.load(f)  # noqa: S301 - our own file, the reference
    out = io.BytesIO()
    _EnumsByName(out).dump(reference)
    assert b"getattr" in out.getvalue()
    assert dcp_read.read_metadata(io.BytesIO(out.getvalue())) == reference


class _Getattr:
    def __init__(self, target, name: str) -> None:
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


@pytest.mark.parametrize("target, name", [
    pytest.param(object, "__subclasses__", id="a builtin class"),
    pytest.param(dcp_metadata.Metadata, "__init__", id="an allowed class's method"),
    pytest.param(dcp_metadata._MEM_FORMAT_ENCODING, "__class__", id="an allowed enum's attribute"),
    pytest.param(enum.Enum, "__new__", id="an enum that is not allowed"),
])
def test_getattr_in_metadata_gives_allowed_enum_members_only(target, name):
    with pytest.raises(dcp_read.UnsafeCheckpoint) as refused:
        dcp_read.read_metadata(io.BytesIO(pickle.dumps(_Getattr(target, name))))
    assert name not in str(refused.value)


def test_garbage_metadata_is_refused_without_quoting_it():
    with pytest.raises(dcp_read.UnsafeCheckpoint) as refused:
        dcp_read.read_metadata(io.BytesIO(b"\x80\x04" + SECRET.encode()))
    assert SECRET not in str(refused.value)


def test_a_value_that_calls_anything_is_refused_unrun(tmp_path):
    """DCP's own planner reads non-tensor values with torch.load(weights_only=False); ours with True."""
    marker = tmp_path / "ran"
    _save({"w": torch.ones(2), "extra": _Payload(os.system, f"touch {marker}")}, tmp_path / "step-1")
    with pytest.raises((dcp_read.UnsafeCheckpoint, CheckpointException)) as refused:
        dcp_read.load({"w": torch.empty(2), "extra": None}, f"file://{tmp_path}/step-1")
    assert not marker.exists()
    if isinstance(refused.value, CheckpointException):
        assert any(isinstance(e, dcp_read.UnsafeCheckpoint) for e, _ in refused.value.failures.values())


def test_the_trainer_resumes_from_no_planted_metadata(tmp_path):
    """The trainer's resume reads the same files (inside its sandbox): the planted one is skipped, unrun."""
    marker = tmp_path / "ran"
    _save({"w": torch.ones(2)}, tmp_path / "ckpt" / "step-1")
    (tmp_path / "ckpt" / "step-1" / ".metadata").write_bytes(pickle.dumps(_Payload(os.system, f"touch {marker}")))
    (tmp_path / "ckpt" / "step-1" / runtime.CHECKPOINT_MARKER).write_bytes(
        runtime.CheckpointMarker(1, runtime.CHECKPOINT_FULL, None, 1).to_bytes())
    checkpointer = Checkpointer(f"file://{tmp_path}/ckpt", keep=1, is_main=True, guard=Guard(None))
    with pytest.raises(RuntimeError, match="could be loaded"):
        checkpointer.load_latest({"w": torch.empty(2)})
    checkpointer.close()
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------- the worker's confinement
def _run(tmp_path: Path, code: str, *, read=(), denied=(), **limits) -> tuple[checkpoint_reader.Output, bytes]:
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    sink = io.BytesIO()
    output = checkpoint_reader.run([sys.executable, "-c", code], read=[str(p) for p in read], scratch=scratch,
                                   denied=[str(d) for d in denied], sandbox="auto",
                                   limits=checkpoint_reader.Limits(**limits), sink=sink)
    return output, sink.getvalue()


@needs_landlock
def test_the_reader_gets_no_server_secret_and_opens_nothing_outside_its_folders(tmp_path, monkeypatch):
    data_dir, folder = tmp_path / "kembed", tmp_path / "checkpoint"
    data_dir.mkdir()
    folder.mkdir()
    (data_dir / "admin-token").write_text(SECRET)
    (folder / "shard").symlink_to(data_dir / "admin-token")  # the kernel judges a symlink by its target
    (folder / "marker").write_text("mine")
    monkeypatch.setenv("KEMBED_DATABASE_URL", f"postgresql://{SECRET}@db/kembed")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    code = f"""
import json, os
def read(path):
    try:
        return open(path).read()
    except OSError as error:
        return type(error).__name__
print(json.dumps({{"env": dict(os.environ), "own": read({str(folder / 'marker')!r}),
                   "link": read({str(folder / 'shard')!r}), "token": read({str(data_dir / 'admin-token')!r})}}))
"""
    output, _ = _run(tmp_path, code, read=[folder], denied=[data_dir])
    seen = json.loads(output.header)
    assert seen["own"] == "mine" and seen["link"] == seen["token"] == "PermissionError"
    assert SECRET not in json.dumps(seen["env"]) and not any(k.startswith(("KEMBED_", "AWS_")) for k in seen["env"])


def test_the_reader_is_stopped_at_its_deadline_and_its_output_bound(tmp_path):
    with pytest.raises(checkpoint_reader.ReaderFailed, match="in time"):
        _run(tmp_path, "import time; time.sleep(60)", wall_seconds=2)
    with pytest.raises(checkpoint_reader.ReaderFailed, match="over its limit"):
        _run(tmp_path, "import sys; sys.stdout.write('{}\\n' + 'x' * (4 << 20))", output_bytes=1 << 20)
    output, _ = _run(tmp_path, "x = bytearray(1 << 30)", memory_bytes=256 << 20)
    assert output.returncode != 0  # MemoryError: the allocation was refused, the machine untouched


def test_readers_at_once_are_bounded(tmp_path, monkeypatch):
    """Each reader is bounded, and so is their number: one more waits, then is told to come back."""
    monkeypatch.setattr(checkpoint_reader, "_WAIT_FOR_SLOT_S", 0.1)
    held = [checkpoint_reader._slots.acquire(timeout=60) for _ in range(checkpoint_reader.MAX_READERS)]
    try:
        assert all(held)
        with pytest.raises(checkpoint_reader.ReaderBusy):
            _run(tmp_path, "print('{}')")
    finally:
        for _ in held:
            checkpoint_reader._slots.release()
    assert _run(tmp_path, "print('{}')")[0].header == b"{}"


@needs_landlock
def test_a_shard_linked_outside_is_refused_by_the_kernel_even_past_the_policy_check(tmp_path, genuine, monkeypatch):
    """Should the policy's check miss it (a bug, or a file swapped after the check), the reader still cannot
    open a shard that is a symlink to the server's data dir."""
    data_dir = tmp_path / "kembed"
    data_dir.mkdir()
    (data_dir / "kembed.db").write_text(SECRET)
    step = tmp_path / "job" / genuine.name
    shutil.copytree(genuine, step)
    shard = next(step.glob("*.distcp"))
    shard.unlink()
    shard.symlink_to(data_dir / "kembed.db")
    monkeypatch.setattr(Guard, "check_tree", lambda *a, **k: None)
    policy = StoragePolicy(own=((tmp_path / "job").as_uri(),), deny=(data_dir.as_uri(),))
    with pytest.raises(exports.CheckpointRefused, match=f"checkpoint step {step.name[5:]} refused") as refused:
        exports.export_file((tmp_path / "job").as_uri(), job_id="j", fmt="numpy", table=None, step=None, policy=policy)
    assert SECRET not in str(refused.value)


# ----------------------------------------------------------------------------------------------- against a real server
@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A real DLRM checkpoint step folder, written by the trainer."""
    root = tmp_path_factory.mktemp("genuine")
    cfg = tiny_config(training={"steps": 20, "log_every": 20}, checkpoint={"uri": f"file://{root}/ckpt",
                                                                          "every_steps": 20, "keep": 1})
    cfg["data"]["eval_samples"] = 256
    code, _, stderr = run_trainer(write_config(root / "c.yaml", cfg), timeout=300)
    assert code == 0, stderr
    return root / "ckpt" / "step-20"


@pytest.fixture(scope="module")
def writable(world, tmp_path_factory) -> Path:
    """A folder tenant alpha's jobs may write (a platform admin granted it) and its member can write directly."""
    folder = tmp_path_factory.mktemp("alpha-exports").resolve()
    with world.admin_client() as admin:
        admin.patch("/v1/tenants/alpha", json={"storage": {"read": [], "write": [str(folder)]}}).raise_for_status()
    return folder


def _job(world, folder: Path) -> str:
    """A member's job whose checkpoint folder is `folder`, cancelled before it ran (admission is paused)."""
    spec = make_spec("planted").build()
    spec["trainer"]["checkpoint"]["uri"] = str(folder)
    with world.as_("alpha", "member") as member:
        made = member.post("/v1/jobs", json=spec)
        assert made.status_code == 201, made.text
        job_id = made.json()["id"]
        member.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
    return job_id


@pytest.mark.parametrize(("route", "payload"), [
    pytest.param("export?format=numpy", _exec_payload, id="export-exec"),
    pytest.param("neighbours?word=5", _system_payload, id="neighbours-system"),
])
def test_a_planted_checkpoint_runs_nothing_in_the_server(world, writable, genuine, tmp_path, route, payload):
    marker, token = tmp_path / "ran", world.server.data_dir / "admin-token"
    folder = writable / f"planted-{route.split('?')[0]}"
    _plant(folder / "step-5", genuine, payload(marker, token))
    job_id = _job(world, folder)
    with world.as_("alpha", "member") as member:
        answer = member.get(f"/v1/jobs/{job_id}/{route}")
    assert not marker.exists(), "the planted pickle ran"
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert "checkpoint step 5 refused" in detail
    for quoted in ("exec", "system", str(marker), token.read_text().strip(), "pathlib"):
        assert quoted not in answer.text


def test_a_genuine_checkpoint_still_exports_and_answers_neighbours(world, writable, genuine):
    folder = writable / "genuine"
    shutil.copytree(genuine, folder / genuine.name)
    job_id = _job(world, folder)
    expected = export.read_table(f"file://{folder / genuine.name}")
    with world.as_("alpha", "member") as member:
        exported = member.get(f"/v1/jobs/{job_id}/export", params={"format": "numpy"})
        near = member.get(f"/v1/jobs/{job_id}/neighbours", params={"word": "5", "k": 3})
    assert exported.status_code == 200, exported.text
    assert exported.headers["X-Kembed-Table"] == expected.name
    assert np.array_equal(np.load(io.BytesIO(exported.content), allow_pickle=False), expected.vectors.read())
    assert near.status_code == 200, near.text
    assert [(n["key"], pytest.approx(n["similarity"])) for n in near.json()["neighbours"]] == [
        (k, pytest.approx(s)) for k, s in export.neighbours(expected, "5", 3)]


def test_a_shard_linked_to_the_servers_data_is_refused(world, writable, genuine):
    folder = writable / "linked"
    shutil.copytree(genuine, folder / genuine.name)
    shard = next((folder / genuine.name).glob("*.distcp"))
    shard.unlink()
    shard.symlink_to(world.server.data_dir / "admin-token")
    job_id = _job(world, folder)
    with world.as_("alpha", "member") as member:
        answer = member.get(f"/v1/jobs/{job_id}/export", params={"format": "numpy"})
    assert answer.status_code == 409, answer.text
    assert "outside the tenant's storage policy" in answer.json()["detail"]
    assert (world.server.data_dir / "admin-token").read_text().strip() not in answer.text


def test_an_s3_checkpoint_is_read_from_a_copy_by_a_worker_without_credentials(s3_server, genuine, tmp_path):
    """The server copies the chain's bytes with its credentials; the worker (no credentials, no endpoint) reads
    the copy: a genuine checkpoint exports, a planted one runs nothing."""
    import fsspec

    bucket = s3_server.create_bucket("checkpoint-reads")
    fs = fsspec.filesystem("s3")
    fs.put(str(genuine), f"{bucket}/genuine/{genuine.name}", recursive=True)
    marker = tmp_path / "ran"
    _plant(tmp_path / "planted" / "step-5", genuine, _system_payload(marker, tmp_path / "token"))
    fs.put(str(tmp_path / "planted" / "step-5"), f"{bucket}/planted/step-5", recursive=True)
    policy = StoragePolicy(own=(bucket,))
    made = exports.export_file(f"{bucket}/genuine", job_id="j", fmt="numpy", table=None, step=None, policy=policy)
    try:
        assert np.array_equal(np.load(made.path, allow_pickle=False),
                              export.read_table(f"file://{genuine}").vectors.read())
    finally:
        os.unlink(made.path)
    with pytest.raises(exports.CheckpointRefused, match="checkpoint step 5 refused"):
        exports.nearest(f"{bucket}/planted", word="5", k=3, table=None, policy=policy)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------- links a trainer plants
def test_the_server_reads_no_termination_message_through_a_link(tmp_path):
    """The local backend reads a failed trainer's message from the job's folder, which the trainer can write: a
    link there to the server's token must not come back as the job's message."""
    secret = tmp_path / "admin-token"
    secret.write_text(SECRET)
    message = tmp_path / "node-0.termination-log"
    message.symlink_to(secret)
    assert runtime.read_termination_message(message) == ""
    message.unlink()
    os.link(secret, message)
    assert runtime.read_termination_message(message) == ""
    message.unlink()
    message.write_text("step 3: out of memory")
    assert runtime.read_termination_message(message) == "step 3: out of memory"


def test_a_step_folder_or_marker_linked_elsewhere_is_not_listed(tmp_path):
    """Listing a job's checkpoints follows no link: one to another tenant's step folder would show its time and
    size."""
    from kembed_api.jobs import checkpoints

    other, mine = tmp_path / "other" / "job", tmp_path / "mine"
    for folder, step in ((other, 100), (mine, 10), (mine, 30)):
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / runtime.CHECKPOINT_MARKER).write_bytes(
            runtime.CheckpointMarker(step, runtime.CHECKPOINT_FULL, None, 1).to_bytes())
    (mine / "step-100").symlink_to(other / "step-100")
    (mine / "step-30" / runtime.CHECKPOINT_MARKER).unlink()
    (mine / "step-30" / runtime.CHECKPOINT_MARKER).symlink_to(other / "step-100" / runtime.CHECKPOINT_MARKER)
    assert [c.step for c in checkpoints.list_checkpoints(mine.as_uri())] == [10]
