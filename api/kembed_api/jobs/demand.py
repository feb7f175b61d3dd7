"""What a job holds while it runs, as stored columns and as the admission core's Demand."""

from kembed_api.jobs.models import Job
from kembed_api.quota.admission import Demand

__all__ = ["DEMAND_COLUMNS", "demand_from_columns", "describe"]

# What one job holds, as columns: queries that sum or replay the queue read only these.
DEMAND_COLUMNS = (Job.gpus, Job.cpu, Job.memory_bytes, Job.processes)


def demand_from_columns(gpus: int, cpu: float, memory_bytes: int, processes: int) -> Demand:
    return Demand(gpus=gpus, cpu=cpu, memory_bytes=memory_bytes, jobs=1, processes=processes)


def describe(demand: Demand) -> str:
    parts = [f"{demand.processes} trainer processes", f"{demand.cpu:g} CPU", f"{demand.memory_bytes / 2**30:g} GiB"]
    if demand.gpus:
        parts.insert(0, f"{demand.gpus} GPUs")
    return ", ".join(parts)
