"""Incremental checkpoints: chains of a full checkpoint and deltas that survive kill -9 at every phase of a save,
resume bit for bit, load on another world size, and are pruned whole."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import threading
import uuid

import fsspec
import pytest

from kembed_contract import runtime
from kembed_trainer import checkpoint
from kembed_trainer.storage import Guard
from tests.trainer.conftest import REPO, run_trainer, tiny_config, trainer_env, write_config

# Saves every 5 steps: full at 5, deltas at 10, 15, 20, full at 25, delta at 30 (full_every 4; the size rule off).
CHAIN = {"every_steps": 5, "incremental": True, "full_every": 4, "max_chain_share": 100, "keep": 10}
STEPS = 30
RUN_TIMEOUT_S = 600  # seconds on a quiet machine; the limit only stops a hung run
HANG_WAIT_S = 240  # for the trainer to reach a save that takes seconds; past it, where it is stuck is the failure
# Admission counts change on rows other than the ones trained: deltas must carry them too.
TABLES_WITH_ADMISSION = [
    {"name": "t0", "num_embeddings": 2000, "embedding_dim": 8, "features": ["c0"], "admit_after": 2},
    {"name": "t1", "num_embeddings": 1000, "embedding_dim": 8, "features": ["c1"]},
]


def chain_config(uri: str, **checkpoint_settings) -> dict:
    return tiny_config(
        checkpoint={"uri": uri, **CHAIN, **checkpoint_settings},
        training={"steps": STEPS, "log_every": 1},
        embeddings={"tables": TABLES_WITH_ADMISSION},
        optimizer={"sparse": {"name": "adam", "lr": 0.05}},  # two state tensors per element
    )


def losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if r["event"] == "progress"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The records of a run that is never stopped (its own full checkpoints only at the end)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    cfg = chain_config(f"file://{tmp}/ckpt", incremental=False, every_steps=0)
    code, recs, stderr = run_trainer(write_config(tmp / "c.yaml", cfg), timeout=RUN_TIMEOUT_S)
    assert code == 0, stderr
    return recs


# The trainer with a hang at one phase of the save of step 15 (a delta); the test kills it with SIGKILL there.
HANGS_AT = """
import sys, time
from kembed_trainer import __main__, checkpoint

PHASE, STEP = sys.argv[2], 15

def hang():
    sys.stdout.write("HANG\\n")  # one write: a record the main thread prints cannot split the line
    sys.stdout.flush()
    time.sleep(600)

if PHASE == "before":  # training reached the save, nothing of it written
    save = checkpoint.Checkpointer.save
    def stuck_save(self, step, *args, **kwargs):
        if step == STEP:
            hang()
        return save(self, step, *args, **kwargs)
    checkpoint.Checkpointer.save = stuck_save
elif PHASE == "during":  # the side files and part of DCP's written, no marker
    class StuckWriter(checkpoint.StepWriter):
        def write_data(self, plan, planner):
            if f"step-{STEP}" in str(self.path):
                hang()
            return super().write_data(plan, planner)
    checkpoint.StepWriter = StuckWriter
elif PHASE == "after":  # the marker written, nothing pruned or reported yet
    prune = checkpoint.Checkpointer._prune
    def stuck_prune(self, *args):
        if self._chain[-1].step == STEP:
            hang()
        return prune(self, *args)
    checkpoint.Checkpointer._prune = stuck_prune
sys.exit(__main__.main(["--config", sys.argv[1]]))
"""


def run_until_hang(config: pathlib.Path, phase: str, **env: str) -> None:
    """Runs the trainer until it prints HANG, then SIGKILLs it. A trainer that neither hangs nor ends within
    HANG_WAIT_S is stopped with SIGABRT instead, so that faulthandler prints where each of its threads was: the
    failure then shows what the trainer was stuck on, not only that it was."""
    stderr = config.with_suffix(".stderr")
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-c", HANGS_AT, str(config), phase],
            env=trainer_env(**env), stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
        )
    hung = threading.Event()

    def watch() -> None:
        for line in proc.stdout:
            if line.startswith("HANG"):
                hung.set()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        watcher.join(HANG_WAIT_S)
        if watcher.is_alive():
            proc.send_signal(signal.SIGABRT)
            proc.wait(timeout=30)
            raise AssertionError(f"the trainer neither reached its {phase} hang nor ended in {HANG_WAIT_S} s; "
                                 f"its threads then:\n{stderr.read_text()[-6000:]}")
        assert hung.is_set(), f"the trainer ended before its {phase} hang (exit {proc.wait()})"
    finally:
        proc.kill()  # SIGKILL: no handler runs, nothing is flushed or cleaned up
        proc.wait(timeout=30)


def storage(request, where: str) -> tuple[str, dict[str, str]]:
    """A checkpoint folder on file:// or on the S3 server (a bucket of its own), and the environment to reach it."""
    if where == "s3":
        s3 = request.getfixturevalue("s3_server")
        return f"{s3.create_bucket(f'incr-{uuid.uuid4().hex[:12]}')}/job", s3.env
    return f"file://{request.getfixturevalue('tmp_path')}/ckpt", {}


