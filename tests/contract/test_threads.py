"""The one thread policy (kembed_contract.threads): a rank runs its share of the cores its job was admitted with."""

import pytest

from kembed_contract import threads


@pytest.mark.parametrize("cpu_per_node, procs_per_node, expected", [
    pytest.param(1.0, 1, 1, id="one-core-one-rank"),
    pytest.param(2.0, 1, 2, id="two-cores-one-rank"),
    pytest.param(2.0, 2, 1, id="two-cores-two-ranks"),
    pytest.param(8.0, 2, 4, id="eight-cores-two-ranks"),
    pytest.param(3.0, 2, 1, id="an-uneven-share-rounds-down"),
    pytest.param(0.5, 1, 1, id="half-a-core-still-runs-a-thread"),
    pytest.param(1.5, 1, 1, id="a-fraction-above-one-rounds-down"),
    pytest.param(0.3 * 10, 1, 3, id="float-arithmetic-keeps-whole-cores"),
    pytest.param(1.0, 4, 1, id="more-ranks-than-cores"),
])
def test_a_rank_runs_its_whole_share_of_the_cores(cpu_per_node, procs_per_node, expected):
    assert threads.threads_per_rank_for(cpu_per_node, procs_per_node) == expected


def test_the_environment_sets_every_pool_and_makes_idle_threads_sleep():
    env = threads.thread_environ(4.0, 2)
    assert threads.threads_per_rank(env) == 2
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        assert env[name] == "2", name
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_unset_means_a_trainer_run_by_hand():
    assert threads.threads_per_rank({}) is None


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_value_names_the_variable(value):
    with pytest.raises(ValueError, match=threads.ENV_THREADS_PER_RANK):
        threads.threads_per_rank({threads.ENV_THREADS_PER_RANK: value})


@pytest.mark.parametrize("cpu, procs, field", [(0.0, 1, "cpu_per_node"), (float("nan"), 1, "cpu_per_node"),
                                               (1.0, 0, "procs_per_node")])
def test_impossible_resources_are_refused_naming_the_field(cpu, procs, field):
    with pytest.raises(ValueError, match=f"resources.{field}"):
        threads.threads_per_rank_for(cpu, procs)
