"""Why a job request is refused: the jobs domain's errors, each mapped to one HTTP status by the router."""

__all__ = ["CannotRun", "JobNotFound", "KeyReused", "QueueFull"]


class JobNotFound(LookupError):
    """No such job for this tenant (another tenant's job is indistinguishable from a missing one)."""


class CannotRun(ValueError):
    """The job could never run for this tenant (422): bigger than its quota or than the memory it asks for."""


class QueueFull(RuntimeError):
    """The tenant already has as many queued jobs as its quota allows (429)."""


class KeyReused(ValueError):
    """An Idempotency-Key the tenant used before, now with a different spec (422): a retry must send the same
    request, and a different job needs a key of its own."""

