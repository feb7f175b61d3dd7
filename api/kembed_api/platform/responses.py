"""JSON responses of models our own code built.

A route that returns a pydantic model gets it validated again and serialised by FastAPI; for a sync route the
validation even takes a second trip through the worker threads. Our read models are built from the database by
our own code, so the routes that clients poll (jobs, usage) return `ModelResponse(model)` instead: serialised
once, straight to JSON. Such a route keeps `response_model=` in its decorator, so the OpenAPI document still
describes the answer.
"""

from __future__ import annotations

from pydantic import BaseModel
from starlette.responses import Response

__all__ = ["ModelResponse"]


class ModelResponse(Response):
    media_type = "application/json"

    def render(self, content: BaseModel) -> bytes:
        return content.model_dump_json().encode()
