"""Tiered tables (rows on local disk, hot rows cached) give the numbers of in-memory tables, with a small cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import embedding, export
from kembed_trainer.data.batch import Batch
from kembed_trainer.tiered import cache as tier_cache
from kembed_trainer.tiered import store as tier_store
from tests.trainer.conftest import run_trainer, tiny_config, write_config
from tests.trainer.test_export import assert_exported_as_whole, exported_bytes

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
BATCH = 64


def tables(tier: dict | None) -> list[dict]:
    """Two tiered-or-not tables of width 8 (one with admission and weight decay), and an in-memory one beside."""
    extra = {"tier": tier} if tier else {"sharding": "row_wise"}
    return [
        {"name": "big", "num_embeddings": 3000, "embedding_dim": 8, "features": ["a", "b"], **extra},
        {"name": "mid", "num_embeddings": 700, "embedding_dim": 8, "features": ["c"], "lr_scale": 0.5,
         "weight_decay": 0.01, "admit_after": 2, **extra},
        {"name": "small", "num_embeddings": 50, "embedding_dim": 8, "features": ["d"]},
    ]


def collection(optimizer: str, tier: dict | None, tmp_path, monkeypatch) -> embedding.EmbeddingCollection:
    monkeypatch.setenv("KEMBED_LOCAL_DIR", str(tmp_path))
    emb = config.EmbeddingsConfig.model_validate({"tables": tables(tier)})
    opt = config.SparseOptimizerConfig(name=optimizer, lr=0.05)
    return embedding.EmbeddingCollection(emb, opt, device=torch.device("cpu"), seed=3, world_size=1)


def zipf_batch(step: int) -> Batch:
    gen = torch.Generator().manual_seed(step)
    sizes = {"a": 3000, "b": 3000, "c": 700, "d": 50}
    values, lengths = [], []
    for n in sizes.values():
        lens = torch.randint(1, 3, (BATCH,), generator=gen)
        ranks = torch.multinomial(torch.arange(1, n + 1, dtype=torch.float64) ** -1.1, int(lens.sum()), True,
                                  generator=gen)
        values.append((ranks * 7919) % n)  # hot ids spread over the table
        lengths.append(lens)
    return Batch(dense=torch.zeros(BATCH, 0), values=torch.cat(values), lengths=torch.cat(lengths),
                 labels=torch.zeros(BATCH))


def train(coll: embedding.EmbeddingCollection, steps: int, *, prefetch: bool) -> list[tuple]:
    """Each step's pooled vectors and their gradients; a fixed linear loss of the pooled vectors."""
    seen = []
    for step in range(steps):
        pooled = coll(zipf_batch(step))
        if prefetch and step % 5 != 4:  # some steps without: the lookup fetches what it misses itself
            coll.prefetch(zipf_batch(step + 1))
        everything = torch.cat(pooled, 1)
        (everything * torch.linspace(-1, 1, everything.numel()).view_as(everything)).sum().backward()
        # The rows' gradients: of replicated tables, then of sharded (or tiered) ones, in row order.
        grads = [touched.grad for _, _, touched, _ in coll._pending]
        num_repl = [where.num_repl for _, where, _, _ in coll._pending]
        repl = torch.cat([g[:n] for g, n in zip(grads, num_repl, strict=True)])
        sharded = torch.cat([g[n:] for g, n in zip(grads, num_repl, strict=True)])
        coll.step(step)
        seen.append((everything.detach(), (repl, sharded)))
    return seen


def table_state(coll: embedding.EmbeddingCollection, name: str) -> dict[str, torch.Tensor]:
    for g in coll.groups:
        for i, t in enumerate(g.tables):
            if t.name == name:
                if g.tiered:
                    return g.read_table(i)
                piece = g.layout.local_slice(i) if g.is_sharded[i] else g.table_slices(i)
                tensors = {"weight": g.shard if g.is_sharded[i] else g.weight,
                           **(g.shard_state if g.is_sharded[i] else g.state)}
                return {k: v[piece] for k, v in tensors.items()}
    raise KeyError(name)


