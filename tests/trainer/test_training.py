"""Training as a user sees it: loss goes down, ranks cooperate, SIGTERM checkpoints and the rerun resumes."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import weakref

import pytest

from kembed_contract import job_seconds
from kembed_contract import trainer_config as config
from kembed_trainer import dist, report, train
from tests.trainer.conftest import (
    REPO,
    records,
    run_trainer,
    tiny_config,
    trainer_command,
    trainer_env,
    write_config,
)


def train_in_process(cfg: dict) -> tuple[int, list[dict]]:
    out = io.StringIO()
    env = dist.setup("gloo", threads=1)
    code = train.Trainer(
        config.TrainerConfig.model_validate(cfg), env, report.Reporter(enabled=True, out=out)
    ).train()
    return code, [json.loads(line) for line in out.getvalue().splitlines()]


def test_single_process_training_lowers_loss_and_learns_the_signal(ckpt_uri):
    code, recs = train_in_process(tiny_config(checkpoint={"uri": ckpt_uri}))
    assert code == 0
    losses = [r["loss"] for r in recs if r["event"] == "progress"]
    assert losses[-1] < losses[0] - 0.05
    done = recs[-1]
    assert done["event"] == "done" and done["step"] == 60
    assert done["eval"]["auc"] > 0.7
    assert done["checkpoint"] == f"{ckpt_uri}/step-60"


def test_a_finished_trainer_is_freed_once_dropped_and_a_sigterm_after_it_is_harmless(ckpt_uri):
    # What holds the trainer holds its DDP model's process groups: they must go when the trainer goes, before the
    # process groups are destroyed, not in the interpreter's own teardown (where gloo's end sometimes aborted).
    trainer = train.Trainer(config.TrainerConfig.model_validate(tiny_config(checkpoint={"uri": ckpt_uri})),
                            dist.setup("gloo", threads=1), report.Reporter(enabled=True, out=io.StringIO()))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert trainer.train() == 0
        trainer.close()
        gone = weakref.ref(trainer)
        del trainer
        assert gone() is None  # freed at once: no reference cycle, nothing in the signal module
        os.kill(os.getpid(), signal.SIGTERM)  # the handler left behind does nothing once its trainer is gone
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_records_have_the_contract_fields(tmp_path, ckpt_uri):
    code, recs = train_in_process(
        tiny_config(checkpoint={"uri": ckpt_uri, "every_steps": 30}, training={"steps": 40})
    )
    assert code == 0
    events = [r["event"] for r in recs]
    # Saves are asynchronous: the step-30 record comes when that save landed, a step or more later.
    assert [e for e in events if e != "checkpoint"] == ["started", *["progress"] * 4, "eval", "done"]
    assert [r["step"] for r in recs if r["event"] == "checkpoint"] == [30, 40]
    assert events[-2:] == ["checkpoint", "done"] and events.index("checkpoint") > events.index("progress")
    assert all({"event", "step", "time"} <= r.keys() for r in recs)
    # Every record carries its run and its place in it, so the API applies a redelivered one once.
    assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1)) and len({r["run"] for r in recs}) == 1
    assert recs[0] | {"time": 0, "run": None, "seconds": None} == {
        "seconds": None,  # below
        "run": None,
        "seq": 1,
        "event": "started",
        "step": 0,
        "time": 0,
        "total_steps": 40,
        "world_size": 1,
        "resumed_from": None,
        "embedding_mb": pytest.approx(4600 * (8 + 1) * 4 / 2**20, rel=0.01),  # rows x (dim + row-wise sum_sq)
        "dataset": {"eval_rows": 4096},  # synthetic data: endless training rows, a fixed eval set
    }
    progress = recs[1]
    assert {"total_steps", "loss", "samples_per_sec", "unique_ids_per_step", "memory_mb"} <= progress.keys()
    # The seconds by phase so far (kembed_contract.job_seconds) ride on started, progress and done, never falling.
    timed = [r["seconds"] for r in recs if r["event"] in ("started", "progress", "done")]
    assert all(set(s) == set(job_seconds.TRAINER_PHASES) for s in timed)
    assert all(later[p] >= earlier[p] for earlier, later in itertools.pairwise(timed) for p in later)
    assert timed[0]["data"] > 0 and timed[0]["training"] == 0
    assert timed[-1]["training"] > 0 and timed[-1]["evaluation"] > 0 and timed[-1]["saving"] > 0
    ckpt = next(r for r in recs if r["event"] == "checkpoint")
    assert ckpt["uri"] == f"{ckpt_uri}/step-30" and ckpt["num_bytes"] > 0
    assert 0 <= ckpt["blocked_seconds"] <= ckpt["seconds"]
    assert os.path.exists(f"{ckpt_uri.removeprefix('file://')}/step-30/COMPLETE")


def test_sigterm_checkpoints_and_the_rerun_resumes(tmp_path, ckpt_uri):
    path = write_config(
        tmp_path / "c.yaml",
        tiny_config(
            checkpoint={"uri": ckpt_uri, "every_steps": 0}, training={"steps": 100000, "log_every": 5}
        ),
    )
    proc = subprocess.Popen(
        trainer_command(path), env=trainer_env(), stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    for line in proc.stdout:
        if '"progress"' in line:  # training is under way
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143
    saved = [r for r in records(out) if r["event"] == "checkpoint"]
    assert len(saved) == 1
    stopped_at = saved[0]["step"]

    write_config(path, tiny_config(checkpoint={"uri": ckpt_uri}, training={"steps": stopped_at + 10}))
    code, recs, stderr = run_trainer(path)
    assert code == 0, stderr
    assert recs[0]["resumed_from"] == saved[0]["uri"] and recs[0]["step"] == stopped_at
    assert recs[-1]["event"] == "done" and recs[-1]["step"] == stopped_at + 10


@pytest.mark.parametrize("compression", [pytest.param("bf16", id="bf16"), pytest.param("fp16", id="fp16")])
def test_compressed_gradients_still_learn(tmp_path, ckpt_uri, compression):
    cfg = tiny_config(
        checkpoint={"uri": ckpt_uri}, training={"steps": 30}, distributed={"grad_compression": compression}
    )
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg), nproc=2)
    assert code == 0, stderr
    assert recs[0]["world_size"] == 2
    assert [r["event"] for r in recs].count("started") == 1  # only rank 0 reports
    assert recs[-1]["event"] == "done" and recs[-1]["eval"]["auc"] > 0.6


def test_a_trainer_handed_other_data_trains_on_its_batches():
    """What benchmarks do: replace the data source after building the trainer (batches generated up front)."""
    trainer = train.Trainer(config.TrainerConfig.model_validate(tiny_config(checkpoint={"uri": None})),
                            dist.setup("gloo", threads=1), report.Reporter(enabled=False))
    source, asked = trainer.data, []

    class Recorded:
        def train_batch(self, step):
            asked.append(step)
            return source.train_batch(step)

    trainer.data = Recorded()
    trainer.train_step()
    assert asked == [0]
