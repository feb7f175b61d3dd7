"""Big tables are backed by transparent huge pages where the kernel offers them on request."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from kembed_trainer import hugepages

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        if m := re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line):
            inside = int(m[1], 16) <= address < int(m[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages on this machine"
)
def test_a_big_table_gets_huge_pages_and_starts_at_zero():
    table = hugepages.zeros(64 << 20 >> 8, 64, device=torch.device("cpu"))  # 64 MiB
    assert not table.any()
    assert anon_huge_kb(table.data_ptr() + table.numel() * 2) >= 2048


def test_small_and_int_tables_are_plain_tensors_of_the_asked_shape():
    small = hugepages.zeros(3, 2, device=torch.device("cpu"), dtype=torch.int64)
    assert small.shape == (3, 2) and small.dtype == torch.int64 and not small.any()
