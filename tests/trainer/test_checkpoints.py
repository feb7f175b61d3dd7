"""Checkpoints a user relies on: S3, keep-K, a partial or corrupt one skipped, N->M ranks, exact resume."""

from __future__ import annotations

import io
import itertools
import json
import pathlib
import subprocess
import sys
import time
import warnings

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kembed_contract import trainer_config as config
from kembed_trainer import checkpoint, dist, report, train
from tests.trainer.conftest import (
    REPO,
    run_trainer,
    run_trainer_to_its_reason,
    tiny_config,
    trainer_env,
    write_config,
)


def progress_losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if r["event"] == "progress"}


def test_s3_checkpoints_keep_the_latest_k_and_resume(tmp_path, s3_server):
    bucket = s3_server.create_bucket("kembed-ckpt")
    uri = f"{bucket}/tenant/job-1"
    cfg = tiny_config(checkpoint={"uri": uri, "every_steps": 10, "keep": 2}, training={"steps": 40})
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), **s3_server.env)
    assert code == 0, stderr
    assert [r["uri"] for r in recs if r["event"] == "checkpoint"] == [
        f"{uri}/step-{s}" for s in (10, 20, 30, 40)
    ]
    fs = fsspec.filesystem("s3")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(uri.removeprefix("s3://"))) == ["step-30", "step-40"]

    cfg["training"]["steps"] = 50
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), **s3_server.env)
    assert code == 0, stderr
    assert recs[0]["resumed_from"] == f"{uri}/step-40"
    assert recs[-1]["checkpoint"] == f"{uri}/step-50"


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="dense"),
        pytest.param(
            {
                "sparsity": {
                    "method": "score",
                    "target": 0.6,
                    "dense_until": 5,
                    "increase": 0.3,
                    "increase_every": 8,
                    "every_steps": 4,
                    "block_size": 2,
                }
            },
            id="sparse-masks",
        ),
        pytest.param({"training": {"mixed_precision": "bf16"}}, id="bf16"),
    ],
)
def test_resumed_run_gives_the_same_losses_as_an_uninterrupted_one(tmp_path, extra):
    def run(name: str, steps: int, uri: str) -> list[dict]:
        cfg = tiny_config(
            checkpoint={"uri": uri, "every_steps": 0}, training={"steps": steps, "log_every": 1}
        )
        for section, values in extra.items():
            cfg.setdefault(section, {}).update(values)
        code, recs, stderr = run_trainer(write_config(tmp_path / f"{name}.yaml", cfg))
        assert code == 0, stderr
        return recs

    straight = progress_losses(run("straight", 30, f"file://{tmp_path}/a"))
    run("first-half", 15, f"file://{tmp_path}/b")
    resumed = run("second-half", 30, f"file://{tmp_path}/b")
    assert resumed[0]["step"] == 15
    second = progress_losses(resumed)
    assert list(second) == list(range(16, 31))
    assert second == {s: straight[s] for s in second}  # bit for bit, not approximately


def write_without_best(step_dir: pathlib.Path, scratch: pathlib.Path) -> None:
    """Rewrite a checkpoint as the trainer wrote it before it kept the best eval: no `trainer.best`."""
    dcp_to_torch_save(step_dir, scratch)
    state = torch.load(scratch, weights_only=False)
    del state["trainer"]["best"]
    for file in [step_dir / ".metadata", *step_dir.glob("*.distcp")]:
        file.unlink()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: as meant
        dcp.save(state, storage_writer=FsspecWriter(f"file://{step_dir}"))


def test_a_checkpoint_from_before_the_best_eval_was_kept_resumes(tmp_path):
    def run(name: str, steps: int, uri: str) -> list[dict]:
        cfg = tiny_config(checkpoint={"uri": uri, "every_steps": 0}, training={"steps": steps, "log_every": 1})
        code, recs, stderr = run_trainer(write_config(tmp_path / f"{name}.yaml", cfg))
        assert code == 0, stderr
        return recs

    straight = progress_losses(run("straight", 30, f"file://{tmp_path}/a"))
    run("first-half", 15, f"file://{tmp_path}/b")
    write_without_best(tmp_path / "b" / "step-15", tmp_path / "old.pt")
    resumed = run("second-half", 30, f"file://{tmp_path}/b")
    assert resumed[0]["resumed_from"] == f"file://{tmp_path}/b/step-15"
    second = progress_losses(resumed)
    assert second == {s: straight[s] for s in range(16, 31)}
    assert resumed[-1]["event"] == "done" and resumed[-1]["best_step"] == 30  # its evals since count


