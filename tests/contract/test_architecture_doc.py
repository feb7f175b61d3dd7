"""docs/architecture.md names modules, files and folders: each must exist, so the map stays true as code moves."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
SOURCE_ROOTS = ("contract", "api", "operator", "trainer_image")
_CODE = re.compile(r"`([^`\s]+)`")
_DOTTED = re.compile(r"^kembed_[a-z_]+(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_PATH = re.compile(r"^[\w./-]+(\.py|\.md|\.yaml|/)$")


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def _module_file(dotted: list[str]) -> Path | None:
    for root in SOURCE_ROOTS:
        base = ROOT / root / Path(*dotted)
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
    return None


def _dotted_exists(name: str) -> bool:
    """A module, or a module and one name defined in it (`kembed_api.quota.preemption.decide`)."""
    parts = name.split(".")
    if _module_file(parts):
        return True
    module = _module_file(parts[:-1]) if len(parts) > 1 else None
    return bool(module and re.search(rf"^\s*(def|class|async def)? ?{re.escape(parts[-1])}\b", module.read_text(),
                                     re.M))


def _path_exists(path: str, tracked: list[str]) -> bool:
    """A file or folder of the repository, named whole or by its tail (`auth/roles.py` inside `kembed_api`)."""
    path = path.rstrip("/")
    return (ROOT / path).exists() or any(f == path or f.endswith("/" + path) or f"/{path}/" in f"/{f}"
                                         for f in tracked)


def test_every_module_and_file_the_architecture_names_exists() -> None:
    tracked = _tracked()
    names = set(_CODE.findall(DOC.read_text()))
    dotted = {n for n in names if _DOTTED.match(n)}
    paths = {n for n in names if _PATH.match(n) and "<" not in n and not n.startswith(("http", "s3:"))}
    assert dotted and paths, "the architecture names no modules or files: the check would prove nothing"
    missing = sorted([n for n in dotted if not _dotted_exists(n)] + [p for p in paths if not _path_exists(p, tracked)])
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"
