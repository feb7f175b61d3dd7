"""The local backend's admission checks (its process handling is tested for real in tests/e2e)."""

import pytest

from kembed_api.admission import Quota
from kembed_api.backends.local import LocalBackend
from kembed_contract.spec import JobSpec
from tests.builders import make_spec


@pytest.fixture
def local(tmp_path):
    return LocalBackend(data_dir=tmp_path, slots=4)


def test_a_job_larger_than_the_slots_is_refused_with_the_numbers(local):
    with pytest.raises(ValueError, match=r"needs 6 trainer processes .* 4 local slots \(KEMBED_LOCAL_SLOTS\)"):
        local.check_fits(JobSpec.model_validate(make_spec().with_nodes(3, 2).build()))


def test_gpus_are_refused_on_the_cpu_only_local_backend(local):
    spec = make_spec().build()
    spec["resources"]["gpus_per_node"] = 1
    with pytest.raises(ValueError, match="resources.gpus_per_node"):
        local.check_fits(JobSpec.model_validate(spec))


def test_capacity_is_the_slots_in_trainer_processes(local):
    assert local.capacity() == Quota(max_processes=4)
