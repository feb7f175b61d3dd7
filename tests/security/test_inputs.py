"""Hostile inputs against a real `kembed serve`: numbers JSON does not have, floods, wrong types, sizes that could
only fail or hang later, jobs no memory can hold. Each is a 4xx naming the field, never a 500, never stored."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.builders import make_spec
from tests.security.hostile import World


def _jobs_of(client: httpx.Client) -> list[dict]:
    return client.get("/v1/jobs", params={"limit": 500}).json()["items"]


def _raw_post(client: httpx.Client, path: str, text: str) -> httpx.Response:
    return client.post(path, content=text.encode(), headers={"Content-Type": "application/json"})


def _spec_text(**replace: str) -> str:
    """A valid spec as JSON text, with literal text put in for some values (`NaN` cannot be written by json)."""
    spec = make_spec("hostile").build()
    spec["trainer"]["optimizer"]["sparse"]["lr"] = "@LR@"
    spec["resources"]["cpu_per_node"] = "@CPU@"
    spec["labels"] = {"team": "@LABEL@"}
    spec["priority"] = "@PRIORITY@"
    text = json.dumps(spec)
    defaults = {"LR": "0.1", "CPU": "1", "LABEL": '"x"', "PRIORITY": "0"}
    for key, value in {**defaults, **replace}.items():
        text = text.replace(f'"@{key}@"', value)
    return text


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
@pytest.mark.parametrize(("placeholder", "field"), [
    ("LR", "trainer.optimizer.sparse.lr"),
    ("CPU", "resources.cpu_per_node"),
    ("LABEL", "labels.team"),
    ("PRIORITY", "priority"),
])
def test_non_finite_numbers_are_422_naming_the_field_and_keep_the_connection(world: World, literal, placeholder,
                                                                             field):
    with world.as_("alpha", "member") as client:
        before = len(_jobs_of(client))
        response = _raw_post(client, "/v1/jobs", _spec_text(**{placeholder: literal}))
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["detail"].startswith(f"{field}: ") and "finite" in body["detail"]
        assert [".".join(map(str, e["loc"][1:])) for e in body["errors"]] == [field]
        assert response.headers.get("connection", "").lower() != "close"
        # the same keep-alive connection answers the next request, and nothing was stored
        assert len(_jobs_of(client)) == before


@pytest.mark.parametrize(("path", "text", "field"), [
    ("/v1/tenants", '{"name": "nan-team", "quota": {"cpu": NaN}}', "quota.cpu"),
    ("/v1/tenants/alpha/tokens", '{"name": "t", "role": "viewer", "expires_at": Infinity}', "expires_at"),
])
def test_non_finite_numbers_are_refused_on_every_route(world: World, path, text, field):
    with world.admin_client() as admin:
        response = _raw_post(admin, path, text)
        assert response.status_code == 422, response.text
        assert [".".join(map(str, e["loc"][1:])) for e in response.json()["errors"]] == [field]
        assert admin.get("/v1/tenants/nan-team").status_code == 404


def test_a_report_with_nan_is_refused_not_stored(world: World):
    # A trainer's report carries free-form metric values: a NaN there must not reach the database either.
    with world.as_("alpha", "member") as client:
        job = client.post("/v1/jobs", json=make_spec("report-nan").build()).json()
        response = _raw_post(client, f"/v1/jobs/{job['id']}/reports", '{"event": "progress", "step": 1, "loss": NaN}')
        assert response.status_code == 422 and response.json()["errors"][0]["loc"] == ["body", "loss"]


def _body_of(num_bytes: int) -> bytes:
    spec = make_spec("flood").build()
    spec["labels"] = {"big": "x" * num_bytes}
    return json.dumps(spec).encode()


def test_a_body_over_the_limit_is_413_before_it_is_read(world: World):
    with world.as_("alpha", "member") as client:
        before = len(_jobs_of(client))
        response = client.post("/v1/jobs", content=_body_of(10 * 2**20), headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert "larger than" in response.json()["detail"]
        assert len(_jobs_of(client)) == before


def test_a_chunked_body_over_the_limit_is_413(world: World):
    body = _body_of(3 * 2**20)

    def chunks():
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    with world.as_("alpha", "member") as client:
        before = len(_jobs_of(client))
        response = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert "content-length" not in response.request.headers  # really sent chunked
        assert response.status_code == 413
        assert len(_jobs_of(client)) == before


def test_a_declared_length_over_the_limit_is_refused_without_sending_the_body(world: World):
    host, port = world.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {world.tokens['alpha', 'member']}"
                     f"\r\nContent-Type: application/json\r\nContent-Length: {2**40}\r\n\r\n".encode())
        answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 413")


def _labels(count: int, *, key_len: int = 8, value_len: int = 8) -> dict[str, str]:
    return {f"k{i:0{key_len - 1}d}": "v" * value_len for i in range(count)}


@pytest.mark.parametrize(("mutate", "field"), [
    pytest.param(lambda s: s.update(labels=_labels(65)), "labels", id="too-many-labels"),
    pytest.param(lambda s: s.update(labels=_labels(1, key_len=200)), "labels", id="label-key-too-long"),
    pytest.param(lambda s: s.update(labels=_labels(1, value_len=300)), "labels", id="label-value-too-long"),
    pytest.param(lambda s: s.update(labels={"a": "line\nforged"}), "labels", id="label-control-character"),
    pytest.param(lambda s: s.update(image="r.example/x:" + "1" * 600), "image", id="image-too-long"),
    pytest.param(lambda s: s.update(image="r.example/x:1\nEVIL"), "image", id="image-newline"),
    pytest.param(lambda s: s["trainer"].update(data={"kind": "table", "uri": "x" * 5000, "label": "y",
                                                      "sparse": {f"c{i}": f"c{i}" for i in range(8)}}),
                 "trainer.data.table.uri", id="uri-too-long"),
    pytest.param(lambda s: s["trainer"]["checkpoint"].update(uri="file:///" + "a" * 5000),
                 "trainer.checkpoint.uri", id="checkpoint-uri-too-long"),
    pytest.param(lambda s: s["trainer"]["embeddings"]["tables"][0].update(features=["c0" + "x" * 300]),
                 "trainer.embeddings.tables.0.features.0", id="feature-name-too-long"),
])
def test_free_strings_and_label_maps_are_bounded(world: World, mutate, field):
    spec = make_spec("strings").build()
    mutate(spec)
    with world.as_("alpha", "member") as client:
        before = len(_jobs_of(client))
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        assert any(".".join(map(str, e["loc"][1:])).startswith(field) for e in response.json()["errors"])
        assert len(_jobs_of(client)) == before


@pytest.mark.parametrize(("section", "key", "value", "field"), [
    pytest.param("training", "steps", True, "trainer.training.steps", id="bool-as-steps"),
    pytest.param("training", "batch_size", "256", "trainer.training.batch_size", id="string-as-batch"),
    pytest.param("training", "seed", False, "trainer.training.seed", id="bool-as-seed"),
    pytest.param("optimizer", "sparse", {"lr": "0.1"}, "trainer.optimizer.sparse.lr", id="string-as-lr"),
    pytest.param("optimizer", "sparse", {"lr": True}, "trainer.optimizer.sparse.lr", id="bool-as-lr"),
    pytest.param("training", "batch_size", 10**12, "trainer.training.batch_size", id="huge-batch"),
    pytest.param("data", "max_hotness", 10**9, "trainer.data.synthetic.max_hotness", id="huge-hotness"),
    pytest.param("data", "eval_samples", 10**12, "trainer.data.synthetic.eval_samples", id="huge-eval"),
    pytest.param("optimizer", "sparse", {"lr": 1e300}, "trainer.optimizer.sparse.lr", id="huge-lr"),
    pytest.param("training", "steps", 2**40, "trainer.training.steps", id="steps-past-storage"),
])
def test_types_are_strict_and_sizes_bounded(world: World, section, key, value, field):
    spec = make_spec("strict").build()
    spec["trainer"].setdefault(section, {})[key] = value
    with world.as_("alpha", "member") as client:
        before = len(_jobs_of(client))
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        assert field in [".".join(map(str, e["loc"][1:])) for e in response.json()["errors"]]
        assert len(_jobs_of(client)) == before


@pytest.mark.parametrize(("resources", "field"), [
    ({"nodes": True}, "resources.nodes"),
    ({"procs_per_node": "1"}, "resources.procs_per_node"),
    ({"cpu_per_node": True}, "resources.cpu_per_node"),
])
def test_resources_are_strictly_typed(world: World, resources, field):
    spec = make_spec("strict-resources").build()
    spec["resources"].update(resources)
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        assert field in [".".join(map(str, e["loc"][1:])) for e in response.json()["errors"]]


def test_a_job_whose_memory_cannot_fit_is_refused_with_the_estimate(world: World):
    spec = make_spec("too-big").build()
    # 50M rows of 64 floats with row-wise Adagrad: about 12 GiB of table alone, asked to fit in 2Gi
    spec["trainer"]["embeddings"]["tables"][0].update(num_embeddings=50_000_000)
    spec["trainer"]["embeddings"]["tables"] = [spec["trainer"]["embeddings"]["tables"][0]]
    spec["trainer"]["embeddings"]["tables"][0].update(embedding_dim=64, features=[f"c{i}" for i in range(8)])
    spec["trainer"]["model"]["bottom_mlp"] = [16, 64]
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert detail.startswith("resources.memory_per_node: ") and "GiB per rank (tables" in detail


def test_a_big_batch_counts_in_the_estimate(world: World):
    # Small tables, but a batch of 4M samples with 64-wide rows of 8 features: gigabytes per step
    spec = make_spec("big-batch").build()
    spec["trainer"]["training"]["batch_size"] = 2**22
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422 and "batch" in response.json()["detail"], response.text


@pytest.mark.parametrize(("resources", "field"), [
    ({"memory_per_node": "900Ti"}, "resources.memory_per_node"),
    ({"cpu_per_node": 512}, "resources.cpu_per_node"),
])
def test_the_local_backend_refuses_what_this_machine_cannot_hold(world: World, resources, field):
    spec = make_spec("machine").build()
    spec["resources"].update(resources)
    with world.as_("alpha", "member") as client:
        response = client.post("/v1/jobs", json=spec)
        assert response.status_code == 422, response.text
        assert response.json()["detail"].startswith(f"{field}: ") and "this machine has" in response.json()["detail"]
