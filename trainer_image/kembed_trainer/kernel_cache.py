"""The trainer's numba kernels, compiled once by the platform and loaded by every job, never written by one.

numba caches a kernel compiled with `cache=True` as pickled machine code under NUMBA_CACHE_DIR, keyed by the
source file's content, the argument types and the CPU. Compiling in every job costs seconds; a cache that jobs share
and write would let one tenant's job leave code that another tenant's job loads. So:

- the platform builds the cache of the trainer's kernels (`python -m kembed_trainer.kernel_cache ensure ROOT`: the
  embedded server at its start, into ROOT/<cache_key()>; the trainer image at its build), and jobs may only read
  it: the image's files are root's, and the embedded backend's Landlock grants the folder for reading only;
- a job's launcher links the platform's files into the job's own, writable NUMBA_CACHE_DIR (`expose`), because
  numba uses a cache folder only where it may write. A kernel the platform built is loaded through its link; one
  it did not build (another CPU, other argument types) is compiled and saved into the job's folder, replacing the
  link rather than writing through it, so the platform's files stay as they are.

The modules with cached kernels are the kinds' own (`kernel_modules` of a model kind's or a table kind's trainer
half, gathered by kembed_trainer.kinds.kernel_modules); each has a `warm()` that compiles its kernels for the
argument types training passes them. A job given the platform's kernels warms its table kinds' modules before it
builds its tables, so that numba's counts in its `started` record cover the kernels its first steps use. Stdlib only at import: the
launcher runs `expose` before torch or numba.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, MutableMapping
from pathlib import Path

from kembed_contract.runtime import ENV_KERNEL_CACHE

__all__ = ["build", "cache_key", "ensure", "expose", "link", "stats", "warm"]

_NUMBA_CACHE_DIR = "NUMBA_CACHE_DIR"  # numba's own name for where its cache is
_PACKAGE = Path(__file__).resolve().parent


def cache_key() -> str:
    """The folder name of this installation's cache: what numba's own keys depend on apart from the CPU (the
    interpreter, numba's version, the kernels' source and where it lives), so an upgrade or an edit builds anew.
    The source is the trainer package's whole (read, not imported: finding the kinds' kernels imports torch)."""
    digest = hashlib.sha256()
    digest.update(f"{sys.version}\0{importlib.metadata.version('numba')}\0{_PACKAGE}\0".encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(f"{path.relative_to(_PACKAGE)}\0".encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def build(folder: Path) -> None:
    """Compile every kernel into `folder` (a fresh process: numba reads NUMBA_CACHE_DIR once, when imported), then
    make the files read-only, so that nobody writes through a job's links by mistake."""
    if "numba" in sys.modules:
        raise RuntimeError("build needs a process that has not imported numba yet")
    os.environ[_NUMBA_CACHE_DIR] = str(folder)
    from kembed_trainer import kinds

    warm(kinds.kernel_modules())
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders that hold them
        path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH | (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH
                                                                  if path.is_dir() else 0))


def ensure(root: Path) -> Path:
    """This installation's cache under `root`, built first when it is not there (into a folder of its own, renamed
    into place when complete, so a job never sees half of it and two builders do not collide)."""
    folder = root / cache_key()
    if folder.is_dir():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    try:
        build(partial)
        partial.chmod(0o555)
        os.rename(partial, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        if partial.exists():
            for path in [partial, *partial.rglob("*")]:
                path.chmod(stat.S_IRWXU)
            shutil.rmtree(partial)
    return folder


def link(platform: Path, job: Path) -> int:
    """Link every file of the platform's cache into the job's folder, the same layout (what the job's numba
    reads); returns how many. A file the job already has is left as it is."""
    count = 0
    for folder, _, files in os.walk(platform):
        inside = job / Path(folder).relative_to(platform)
        inside.mkdir(parents=True, exist_ok=True)
        for name in files:
            target = inside / name
            if not target.exists() and not target.is_symlink():
                target.symlink_to(Path(folder) / name)
                count += 1
    return count


def expose(environ: MutableMapping[str, str]) -> str:
    """Give the job's ranks the platform's kernels (ENV_KERNEL_CACHE, when the launcher's environment names one):
    link them into the job's NUMBA_CACHE_DIR, a new temporary folder when none is set. Returns what it did, for
    the launcher's log; a cache that cannot be used is said and skipped (the ranks then compile, as without one)."""
    platform = environ.get(ENV_KERNEL_CACHE)
    if not platform:
        return ""
    try:
        if not Path(platform).is_dir():
            return f"no kernel cache at {platform}: kernels compile in the job"
        job = environ.get(_NUMBA_CACHE_DIR) or tempfile.mkdtemp(prefix="numba-cache-")
        count = link(Path(platform), Path(job))
    except OSError as exc:
        return f"kernel cache {platform} not used ({exc}): kernels compile in the job"
    environ[_NUMBA_CACHE_DIR] = job
    return f"{count} compiled kernel files from {platform}"


def warm(modules: Iterable[str]) -> None:
    """Compile (or load from numba's cache) the kernels of `modules` for the argument types training passes."""
    for module in modules:
        importlib.import_module(module).warm()


def stats(modules: Iterable[str]) -> dict[str, int]:
    """How many kernels of `modules` (those imported) this process loaded from a cache and how many it compiled
    (numba's own counts, by signature)."""
    loaded = compiled = 0
    for module in modules:
        for value in vars(sys.modules[module]).values() if module in sys.modules else ():
            counts = getattr(value, "stats", None)
            if hasattr(counts, "cache_hits") and hasattr(counts, "cache_misses"):
                loaded += sum(counts.cache_hits.values())
                compiled += sum(counts.cache_misses.values())
    return {"loaded": loaded, "compiled": compiled}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("ensure", "build"):
        print("usage: python -m kembed_trainer.kernel_cache {ensure ROOT | build FOLDER}", file=sys.stderr)
        return 2
    if args[0] == "build":
        build(Path(args[1]))
        print(args[1])
    else:
        print(ensure(Path(args[1]).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
