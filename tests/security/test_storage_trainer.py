"""Trainers started directly with a malicious config (no API in front) under tenant b's storage policy: they
read and write nothing outside it, delete nothing of tenant a's, and never echo a file's contents."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kembed_contract.storage_policy import POLICY_ENV
from tests.builders import TINY_TRAINER
from tests.security.storage_layout import SECRET, Layout, make_layout, tenant_a_files
from tests.trainer.conftest import records, trainer_env

EXIT_BAD_CONFIG = 2


@pytest.fixture
def layout(tmp_path) -> Layout:
    return make_layout(tmp_path)


def run_as_b(layout: Layout, trainer: dict, *, steps: int = 4) -> tuple[int, list[dict], str]:
    """Tenant b's trainer, launched as the platform launches it (policy in the environment)."""
    config = {**trainer, "training": {**trainer["training"], "steps": steps}}
    path = layout.root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is what we test
        [sys.executable, "-m", "kembed_trainer", "--config", str(path)], capture_output=True, text=True,
        timeout=180, cwd=layout.root, env=trainer_env(**{POLICY_ENV: layout.policy("b").to_json()}))
    return proc.returncode, records(proc.stdout), proc.stdout + proc.stderr


def tiny(**sections) -> dict:
    config = yaml.safe_load(yaml.safe_dump(TINY_TRAINER))
    config.update(sections)
    return config


def table_data(uri: str, **extra) -> dict:
    return {"kind": "table", "uri": uri, "label": "label", "dense": [], "eval_fraction": 0.0,
            "sparse": {f"c{i}": "c" for i in range(8)}, **extra}


@pytest.mark.parametrize("spelling", [
    pytest.param("{a}/job-a", id="plain"),
    pytest.param("{b}/../a/job-a", id="dot-dot"),
    pytest.param("file://{b}/%2e%2e/a/job-a", id="percent"),
    pytest.param("file://localhost{a}/job-a", id="localhost"),
    pytest.param("{b}/link-to-a/job-a", id="symlink"),
    pytest.param("{root}", id="checkpoint-root"),
    pytest.param("{data}", id="data-dir"),
])
def test_checkpointing_into_tenant_a_with_keep_1_is_refused_and_deletes_nothing(layout, spelling):
    (layout.folder("b") / "link-to-a").symlink_to(layout.folder("a"))
    before = tenant_a_files(layout)
    uri = spelling.format(a=layout.folder("a"), b=layout.folder("b"), root=layout.checkpoints, data=layout.data_dir)
    code, recs, output = run_as_b(layout, tiny(checkpoint={"uri": uri, "every_steps": 1, "keep": 1}))
    assert code == EXIT_BAD_CONFIG, output
    assert "checkpoint.uri" in output and "outside the tenant's storage policy" in output
    assert not any(r["event"] == "started" for r in recs)  # refused before anything ran: nothing resumed
    assert tenant_a_files(layout) == before


@pytest.mark.parametrize(("field", "target"), [
    pytest.param("uri", "{data}/admin-token", id="admin-token"),
    pytest.param("eval_uri", "file://{data}/admin-token", id="eval-admin-token"),
    pytest.param("uri", "{data}/kembed.db", id="sqlite-db"),
    pytest.param("uri", "/proc/self/environ", id="proc-self-environ"),
    pytest.param("uri", "/etc/passwd", id="etc-passwd"),
    pytest.param("uri", "{a}/job-a/step-20/.metadata", id="other-tenant-checkpoint"),
    pytest.param("uri", "{outside}/secret.csv", id="outside-the-policy"),
    pytest.param("uri", "{datasets}/../outside/secret.csv", id="dot-dot-out-of-datasets"),
])
def test_reading_outside_the_policy_is_refused_without_echoing_the_file(layout, field, target):
    (layout.datasets / "train.csv").write_text("c,label\n1,0\n2,1\n")
    target = target.format(data=layout.data_dir, a=layout.folder("a"), outside=layout.outside,
                           datasets=layout.datasets)
    data = table_data(str(layout.datasets / "train.csv"))
    data[field] = target
    code, _, output = run_as_b(layout, tiny(data=data))
    assert code == EXIT_BAD_CONFIG, output
    assert f"data.{field}" in output and SECRET not in output


def test_a_symlink_inside_an_allowed_folder_is_not_followed_out_of_it(layout):
    (layout.datasets / "train.csv").write_text("c,label\n1,0\n2,1\n")
    (layout.datasets / "zz-token.csv").symlink_to(layout.data_dir / "admin-token")
    code, _, output = run_as_b(layout, tiny(data=table_data(str(layout.datasets))))
    assert code == EXIT_BAD_CONFIG, output
    assert "outside the tenant's storage policy" in output and SECRET not in output


def test_resuming_from_tenant_a_through_a_planted_step_folder_is_refused(layout):
    own = layout.folder("b") / "job-b"
    own.mkdir()
    (own / "step-30").symlink_to(layout.folder("a") / "job-a" / "step-20")  # "the latest checkpoint" is a's
    before = tenant_a_files(layout)
    code, recs, output = run_as_b(layout, tiny(checkpoint={"uri": str(own), "keep": 1}))
    assert code == EXIT_BAD_CONFIG, output
    assert "step-30" in output and "outside the tenant's storage policy" in output
    assert not any(r["event"] == "started" for r in recs)
    assert tenant_a_files(layout) == before


