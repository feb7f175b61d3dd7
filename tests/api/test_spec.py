import pytest
from pydantic import ValidationError

from kembed_contract.spec import JobSpec, parse_quantity
from tests.builders import make_spec


def _error_locations(spec: dict) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(spec)
    return [".".join(str(p) for p in error["loc"]) for error in caught.value.errors()]


def test_the_tiny_spec_is_valid_and_defaults_procs_to_one():
    spec = JobSpec.model_validate(make_spec().build())
    assert spec.resources.procs_per_node == 1
    assert spec.resources.num_processes == 1


@pytest.mark.parametrize(
    ("mutate", "location"),
    [
        pytest.param(lambda s: s.update(name="Bad_Name"), "name", id="name-not-dns-label"),
        pytest.param(lambda s: s["resources"].update(nodes=0), "resources.nodes", id="zero-nodes"),
        pytest.param(lambda s: s["resources"].update(memory_per_node="lots"), "resources.memory_per_node",
                     id="memory-not-quantity"),
        pytest.param(lambda s: s["resources"].update(gpus_per_node=2, procs_per_node=4), "resources",
                     id="more-ranks-than-gpus"),
        pytest.param(lambda s: s["trainer"]["training"].update(steps=0), "trainer.training.steps", id="zero-steps"),
        pytest.param(lambda s: s["trainer"]["training"].update(stepz=5), "trainer.training.stepz", id="typo"),
        pytest.param(lambda s: s.update(colour="blue"), "colour", id="unknown-top-level-field"),
        pytest.param(lambda s: s["trainer"]["checkpoint"].update(uri="gs://bucket/x"), "trainer.checkpoint.uri",
                     id="unsupported-scheme"),
        pytest.param(lambda s: s["trainer"]["checkpoint"].update(incremental=True, full_every=0),
                     "trainer.checkpoint.full_every", id="chain-of-no-saves"),
        pytest.param(lambda s: s["trainer"]["checkpoint"].update(incremental=True, max_chain_share=0),
                     "trainer.checkpoint.max_chain_share", id="chain-share-zero"),
    ],
)
def test_a_bad_spec_names_the_field_at_fault(mutate, location):
    spec = make_spec().build()
    mutate(spec)
    assert location in _error_locations(spec)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        pytest.param("4Gi", 4 * 2**30, id="binary"),
        pytest.param("500m", 0.5, id="milli"),
        pytest.param("2G", 2e9, id="decimal"),
        pytest.param(3, 3, id="plain-number"),
    ],
)
def test_quantities_parse_like_kubernetes(text, value):
    assert parse_quantity(text) == value


def test_the_table_memory_estimate_splits_sharded_tables_across_ranks():
    from kembed_contract.sizing import table_memory_bytes_per_rank

    spec = make_spec().build()
    spec["trainer"]["embeddings"]["tables"][0].update(num_embeddings=1000, embedding_dim=8, sharding="row_wise")
    trainer = JobSpec.model_validate(spec).trainer
    sharded_rows = 1000 * 8 * (1 + 1 / 8) * 4  # rowwise_adagrad keeps one float per row
    one, four = table_memory_bytes_per_rank(trainer), table_memory_bytes_per_rank(trainer, world_size=4)
    assert one - four == pytest.approx(sharded_rows * 3 / 4, rel=1e-6)


def test_a_tiered_table_is_estimated_at_its_cache_not_its_rows():
    """A table of 150M rows on disk asks a rank for its cache and 7 bytes a row of bookkeeping, not its rows."""
    from kembed_contract.sizing import table_memory_bytes_per_rank

    spec = make_spec().build()
    spec["trainer"]["embeddings"]["tables"][0].update(num_embeddings=150_000_000, tier={"cache_rows": 1_000_000})
    trainer = JobSpec.model_validate(spec).trainer
    dim = trainer.embeddings.tables[0].embedding_dim
    row = dim * (1 + 1 / dim) * 4  # rowwise_adagrad keeps one float per row
    others = sum(t.num_embeddings * t.embedding_dim * (1 + 1 / t.embedding_dim) * 4
                 for t in trainer.embeddings.tables[1:])
    assert table_memory_bytes_per_rank(trainer) == pytest.approx(1_000_000 * row + 150_000_000 * 7 + others)
    two = table_memory_bytes_per_rank(trainer, world_size=2)  # each rank caches its own share; half the rows each
    assert two == pytest.approx(1_000_000 * row + 75_000_000 * 7 + others, rel=1e-6)


