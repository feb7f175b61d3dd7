"""Results out of a real `kembed serve`: bad data is a permanent failure with its reason; embeddings export."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from gensim.models import KeyedVectors

from kembed_api.cli.client import ApiError, Client
from tests.builders import make_spec
from tests.trainer.test_models_and_data import write_corpus

pytestmark = pytest.mark.slow


def with_sections(name: str, **sections) -> dict:
    """The tiny spec with whole trainer sections replaced (not merged: another model or data kind)."""
    spec = make_spec(name).build()
    spec["trainer"].update(sections)
    return spec


def ratings_spec(name: str, uri: str, *, num_users: int) -> dict:
    return with_sections(
        name,
        model={"kind": "two_tower", "user_features": ["user"], "item_features": ["item"]},
        embeddings={"tables": [
            {"name": "users", "num_embeddings": num_users, "embedding_dim": 8, "features": ["user"]},
            {"name": "items", "num_embeddings": 50, "embedding_dim": 8, "features": ["item"]},
        ]},
        data={"kind": "table", "uri": uri, "label": "rating", "sparse": {"user": "user", "item": "item"}},
    )


def test_ids_outside_the_table_fail_at_once_with_the_reason_and_no_restart(server, tmp_path):
    pq.write_table(pa.table({"user": np.arange(1, 101) % 100 + 1, "item": np.arange(100) % 50,
                             "rating": np.ones(100)}), tmp_path / "ratings.parquet")
    spec = ratings_spec("bad-ids", str(tmp_path / "ratings.parquet"), num_users=100)  # ids go up to 100
    spec["resources"]["procs_per_node"] = 2
    server.client.set_storage("default", {"read": [str(tmp_path)], "write": []})  # its storage policy: the data
    job = server.client.submit(spec)
    done = server.wait_terminal(job["id"])
    assert (done["state"], done["reason"], done["restart_count"]) == ("FAILED", "TrainerExitedPermanently", 0)
    # The id, the table's bounds, the way out, and where the first bad id is: column, file, row group and row.
    assert re.fullmatch(r"node 0 \(node rank 0\) failed with exit code 2: data error: feature 'user': ids \d+\.\.100 "
                        r"outside \[0, 100\); set hash_ids on its table \(column 'user', first at file://\S+/ratings\.parquet "
                        r"row group 0 row \d+\)", done["message"]), done["message"]
    assert "Root Cause" not in done["message"] and "torch.distributed" not in done["message"]
    assert "Restarting" not in [e["reason"] for e in done["events"]]


def test_a_word2vec_job_exports_and_answers_neighbours_for_its_tenant_only(server, tmp_path):
    write_corpus(tmp_path / "corpus.txt")
    server.client.set_storage("default", {"read": [str(tmp_path)], "write": []})  # its storage policy: the corpus
    spec = with_sections(
        "w2v",
        model={"kind": "word2vec"},
        embeddings={"tables": [
            {"name": "words_in", "num_embeddings": 200, "embedding_dim": 16, "features": ["center"]},
            {"name": "words_out", "num_embeddings": 200, "embedding_dim": 16, "features": ["context"]},
        ]},
        data={"kind": "text", "uri": str(tmp_path / "corpus.txt"), "window": 3, "negatives": 3},
        optimizer={"sparse": {"name": "sgd", "lr": 0.025, "min_lr": 0.0001}},
        training={"epochs": 5, "batch_size": 2000, "threads": 1},
    )
    done = server.wait_terminal(server.client.submit(spec)["id"])
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["dataset"]["vocab_size"] > 50 and done["dataset"]["train_sentences"] > 1500
    assert done["progress"]["total_steps"] > 0

    def kembed(*args: str, token: str = server.token) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kembed_api.cli", *args, "--server", server.url],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "KEMBED_TOKEN": token})

    out = tmp_path / "vectors.bin"
    exported = kembed("export", done["id"], "--format", "word2vec-binary", "--output", str(out))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    vectors = KeyedVectors.load_word2vec_format(out, binary=True)
    assert len(vectors) == done["dataset"]["vocab_size"] and vectors.vector_size == 16
    assert not list(tmp_path.glob(".*.partial"))
    listed = subprocess.run([sys.executable, "-m", "kembed_api.cli", "jobs", "--server", server.url],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KEMBED_TOKEN": server.token, "COLUMNS": "80"}).stdout
    row = next(line for line in listed.splitlines() if line.startswith(done["id"]))
    assert max(map(len, listed.splitlines())) <= 80 and " SUCCEEDED " in row
    assert f"auc {done['result']['auc']:.4f}" in row  # word2vec's metric: true against noise pairs
    status = kembed("status", done["id"])
    assert f"vocab_size={done['dataset']['vocab_size']:,}" in status.stdout

    near = server.client.neighbours(done["id"], "w3", k=5)
    assert [n["key"] for n in near["neighbours"]] == [w for w, _ in vectors.most_similar("w3", topn=5)]
    shown = kembed("neighbours", done["id"], "w3", "-k", "5")
    assert shown.returncode == 0 and near["neighbours"][0]["key"] in shown.stdout
    with pytest.raises(ApiError) as unknown:
        server.client.neighbours(done["id"], "no-such-word")
    assert unknown.value.status_code == 422 and "not in the vocabulary" in str(unknown.value)
    assert "no-such-word" not in str(unknown.value)  # the error names the field, never echoes the input

    # Another tenant (even its admin) finds neither the job nor its embeddings.
    server.client.create_tenant("rival", {"max_running_jobs": 1})
    secret = server.client.create_token("rival", name="r", role="tenant-admin")["token"]
    with Client(server.url, token=secret) as rival, open(os.devnull, "wb") as sink:
        for call in (lambda: rival.neighbours(done["id"], "w3"),
                     lambda: rival.export(done["id"], sink, fmt="numpy")):
            with pytest.raises(ApiError) as hidden:
                call()
            assert hidden.value.status_code == 404
