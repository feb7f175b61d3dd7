"""Kopf's diff base, built only for the kinds that have change handlers.

On every watch event of every resource it watches, Kopf builds the object's "essence" (a deep copy of the whole
object, status included) to diff it against the last handled one. Only change handlers (on.create/update/resume)
read that diff; here those are the Tenant's. Pods, batch Jobs and EmbeddingJobs have event handlers and a daemon
only, and at 500 jobs their copies were an eighth of the operator's CPU. For them the essence is empty; the one
thing it would still feed, resetting the idle time of `idle=` daemons and timers, is not used.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import kopf

__all__ = ["ChangeHandledKindsDiffBase"]


class ChangeHandledKindsDiffBase(kopf.AnnotationsDiffBaseStorage):
    def __init__(self, *, kinds: Iterable[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kinds = frozenset(kinds)

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> Any:
        if body.get("kind") not in self.kinds:
            return {}
        return super().build(body=body, extra_fields=extra_fields)
