"""The bounds of a quota, defined once: the API's QuotaSpec (and so the database's columns), the Tenant resource
and the Kubernetes backend's stand-ins for "unlimited" all use them. Far above any real cluster; counts fit the
database's 32-bit integers."""

from __future__ import annotations

__all__ = ["MAX_CPU", "MAX_GPUS", "MAX_JOBS", "MAX_MEMORY_BYTES", "cpu_quantity"]

MAX_GPUS = 1_000_000
MAX_CPU = 100_000_000  # cores
MAX_MEMORY_BYTES = 2**62  # 4Ei
MAX_JOBS = 1_000_000  # running or queued at once


def cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity, never in exponent notation (which a quantity cannot be): 96, 0.5, 100000000."""
    return f"{cores:.3f}".rstrip("0").rstrip(".")
