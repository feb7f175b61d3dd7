"""word2vec's compiled hogwild trainer: it learns planted neighbours, at 1 and 2 threads and ranks, and resumes
exactly where it promises to (one thread per rank)."""

from __future__ import annotations

import pathlib
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from kembed_contract import trainer_config as config
from kembed_trainer import embedding, sparse_optim
from kembed_trainer.data import text
from kembed_trainer.models.word2vec import sgd as word2vec_sgd
from kembed_trainer.models.word2vec import sgns_kernel
from kembed_trainer.storage import Guard
from tests.trainer.conftest import run_trainer, write_config

NUM_TOPICS, TOPIC_SIZE = 8, 6


def topic_of(word: str) -> int:
    return int(word.split("_")[0][1:])


def write_planted_corpus(path: pathlib.Path, num_sentences: int = 2000) -> None:
    """Each sentence mixes the words of one topic (`t3_0` .. `t3_5`) with a few words every topic shares, so
    only words of a topic ever share a window."""
    rng = np.random.default_rng(0)
    shared = [f"common{i}" for i in range(10)]
    lines = []
    for i in range(num_sentences):
        topic = [f"t{i % NUM_TOPICS}_{j}" for j in range(TOPIC_SIZE)]
        words = list(rng.choice(topic, rng.integers(6, 12))) + list(rng.choice(shared, 2))
        rng.shuffle(words)
        lines.append(" ".join(words))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def word2vec_config(corpus: pathlib.Path, **training) -> config.TrainerConfig:
    return config.TrainerConfig.model_validate(
        {
            "model": {"kind": "word2vec"},
            "embeddings": {
                "tables": [
                    {"name": "words_in", "num_embeddings": 100, "embedding_dim": 32, "features": ["center"]},
                    {
                        "name": "words_out",
                        "num_embeddings": 100,
                        "embedding_dim": 32,
                        "features": ["context"],
                    },
                ]
            },
            "data": {"kind": "text", "uri": str(corpus), "window": 3, "negatives": 5},
            "training": {"steps": 40, "batch_size": 2000, "threads": 1, **training},
        }
    )


def test_unset_optimizer_fields_take_gensims_values(tmp_path):
    cfg = word2vec_config(tmp_path / "corpus.txt")
    assert (cfg.optimizer.sparse.name, cfg.optimizer.sparse.lr, cfg.optimizer.sparse.min_lr) == (
        "sgd",
        0.025,
        0.0001,
    )
    raw = cfg.model_dump(mode="json")
    raw["optimizer"] = {"sparse": {"lr": 0.05}}
    given = config.TrainerConfig.model_validate(raw).optimizer.sparse
    assert (given.name, given.lr, given.min_lr) == ("sgd", 0.05, 0.0001)
    assert sparse_optim.learning_rate(given, 0, 100) == 0.05
    assert sparse_optim.learning_rate(given, 50, 100) == pytest.approx((0.05 + 0.0001) / 2)
    assert sparse_optim.learning_rate(given, 100, 100) == pytest.approx(0.0001)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param(
            lambda c: c["optimizer"]["sparse"].update(name="adagrad"),
            "optimizer.sparse.name: word2vec trains with 'sgd'",
            id="adagrad",
        ),
        pytest.param(
            lambda c: c["embeddings"]["tables"][0].update(sharding="row_wise"),
            "embeddings.tables.0: word2vec tables are replicated; set sharding: replicated",
            id="sharded",
        ),
        pytest.param(
            lambda c: c["embeddings"]["tables"][1].update(hash_ids=True),
            "embeddings.tables.1: word2vec rows are vocabulary indices; set hash_ids: false",
            id="hashed",
        ),
        pytest.param(
            lambda c: c["distributed"].update(backend="nccl"),
            "distributed.backend: word2vec trains on CPU cores",
            id="nccl",
        ),
    ],
)
def test_settings_the_compiled_trainer_cannot_honour_are_refused(tmp_path, change, message):
    raw = word2vec_config(tmp_path / "corpus.txt").model_dump(mode="json")
    change(raw)
    with pytest.raises(config.ValidationError) as err:
        config.TrainerConfig.model_validate(raw)
    assert message in config.format_validation_error(err.value)


def share_of_neighbours_in_topic(vocab: list[str], vectors: torch.Tensor, k: int = 4) -> float:
    """Of each planted word's k nearest words (cosine of input vectors), the share from its own topic."""
    planted = [i for i, w in enumerate(vocab) if w.startswith("t")]
    unit = torch.nn.functional.normalize(vectors[: len(vocab)], dim=1)
    sims = unit[planted] @ unit[planted].T
    sims.fill_diagonal_(-2.0)
    nearest = sims.topk(k, dim=1).indices
    hits = [
        topic_of(vocab[planted[j]]) == topic_of(vocab[i])
        for row, i in zip(nearest, planted, strict=True)
        for j in row
    ]
    return sum(hits) / len(hits)