@pytest.mark.parametrize("optimizer", [pytest.param(o, id=o) for o in OPTIMIZERS])
def test_tiered_tables_train_as_in_memory_ones(optimizer, tmp_path, monkeypatch):
    """Lookups, gradients, updates and the final tables equal the in-memory ones, with a cache that holds a
    tenth of the rows (so rows are evicted, written back and fetched again every few steps)."""
    steps = 25
    plain = collection(optimizer, None, tmp_path, monkeypatch)
    tiered = collection(optimizer, {"cache_rows": 180}, tmp_path, monkeypatch)
    try:
        want, got = train(plain, steps, prefetch=False), train(tiered, steps, prefetch=True)
        for step, ((p_want, g_want), (p_got, g_got)) in enumerate(zip(want, got, strict=True)):
            torch.testing.assert_close(p_got, p_want, rtol=1e-6, atol=1e-7, msg=f"pooled, step {step}")
            for a, b in zip(g_want, g_got, strict=True):
                torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"gradient, step {step}")
        for name in ("big", "mid", "small"):
            want_state, got_state = table_state(plain, name), table_state(tiered, name)
            assert want_state.keys() == got_state.keys()
            for key in want_state:
                torch.testing.assert_close(got_state[key], want_state[key], rtol=1e-6, atol=1e-7,
                                           msg=f"{name}.{key}")
        stats = tiered.tier_stats()
        assert stats["written"] > 0 and stats["fetched"] > stats["rows"] * 0.1  # the cache really turned over
        assert stats["fetched"] < stats["rows"]  # and most rows were cached when looked up
    finally:
        tiered.close()


def test_tiered_files_leave_nothing_behind(tmp_path, monkeypatch):
    coll = collection("rowwise_adagrad", {"cache_rows": 200}, tmp_path, monkeypatch)
    coll(zipf_batch(0))
    assert list(tmp_path.iterdir()) == []  # the open files are already unlinked: a killed trainer leaves none
    coll.close()


def test_a_save_reads_the_stores_as_they_were_while_training_writes_on(tmp_path, monkeypatch):
    """A snapshot taken for a save gives the rows as they were when it was taken, while training goes on
    writing rows back into the same stores (copy-on-write), and leaves no file behind."""
    coll = collection("adam", {"cache_rows": 180}, tmp_path, monkeypatch)
    try:
        train(coll, 10, prefetch=True)
        coll.flush()
        fields = coll.tier_fields()
        taken = {key: field.read(field.lo, field.num_rows) for key, field in fields.items()}
        release = coll.snapshot()
        train(coll, 10, prefetch=True)  # rows evicted and written back over the snapshot's
        coll.flush()
        changed = [key for key, field in fields.items()
                   if not torch.equal(field.group.read_rows(field.i, 0, field.num_rows)[key.split(".")[1]],
                                      taken[key])]
        assert {"big.weight", "big.exp_avg", "mid.weight"} <= set(changed)  # the stores did change under it
        some = np.array([0, 5, 6, 7, 699, 2999], dtype=np.int64)
        for key, field in fields.items():
            assert torch.equal(field.read(field.lo, field.num_rows), taken[key]), key
            rows = some[some < field.num_rows]  # a delta's changed rows
            assert torch.equal(field.read(0, 0, rows=rows), taken[key][rows]), key
        assert list(tmp_path.iterdir()) == []  # the side files are unlinked at open, as the stores
        release()
        for key, field in fields.items():  # released: the fields read the stores again
            assert torch.equal(field.read(field.lo, field.num_rows),
                               field.group.read_rows(field.i, 0, field.num_rows)[key.split(".")[1]])
    finally:
        coll.close()


def test_a_cache_too_small_for_two_steps_names_the_fix(tmp_path, monkeypatch):
    coll = collection("sgd", {"cache_rows": 20}, tmp_path, monkeypatch)
    try:
        with pytest.raises(RuntimeError, match="more cache rows"):
            coll(zipf_batch(0))
    finally:
        coll.close()


def test_tier_config_takes_one_size_and_is_never_replicated():
    with pytest.raises(config.ValidationError, match="cache_rows or cache_mb"):
        config.TierConfig.model_validate({"cache_rows": 10, "cache_mb": 1.0})
    with pytest.raises(config.ValidationError, match="not replicated"):
        config.TableConfig.model_validate({"name": "t", "num_embeddings": 10, "features": ["f"],
                                           "sharding": "replicated", "tier": {"cache_rows": 5}})


