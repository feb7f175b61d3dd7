"""Embedding tables and their optimizer state on transparent huge pages (Linux, CPU).

A lookup and its sparse update each touch tens of thousands of random rows of tables of hundreds of MB. With
4 KiB pages nearly every row costs a TLB miss and a page-table walk besides the cache miss; 2 MiB pages let
the TLB cover the tables. On the benchmark's CPU a cold gather or update of 60k random rows of a 1 GB table
took half the time. Linux usually backs memory with huge pages only where asked (THP mode `madvise`), and
only at the first touch, so the hint is given right after allocation, before the tables are filled. Elsewhere (not Linux, not CPU, THP off) these are plain tensors.
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["empty", "zeros"]

_MADV_HUGEPAGE = 14  # linux/mman.h
_PAGE = 4096
_MIN_BYTES = 2 << 20  # one huge page: smaller tensors cannot use one


def empty(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.empty(*shape, device=device, dtype=dtype)
    num_bytes = t.numel() * t.element_size()
    if t.device.type == "cpu" and num_bytes >= _MIN_BYTES and _madvise is not None:
        start = -(-t.data_ptr() // _PAGE) * _PAGE  # madvise wants page-aligned ranges
        end = (t.data_ptr() + num_bytes) // _PAGE * _PAGE
        _madvise(start, end - start, _MADV_HUGEPAGE)  # a hint: an error only means no huge pages
    return t


def zeros(*shape: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return empty(*shape, device=device, dtype=dtype).zero_()


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()
