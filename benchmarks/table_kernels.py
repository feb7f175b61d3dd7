"""A small job with tiered tables and one with dynamic tables, with and without the platform's compiled kernels.

    .venv/bin/python benchmarks/table_kernels.py [--rounds N] [--kinds tiered dynamic]

Each job runs as a local job's node does (`python -m kembed_trainer.launch`, one process: the launcher links the
platform's kernels into the job's NUMBA_CACHE_DIR when KEMBED_KERNEL_CACHE names them), with a fresh, empty
NUMBA_CACHE_DIR of its own every run, once with the platform's folder (built first, as `make install` and the
embedded server build it: `python -m kembed_trainer.kernel_cache ensure`) and once without, in turn. Prints per run
the trainer's seconds by phase (its `done` record: the tiered kernels compile while its tables are built, in
"data and vocabulary"; the dynamic ones at the first steps, in "training"), numba's counts from its `started`
record, the kernels the job compiled and saved in its folder over the whole run (its own files, not the
platform's links), and the process's wall time. The configs are the trainer tests' (tests/trainer/test_tiered.py's
`tiered_config`, tests/trainer/test_dynamic.py's `dynamic_config`), 30 steps, no checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from kembed_contract import runtime  # noqa: E402
from tests.trainer.test_dynamic import dynamic_config  # noqa: E402
from tests.trainer.test_tiered import tiered_config  # noqa: E402

_STEPS = 30
_PHASES = ("process_start", "imports", "data", "training", "evaluation", "saving")


def _config(kind: str) -> dict:
    cfg = tiered_config("", _STEPS) if kind == "tiered" else dynamic_config("", _STEPS)
    cfg["checkpoint"] = {"every_steps": 0}  # no uri: nothing saved
    cfg["training"]["log_every"] = 10
    return cfg


def _run(config: pathlib.Path, work: pathlib.Path, platform: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", runtime.ENV_KERNEL_CACHE)}
    numba_dir = pathlib.Path(tempfile.mkdtemp(prefix="numba-", dir=work))
    env |= {"NUMBA_CACHE_DIR": str(numba_dir), runtime.ENV_LOCAL_DIR: str(work), "KEMBED_JOB_ID": "bench"}
    if platform:
        env[runtime.ENV_KERNEL_CACHE] = platform
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kembed_trainer.launch", "--nnodes=1", "--nproc-per-node=1",
                           "-m", "kembed_trainer", "--config", str(config)],
                          env=env, capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    first = next(r for r in records if r.get("event") == runtime.EVENT_STARTED)
    done = next(r for r in records if r.get("event") == runtime.EVENT_DONE)
    # Kernels the job compiled and saved itself, whenever in the run (the platform's are links): index files.
    saved = sum(1 for f in numba_dir.rglob("*.nbi") if not f.is_symlink())
    return {"wall": wall, **{p: done["seconds"].get(p, 0.0) for p in _PHASES}, "kernels": first.get("kernels"),
            "saved": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", nargs="+", default=["tiered", "dynamic"], choices=["tiered", "dynamic"])
    args = parser.parse_args()
    built = subprocess.run([sys.executable, "-m", runtime.KERNEL_CACHE_MODULE, "ensure",
                            str(pathlib.Path("~/.cache/kembed/kernels").expanduser())],
                           capture_output=True, text=True, check=True)
    platform = built.stdout.strip().splitlines()[-1]
    print(f"load before: {os.getloadavg()[0]:.2f}; platform kernels {platform}")
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for kind in args.kinds:
            config = work / f"{kind}.yaml"
            config.write_text(yaml.safe_dump(_config(kind)))
            for _ in range(args.rounds):
                for label, folder in (("platform", platform), ("own", None)):
                    run = _run(config, work, folder)
                    runs.setdefault((kind, label), []).append(run)
                    print(f"  {kind:<8} {label:<9} " + " ".join(f"{k} {v:.2f}" for k, v in run.items()
                                                             if k not in ("kernels", "saved"))
                          + f"  started: kernels {run['kernels']}; kernel files the job saved {run['saved']}",
                          flush=True)
    print(f"\n{'job':<8} {'kernels':<9} " + " ".join(f"{c:>13}" for c in ("wall", *_PHASES)) + "  (medians)")
    for (kind, label), rs in runs.items():
        print(f"{kind:<8} {label:<9} " + " ".join(f"{statistics.median(r[c] for r in rs):>13.2f}"
                                               for c in ("wall", *_PHASES)))
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
