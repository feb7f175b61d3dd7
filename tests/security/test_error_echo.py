"""Errors never echo input, against a real `kembed serve`: a value sent (it may be large, or a secret pasted into
the wrong field) does not come back in the answer that refuses it. The answer still names the field."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.builders import make_spec
from tests.security.hostile import World

# Valid where a name, a label, a key or a tag may be: lower-case letters and digits.
MARKER = "zqmarker7f3a"


def _with(change: Callable[[dict], None]) -> dict:
    spec = make_spec("echo").build()
    change(spec)
    return spec


def _table_data(spec: dict) -> None:
    spec["trainer"]["data"] = {"kind": "table", "uri": "file:///data/rows.parquet", "label": "y",
                               "sparse": {MARKER: "c0"}}


def _same_table_names(spec: dict) -> None:
    for table in spec["trainer"]["embeddings"]["tables"][:2]:
        table["name"] = MARKER


@pytest.mark.parametrize(("change", "field"), [
    pytest.param(lambda s: s.update(priority_class=MARKER), "priority_class", id="priority-class"),
    pytest.param(lambda s: s["trainer"]["model"].update(kind=MARKER), "trainer.model", id="union-tag"),
    pytest.param(_table_data, "trainer", id="sparse-features"),
    pytest.param(_same_table_names, "trainer.embeddings", id="table-names"),
    pytest.param(lambda s: s["resources"].update(memory_per_node=f"{MARKER}Gi"), "resources.memory_per_node",
                 id="quantity"),
])
def test_a_refused_spec_does_not_echo_what_its_field_held(world: World, change, field):
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=_with(change))
        assert response.status_code == 422, response.text
        assert MARKER not in response.text
        assert response.json()["detail"].startswith(f"{field}")


def test_a_reused_idempotency_key_is_not_echoed(world: World):
    with world.as_("alpha", "member") as client:
        headers = {"Idempotency-Key": MARKER}
        assert client.post("/v1/jobs", json=make_spec("key-a").build(), headers=headers).status_code == 201
        response = client.post("/v1/jobs", json=make_spec("key-b").build(), headers=headers)
        assert response.status_code == 422
        assert MARKER not in response.text and "idempotency-key" in response.json()["detail"]


@pytest.mark.parametrize("path", [f"/v1/jobs/{MARKER}-abcde", f"/v1/jobs/{MARKER}-abcde/events",
                                  f"/v1/tenants/{MARKER}"])
def test_a_missing_object_is_not_named_back(world: World, path):
    with world.as_("alpha", "member") as client:
        response = client.get(path)
        assert response.status_code == 404
        assert MARKER not in response.text


def test_a_huge_unknown_key_is_shortened_in_loc(world: World):
    key = "k" + MARKER * 1000
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=_with(lambda s: s.update({key: 1})))
        assert response.status_code == 422
        assert len(response.text) < 2000 and response.json()["errors"][0]["type"] == "extra_forbidden"


def test_a_validation_error_of_any_route_has_no_input_or_ctx(world: World):
    with world.admin_client() as admin:
        response = admin.post("/v1/tenants", json={"name": MARKER, "quota": {"gpus": MARKER}})
        assert response.status_code == 422
        assert MARKER not in response.text
        assert all(set(item) == {"loc", "msg", "type"} for item in response.json()["errors"])
    response = httpx.get(f"{world.url}/v1/jobs", params={"limit": MARKER},
                         headers={"Authorization": f"Bearer {world.tokens['alpha', 'viewer']}"})
    assert response.status_code == 422 and MARKER not in response.text