def test_lfu_keeps_frequent_rows_and_pins_the_steps_in_flight():
    cache = tier_cache.SlotCache(100, 10)
    hot, one_off = np.array([1, 2, 3], dtype=np.int64), np.arange(10, 15, dtype=np.int64)
    for _ in range(5):
        cache.plan(hot)
    cache.plan(one_off)  # 8 of 10 slots taken
    cache.plan(hot)
    plan = cache.plan(np.arange(20, 25, dtype=np.int64))  # 3 more slots needed: the rows used least go
    assert plan.num_hits == 0 and plan.fetch_rows.tolist() == [20, 21, 22, 23, 24]
    cached = set(cache.row_of_slot[cache.row_of_slot >= 0].tolist())
    assert {1, 2, 3} <= cached and len(cached & set(one_off.tolist())) == 2
    # The step just planned and the one before it are pinned (one trains while the other is fetched): a step
    # that needs more room than the other slots hold cannot be planned.
    with pytest.raises(RuntimeError, match="more cache rows"):
        cache.plan(np.arange(30, 38, dtype=np.int64))


def test_row_file_reads_back_what_it_wrote(tmp_path):
    f = tier_store.RowFile(tmp_path / "t.rows", 50_000, 5, io_threads=3)
    rows = np.sort(np.random.default_rng(0).choice(50_000, 9000, replace=False)).astype(np.int64)
    values = np.random.default_rng(1).random((9000, 5), dtype=np.float32)
    f.write(rows, values)
    out = np.empty_like(values)
    f.read(rows, out)
    np.testing.assert_array_equal(out, values)
    with pytest.raises(IndexError):
        f.read(np.array([50_000], dtype=np.int64), out[:1])
    f.remove()


# ------------------------------------------------------------------------------------------------ checkpoints
TIERED_TABLES = [
    {"name": "t0", "num_embeddings": 2000, "embedding_dim": 8, "features": ["c0"], "admit_after": 2,
     "tier": {"cache_rows": 400}},
    {"name": "t1", "num_embeddings": 1000, "embedding_dim": 8, "features": ["c1"], "tier": {"cache_rows": 300}},
    {"name": "t2", "num_embeddings": 500, "embedding_dim": 8, "features": ["c2"]},
]
CHAIN = {"every_steps": 5, "incremental": True, "full_every": 3, "max_chain_share": 100, "keep": 10}


def tiered_config(uri: str, steps: int, **checkpoint) -> dict:
    return tiny_config(checkpoint={"uri": uri, **CHAIN, **checkpoint}, training={"steps": steps, "log_every": 1},
                       embeddings={"tables": TIERED_TABLES}, optimizer={"sparse": {"name": "adam", "lr": 0.05}})


def losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if r["event"] == "progress"}