@pytest.fixture(params=["file", "s3"])
def store(request) -> tuple[str, dict[str, str]]:
    return storage(request, request.param)


@pytest.mark.parametrize(("where", "phase", "resumes_from"), [
    pytest.param("file", "before", 10, id="file-before"),
    pytest.param("file", "during", 10, id="file-during"),
    pytest.param("file", "after", 15, id="file-after"),
    pytest.param("s3", "during", 10, id="s3-during"),
])
def test_a_chain_killed_at_any_phase_of_a_delta_resumes_bit_for_bit(request, tmp_path, uninterrupted, where,
                                                                    phase, resumes_from):
    uri, env = storage(request, where)
    config = write_config(tmp_path / "c.yaml", chain_config(uri))
    run_until_hang(config, phase, **env)

    code, recs, stderr = run_trainer(config, **env, timeout=RUN_TIMEOUT_S)
    assert code == 0, stderr
    assert recs[0]["resumed_from"] == f"{uri}/step-{resumes_from}"
    resumed = losses(recs)
    assert list(resumed) == list(range(resumes_from + 1, STEPS + 1))
    assert resumed == {s: losses(uninterrupted)[s] for s in resumed}  # bit for bit, not approximately
    assert recs[-1]["eval"] == uninterrupted[-1]["eval"]
    saves = [(r["step"], r["kind"], r["parent_step"]) for r in recs if r["event"] == "checkpoint"]
    # The chain goes on where it was cut: the next save is a delta on the step it resumed from.
    assert saves[0] == (resumes_from + 5, "delta", resumes_from)


@pytest.mark.parametrize(("first", "then"), [pytest.param(2, 1, id="2-to-1"), pytest.param(1, 2, id="1-to-2")])
def test_a_chain_loads_on_another_number_of_ranks(tmp_path, ckpt_uri, first, then):
    # 500 rows and up: t0 and t1 are split row-wise, the rest replicated.
    cfg = tiny_config(checkpoint={"uri": ckpt_uri, **CHAIN}, training={"steps": 20},
                      embeddings={"shard_threshold_rows": 500})
    path = write_config(tmp_path / "c.yaml", cfg)
    code, before, stderr = run_trainer(path, nproc=first, timeout=RUN_TIMEOUT_S)
    assert code == 0, stderr
    assert [(r["step"], r["kind"]) for r in before if r["event"] == "checkpoint"] == [
        (5, "full"), (10, "delta"), (15, "delta"), (20, "delta")]
    # Resuming at the last step only evaluates: the model rebuilt from the chain gives the same held-out metrics.
    code, after, stderr = run_trainer(path, nproc=then, timeout=RUN_TIMEOUT_S)
    assert code == 0, stderr
    assert after[0]["world_size"] == then and after[0]["resumed_from"] == f"{ckpt_uri}/step-20"
    assert after[-1]["eval"] == pytest.approx(before[-1]["eval"], rel=1e-5)


def test_keep_prunes_whole_chains_and_size_starts_a_new_one(tmp_path, store):
    uri, env = store
    # Full every 3 saves: 3 F, 6 D, 9 D, 12 F, 15 D, 18 D.
    cfg = chain_config(uri, every_steps=3, full_every=3, keep=2)
    cfg["training"].update(steps=18, log_every=6)
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), **env, timeout=RUN_TIMEOUT_S)
    assert code == 0, stderr
    assert [r["kind"] for r in recs if r["event"] == "checkpoint"] == ["full", "delta", "delta"] * 2
    # keep 2: steps 18 and 15 stay restorable, and they need their chain from 12; 3's chain went whole.
    pointer = checkpoint.Checkpointer(uri, keep=2, is_main=False, guard=Guard(None))
    assert sorted(pointer.markers()) == [12, 15, 18]
    assert pointer.complete_steps() == [18, 15, 12]

    # Deltas adding up to more than max_chain_share of their full checkpoint start a new chain.
    cfg["checkpoint"].update(max_chain_share=0.01)
    cfg["training"]["steps"] = 24
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), **env, timeout=RUN_TIMEOUT_S)
    assert code == 0, stderr
    assert recs[0]["resumed_from"] == f"{uri}/step-18"
    assert [(r["step"], r["kind"]) for r in recs if r["event"] == "checkpoint"] == [(21, "full"), (24, "delta")]


