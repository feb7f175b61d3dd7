"""The field types and bounds every section of the trainer's config is made of.

`kembed_contract.trainer_config` and every kind's own section (`kembed_contract.kinds`) build on these, so a
bound is said once whichever section uses it. No torch, no numpy: the API validates specs with this.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from kembed_contract.storage_policy import Access, check_uri_syntax

__all__ = [
    "MAX_BATCH", "MAX_EPOCHS", "MAX_EVAL_SAMPLES", "MAX_FEATURES", "MAX_FEATURES_PER_TABLE", "MAX_HOTNESS",
    "MAX_INT32", "MAX_LR", "MAX_NAME", "MAX_ROWS", "MAX_TABLES", "MAX_URI", "MAX_WIDTH", "Count", "Features",
    "Fraction", "Layers", "LearningRate", "Name", "NumbersOnly", "OptionalReadUri", "OptionalWriteUri",
    "PositiveInt", "ReadUri", "Strict", "TableFeatures", "Uri", "bounded_float", "bounded_int",
]

# Every number is finite, strictly typed (`true` is not 1, "5" is not 5) and bounded, and every string has a
# length limit: a value past these bounds could only fail, hang or exhaust a machine later, never train. The
# bounds sit far past any real job; memory is checked against the job's resources separately
# (kembed_api.jobs.estimates). 2**31 - 1: steps and counts are stored as 32-bit integers.
MAX_INT32 = 2**31 - 1
MAX_ROWS = 2**40  # rows of one table (hash buckets): a trillion, beyond any single table in production
MAX_WIDTH = 65_536  # an embedding's width or an MLP layer's
MAX_URI = 4096
MAX_NAME = 256  # a column, feature or table name
# How many tables and sparse features one job may have. Validation's cost grows with them (a 1,024-table spec of
# 56,000 features took 0.1 s of the API's CPU to refuse), so they are bounded, and counted before the rest is
# validated. Far past real models: a CTR model on Criteo's log has 26 features; production CTR models have hundreds.
MAX_TABLES = 512
MAX_FEATURES_PER_TABLE = 256
MAX_FEATURES = 1024  # over all tables (and so over data.sparse and a model's feature lists)


def _numbers_only(value: object) -> object:
    """JSON's numbers only: `true` is not 1 and "5" is not 5 (JSON Schema agrees). An integral 5.0 is the integer
    5, as JSON Schema says too; 5.5 is not."""
    if isinstance(value, bool | str | bytes):
        raise PydanticCustomError("number_type", "Input should be a number, not {kind}",
                                  {"kind": "true/false" if isinstance(value, bool) else "text"})
    return value


NumbersOnly = BeforeValidator(_numbers_only)


def bounded_int(ge: int, le: int) -> type[int]:
    if ge == 1:  # said as "greater than 0", as the errors of positive counts always were
        return Annotated[int, NumbersOnly, Field(gt=0, le=le)]  # type: ignore[return-value]
    return Annotated[int, NumbersOnly, Field(ge=ge, le=le)]  # type: ignore[return-value]


PositiveInt = bounded_int(1, MAX_INT32)
Count = bounded_int(0, MAX_INT32)
Fraction = Annotated[float, Field(strict=True, ge=0, lt=1, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=r"^[^\x00-\x1f\x7f]*$")]
Uri = Annotated[str, Field(min_length=1, max_length=MAX_URI, pattern=r"^[^\x00-\x1f\x7f]*$")]
Layers = Annotated[list[bounded_int(1, MAX_WIDTH)], Field(max_length=32)]
Features = Annotated[list[Name], Field(min_length=1, max_length=MAX_FEATURES)]
TableFeatures = Annotated[list[Name], Field(min_length=1, max_length=MAX_FEATURES_PER_TABLE)]


def bounded_float(*, gt: float | None = None, ge: float | None = None, le: float | None = None,
           lt: float | None = None) -> type[float]:
    return Annotated[float, Field(strict=True, gt=gt, ge=ge, le=le, lt=lt, allow_inf_nan=False)]  # type: ignore


MAX_LR = 1000
LearningRate = bounded_float(gt=0, le=MAX_LR)
MAX_HOTNESS = 4096  # ids per feature per sample
MAX_EVAL_SAMPLES = 100_000_000  # an eval's scores and labels are gathered on every rank
MAX_BATCH = 2**22  # samples per rank per step (4M); memory is checked separately
MAX_EPOCHS = 100_000  # passes over the training data
# Every storage URI of the config is one of these: the Access marks it for the storage policy's checks
# (kembed_contract.storage_policy.uri_fields finds them), the validator refuses what has no canonical form.
ReadUri = Annotated[Uri, AfterValidator(check_uri_syntax), Access.READ]
OptionalReadUri = Annotated[Uri | None, AfterValidator(lambda u: u if u is None else check_uri_syntax(u)), Access.READ]
OptionalWriteUri = Annotated[
    Uri | None, AfterValidator(lambda u: u if u is None else check_uri_syntax(u)), Access.WRITE
]


class Strict(BaseModel):
    """A config section: unknown keys are an error naming the field, and no number is NaN or infinite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
