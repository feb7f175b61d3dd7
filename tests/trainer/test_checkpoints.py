"""Checkpoints a user relies on: S3, keep-K, a partial or corrupt one skipped, N->M ranks, exact resume."""

from __future__ import annotations

import fsspec
import pytest

from tests.trainer.conftest import run_trainer, tiny_config, write_config


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


def test_resumed_run_gives_the_same_losses_as_an_uninterrupted_one(tmp_path):
    def run(name: str, steps: int, uri: str) -> list[dict]:
        cfg = tiny_config(
            checkpoint={"uri": uri, "every_steps": 0}, training={"steps": steps, "log_every": 1}
        )
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
