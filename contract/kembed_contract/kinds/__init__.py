"""The kinds of model, data and table a job can name: each one module of its own, all found here.

`kinds/models/<kind>.py`, `kinds/data/<kind>.py` and `kinds/tables/<kind>.py` each hold one kind's contract half
(`kinds.base` says what it answers) and end in `KIND = <its class>`: that line registers it, as this package
imports every module of those folders (in name order; `_`-prefixed modules are helpers). A kind's trainer half has
the same name (`kembed_trainer.kinds` finds it by it). Nothing outside a kind's own modules names it: code asks
the registries below, or the kind's capabilities (`kinds.base`). docs/architecture.md, "Adding a kind".
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, Union

from pydantic import Field

from kembed_contract.kinds import base, data, models, tables

if TYPE_CHECKING:
    from kembed_contract.trainer_config import TableConfig

__all__ = [
    "DATA", "DEFAULT_TABLE_HELP", "EXPORT_FORMATS", "MODELS", "TABLES", "data_union", "default_data", "default_model", "in_words",
    "model_union", "table_kind", "with_vocabulary",
]

_Kind = TypeVar("_Kind")


def _found(package: ModuleType, kind_base: type[_Kind]) -> dict[str, type[_Kind]]:
    """name -> class of every kind module in `package`, in name order."""
    found: dict[str, type[_Kind]] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        kind = getattr(module, "KIND", None)
        if not (isinstance(kind, type) and issubclass(kind, kind_base)):
            raise ImportError(f"{module.__name__}: a kind's module ends in `KIND = <its {kind_base.__name__}>`")
        if kind.kind_name() != info.name:
            raise ImportError(f"{module.__name__}: its kind is named {kind.kind_name()!r}; a kind's modules bear "
                              "its name")
        found[info.name] = kind
    return found


def _the_default(found: dict[str, type[_Kind]], what: str) -> type[_Kind]:
    defaults = [kind for kind in found.values() if kind.default]  # type: ignore[attr-defined]
    if len(defaults) != 1:
        raise ImportError(f"exactly one {what} kind is the default, not {len(defaults)}")
    return defaults[0]


MODELS: dict[str, type[base.ModelKind]] = _found(models, base.ModelKind)
DATA: dict[str, type[base.DataKind]] = _found(data, base.DataKind)
TABLES: dict[str, type[base.TableKind]] = _found(tables, base.TableKind)
_DEFAULT_MODEL = _the_default(MODELS, "model")
_DEFAULT_DATA = _the_default(DATA, "data")
_DEFAULT_TABLE = _the_default(TABLES, "table")

EXPORT_FORMATS: dict[str, str] = {
    "parquet": ".parquet",
    **{name: suffix for kind in MODELS.values() for name, suffix in kind.export_formats.items()},
    "numpy": ".npy",
}
"""Export format -> file suffix (`kembed_trainer.export` writes them; the API and the CLI offer them): parquet and
numpy for every table, and those the model kinds add (they write any job's tables too)."""
DEFAULT_TABLE_HELP = "Default: the model kind's own (a model with a vocabulary: its word vectors), else the first."
"""What an export or neighbours query reads when it names no table (ModelKind.default_table), as help texts say."""


def in_words(names: list[str] | tuple[str, ...]) -> str:
    """`a, b or c`: a list of kinds or formats as a sentence says it (help texts, error messages)."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else list(names))


def model_union() -> Any:
    """The `model` section's type: one of the model kinds, told apart by `kind`."""
    return Annotated[Union[tuple(MODELS.values())], Field(discriminator="kind")]  # noqa: UP007 - built at run time


def data_union() -> Any:
    """The `data` section's type: one of the data kinds, told apart by `kind`."""
    return Annotated[Union[tuple(DATA.values())], Field(discriminator="kind")]  # noqa: UP007 - built at run time


def default_model() -> base.ModelKind:
    return _DEFAULT_MODEL()


def default_data() -> base.DataKind:
    return _DEFAULT_DATA()


def table_kind(table: TableConfig) -> type[base.TableKind]:
    """The kind of `table`: the one that selects it (`TableKind.selects`), else the default one."""
    return next((kind for kind in TABLES.values() if not kind.default and kind.selects(table)), _DEFAULT_TABLE)


def with_vocabulary() -> list[str]:
    """The model kinds whose rows are a vocabulary's words."""
    return [name for name, kind in MODELS.items() if kind.has_vocabulary]
