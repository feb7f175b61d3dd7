"""Dynamic tables: raw ids get rows of their own up to a capacity, admitted by a counter or a Bloom filter,
evicted least used first or past their time to live; they train as plain tables do and resume bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kembed_contract import kinds
from kembed_contract import trainer_config as config
from kembed_trainer import embedding
from kembed_trainer.data.batch import Batch
from kembed_trainer.data.rows import hash_string
from kembed_trainer.dynamic import group as dyn_group
from kembed_trainer.dynamic import index as dyn_index
from tests.trainer.conftest import run_trainer, tiny_config, write_config
from tests.trainer.test_incremental_checkpoints import run_until_hang

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]
BATCH = 64


def make_index(capacity: int, admit_after: int = 0, **dynamic) -> dyn_index.DynamicIndex:
    """One rank's index of a table of `capacity` rows, over arrays as the group makes them."""
    table = config.TableConfig(name="t", features=["f"], admit_after=admit_after,
                               dynamic={"capacity": capacity, **dynamic})
    n = capacity + 1
    arrays = {"row_ids": np.full(n, dyn_index.EMPTY, np.int64), "use_count": np.zeros(n, np.int32),
              "last_used": np.zeros(n, np.int32), "changed": np.zeros(n, np.bool_)}
    arrays["row_ids"][-1] = dyn_index.SHARED
    if admit_after and table.dynamic.admission == "counter":
        arrays |= {"pending_ids": np.full(n, dyn_index.EMPTY, np.int64), "pending_count": np.zeros(n, np.int32),
                   "pending_last": np.zeros(n, np.int32), "pending_changed": np.zeros(n, np.bool_)}
    elif admit_after:
        block = -(-table.dynamic.bloom_counters // dyn_index.NUM_BUCKETS)
        arrays |= {"bloom": np.zeros((dyn_index.NUM_BUCKETS, block), np.uint8),
                   "bloom_changed": np.zeros(dyn_index.NUM_BUCKETS, np.bool_)}
    return dyn_index.DynamicIndex(table, arrays=arrays, rank=0, world_size=1)


def raw_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Distinct raw ids from all of int64 (negative ones too), as a log's would be."""
    return np.unique(rng.integers(-(2**62), 2**62, n * 2))[:n]


# ------------------------------------------------------------------------------------------------ the index
def test_ids_get_rows_of_their_own_up_to_capacity_where_hashing_collides():
    rng = np.random.default_rng(0)
    ids = raw_ids(rng, 1000)
    index = make_index(1000)
    rows = np.concatenate([index.resolve(np.sort(part), step)[0] for step, part in enumerate(np.split(ids, 10))])
    assert (rows >= 0).all() and len(np.unique(rows)) == 1000  # no collision, no id on the shared row
    assert index.stats.admitted == 1000 and index.stats.evicted_capacity == 0
    np.testing.assert_array_equal(index.find(ids), rows)  # and found there again
    hashed = embedding.hash_rows(torch.from_numpy(ids), 1001).numpy()
    assert len(np.unique(hashed)) < 700  # the same ids hashed into as many rows: a third share a bucket


def test_counter_admission_gives_a_row_after_admit_after_batches():
    index = make_index(100, admit_after=2)
    frequent, once = np.array([7, 11]), np.arange(1000, 1050)
    for step in range(2):  # seen in two batches: still on the shared row
        assert (index.resolve(np.sort(np.r_[frequent, once + 100 * step]), step)[0] == -1).all()
    rows, new = index.resolve(np.sort(np.r_[frequent, once + 200]), 2)
    assert (rows[:2] >= 0).all() and (rows[2:] == -1).all()  # the third sighting admits; one-offs never
    assert index.stats.admitted == 2 and len(new) == 2


def test_bloom_admission_admits_frequent_ids_and_few_rare_ones():
    """A filter of 16 counters per distinct id: ids seen in 3 batches get rows at the fourth, ids seen once do
    not, but for the rare one whose counters frequent ids share (a false admission)."""
    rng = np.random.default_rng(1)
    frequent = raw_ids(rng, 200)
    rare = raw_ids(np.random.default_rng(2), 4000)
    index = make_index(1000, admit_after=3, admission="bloom", bloom_counters=16 * 4200)
    for step in range(3):
        index.resolve(np.sort(np.r_[frequent, rare[step::3]]), step)
    rows, _ = index.resolve(np.sort(frequent), 3)
    assert (rows >= 0).all()
    rare_rows, _ = index.resolve(np.sort(raw_ids(np.random.default_rng(3), 1000)), 4)
    assert (rare_rows >= 0).mean() < 0.01
    assert index.pending_ids.size == 0  # no counter of its own for any id


def test_eviction_when_full_keeps_the_frequent_ids():
    rng = np.random.default_rng(4)
    hot = raw_ids(rng, 60)
    index = make_index(100)
    for step in range(10):
        index.resolve(np.sort(hot), step)
    for step in range(10, 200):
        cold = rng.integers(10**12, 10**13, 30)  # new ids every step: more than the table's room
        index.resolve(np.unique(np.r_[hot, cold]) if step % 2 == 0 else np.unique(cold), step)
    assert (index.find(hot) >= 0).all()  # used every other step: never the least used
    assert index.stats.evicted_capacity > 1000 and index.rows_in_use == 100


def test_time_to_live_frees_rows_not_seen_for_that_many_steps():
    index = make_index(100, ttl_steps=16)
    kept, dropped = np.arange(0, 10), np.arange(100, 110)
    index.resolve(np.r_[kept, dropped], 0)
    for step in range(1, 20):
        index.resolve(kept, step)
    assert (index.find(kept) >= 0).all() and (index.find(dropped) == -1).all()
    assert index.stats.evicted_ttl == 10 and index.stats.evicted_capacity == 0 and index.rows_in_use == 10


# ------------------------------------------------------------------------------------------------ training
def collection(optimizer: str, dynamic: bool) -> embedding.EmbeddingCollection:
    """A table of 3000 rows, plain (ids are rows) or dynamic (raw ids, room for all), with weight decay and an
    lr scale, and a plain table beside it."""
    table = {"name": "big", "embedding_dim": 8, "features": ["a", "b"], "lr_scale": 0.5, "weight_decay": 0.01}
    table |= {"dynamic": {"capacity": 3000}} if dynamic else {"num_embeddings": 3001, "sharding": "row_wise"}
    emb = config.EmbeddingsConfig.model_validate({"tables": [
        table, {"name": "small", "num_embeddings": 50, "embedding_dim": 8, "features": ["d"]}]})
    return embedding.EmbeddingCollection(emb, config.SparseOptimizerConfig(name=optimizer, lr=0.05),
                                         device=torch.device("cpu"), seed=3, world_size=1)


RAW = np.random.default_rng(5).permutation(np.arange(3000, dtype=np.int64)) * 0x9E3779B1 - 2**40  # row -> raw id


def zipf_batch(step: int, *, raw: bool) -> Batch:
    gen = torch.Generator().manual_seed(step)
    values, lengths = [], []
    for n in (3000, 3000, 50):
        lens = torch.randint(1, 3, (BATCH,), generator=gen)
        ids = torch.multinomial(torch.arange(1, n + 1, dtype=torch.float64) ** -1.1, int(lens.sum()), True,
                                generator=gen)
        values.append(torch.from_numpy(RAW[ids.numpy()]) if raw and n == 3000 else ids)
        lengths.append(lens)
    return Batch(dense=torch.zeros(BATCH, 0), values=torch.cat(values), lengths=torch.cat(lengths),
                 labels=torch.zeros(BATCH))


def train(coll: embedding.EmbeddingCollection, steps: int, *, raw: bool) -> list[torch.Tensor]:
    """Each step's pooled vectors; a fixed linear loss of them."""
    seen = []
    for step in range(steps):
        pooled = torch.cat(coll(zipf_batch(step, raw=raw), step=step), 1)
        (pooled * torch.linspace(-1, 1, pooled.numel()).view_as(pooled)).sum().backward()
        coll.step(step)
        seen.append(pooled.detach())
    return seen


@pytest.mark.parametrize("optimizer", [pytest.param(o, id=o) for o in OPTIMIZERS])
def test_a_dynamic_table_trains_as_a_plain_one_on_the_same_ids(optimizer):
    """Raw ids with room for all: every step's vectors, and at the end each id's row and optimizer state, equal
    those of a plain table where id i is row i (started from the vectors the dynamic table gives the ids)."""
    plain, dynamic = collection(optimizer, False), collection(optimizer, True)
    big = plain.groups[0]
    bound = embedding._bound(dynamic.groups[0].tables[0])
    big.shard[:3000] = dyn_group.initial_vectors(RAW, 8, bound, seed=3, table=0)
    want, got = train(plain, 30, raw=False), train(dynamic, 30, raw=True)
    for step, (a, b) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"pooled, step {step}")
    g = dynamic.groups[0]
    rows = g.indexes[0].find(RAW)
    used = rows >= 0
    assert used.sum() > 1000
    for name, tensor in {"weight": g.shard, **g.shard_state}.items():
        torch.testing.assert_close(tensor[torch.from_numpy(rows[used])],
                                   {"weight": big.shard, **big.shard_state}[name][torch.from_numpy(used).nonzero()[:, 0]],
                                   rtol=1e-6, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------ config
def test_a_dynamic_table_declares_a_capacity_and_is_its_own_kind():
    table = config.TableConfig(name="t", features=["f"], admit_after=2, dynamic={"capacity": 1000})
    assert table.num_embeddings == 1001 and kinds.table_kind(table).kind_name() == "dynamic"
    assert config.TableConfig.model_validate(table.model_dump()) == table  # a dumped config validates to itself
    cfg = config.TrainerConfig(embeddings={"tables": [table.model_dump()]}, training={"steps": 1})
    plain = config.TableConfig(name="t", features=["f"], num_embeddings=1001, sharding="row_wise")
    index_bytes = kinds.table_kind(table).memory_bytes(table, cfg, world_size=2) - kinds.table_kind(
        plain).memory_bytes(plain, cfg, world_size=2)
    assert index_bytes == table.dynamic.index_bytes(table, world_size=2) > 501 * 40  # rows and the index
    for bad, field in [({"num_embeddings": 5}, "num_embeddings"), ({"hash_ids": True}, "hash_ids"),
                       ({"sharding": "replicated"}, "replicated"),
                       ({"admit_after": 300, "dynamic": {"capacity": 10, "admission": "bloom"}}, "admit_after"),
                       ({"dynamic": {"capacity": 0}}, "capacity")]:
        with pytest.raises(config.ValidationError, match=field):
            config.TableConfig.model_validate({"name": "t", "features": ["f"], "dynamic": {"capacity": 10}} | bad)


# ------------------------------------------------------------------------------------------------ checkpoints
DYNAMIC_TABLES = [
    {"name": "t0", "embedding_dim": 8, "features": ["c0"], "admit_after": 1,
     "dynamic": {"capacity": 300, "ttl_steps": 8}},
    {"name": "t1", "embedding_dim": 8, "features": ["c1"], "admit_after": 2,
     "dynamic": {"capacity": 200, "admission": "bloom", "bloom_counters": 8192}},
    {"name": "t2", "num_embeddings": 500, "embedding_dim": 8, "features": ["c2"]},
]
CHAIN = {"every_steps": 5, "incremental": True, "full_every": 3, "max_chain_share": 100, "keep": 10}


def dynamic_config(uri: str, steps: int, *, num_ids: int = 3000, tiered: bool = False, **checkpoint) -> dict:
    """Synthetic ids of 3000 per feature into tables of 300 and 200 rows: admission, eviction and expiry all
    happen every few steps. `tiered`: t0's rows in a store on disk (the checkpoints stream them)."""
    tables = [{**DYNAMIC_TABLES[0], "tier": {"cache_rows": 250}}, *DYNAMIC_TABLES[1:]] if tiered else DYNAMIC_TABLES
    return tiny_config(checkpoint={"uri": uri, **CHAIN, **checkpoint},
                       training={"steps": steps, "log_every": 1, "eval_every": 10},
                       embeddings={"tables": tables}, data={"num_ids": num_ids},
                       optimizer={"sparse": {"name": "adam", "lr": 0.05}})


def losses(recs: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in recs if r["event"] == "progress"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("whole")
    code, recs, stderr = run_trainer(write_config(tmp / "whole.yaml", dynamic_config(f"file://{tmp}/a", 25)))
    assert code == 0, stderr
    return recs


def test_a_dynamic_chain_resumes_bit_for_bit(tmp_path, uninterrupted):
    """The index (rows' ids, counts, last uses, waiting ids, the filter) is in full checkpoints and deltas: a run
    stopped at 15 (full 5, deltas 10 and 15) and resumed trains on as one that never stopped, loss for loss."""
    uri = f"file://{tmp_path}/b"
    code, first, stderr = run_trainer(write_config(tmp_path / "first.yaml", dynamic_config(uri, 15)))
    assert code == 0, stderr
    assert [(r["step"], r["kind"]) for r in first if r["event"] == "checkpoint"][:3] == [
        (5, "full"), (10, "delta"), (15, "delta")]
    code, then, stderr = run_trainer(write_config(tmp_path / "then.yaml", dynamic_config(uri, 25)))
    assert code == 0, stderr
    assert then[0]["resumed_from"] == f"{uri}/step-15"
    resumed = losses(then)
    assert list(resumed) == list(range(16, 26))
    assert resumed == {s: losses(uninterrupted)[s] for s in resumed}  # bit for bit
    assert then[-1]["eval"] == uninterrupted[-1]["eval"]
    evals = [r for r in uninterrupted if r["event"] == "eval"]
    assert evals[0]["dynamic_rows_in_use"] == evals[0]["dynamic_admitted"] and evals[-1]["dynamic_rows_in_use"] > 450
    # Nearly full: rows are evicted ...
    assert sum(r["dynamic_evicted_capacity"] for r in evals) > 100 and sum(r["dynamic_evicted_ttl"] for r in evals)
    last_eval = [r for r in then if r["event"] == "eval"][-1]  # ... and so is the index's report, as it was
    assert {k: v for k, v in last_eval.items() if k.startswith("dynamic_")} == {
        k: v for k, v in evals[-1].items() if k.startswith("dynamic_")}


def test_a_tiered_dynamic_chain_resumes_bit_for_bit(tmp_path):
    """A dynamic table whose rows are a tiered table's: its store streamed into and out of full checkpoints and
    deltas, beside the index; the run resumed at 15 trains on as the one that never stopped."""
    code, whole, stderr = run_trainer(write_config(tmp_path / "whole.yaml", dynamic_config(
        f"file://{tmp_path}/a", 25, tiered=True, incremental=False, every_steps=0)), KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    uri = f"file://{tmp_path}/b"
    code, first, stderr = run_trainer(write_config(tmp_path / "first.yaml", dynamic_config(uri, 15, tiered=True)),
                                      KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    code, then, stderr = run_trainer(write_config(tmp_path / "then.yaml", dynamic_config(uri, 25, tiered=True)),
                                     KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    assert then[0]["resumed_from"] == f"{uri}/step-15"
    assert losses(then) == {s: losses(whole)[s] for s in range(16, 26)}
    assert then[-1]["eval"] == whole[-1]["eval"]
    assert any("tier_hit_rate" in r for r in then if r["event"] == "progress")


def test_a_rank_killed_mid_run_resumes_to_the_uninterrupted_state(tmp_path, uninterrupted):
    """SIGKILL in the middle of writing the delta of step 15: the resume starts from step 10's chain and ends
    where the run that was never killed ends, loss for loss."""
    uri = f"file://{tmp_path}/c"
    path = write_config(tmp_path / "c.yaml", dynamic_config(uri, 25))
    run_until_hang(path, "during")
    code, then, stderr = run_trainer(path)
    assert code == 0, stderr
    assert then[0]["resumed_from"] == f"{uri}/step-10"
    assert losses(then) == {s: losses(uninterrupted)[s] for s in range(11, 26)}
    assert then[-1]["eval"] == uninterrupted[-1]["eval"]


# Rank 1 of a gang kills itself with SIGKILL when asked for step 17's batch (argv: the config).
KILLS_RANK_1 = """
import os, signal, sys
from kembed_trainer import __main__
from kembed_trainer.data import synthetic

batch = synthetic.SyntheticData.train_batch

def killing(self, step):
    if step == 17 and self.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return batch(self, step)

synthetic.SyntheticData.train_batch = killing
sys.exit(__main__.main())
"""


def test_a_rank_of_two_killed_mid_run_resumes_to_the_uninterrupted_state(tmp_path):
    """Two ranks, each owning its ids: rank 1 SIGKILLed at step 17, the gang resumes from step 15 and ends where
    a gang never killed ends, loss for loss."""
    import subprocess
    import sys

    from tests.trainer.conftest import REPO, records, trainer_env

    code, whole, stderr = run_trainer(write_config(tmp_path / "whole.yaml", dynamic_config(
        f"file://{tmp_path}/a", 25)), nproc=2, timeout=600)
    assert code == 0, stderr
    (tmp_path / "kill.py").write_text(KILLS_RANK_1)
    path = write_config(tmp_path / "c.yaml", dynamic_config(f"file://{tmp_path}/b", 25))
    killed = subprocess.run(  # noqa: PLW1510 - the exit code is what we test
        [sys.executable, "-m", "kembed_trainer.launch", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
         str(tmp_path / "kill.py"), "--config", str(path)],
        env=trainer_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert killed.returncode == 128 + 9, killed.stderr[-3000:]
    assert max(r["step"] for r in records(killed.stdout) if r["event"] == "progress") == 17  # then killed
    code, then, stderr = run_trainer(path, nproc=2, timeout=600)
    assert code == 0, stderr
    assert then[0]["resumed_from"] == f"file://{tmp_path}/b/step-15"
    assert losses(then) == {s: losses(whole)[s] for s in range(16, 26)}
    assert then[-1]["eval"] == whole[-1]["eval"]


@pytest.mark.parametrize(("first", "then", "tiered"), [
    pytest.param(1, 2, False, id="1-to-2"), pytest.param(2, 1, False, id="2-to-1"),
    pytest.param(1, 2, True, id="1-to-2-tiered")])
def test_a_dynamic_chain_loads_on_another_number_of_ranks(tmp_path, first, then, tiered):
    """Ids go to the rank that owns them at the new world size, with their vectors and optimizer state (from the
    store, of a tiered table): a resume at the last step evaluates as the run that saved it. Ids of 150 per
    table: room for all on any rank."""
    uri = f"file://{tmp_path}/ckpt"
    path = write_config(tmp_path / "c.yaml", dynamic_config(uri, 15, num_ids=150, tiered=tiered))
    code, before, stderr = run_trainer(path, nproc=first, timeout=600, KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    code, after, stderr = run_trainer(path, nproc=then, timeout=600, KEMBED_LOCAL_DIR=str(tmp_path))
    assert code == 0, stderr
    assert after[0]["world_size"] == then and after[0]["resumed_from"] == f"{uri}/step-15"
    evals = [r for r in (before, after) for r in r if r["event"] == "eval"]
    assert evals[-1]["auc"] == pytest.approx(evals[-2]["auc"], rel=1e-5)
    assert evals[-1]["dynamic_rows_in_use"] == evals[-2]["dynamic_rows_in_use"] > 150
    assert evals[-1]["dynamic_evicted_capacity"] == 0


# ------------------------------------------------------------------------------------------------ export
def test_an_export_writes_the_raw_id_beside_each_vector(tmp_path):
    """String ids from a file, in order (user 0's rows first, then user 1's, ...), so that most of the ids the
    table holds at the end were first read after the chain's full checkpoint: the parquet export of the last delta
    holds one entry per row that holds an id, with the id's text (from the id index of the whole chain) and that
    row's vector."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kembed_trainer import dcp_read, export, saved_table

    rng = np.random.default_rng(0)
    users = np.array([f"user-{i:03d}" for i in range(120)])  # read as their 63-bit hashes
    picked = users[np.arange(3000) * 120 // 3000]  # 25 rows a user, in order
    (tmp_path / "rows").mkdir()
    pq.write_table(pa.table({"user": picked, "label": (rng.random(3000) < 0.5).astype(np.int64),
                             "price": rng.normal(size=3000)}), tmp_path / "rows" / "part-0.parquet")
    uri = f"file://{tmp_path}/ckpt"
    cfg = tiny_config(
        model={"kind": "dlrm", "bottom_mlp": [8], "top_mlp": [8]},
        embeddings={"tables": [{"name": "users", "embedding_dim": 8, "features": ["user"],
                                "dynamic": {"capacity": 30}}]},
        data={"kind": "table", "uri": str(tmp_path / "rows"), "label": "label", "dense": ["price"],
              "sparse": {"user": "user"}, "shuffle_buffer": 100},
        training={"steps": 30, "batch_size": 50, "log_every": 10},
        checkpoint={"uri": uri, "every_steps": 10, **{k: v for k, v in CHAIN.items() if k != "every_steps"}})
    code, recs, stderr = run_trainer(write_config(tmp_path / "c.yaml", cfg))
    assert code == 0, stderr
    assert [r["kind"] for r in recs if r["event"] == "checkpoint"] == ["full", "delta", "delta"]
    out = tmp_path / "users.parquet"
    with out.open("wb") as f, export.read_table(f"{uri}/step-30", "users") as table:
        export.write(table, "parquet", f)
    exported = pq.read_table(out)
    assert exported.num_rows == 30  # the table is full: every row holds an id
    assert set(exported["id"].to_pylist()) <= set(users) and len(set(exported["id"].to_pylist())) == 30
    first_read = {u for u in users[: 120 * 600 // 3000]}  # users of the first 500 rows, and a window's more
    assert len(set(exported["id"].to_pylist()) - first_read) > 15  # most were read after the full checkpoint
    assert set(exported["feature"].to_pylist()) == {"user"}
    # Each vector is its row's in the checkpoint, and the row holds that id's 63-bit hash.
    readers = [dcp_read.RowRanges(link) for link in export.chain_uris(f"{uri}/step-30")]
    assert len(readers) == 3  # full, delta, delta
    ids = export.dynamic_ids(readers, "users")
    saved = saved_table.SavedTable(readers, "users")
    try:
        weight = saved.read()
    finally:
        saved.close()
    rows = exported["row"].to_numpy()
    np.testing.assert_array_equal(ids[rows], [hash_string(u) for u in exported["id"].to_pylist()])
    np.testing.assert_array_equal(np.stack(exported["vector"].to_numpy(zero_copy_only=False)), weight[rows])


# ------------------------------------------------------------------------------------------------ tiered
def dynamic_collection(optimizer: str, tier: dict | None) -> embedding.EmbeddingCollection:
    """A dynamic table smaller than its ids (admission, eviction and expiry all happen), tiered or not."""
    table = {"name": "big", "embedding_dim": 8, "features": ["a", "b"], "admit_after": 1, "weight_decay": 0.01,
             "dynamic": {"capacity": 400, "ttl_steps": 25}, **({"tier": tier} if tier else {})}
    emb = config.EmbeddingsConfig.model_validate({"tables": [
        table, {"name": "small", "num_embeddings": 50, "embedding_dim": 8, "features": ["d"]}]})
    return embedding.EmbeddingCollection(emb, config.SparseOptimizerConfig(name=optimizer, lr=0.05),
                                         device=torch.device("cpu"), seed=3, world_size=1)


@pytest.mark.parametrize("optimizer", [pytest.param(o, id=o) for o in OPTIMIZERS])
def test_a_tiered_dynamic_table_trains_as_an_in_memory_one(optimizer, tmp_path, monkeypatch):
    """The index maps ids to the store's rows: with a cache of 250 of its 401 rows (rows evicted from the cache,
    written back and fetched again, and rows given to new ids where they are, cached or not), every step's
    vectors, the index and each id's row and optimizer state equal those of the same table in memory."""
    monkeypatch.setenv("KEMBED_LOCAL_DIR", str(tmp_path))
    memory, tiered = dynamic_collection(optimizer, None), dynamic_collection(optimizer, {"cache_rows": 250})
    try:
        assert tiered.groups[0].tiered
        for step in range(40):
            seen = []
            for coll in (memory, tiered):
                pooled = torch.cat(coll(zipf_batch(step, raw=True), step=step), 1)
                if coll is tiered and step % 3:
                    coll.prefetch(zipf_batch(step + 1, raw=True))
                (pooled * torch.linspace(-1, 1, pooled.numel()).view_as(pooled)).sum().backward()
                coll.step(step)
                seen.append(pooled.detach())
            torch.testing.assert_close(seen[1], seen[0], rtol=1e-6, atol=1e-7, msg=f"pooled, step {step}")
        want, got = memory.groups[0], tiered.groups[0]
        np.testing.assert_array_equal(got.indexes[0].row_ids, want.indexes[0].row_ids)
        used = torch.from_numpy(np.flatnonzero(want.indexes[0].row_ids != dyn_index.EMPTY))
        for name, tensor in got.read_table(0).items():
            torch.testing.assert_close(tensor[used], {"weight": want.shard, **want.shard_state}[name][used],
                                       rtol=1e-6, atol=1e-7, msg=name)
        stats = memory.dynamic_stats()
        assert stats == tiered.dynamic_stats() and stats["evicted_capacity"] and stats["evicted_ttl"]
        assert tiered.tier_stats()["written"] > 0  # the cache turned over
    finally:
        tiered.close()
