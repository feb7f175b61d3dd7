"""Job ids: what one looks like, and a fresh one for a job's name."""

import re
import secrets
import string

__all__ = ["is_job_id", "new_job_id"]

# What a job id can be (a DNS label: the name, '-', 5 characters). Anything else is no job, answered before any
# statement runs (PostgreSQL refuses NUL characters outright).
_JOB_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def is_job_id(job_id: str) -> bool:
    return _JOB_ID.match(job_id) is not None


def new_job_id(name: str) -> str:
    alphabet = string.ascii_lowercase + string.digits
    return f"{name}-{''.join(secrets.choice(alphabet) for _ in range(5))}"