def write_checkpoint(root: pathlib.Path, step: int, parent: int | None) -> None:
    (root / f"step-{step}").mkdir(parents=True)
    (root / f"step-{step}" / "data").write_bytes(b"x" * 10)
    kind = runtime.CHECKPOINT_FULL if parent is None else runtime.CHECKPOINT_DELTA
    marker = runtime.CheckpointMarker(step, kind, parent, 10)
    (root / f"step-{step}" / runtime.CHECKPOINT_MARKER).write_bytes(marker.to_bytes())


def test_pruning_keeps_the_best_steps_chain_and_a_cut_prune_leaves_no_orphan(tmp_path, monkeypatch):
    # Two chains: 1 <- 2 <- 3 and 4 <- 5 <- 6.
    for step, parent in {1: None, 2: 1, 3: 2, 4: None, 5: 4, 6: 5}.items():
        write_checkpoint(tmp_path, step, parent)
    (tmp_path / "step-7").mkdir()  # a save under way
    ckpt = checkpoint.Checkpointer(f"file://{tmp_path}", keep=1, is_main=True, guard=Guard(None))
    assert ckpt.complete_steps() == [6, 5, 4, 3, 2, 1]

    # The best (pinned) was step 2: it keeps 1 and 2, not 3. A prune killed after its first deletion...
    ckpt.pinned_step = 2
    removed = []
    real_rm = ckpt.fs.rm

    def rm_then_die(path, recursive=False):
        real_rm(path, recursive=recursive)
        if recursive:
            removed.append(path.rsplit("/", 1)[-1])
            raise KeyboardInterrupt("killed mid-prune")

    monkeypatch.setattr(ckpt.fs, "rm", rm_then_die)
    with pytest.raises(KeyboardInterrupt):
        ckpt._prune()
    assert removed == ["step-3"]  # ...deleted the newest first: every chain left is whole
    assert ckpt.complete_steps() == [6, 5, 4, 2, 1]

    monkeypatch.setattr(ckpt.fs, "rm", real_rm)
    write_checkpoint(tmp_path, 8, 99)  # a delta whose base is gone (deleted by hand): useless, so deleted
    assert 8 not in ckpt.complete_steps()
    ckpt._prune()
    left = sorted(int(p.name[5:]) for p in tmp_path.glob("step-*"))
    assert left == [1, 2, 4, 5, 6, 7]  # the newest chain, the best step's, the save under way


def test_old_markers_are_full_checkpoints_and_broken_ones_never_restore():
    assert runtime.CheckpointMarker.parse(10, json.dumps({"step": 10}).encode()).kind == runtime.CHECKPOINT_FULL
    assert runtime.CheckpointMarker.parse(10, b"").kind == runtime.CHECKPOINT_FULL
    looped = runtime.CheckpointMarker.parse(10, json.dumps({"kind": "delta", "parent": 10}).encode())
    assert runtime.chain_of(10, {10: looped}) is None


def test_an_export_of_a_delta_equals_one_of_a_full_checkpoint(tmp_path):
    from kembed_trainer import export

    tables = {}
    for name, incremental in (("full", False), ("chain", True)):
        uri = f"file://{tmp_path}/{name}"
        cfg = chain_config(uri, incremental=incremental)
        cfg["training"]["steps"] = 20
        code, recs, stderr = run_trainer(write_config(tmp_path / f"{name}.yaml", cfg), timeout=RUN_TIMEOUT_S)
        assert code == 0, stderr
        assert recs[-1]["checkpoint"] == f"{uri}/step-20"
        tables[name] = export.read_table(f"{uri}/step-20", "t0")
    assert fsspec.filesystem("file").exists(f"{tmp_path}/chain/step-20/{runtime.CHECKPOINT_MARKER}")
    assert (tables["chain"].vectors.read() == tables["full"].vectors.read()).all()
    assert list(tables["chain"].keys) == list(tables["full"].keys)
