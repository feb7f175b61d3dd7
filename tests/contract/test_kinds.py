"""Kinds live in their own modules (issue 28, docs/architecture.md "Adding a kind"): nothing else names a model
kind or tests a kind's name, and every registered kind has its contract half, its trainer half and its docs."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import textwrap
from pathlib import Path

import pytest

from kembed_contract import kinds

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("api", "contract", "operator", "trainer_image")
# Examples of a kind, which name it by nature: the trainer's example configs and the demo's sample job.
EXAMPLES = ("trainer_image/examples/", "api/kembed_api/samples/")
CONTRACT_HALVES = {"models": "contract/kembed_contract/kinds/models", "data": "contract/kembed_contract/kinds/data",
                   "tables": "contract/kembed_contract/kinds/tables"}
TRAINER_HALVES = {"models": "trainer_image/kembed_trainer/models", "data": "trainer_image/kembed_trainer/data",
                  "tables": "trainer_image/kembed_trainer/tables"}
REGISTRIES = {"models": kinds.MODELS, "data": kinds.DATA, "tables": kinds.TABLES}


def _product_files() -> list[Path]:
    found = []
    for root in PRODUCT:
        for path in sorted((REPO / root).rglob("*")):
            relative = path.relative_to(REPO).as_posix()
            if (path.is_file() and "__pycache__" not in path.parts and not relative.startswith(EXAMPLES)
                    and path.suffix not in (".pyc", ".png", ".ico", ".woff2")):
                found.append(path)
    return found


def _own(relative: str, group: str, name: str) -> bool:
    """Whether `relative` (a repository path) is one of kind `name`'s own modules."""
    halves = (f"{CONTRACT_HALVES[group]}/{name}.py", f"{TRAINER_HALVES[group]}/{name}.py",
              f"{TRAINER_HALVES[group]}/{name}/")
    return relative.startswith(halves)


def _spelled(name: str) -> re.Pattern[str]:
    """A kind's name as code, prose or a class name spells it: any case, `_` also as `-`, a space or nothing."""
    return re.compile("[_ -]?".join(re.escape(part) for part in name.split("_")), re.IGNORECASE)


def test_no_product_code_names_a_model_kind_outside_its_own_modules():
    """`grep -rni word2vec` (and each model kind) finds nothing in api/, contract/, operator/, trainer_image/ but
    the kind's own modules and its examples: the platform asks the registry and the kinds' capabilities."""
    found = []
    files = [(p, p.relative_to(REPO).as_posix(), p.read_text(encoding="utf-8", errors="replace"))
             for p in _product_files()]
    for name in kinds.MODELS:
        pattern = _spelled(name)
        for _, relative, text in files:
            if _own(relative, "models", name):
                continue
            found += [f"{relative}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                      if pattern.search(line)]
    assert found == []


def _kind_tests(tree: ast.AST, names: set[str]) -> list[tuple[int, str]]:
    """Where code compares something's `kind` with a kind's name, or matches one as a case."""

    def about_kind(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr == "kind"
                   or isinstance(n, ast.Constant) and n.value == "kind" for n in ast.walk(node))

    def named(node: ast.AST) -> set[str]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names}

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            constants = set().union(*(named(side) for side in sides))
            if constants and any(about_kind(side) for side in sides):
                hits += [(node.lineno, name) for name in sorted(constants)]
        elif isinstance(node, ast.Match) and about_kind(node.subject):
            hits += [(case.pattern.lineno, name) for case in node.cases for name in sorted(named(case.pattern))]
    return hits


def test_no_product_code_tests_a_kind_by_name_outside_its_own_modules():
    """`x.kind == "text"`, `match cfg.data.kind: case "table"`, for every model, data and table kind: a kind's
    differences are its own modules' to say (data and table kind names are common words, so this reads the code,
    not the text)."""
    owners = {name: group for group, registry in REGISTRIES.items() for name in registry}
    found = []
    for path in _product_files():
        if path.suffix != ".py":
            continue
        relative = path.relative_to(REPO).as_posix()
        for line, name in _kind_tests(ast.parse(path.read_text(encoding="utf-8")), set(owners)):
            if not _own(relative, owners[name], name):
                found.append(f"{relative}:{line}: tests for kind {name!r}")
    assert found == []


