"""The platform's compiled kernels (kembed_trainer.kernel_cache): every local job loads them and none can change
them. A numba cache file is pickled machine code, so a cache one tenant's job could write would run in the next
tenant's job; a job gets the platform's files to read through links in its own folder, where what it compiles
itself stays."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kembed_api.backends import local
from kembed_api.backends.base import Exit, Launch
from kembed_api.backends.local import LocalBackend
from kembed_contract.spec import JobSpec
from kembed_contract.storage_policy import StoragePolicy
from kembed_platform import sandbox
from tests.builders import make_spec
from tests.fixtures.report_sink import report_sink
from tests.trainer.conftest import tiny_config
from tests.trainer.test_dynamic import DYNAMIC_TABLES
from tests.trainer.test_tiered import TIERED_TABLES
from tests.trainer.test_two_tower_compiled import ratings_config, write_planted_ratings

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sandbox.abi_version() < 1, reason="the kernel has no Landlock: nothing confines a job")]

_WORDS = ["the", "cat", "sat", "on", "the", "mat", "with", "the", "dog", "and", "a", "bird", "sang", "over"]


def _word2vec(corpus: Path) -> dict:
    corpus.write_text("\n".join(" ".join(_WORDS[i % 7:] + _WORDS[:i % 7]) for i in range(300)) + "\n")
    spec = make_spec("w2v").build()
    spec["trainer"] = {
        "model": {"kind": "word2vec"},
        "embeddings": {"tables": [
            {"name": "words_in", "num_embeddings": 64, "embedding_dim": 8, "features": ["center"]},
            {"name": "words_out", "num_embeddings": 64, "embedding_dim": 8, "features": ["context"]}]},
        "data": {"kind": "text", "uri": str(corpus), "window": 2, "negatives": 2},
        "training": {"epochs": 1, "batch_size": 500, "threads": 1},
    }
    return spec


def _run(backend: LocalBackend, job_id: str, spec: dict, *, read: Path, report_url: str) -> Exit:
    backend.start(Launch(job_id=job_id, tenant="t", spec=JobSpec.model_validate(spec), attempt=1,
                         report_url=report_url, report_token="t",
                         storage_policy=StoragePolicy(read=(read.as_uri(),))))
    deadline = time.monotonic() + 400
    while (ended := backend.poll(job_id)) is None:
        assert time.monotonic() < deadline, f"{job_id} did not end"
        time.sleep(0.3)
    return ended


def _files(folder: Path) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def _ratings(data: Path) -> dict:
    write_planted_ratings(data, num_ratings=2000)
    spec = make_spec("mf").build()
    spec["trainer"] = {**ratings_config(data), "training": {"epochs": 1, "threads": 1}}
    return spec


def _tables(tables: list[dict]) -> Callable[[Path], dict]:
    """A small DLRM job on synthetic clicks whose tables are `tables` (the trainer tests' tiered or dynamic ones:
    counter and Bloom admission, a time to live; the tables' kernels are all the job compiles)."""
    def make(_: Path) -> dict:
        spec = make_spec("tables").build()
        spec["trainer"] = tiny_config(embeddings={"tables": tables}, training={"steps": 10, "log_every": 5},
                                      checkpoint={"every_steps": 0}, data={"num_ids": 3000})
        return spec
    return make


@pytest.mark.parametrize(("job_id", "make", "data", "num_kernels"), [
    pytest.param("w2v-a1b2c", _word2vec, "corpus.txt", 1, id="word2vec"),
    pytest.param("mf-a1b2c", _ratings, "ratings.parquet", 1, id="ratings"),
    # The tiered kind's cache plan, row moves and the cache's gather and scatter.
    pytest.param("tier-a1b2c", _tables(TIERED_TABLES), "none", 4, id="tiered"),
    # The dynamic kind's index (10 kernels called from Python), its rows' start, and the tiered kind's for its
    # tiered tables, which this job has none of (each warmed all the same: a kind's kernels load together).
    pytest.param("dyn-a1b2c", _tables(DYNAMIC_TABLES), "none", 15, id="dynamic"),
])
def test_a_job_loads_the_platforms_kernel_and_compiles_none(tmp_path, job_id, make, data, num_kernels):
    backend = LocalBackend(data_dir=tmp_path / "data", slots=1, sandbox="landlock", stop_grace_s=10,
                           kernel_cache_root=tmp_path / "kernels")
    platform = backend.kernel_cache.folder()
    assert platform is not None and platform.parent == tmp_path / "kernels"
    before = _files(platform)
    assert before, "the platform compiled no kernel"
    with report_sink() as url:
        ended = _run(backend, job_id, make(tmp_path / data), read=tmp_path, report_url=url)
    logs = backend.read_logs(job_id)
    assert ended.succeeded, logs
    started = next(json.loads(line) for line in logs.splitlines() if line.startswith('{"event": "started"'))
    # numba's own counts, in the started record: every kernel the job uses loaded, none compiled.
    assert started["kernels"] == {"loaded": num_kernels, "compiled": 0}, logs
    # The job read the platform's files through links in its own folder, and left them as they were.
    links = [p for p in (tmp_path / "data" / "jobs" / job_id / "tmp").rglob("*") if p.is_symlink()]
    assert {link.resolve() for link in links} == set(before)
    assert _files(platform) == before


_WRITER = """
import os, pathlib, sys
folder = pathlib.Path(os.environ["KEMBED_KERNEL_CACHE"])
index = next(folder.rglob("*.nbi"))
for name, attempt in [("new file", lambda: open(index.parent / "planted.nbc", "wb")),
                      ("overwrite", lambda: open(index, "r+b")),
                      ("rename", lambda: os.replace(index, index.parent / "moved")),
                      ("delete", lambda: os.unlink(index))]:
    try:
        attempt()
        print("kernel cache", name, "allowed", flush=True)
    except OSError as error:
        print("kernel cache", name, "denied", error.errno, flush=True)
print("kernel cache read", len(index.read_bytes()) > 0, flush=True)
"""


def test_a_job_cannot_change_the_platforms_kernels(monkeypatch, tmp_path):
    """A hostile tenant's code in the launcher's place, launched exactly as the backend launches a node (its
    sandbox, its environment), tries to plant, overwrite, move and delete the cache's files: Landlock refuses
    each (the server's user may write the folder, so file modes alone would not), and reading works."""
    monkeypatch.setattr(local, "_LAUNCHER", (local.sys.executable, "-c", _WRITER))
    backend = LocalBackend(data_dir=tmp_path / "data", slots=1, sandbox="landlock", stop_grace_s=10,
                           kernel_cache_root=tmp_path / "kernels")
    platform = backend.kernel_cache.folder()
    before = _files(platform)
    with report_sink() as url:
        ended = _run(backend, "plant-d3e4f", make_spec("plant").build(), read=tmp_path, report_url=url)
    logs = backend.read_logs("plant-d3e4f")
    assert ended.succeeded, logs
    for name in ("new file", "overwrite", "rename", "delete"):
        assert f"kernel cache {name} denied 13" in logs, logs  # EACCES: Landlock refused it
    assert "kernel cache read True" in logs, logs
    assert _files(platform) == before
