"""Kubernetes-style conditions on our resources' status: set one, keep the others, keep transition times honest."""

from __future__ import annotations

from typing import Any

__all__ = ["set_condition"]


def set_condition(conditions: list[dict[str, Any]], *, type_: str, status: bool | str, reason: str, message: str,
                  generation: int, now: str) -> list[dict[str, Any]]:
    """A new list with condition `type_` set; lastTransitionTime moves only when its status changes."""
    value = status if isinstance(status, str) else ("True" if status else "False")
    previous = next((c for c in conditions if c.get("type") == type_), None)
    changed = previous is None or previous.get("status") != value
    updated = {
        "type": type_, "status": value, "reason": reason, "message": message,
        "lastTransitionTime": now if changed else previous.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }
    return [updated if c.get("type") == type_ else c for c in conditions] if previous else [*conditions, updated]