@pytest.mark.parametrize(
    ("code", "caught"),
    [
        pytest.param('if cfg.model.kind == "dlrm": pass', True, id="attribute"),
        pytest.param('if model.get("kind") != "text": pass', True, id="get"),
        pytest.param('if cfg.data.kind in ("synthetic", "table"): pass', True, id="in"),
        pytest.param('match cfg.data.kind:\n    case "text": pass', True, id="match"),
        pytest.param('if answer.get("table"): pass', False, id="not-a-kind"),
        pytest.param('if cfg.data.kind == other.kind: pass', False, id="no-name"),
    ],
)
def test_the_kind_test_finder_sees_what_it_means_to(code, caught):
    names = {*kinds.MODELS, *kinds.DATA, *kinds.TABLES}
    assert bool(_kind_tests(ast.parse(code), names)) is caught


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ +(.+?) *$", markdown, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize(("group", "name"), [pytest.param(g, n, id=f"{g}-{n}")
                                             for g, registry in REGISTRIES.items() for n in registry])
def test_every_registered_kind_has_both_halves_and_its_docs_section(group, name):
    from kembed_trainer import kinds as trainer_kinds
    from kembed_trainer.models.base import ModelTraining
    from kembed_trainer.tables.base import TableStorage

    contract_half = REGISTRIES[group][name]
    assert contract_half.kind_name() == name
    assert (REPO / CONTRACT_HALVES[group] / f"{name}.py").is_file()
    trainer_half = importlib.import_module(f"kembed_trainer.{group}.{name}")
    if group == "models":
        assert isinstance(trainer_half.KIND, ModelTraining)
        assert trainer_kinds.model(name) is trainer_half.KIND
        # Every export format the kind offers has its writer, and no other.
        assert set(trainer_half.KIND.writers) == set(contract_half.export_formats)
    elif group == "data":
        assert callable(trainer_half.build)
    else:
        assert isinstance(trainer_half.KIND, TableStorage)
    page, _, anchor = contract_half.docs.partition("#")
    assert anchor in _anchors((REPO / "docs" / page).read_text()), f"docs/{contract_half.docs}"


@pytest.mark.parametrize("group", list(TRAINER_HALVES))
def test_every_trainer_half_belongs_to_a_registered_kind(group):
    """A kind module in the trainer without its contract half would never be found (the trainer finds halves by
    the contract's names): every module of models/ and tables/ is a kind's, or a helper named in the package."""
    helpers = {"models": {"base", "layers"}, "data": None, "tables": {"base"}}[group]
    if helpers is None:  # data/ also holds what the sources share; only the registered names are kinds there
        return
    folder = REPO / TRAINER_HALVES[group]
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    assert modules - helpers == set(REGISTRIES[group])


def test_a_kind_module_without_its_registration_line_is_refused(tmp_path, monkeypatch):
    """The registry finds a folder's modules; one that forgets `KIND = ...`, or names itself otherwise than its
    module, stops the import instead of silently missing from the union."""
    package = tmp_path / "fake_kinds"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_helper.py").write_text("X = 1\n")  # a helper: skipped
    (package / "alpha.py").write_text(textwrap.dedent("""
        from typing import Literal
        from kembed_contract.kinds.base import DataKind
        class AlphaData(DataKind):
            kind: Literal["alpha"] = "alpha"
        KIND = AlphaData
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_kinds", raising=False)
    fake = importlib.import_module("fake_kinds")
    assert list(kinds._found(fake, kinds.base.DataKind)) == ["alpha"]

    (package / "beta.py").write_text("X = 1\n")
    with pytest.raises(ImportError, match="KIND = "):
        kinds._found(fake, kinds.base.DataKind)
    (package / "beta.py").write_text(textwrap.dedent("""
        from typing import Literal
        from kembed_contract.kinds.base import DataKind
        class Gamma(DataKind):
            kind: Literal["gamma"] = "gamma"
        KIND = Gamma
    """))
    monkeypatch.delitem(sys.modules, "fake_kinds.beta", raising=False)
    with pytest.raises(ImportError, match="bear its name"):
        kinds._found(fake, kinds.base.DataKind)
