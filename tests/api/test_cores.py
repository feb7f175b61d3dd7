"""Where local trainers run (kembed_api.backends.cores): running jobs on disjoint cores while they fit."""

import pytest

from kembed_api.backends.cores import CoreAllocator, cores_for


def test_jobs_get_disjoint_cores_while_they_fit():
    cores = CoreAllocator([0, 1, 2, 3])
    a = cores.take("a", nodes=1, cpu_per_node=1)
    b = cores.take("b", nodes=1, cpu_per_node=2)
    c = cores.take("c", nodes=1, cpu_per_node=1)
    assert a == [[0]] and b == [[1, 2]] and c == [[3]]


def test_a_gang_s_nodes_get_cores_of_their_own():
    assert CoreAllocator([0, 1, 2, 3]).take("g", nodes=2, cpu_per_node=2) == [[0, 1], [2, 3]]


def test_released_cores_go_to_the_next_job():
    cores = CoreAllocator([0, 1])
    cores.take("a", nodes=1, cpu_per_node=1)
    cores.take("b", nodes=1, cpu_per_node=1)
    cores.release("a")
    assert cores.take("c", nodes=1, cpu_per_node=1) == [[0]]
    assert cores.held() == {"b": [[1]], "c": [[0]]}


def test_once_every_core_is_held_a_job_shares_the_least_held():
    cores = CoreAllocator([0, 1, 2])
    cores.take("a", nodes=1, cpu_per_node=2)  # 0, 1
    cores.take("b", nodes=1, cpu_per_node=1)  # 2
    assert cores.take("c", nodes=1, cpu_per_node=2) == [[0, 1]]  # all held once: the lowest
    assert cores.take("d", nodes=1, cpu_per_node=1) == [[2]]  # 2 is held once, 0 and 1 twice


def test_a_job_asking_more_than_the_machine_gets_every_core_once():
    assert CoreAllocator([4, 5]).take("big", nodes=1, cpu_per_node=16) == [[4, 5]]


def test_taking_again_gives_back_what_the_job_held_first():
    cores = CoreAllocator([0, 1])
    cores.take("a", nodes=1, cpu_per_node=1)
    assert cores.take("a", nodes=1, cpu_per_node=1) == [[0]]  # a restart: not 1 because 0 looked held


@pytest.mark.parametrize("cpu, whole", [(0.01, 1), (0.5, 1), (1.0, 1), (1.5, 2), (2.0, 2), (0.1 * 30, 3)])
def test_fractional_cpus_are_placed_on_whole_cores_rounded_up(cpu, whole):
    assert cores_for(cpu) == whole


def test_no_cores_is_an_error():
    with pytest.raises(ValueError, match="no cores"):
        CoreAllocator([])


def test_the_node_wrapper_runs_its_command_on_the_cores_it_was_given():
    """The sandbox wrapper every local node starts under pins itself before the exec: the launcher, its ranks and
    their threads inherit the cores."""
    import os
    import subprocess

    from kembed_api.platform.confinement import sandbox_command

    core = max(os.sched_getaffinity(0))
    command = [*sandbox_command(files=None, network=None, cpus=[core]), "grep", "Cpus_allowed_list", "/proc/self/status"]
    shown = subprocess.run(command, capture_output=True, text=True, check=True, timeout=60).stdout
    assert shown.split(":")[1].strip() == str(core)
