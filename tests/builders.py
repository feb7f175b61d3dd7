"""Builders for test objects: `make_spec().with_nodes(2).with_steps(40).build()` (Kueue's wrappers)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
TINY_TRAINER = yaml.safe_load((REPO / "trainer_image/examples/dlrm-tiny.yaml").read_text())


class SpecBuilder:
    def __init__(self, name: str = "tiny") -> None:
        self.spec: dict[str, Any] = {
            "name": name,
            "resources": {"nodes": 1, "procs_per_node": 1},
            "trainer": copy.deepcopy(TINY_TRAINER),
        }

    def with_name(self, name: str) -> SpecBuilder:
        self.spec["name"] = name
        return self

    def with_nodes(self, nodes: int, procs_per_node: int = 1) -> SpecBuilder:
        self.spec["resources"].update(nodes=nodes, procs_per_node=procs_per_node)
        return self

    def with_priority(self, priority: int) -> SpecBuilder:
        self.spec["priority"] = priority
        return self

    def with_priority_class(self, name: str) -> SpecBuilder:
        self.spec["priority_class"] = name
        return self

    def with_steps(self, steps: int, *, checkpoint_every: int | None = None) -> SpecBuilder:
        self.spec["trainer"]["training"]["steps"] = steps
        if checkpoint_every is not None:
            self.spec["trainer"]["checkpoint"]["every_steps"] = checkpoint_every
        return self

    def with_max_restarts(self, max_restarts: int) -> SpecBuilder:
        self.spec["max_restarts"] = max_restarts
        return self

    def with_trainer(self, **sections: Any) -> SpecBuilder:
        for section, values in sections.items():
            self.spec["trainer"].setdefault(section, {}).update(values)
        return self

    def build(self) -> dict[str, Any]:
        return copy.deepcopy(self.spec)


def make_spec(name: str = "tiny") -> SpecBuilder:
    return SpecBuilder(name)