def test_a_dynamic_table_is_estimated_at_its_rows_and_its_index():
    """A dynamic table of 10M rows asks each rank for its share of the rows with their optimizer state and of the
    index (16 bytes a row: id, count, last use; and the id -> row map, 12 bytes a slot), and the Bloom filter's
    share."""
    from kembed_contract.sizing import table_memory_bytes_per_rank
    from kembed_contract.trainer_config import dynamic_map_slots

    spec = make_spec().build()
    table = spec["trainer"]["embeddings"]["tables"][0]
    table.pop("num_embeddings")
    table.update(admit_after=2, dynamic={"capacity": 10_000_000, "admission": "bloom", "bloom_counters": 2**24})
    trainer = JobSpec.model_validate(spec).trainer
    dim = trainer.embeddings.tables[0].embedding_dim
    row = dim * (1 + 1 / dim) * 4  # rowwise_adagrad keeps one float per row
    others = sum(t.num_embeddings * t.embedding_dim * (1 + 1 / t.embedding_dim) * 4
                 for t in trainer.embeddings.tables[1:])
    two = table_memory_bytes_per_rank(trainer, world_size=2)
    assert dynamic_map_slots(5_000_001) == 2**23  # the power of two at least 1.5 x 5M
    assert two == pytest.approx(5_000_001 * (row + 16) + 2**23 * 12 + 2**23 + others, rel=1e-6)


def test_a_spec_with_only_data_and_kind_is_stored_and_estimated_with_its_kinds_defaults():
    """The API validates, stores (the dump) and estimates what the trainer will run: the kind's defaults."""
    from kembed_contract.sizing import memory_per_rank, table_memory_bytes_per_rank

    spec = make_spec("w2v").build()
    spec["trainer"] = {
        "model": {"kind": "word2vec"},
        "embeddings": {"tables": [{"name": "words_in", "num_embeddings": 50_000, "features": ["center"]},
                                  {"name": "words_out", "num_embeddings": 50_000, "features": ["context"]}]},
        "data": {"kind": "text", "uri": "s3://bucket/corpus/"},
    }
    trainer = JobSpec.model_validate(spec).trainer
    stored = JobSpec.model_validate(spec).model_dump(mode="json")["trainer"]
    assert stored["training"]["epochs"] == 5 and stored["training"]["batch_size"] == 10_000
    assert [t["embedding_dim"] for t in stored["embeddings"]["tables"]] == [100, 100]
    assert stored["optimizer"]["sparse"] == {**stored["optimizer"]["sparse"], "name": "sgd", "lr": 0.025,
                                             "min_lr": 0.0001}
    assert JobSpec.model_validate({**spec, "trainer": stored}).trainer == trainer  # the stored spec reads back
    assert table_memory_bytes_per_rank(trainer) == 2 * 50_000 * 100 * 4  # SGD keeps no state
    bigger = JobSpec.model_validate({**spec, "trainer": {**spec["trainer"], "training": {"batch_size": 100_000}}})
    assert memory_per_rank(bigger.trainer).total > memory_per_rank(trainer).total  # the batch counts, as given
    # The corpus is streamed: what its reader holds is bounded by the config (windows, the vocabulary pass's counts).
    bounded = {**spec["trainer"]["data"], "shuffle_buffer": 1 << 18, "max_vocab_size": 100_000}
    smaller = JobSpec.model_validate({**spec, "trainer": {**spec["trainer"], "data": bounded}}).trainer
    assert memory_per_rank(trainer).data - memory_per_rank(smaller).data == (
        3 * ((1 << 20) - (1 << 18)) * 16 + (4_000_000 - 100_000) * 128)


def test_the_memory_estimate_counts_what_evaluation_holds():
    """Recall@k scores a chunk of positives at a time (runtime.EVAL_SCORE_CHUNK_BYTES): the estimate counts that
    chunk and what the held-out set's encodings take on every rank, growing with eval_samples, not with its
    square."""
    import yaml

    from kembed_contract import runtime
    from kembed_contract.sizing import memory_per_rank
    from tests.builders import REPO

    trainer = yaml.safe_load((REPO / "trainer_image/examples/two-tower-retrieval.yaml").read_text())
    trainer.pop("data")  # synthetic data instead, whose held-out size the spec states (and steps, not epochs)
    trainer["training"] = {**trainer["training"], "epochs": None, "steps": 100}

    def eval_bytes(samples: int) -> int:
        spec = make_spec("tt").build()
        spec["trainer"] = {**trainer, "data": {"kind": "synthetic", "num_dense": 0, "eval_samples": samples}}
        parsed = JobSpec.model_validate(spec).trainer
        assert "recall_at_k" in parsed.eval_metrics
        return memory_per_rank(parsed).eval

    small, large = eval_bytes(1_000), eval_bytes(200_000)
    assert small >= runtime.EVAL_SCORE_CHUNK_BYTES  # the chunk, however few the rows
    assert 200 * (large - small) / (200_000 - 1_000) < 200 * 2**20  # linear in the rows: bytes per row, not rows
    assert large > small + 199_000 * 2 * 4  # each row's encodings count