def test_partial_and_corrupt_latest_checkpoints_are_skipped(tmp_path, ckpt_uri):
    cfg = tiny_config(checkpoint={"uri": ckpt_uri, "every_steps": 10, "keep": 5}, training={"steps": 30})
    path = write_config(tmp_path / "c.yaml", cfg)
    assert run_trainer(path)[0] == 0
    root = ckpt_uri.removeprefix("file://")
    (tmp_path / "ckpt" / "step-30" / "COMPLETE").unlink()  # as if the save of step 30 was cut short
    shard = next((tmp_path / "ckpt" / "step-20").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # step 20 complete but its data damaged since

    code, recs, stderr = run_trainer(path)
    assert code == 0, stderr
    assert recs[0]["resumed_from"] == f"file://{root}/step-10"
    assert "step-20 unreadable" in stderr
    assert recs[-1]["step"] == 30 and recs[-1]["checkpoint"] == f"file://{root}/step-30"


@pytest.mark.parametrize(
    ("first", "then", "sharded"),
    [
        pytest.param(2, 1, False, id="2-to-1"),
        pytest.param(1, 2, False, id="1-to-2"),
        pytest.param(2, 1, True, id="2-to-1-sharded"),
        pytest.param(1, 2, True, id="1-to-2-sharded"),
    ],
)
def test_checkpoint_loads_on_a_different_number_of_ranks(tmp_path, ckpt_uri, first, then, sharded):
    # 500 rows and up: the four biggest tiny tables are split row-wise, the four small ones replicated.
    embeddings = {"shard_threshold_rows": 500 if sharded else 10**9}
    cfg = tiny_config(checkpoint={"uri": ckpt_uri}, training={"steps": 20}, embeddings=embeddings)
    path = write_config(tmp_path / "c.yaml", cfg)
    code, before, stderr = run_trainer(path, nproc=first)
    assert code == 0, stderr
    # Resuming at the last step only evaluates: the same model must give the same held-out metrics.
    code, after, stderr = run_trainer(path, nproc=then)
    assert code == 0, stderr
    assert after[0]["world_size"] == then and after[0]["resumed_from"] == f"{ckpt_uri}/step-20"
    assert after[-1]["eval"] == pytest.approx(before[-1]["eval"], rel=1e-5)

    cfg["training"]["steps"] = 30  # and it trains on from there
    code, more, stderr = run_trainer(write_config(path, cfg), nproc=then)
    assert code == 0, stderr
    assert more[-1]["step"] == 30


class SlowWriter(checkpoint.StepWriter):
    """A checkpoint store that takes a while to write, like a slow S3 upload."""

    delay_s = 1.0

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


def test_training_goes_on_while_a_checkpoint_is_written(monkeypatch, ckpt_uri):
    monkeypatch.setattr(checkpoint, "StepWriter", SlowWriter)
    cfg = tiny_config(
        checkpoint={"uri": ckpt_uri, "every_steps": 10, "keep": 5}, training={"steps": 30, "log_every": 1}
    )
    out = io.StringIO()
    trainer = train.Trainer(
        config.TrainerConfig.model_validate(cfg),
        dist.setup("gloo", threads=1),
        report.Reporter(enabled=True, out=out),
    )
    assert trainer.train() == 0
    recs = [json.loads(line) for line in out.getvalue().splitlines()]
    order = [(r["event"], r["step"]) for r in recs]
    first = next(r for r in recs if r["event"] == "checkpoint")
    assert first["step"] == 10
    assert order.index(("progress", 11)) < order.index(
        ("checkpoint", 10)
    )  # step 11 trained during the upload
    assert first["blocked_seconds"] < 0.5 < SlowWriter.delay_s <= first["seconds"]
    # Every save landed, the last one before `done`.
    assert [s for e, s in order if e == "checkpoint"] == [10, 20, 30] and order[-2] == ("checkpoint", 30)


KILLED_MID_SAVE = """
import sys, time
from kembed_trainer import __main__, checkpoint

class StuckAtStep20(checkpoint.StepWriter):
    def write_data(self, plan, planner):
        if "step-20" in str(self.path):
            time.sleep(600)  # killed before this returns
        return super().write_data(plan, planner)

checkpoint.StepWriter = StuckAtStep20
sys.exit(__main__.main(["--config", sys.argv[1]]))
"""


def test_a_checkpoint_killed_mid_save_is_never_loaded(tmp_path, ckpt_uri):
    cfg = tiny_config(
        checkpoint={"uri": ckpt_uri, "every_steps": 10, "keep": 5}, training={"steps": 1000, "log_every": 1}
    )
    path = write_config(tmp_path / "c.yaml", cfg)
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_SAVE, str(path)],
        env=trainer_env(),
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    for line in proc.stdout:
        if '"progress"' in line and json.loads(line)["step"] == 25:  # the step-20 save is in flight
            break
    proc.kill()
    proc.wait(timeout=30)
    step_20 = tmp_path / "ckpt" / "step-20"
    assert step_20.exists() and not (step_20 / "COMPLETE").exists()

    cfg["training"]["steps"] = 30
    code, recs, stderr = run_trainer(write_config(path, cfg))
    assert code == 0, stderr
    assert recs[0]["resumed_from"] == f"{ckpt_uri}/step-10"
    assert recs[-1]["checkpoint"] == f"{ckpt_uri}/step-30"


