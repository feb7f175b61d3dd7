"""The test kubelet's layer cache (tests/cluster/oci.py) stays within its size: a new layer makes room by removing
the layers pulled least recently, never one a running container's overlay reads, never one of the image it is
pulling. Without that, every build of the trainer's dependencies left another 5 GB behind."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time

import pytest

from tests.cluster import oci
from tests.images.registry import Images

pytestmark = pytest.mark.images

GIB = 2**30


def _old_layer(store: pathlib.Path, name: str, *, size: int, pulled_s_ago: float) -> pathlib.Path:
    """A layer pulled earlier: a directory with a file, its recorded size, and its last pull's time."""
    layer = store / "layers" / f"sha256-{name * 64}"
    layer.mkdir(parents=True)
    (layer / "file").write_text(name)
    layer.with_name(layer.name + ".size").write_text(str(size))
    then = time.time() - pulled_s_ago
    os.utime(layer, (then, then))
    return layer


def test_a_new_layer_makes_room_by_the_least_recently_pulled_and_spares_those_in_use(tmp_path, images: Images):
    store = tmp_path / "store"
    oldest_mounted = _old_layer(store, "a", size=10 * GIB, pulled_s_ago=400)
    old = _old_layer(store, "b", size=10 * GIB, pulled_s_ago=300)
    older_than_recent = _old_layer(store, "c", size=10 * GIB, pulled_s_ago=200)
    recent = _old_layer(store, "d", size=10 * GIB, pulled_s_ago=100)
    mount_point, other_lower = tmp_path / "mnt", tmp_path / "lower"
    mount_point.mkdir()
    other_lower.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={oldest_mounted}:{other_lower}",
                    str(mount_point)], check=True)
    try:
        image = oci.ImageStore(store, max_bytes=25 * GIB).pull(images.platform)
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)

    # 40 GiB were there: the two least recently pulled that no container reads went, the image's layers came.
    assert not old.exists() and not older_than_recent.exists()
    assert oldest_mounted.is_dir() and recent.is_dir()
    assert all(layer.is_dir() for layer in image.layers)
    left = {p.name for p in (store / "layers").glob("sha256-*") if p.is_dir()}
    assert left == {oldest_mounted.name, recent.name} | {layer.name for layer in image.layers}


def test_a_pull_of_layers_already_there_keeps_them_and_makes_them_the_last_to_go(tmp_path, images: Images):
    store = oci.ImageStore(tmp_path / "store", max_bytes=1)  # smaller than any layer: only a pull's own stay
    first = store.pull(images.platform)
    stale = time.time() - 3600
    for layer in first.layers:
        os.utime(layer, (stale, stale))
    again = store.pull(images.platform)
    assert again.layers == first.layers
    assert all(layer.is_dir() and layer.stat().st_mtime > stale + 3000 for layer in again.layers)
