"""A newcomer's own file on the embedded default: refused with the command that allows it, then trained on."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kembed_api.cli.client import ApiError
from tests.builders import make_spec
from tests.e2e.conftest import ServerProcess

pytestmark = pytest.mark.slow


def test_a_local_parquet_file_is_refused_naming_the_grant_then_trains_once_granted(tmp_path):
    mine = tmp_path / "my-data"
    mine.mkdir()
    rng = np.random.default_rng(0)
    c = rng.integers(0, 100, 4000)
    label = (rng.random(4000) < np.where(c < 50, 0.9, 0.1)).astype(np.int64)
    pq.write_table(pa.table({"c": c, "label": label}), mine / "clicks.parquet")
    spec = make_spec("own-data").build()
    # The tiny example's eight tables all read the one column.
    spec["trainer"]["data"] = {"kind": "table", "uri": str(mine / "clicks.parquet"), "label": "label",
                               "sparse": {f"c{i}": "c" for i in range(8)}}
    spec["trainer"]["model"]["bottom_mlp"] = [16, 8]

    server = ServerProcess(tmp_path / "kembed").start()
    try:
        with pytest.raises(ApiError) as refused:
            server.client.submit(spec)
    finally:
        server.stop()
    assert refused.value.status_code == 422
    detail = str(refused.value.detail)
    assert "outside the tenant's storage policy" in detail and "kembed serve --read-prefix" in detail
    assert "kembed tenants set-storage default --read-prefix" in detail

    server = ServerProcess(tmp_path / "kembed", args=("--read-prefix", str(mine))).start()
    try:
        done = server.wait_terminal(server.client.submit(spec)["id"])
    finally:
        server.stop()
    assert done["state"] == "SUCCEEDED", done["message"]
    assert done["result"]["auc"] > 0.7
