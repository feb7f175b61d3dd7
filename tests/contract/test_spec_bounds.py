"""`oversized`: a spec's lengths checked against the models' own bounds before validation, naming each field as
pydantic would (the bounds are defined once, in the models)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import ValidationError

from kembed_contract.spec import JobSpec, oversized
from tests.builders import make_spec


def _table_data(uri: str) -> Callable[[dict], None]:
    return lambda s: s["trainer"].update(data={"kind": "table", "uri": uri, "label": "y", "sparse": {}})


@pytest.mark.parametrize(("change", "loc"), [
    pytest.param(lambda s: s.update(labels={f"k{i}": "v" for i in range(65)}), ("labels",), id="labels"),
    pytest.param(lambda s: s["trainer"]["embeddings"].update(tables=[{"name": f"t{i}"} for i in range(513)]),
                 ("trainer", "embeddings", "tables"), id="tables"),
    pytest.param(lambda s: s["trainer"]["embeddings"]["tables"][3].update(features=["f"] * 257),
                 ("trainer", "embeddings", "tables", 3, "features"), id="features-of-a-table"),
    pytest.param(_table_data("file:///" + "a" * 5000), ("trainer", "data", "table", "uri"), id="tagged-union"),
    pytest.param(lambda s: s["trainer"]["model"].update(kind="two_tower", user_features=["u"] * 1025,
                                                         item_features=["i"]),
                 ("trainer", "model", "two_tower", "user_features"), id="towers"),
])
def test_oversized_names_the_field_pydantic_names(change, loc):
    spec = make_spec("bounds").build()
    change(spec)
    found = oversized(spec)
    assert [e["loc"] for e in found] == [loc] and found[0]["type"] == "too_long"
    with pytest.raises(ValidationError) as caught:
        JobSpec.model_validate(spec)
    assert loc in [e["loc"] for e in caught.value.errors()]  # the same bound, the same field


def test_a_valid_spec_and_a_wrong_kind_are_not_oversized():
    assert oversized(make_spec().build()) == []
    spec = make_spec().build()
    spec["trainer"]["model"] = {"kind": "unknown", "user_features": ["u"] * 5000}
    assert oversized(spec) == []  # pydantic refuses the kind, without looking at the rest