def test_a_file_that_is_not_the_data_it_should_be_is_named_not_quoted(layout):
    """The admin-token incident: the first line of a file read as CSV used to come back as a column name."""
    (layout.datasets / "token.csv").write_text(SECRET + "\n")
    (layout.datasets / "ragged.csv").write_text(f"c,label\n1,0\n{SECRET},1,2,3\n")
    for name in ("token.csv", "ragged.csv"):
        code, _, output = run_as_b(layout, tiny(data=table_data(str(layout.datasets / name))))
        assert code != 0 and SECRET not in output, output
        assert name in output or "data.label" in output, output


def test_the_own_folder_and_datasets_still_work(layout):
    """The policy lets through what it should: a dataset read, checkpoints written and pruned with keep 1."""
    (layout.datasets / "train.csv").write_text("c,label\n" + "".join(f"{i % 7},{i % 2}\n" for i in range(64)))
    own = f"file://localhost{layout.folder('b')}/x/../job-b"
    code, recs, output = run_as_b(layout, tiny(data=table_data(str(layout.datasets / "train.csv")),
                                                checkpoint={"uri": own, "every_steps": 2, "keep": 1}))
    assert code == 0, output
    done = next(r for r in recs if r["event"] == "done")
    assert done["checkpoint"] == f"{layout.folder('b').as_uri()}/job-b/step-4"
    assert sorted(p.name for p in (layout.folder("b") / "job-b").iterdir()) == ["step-4"]


def test_without_a_policy_a_trainer_run_by_hand_is_not_limited(tmp_path):
    """The policy comes from the launcher, not the config: a config cannot switch it off, but a person running
    the trainer on their own machine is not limited."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny(checkpoint={"uri": str(tmp_path / "ckpt")}, training={
        **TINY_TRAINER["training"], "steps": 2})))
    proc = subprocess.run([sys.executable, "-m", "kembed_trainer", "--config", str(path)], capture_output=True,
                          text=True, timeout=180, env=trainer_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert Path(tmp_path / "ckpt" / "step-2" / "COMPLETE").exists()


@pytest.mark.parametrize("target", [
    pytest.param("{data}/admin-token", id="admin-token"),
    pytest.param("{a}/job-a/step-20/.metadata", id="other-tenant-checkpoint"),
])
def test_word2vec_analogies_are_opened_through_the_policy(layout, target):
    """A link planted in an allowed folder after the job was checked: the analogies file is refused when it is
    opened, like every other file (it was opened with plain fsspec before)."""
    from kembed_contract.storage_policy import StorageDenied
    from kembed_trainer.models.word2vec.word_eval import WordEval
    from kembed_trainer.storage import Guard

    link = layout.datasets / "analogies.txt"
    link.symlink_to(target.format(data=layout.data_dir, a=layout.folder("a")))
    with pytest.raises(StorageDenied, match="evaluation.analogies_uri") as refused:
        WordEval(["king", "queen"], neighbours_of=[], k=1, analogies_uri=str(link), guard=Guard(layout.policy("b")))
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize("planted", ["__0_0.distcp", ".metadata", "nested/__1_0.distcp"])
def test_an_export_reads_no_checkpoint_file_that_leads_outside_the_policy(layout, planted):
    """The API reads a checkpoint its tenant's trainer wrote, with the server's rights: a shard that is a symlink
    to the server's database would come back as embeddings. The checkpoint is refused instead."""
    from kembed_api.jobs import exports

    step = layout.folder("b") / "job-b" / "step-5"
    (step / planted).parent.mkdir(parents=True)
    (step / "COMPLETE").write_text('{"step": 5}')
    (step / planted).symlink_to(layout.data_dir / "kembed.db")
    folder = (layout.folder("b") / "job-b").as_uri()
    with pytest.raises(exports.NoCheckpoint, match="outside the tenant's storage policy") as refused:
        exports.find_checkpoint(folder, policy=layout.policy("b"))
    assert SECRET not in str(refused.value) and "kembed.db" not in str(refused.value)
    (step / planted).unlink()
    (step / planted).write_text("a shard")
    assert exports.find_checkpoint(folder, policy=layout.policy("b")).step == 5


def test_an_export_of_a_delta_reads_no_file_of_its_chain_that_leads_outside_the_policy(layout):
    """A delta is read through its chain: a shard of its full checkpoint that is a symlink refuses the delta too."""
    from kembed_api.jobs import exports
    from kembed_contract import runtime

    job = layout.folder("b") / "job-b"
    for step, parent in ((5, None), (10, 5)):
        (job / f"step-{step}").mkdir(parents=True)
        (job / f"step-{step}" / "__0_0.distcp").write_text("a shard")
        kind = runtime.CHECKPOINT_FULL if parent is None else runtime.CHECKPOINT_DELTA
        (job / f"step-{step}" / "COMPLETE").write_bytes(runtime.CheckpointMarker(step, kind, parent, 7).to_bytes())
    (job / "step-5" / "__0_0.distcp").unlink()
    (job / "step-5" / "__0_0.distcp").symlink_to(layout.data_dir / "kembed.db")
    with pytest.raises(exports.NoCheckpoint, match="outside the tenant's storage policy") as refused:
        exports.find_checkpoint(job.as_uri(), 10, policy=layout.policy("b"))
    assert SECRET not in str(refused.value) and "kembed.db" not in str(refused.value)
    (job / "step-5" / "__0_0.distcp").unlink()
    (job / "step-5" / "__0_0.distcp").write_text("a shard")
    assert exports.find_checkpoint(job.as_uri(), 10, policy=layout.policy("b")).step == 10