def test_a_save_past_the_storage_budget_is_dropped_and_keep_k_counts(tmp_path):
    """A job told its storage budget (runtime.ENV_STORAGE_BUDGET) never marks a save that would pass it: it removes
    that save's files, keeps its earlier checkpoints, and exits EXIT_STORAGE_QUOTA with the reason; pruning to
    `keep` counts, so a job that keeps few checkpoints runs on within the same budget."""
    from kembed_contract import runtime

    unlimited = tiny_config(checkpoint={"uri": f"file://{tmp_path}/free", "every_steps": 1, "keep": 100},
                            training={"steps": 3})
    code, recs, stderr = run_trainer(write_config(tmp_path / "free.yaml", unlimited))
    assert code == 0, stderr
    saves = [r for r in recs if r["event"] == "checkpoint"]
    assert [r["stored_bytes"] for r in saves] == list(itertools.accumulate(r["num_bytes"] for r in saves))
    budget = str(int(saves[0]["num_bytes"] * 2.5))  # two checkpoints fit, a third does not

    capped = tiny_config(checkpoint={"uri": f"file://{tmp_path}/capped", "every_steps": 1, "keep": 100},
                         training={"steps": 10})
    code, message, stderr = run_trainer_to_its_reason(write_config(tmp_path / "capped.yaml", capped),
                                                      **{runtime.ENV_STORAGE_BUDGET: budget})
    assert code == runtime.EXIT_STORAGE_QUOTA, stderr
    assert "checkpoint step 3 not saved" in message and f"over the {budget} bytes" in message
    assert sorted(p.name for p in (tmp_path / "capped").iterdir()) == ["step-1", "step-2"]  # step 3's files gone
    for step in (1, 2):
        assert (tmp_path / "capped" / f"step-{step}" / runtime.CHECKPOINT_MARKER).exists()

    pruned = tiny_config(checkpoint={"uri": f"file://{tmp_path}/pruned", "every_steps": 1, "keep": 2},
                         training={"steps": 6})
    code, recs, stderr = run_trainer(write_config(tmp_path / "pruned.yaml", pruned),
                                     **{runtime.ENV_STORAGE_BUDGET: budget})
    assert code == 0, stderr
    assert sorted(p.name for p in (tmp_path / "pruned").iterdir()) == ["step-5", "step-6"]