@pytest.mark.parametrize(
    "threads", [pytest.param(1, id="one-thread"), pytest.param(2, id="two-hogwild-threads")]
)
def test_planted_neighbours_are_found(tmp_path, threads):
    write_planted_corpus(tmp_path / "corpus.txt")
    cfg = word2vec_config(tmp_path / "corpus.txt")
    data = text.TextData(
        cfg.data, tables=cfg.embeddings.tables, seed=0, batch_size=2000, rank=0, world_size=1, guard=Guard(None)
    )
    emb = embedding.EmbeddingCollection(
        cfg.embeddings, cfg.optimizer.sparse, device=torch.device("cpu"), seed=0, world_size=1
    )
    trainer = word2vec_sgd.SkipGramSGD(cfg, data, emb, total_steps=40, threads=threads, rank=0, world_size=1)
    center = emb.groups[0].weight[:100]
    assert share_of_neighbours_in_topic(data.vocab, center) < 0.5  # random vectors: about 1 in 8
    losses = [float(trainer.step(step)) for step in range(40)]
    trainer.close()
    assert losses[-1] < losses[0] - 0.1
    assert share_of_neighbours_in_topic(data.vocab, center) > 0.95


@pytest.mark.parametrize("weights", [
    pytest.param(np.arange(1, 2001, dtype=np.float64)[::-1] ** -0.75, id="zipf-like"),
    pytest.param(np.array([5.0, 1e-9, 1.0, 1.0, 3.0]), id="one-all-but-zero"),
    pytest.param(np.ones(7), id="uniform"),
])
def test_noise_words_are_drawn_from_the_noise_distribution_exactly(weights):
    """The alias tables give each word, summed over the slots that can yield it, exactly its share of the weights."""
    accept, alias = sgns_kernel.noise_tables(weights)
    kept = accept / 2.0**32
    yielded = np.bincount(np.arange(len(weights)), kept, len(weights)) + np.bincount(alias, 1 - kept, len(weights))
    np.testing.assert_allclose(yielded / len(weights), weights / weights.sum(), rtol=1e-6, atol=1e-9)


def final_tables(ckpt: pathlib.Path, step: int) -> dict[str, torch.Tensor]:
    state = {"embeddings": {f"{t}.weight": torch.empty(100, 32) for t in ("words_in", "words_out")}}
    dcp.load(state, storage_reader=FsspecReader(f"file://{ckpt}/step-{step}"))
    return {name.removesuffix(".weight"): t for name, t in state["embeddings"].items()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the test reads the checkpoint alone
def test_two_ranks_learn_the_neighbours_and_resume_bit_for_bit(tmp_path):
    """Each rank trains half of the sentences; their changes are added up every step, so both hold the same
    tables, and a run resumed from a checkpoint replays the rest exactly."""
    write_planted_corpus(tmp_path / "corpus.txt")
    cfg = word2vec_config(tmp_path / "corpus.txt", log_every=1).model_dump(mode="json")
    cfg["checkpoint"] = {"uri": f"file://{tmp_path}/ckpt", "every_steps": 10, "keep": 4}
    path = write_config(tmp_path / "c.yaml", cfg)
    code, straight, stderr = run_trainer(path, nproc=2)
    assert code == 0, stderr
    assert straight[0]["world_size"] == 2
    data = text.TextData(
        config.TextDataConfig.model_validate(cfg["data"]),
        tables=[config.TableConfig.model_validate(t) for t in cfg["embeddings"]["tables"]],
        seed=0,
        batch_size=2000,
        rank=0,
        world_size=1,
        guard=Guard(None),  # the test's own files, no policy
    )
    tables = final_tables(tmp_path / "ckpt", 40)
    assert share_of_neighbours_in_topic(data.vocab, tables["words_in"]) > 0.95
    assert straight[-1]["eval"]["auc"] > 0.8

    for step in (20, 30, 40):  # back to step 10, as if the job had died there
        shutil.rmtree(tmp_path / "ckpt" / f"step-{step}")
    code, resumed, stderr = run_trainer(path, nproc=2)
    assert code == 0, stderr
    assert resumed[0]["resumed_from"].endswith("/step-10")
    losses = {r["step"]: r["loss"] for r in straight if r["event"] == "progress"}
    again = {r["step"]: r["loss"] for r in resumed if r["event"] == "progress"}
    assert list(again) == list(range(11, 41))
    assert again == {s: losses[s] for s in again}  # bit for bit
    assert torch.equal(final_tables(tmp_path / "ckpt", 40)["words_in"], tables["words_in"])
