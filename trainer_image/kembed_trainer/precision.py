"""The dense part's precision: `training.mixed_precision` resolved on the device a rank trains on.

`auto` is bf16 only where the device multiplies bf16 natively. oneDNN runs bf16 matmuls on any AVX-512 CPU, but
without the bf16 instructions it converts to float32 and back around float32 arithmetic: slower than float32
alone, so such CPUs keep float32.
"""

from __future__ import annotations

import functools
import pathlib

import torch

__all__ = ["autocast", "dense_dtype", "has_bf16_units"]

# /proc/cpuinfo's names for bf16 arithmetic: AVX-512 BF16 and AMX (x86), the BF16 extension (Arm).
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def dense_dtype(setting: str, device: torch.device) -> torch.dtype:
    """What the dense part computes in: bfloat16 or float32."""
    bf16 = setting == "bf16" or (setting == "auto" and has_bf16_units(device))
    return torch.bfloat16 if bf16 else torch.float32


def autocast(setting: str, device: torch.device) -> torch.autocast:
    """The autocast the dense part's forward runs under (disabled: float32)."""
    low = dense_dtype(setting, device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=low == torch.bfloat16)


def has_bf16_units(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and bool(_BF16_FLAGS & _cpu_flags())


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them; none elsewhere (so `auto` stays float32 there)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return frozenset(flags)
