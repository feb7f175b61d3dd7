"""An export's peak memory against its table's size: the export worker reads a table a range of rows at a time.

    .venv/bin/python benchmarks/export_memory.py                        # tables of 1000 rows, 244 and 732 MiB
    .venv/bin/python benchmarks/export_memory.py --rows 1000 8000000 --formats numpy

Each table (dim 32, float32) is saved as the trainer saves one (`step_writer`: chunks of 8 MiB), with a delta that
changed a quarter of its rows (step 2). Each export is `python -m kembed_trainer.export_worker` in a process of
its own, started from a launcher that imports nothing large, so that its `ru_maxrss` is its own (the test of the
same name in tests/trainer/test_export.py holds the bound). `full` reads the full checkpoint (step 1), `chain`
the delta through its chain (step 2: the table assembled in a scratch file on local disk first).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))
sys.path.insert(0, str(REPO))

from tests.trainer.test_export import export_peak_rss, saved_chain  # noqa: E402 - after the path set-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1000, 2_000_000, 6_000_000])
    parser.add_argument("--formats", nargs="+", default=["numpy", "parquet", "word2vec-binary"])
    args = parser.parse_args()
    dim = 32
    print("| table rows | table MiB | read | format | peak RSS MiB | over the 1000-row table's | seconds |")
    print("| ---: | ---: | --- | --- | ---: | ---: | ---: |")
    baseline: dict[tuple[str, str], int] = {}
    for num_rows in args.rows:
        with tempfile.TemporaryDirectory(prefix="kembed-export-memory-") as folder:
            root = pathlib.Path(folder)
            (root / "chain").mkdir()
            uris = dict(zip(("full", "chain"), saved_chain(root / "chain", num_rows, dim), strict=True))
            for fmt in args.formats:
                for read, uri in uris.items():
                    started = time.perf_counter()
                    _, peak = export_peak_rss(uri, fmt, root)
                    seconds = time.perf_counter() - started
                    baseline.setdefault((read, fmt), peak)
                    print(f"| {num_rows:,} | {num_rows * dim * 4 / 2**20:,.0f} | {read} | {fmt} | {peak / 2**20:,.0f} "
                          f"| {(peak - baseline[read, fmt]) / 2**20:+,.0f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