def test_a_tiered_chain_resumes_bit_for_bit(tmp_path, monkeypatch):
    """Full checkpoints and deltas stream the tiered tables from their stores and back: a run stopped at step 15
    (saves: full 5, deltas 10 and 15) and resumed trains on as one that never stopped, loss for loss."""
    code, whole, stderr = run_trainer(
        write_config(tmp_path / "whole.yaml", tiered_config(f"file://{tmp_path}/a", 25, incremental=False,
                                                             every_steps=0)), KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    uri = f"file://{tmp_path}/b"
    code, first, stderr = run_trainer(write_config(tmp_path / "first.yaml", tiered_config(uri, 15)),
                                      KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    assert [(r["step"], r["kind"]) for r in first if r["event"] == "checkpoint"][:3] == [
        (5, "full"), (10, "delta"), (15, "delta")]
    code, then, stderr = run_trainer(write_config(tmp_path / "then.yaml", tiered_config(uri, 25)),
                                     KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    assert then[0]["resumed_from"] == f"{uri}/step-15"
    resumed = losses(then)
    assert list(resumed) == list(range(16, 26))
    assert resumed == {s: losses(whole)[s] for s in resumed}  # bit for bit
    assert then[-1]["eval"] == whole[-1]["eval"]
    assert any("tier_hit_rate" in r for r in then if r["event"] == "progress")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("kembed-tier")]  # no store left behind
    # Exports read tiered tables as any, a range of rows at a time: the chain's last step (full at 20, delta at
    # 25) gives the vectors the uninterrupted run's full checkpoint of step 25 gives, in every format, and what
    # the whole table read at once gives.
    for table in ("t0", "t1"):
        with (export.read_table(f"{uri}/step-25", table) as chained,
              export.read_table(f"file://{tmp_path}/a/step-25", table) as uninterrupted):
            np.testing.assert_array_equal(chained.vectors.read(), uninterrupted.vectors.read())
            for fmt in export.FORMATS:
                assert exported_bytes(chained, fmt) == exported_bytes(uninterrupted, fmt), fmt
        assert_exported_as_whole(f"{uri}/step-25", table, monkeypatch)


@pytest.mark.parametrize(("first", "then"), [pytest.param(1, 2, id="1-to-2"), pytest.param(2, 1, id="2-to-1")])
def test_a_tiered_chain_loads_on_another_number_of_ranks(tmp_path, first, then):
    uri = f"file://{tmp_path}/ckpt"
    path = write_config(tmp_path / "c.yaml", tiered_config(uri, 15))
    code, before, stderr = run_trainer(path, nproc=first, timeout=600, KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    # Resuming at the last step only evaluates: the tables rebuilt from the chain give the same metrics.
    code, after, stderr = run_trainer(path, nproc=then, timeout=600, KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    assert after[0]["world_size"] == then and after[0]["resumed_from"] == f"{uri}/step-15"
    assert after[-1]["eval"] == pytest.approx(before[-1]["eval"], rel=1e-5)


def test_two_ranks_train_tiered_tables_as_in_memory_ones(tmp_path):
    """At two ranks each rank's store holds its half of the rows and answers the other rank's lookups from its
    cache: the losses and the eval are those of the same tables in memory, sharded row-wise."""
    in_memory = [{k: v for k, v in t.items() if k != "tier"} | {"sharding": "row_wise"} if "tier" in t else t
                 for t in TIERED_TABLES]
    runs = {}
    for name, tables in (("tiered", TIERED_TABLES), ("in_memory", in_memory)):
        cfg = tiny_config(training={"steps": 12, "log_every": 1}, embeddings={"tables": tables},
                          optimizer={"sparse": {"name": "adagrad", "lr": 0.05}})
        cfg.pop("checkpoint", None)
        code, recs, stderr = run_trainer(write_config(tmp_path / f"{name}.yaml", cfg), nproc=2, timeout=600,
                                         KEMBED_LOCAL_DIR=str(tmp_path))
        assert code == 0, stderr
        runs[name] = recs
    assert losses(runs["tiered"]) == pytest.approx(losses(runs["in_memory"]), rel=1e-5)
    assert runs["tiered"][-1]["eval"] == pytest.approx(runs["in_memory"][-1]["eval"], rel=1e-5)


def test_a_tier_without_a_cache_size_takes_what_the_launchers_memory_limit_leaves(tmp_path):
    """The launcher says what a rank may use (runtime.ENV_MEMORY_PER_RANK); the trainer sizes the cache from it
    as the API's estimate did, and refuses to start, naming the fix, without it or when it leaves too little."""
    from kembed_contract import runtime, sizing

    cfg = tiny_config(training={"steps": 10, "log_every": 5})
    cfg["embeddings"]["tables"][0]["tier"] = {}
    path = write_config(tmp_path / "auto.yaml", cfg)

    code, _, stderr = run_trainer(path)
    assert code == runtime.EXIT_BAD_CONFIG
    assert ("config error: embeddings.tables[].tier: table t0's tier gives no cache size and the launcher gave no "
            "memory limit (KEMBED_MEMORY_BYTES_PER_RANK) to size it from: give its cache_rows or cache_mb") in stderr

    code, _, stderr = run_trainer(path, **{runtime.ENV_MEMORY_PER_RANK: str(64 * 2**20)})
    assert code == runtime.EXIT_BAD_CONFIG
    assert "config error: resources.memory_per_node: a tiered table's cache of 1 rows cannot hold two steps' rows" \
        in stderr

    # 1 GiB leaves the cache room for all of t0's 2000 rows.
    parsed = config.TrainerConfig.model_validate(cfg)
    sized = sizing.with_cache_sizes(parsed, world_size=1, memory_bytes_per_rank=2**30)
    assert sized.embeddings.tables[0].tier.cache_rows == 2000
    code, records, stderr = run_trainer(path, **{runtime.ENV_MEMORY_PER_RANK: str(2**30)})
    assert code == 0, stderr
    progress = [r for r in records if r["event"] == "progress"]
    assert progress and progress[-1]["tier_hit_rate"] > 0  # trained through its tier
