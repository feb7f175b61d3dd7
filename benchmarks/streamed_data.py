"""Streamed data: memory flat in the data's size, reading that keeps up, and what the shuffle window costs.

    .venv/bin/python benchmarks/streamed_data.py make --gb 1            # once: Criteo-shaped Parquet, cached
    .venv/bin/python benchmarks/streamed_data.py memory --gb 1 20       # one epoch on each, peak RSS side by side
    .venv/bin/python benchmarks/streamed_data.py throughput --gb 1      # synthetic vs Parquet on disk vs on S3
    .venv/bin/python benchmarks/streamed_data.py shuffle                # a log sorted by a feature: AUC per buffer
    .venv/bin/python benchmarks/streamed_data.py text memory --words 10 100   # word2vec: one epoch each, peak RSS
    .venv/bin/python benchmarks/streamed_data.py text speed --words 10        # words/s, streamed vs the in-memory reader

Text (`text`): a Zipf corpus (200,000 word types of 3-10 letters, exponent 1, sentences of 5-35 words, one per
line) in files of 10M words under ~/.cache/kembed/text-zipf-<words>m/, generated once, the first file of every
size the same. `memory` runs a light word2vec (width 32, 50,000 words a step) for one epoch on each size with the
trainer of this tree and, on the smallest, the in-memory reader it replaced (the trainer of IN_MEMORY_TEXT, the
last commit that had it, extracted with `git archive` under ~/.cache/kembed/ and run from there). `speed` runs word2vec
with its defaults (width 100, window 5, 5 negatives) for one epoch, both trainers interleaved over rounds, at 1
process x 2 threads and 2 ranks x 1 thread: words/s is the corpus's words over the training time (the `progress`
records' own, so the vocabulary pass is not in it; `start-up s` is the time to the first step, the pass included)
and words/CPU s the corpus's words over the CPU time the job's processes spent training (the reader thread's
included): on a shared machine the second moves far less with the neighbours' load. Ratios are per round,
against the in-memory run just before, then the median.

Data (`make`): Parquet under ~/.cache/kembed/criteo-shaped-<N>gb/, uncompressed (so N GB on disk is N GB to
read and decode), files of 256 MiB in row groups of 131072 rows: a 0/1 label, 13 dense floats, 26 integer ids
(tables of 1k..100k rows, skewed towards low ids) with a planted signal. Every job runs in its own process
(`python -m kembed_trainer`, one rank, its cores' threads) and reports its own peak RSS. Throughput runs the same
DLRM for the same steps on the Parquet files from local disk and on a copy of them on moto's S3 server (on 127.0.0.1), side by side in one run, against the ceiling: the Parquet rows'
first 16 batches read before the clock starts and replayed (the same model on the same rows, no reading); synthetic
batches generated each step are shown too. `memory` runs a light model (width 4, batches of 32768) for one epoch,
so that the reader, not the model, sets the pace.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))
sys.path.insert(0, str(REPO))

CACHE = pathlib.Path.home() / ".cache" / "kembed"
NUM_DENSE, NUM_SPARSE = 13, 26
TABLE_ROWS = [int(1000 * 100 ** (i / (NUM_SPARSE - 1))) for i in range(NUM_SPARSE)]  # 1k .. 100k, geometric
ROW_GROUP, FILE_BYTES = 131072, 256 << 20
ROW_BYTES = 1 + 4 * NUM_DENSE + 8 * NUM_SPARSE  # label int8, float32 dense, int64 ids, uncompressed


def data_dir(gb: float) -> pathlib.Path:
    return CACHE / f"criteo-shaped-{gb:g}gb"


def make_rows(n: int, rng: np.random.Generator, *, scores: np.ndarray) -> pa.Table:
    dense = rng.standard_normal((n, NUM_DENSE), dtype=np.float32)
    ids = [np.minimum((rows * rng.random(n) ** 3).astype(np.int64), rows - 1) for rows in TABLE_ROWS]
    logit = dense[:, 0] + sum(scores[i][ids[i] % len(scores[i])] for i in range(4))
    label = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    cols = {"label": label, **{f"i{j}": dense[:, j] for j in range(NUM_DENSE)},
            **{f"c{i}": ids[i] for i in range(NUM_SPARSE)}}
    return pa.table(cols)


def eval_file() -> str:
    """Held-out rows of the same distribution, beside the data sets (an eval never rereads the training files)."""
    path = CACHE / "criteo-shaped-eval.parquet"
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        scores = np.random.default_rng(1).standard_normal((4, 997))
        pq.write_table(make_rows(100_000, np.random.default_rng(99), scores=scores), path)
    return str(path)


def make(gb: float) -> pathlib.Path:
    out = data_dir(gb)
    done = out / "_DONE"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    scores = np.random.default_rng(1).standard_normal((4, 997))
    rng = np.random.default_rng(0)
    rows_per_file = FILE_BYTES // ROW_BYTES // ROW_GROUP * ROW_GROUP
    num_files = max(1, round(gb * 2**30 / (rows_per_file * ROW_BYTES)))
    for i in range(num_files):
        table = make_rows(rows_per_file, rng, scores=scores)
        pq.write_table(table, out / f"part-{i:05d}.parquet", row_group_size=ROW_GROUP, compression="none",
                       use_dictionary=False)
    done.write_text(json.dumps({"files": num_files, "rows": num_files * rows_per_file}))
    return out


def job(uri: str, *, steps: int | None = None, epochs: int | None = None, batch_size: int = 8192,
        eval_uri: str | None = None, shuffle_buffer: int = 1 << 18, kind: str = "table", dim: int = 16) -> dict:
    tables = [{"name": f"t{i}", "num_embeddings": n, "embedding_dim": dim, "features": [f"c{i}"]}
              for i, n in enumerate(TABLE_ROWS)]
    data = ({"kind": "synthetic", "num_dense": NUM_DENSE, "eval_samples": 8192} if kind == "synthetic" else
            {"kind": "table", "uri": uri, "label": "label", "dense": [f"i{j}" for j in range(NUM_DENSE)],
             "sparse": {f"c{i}": f"c{i}" for i in range(NUM_SPARSE)}, "shuffle_buffer": shuffle_buffer,
             "eval_uri": eval_uri or eval_file()})
    return {
        "model": {"kind": "dlrm", "bottom_mlp": [64, dim], "top_mlp": [64]},
        "embeddings": {"tables": tables},
        "data": data,
        "optimizer": {"sparse": {"name": "rowwise_adagrad", "lr": 0.05}, "dense": {"name": "adam", "lr": 0.001}},
        "training": {"steps": steps, "epochs": epochs, "batch_size": batch_size, "log_every": 20,
                     "threads": os.cpu_count()},
    }


REPLAYED_BATCHES = 16


def replay_trainer(config_path: str) -> int:
    """The trainer with its table data's first batches read before the clock starts and replayed: the same model
    on the same rows, with reading taken out (the ceiling streamed data is measured against)."""
    from kembed_trainer import __main__ as trainer_main
    from kembed_trainer.data import table

    original, cached = table.TableData.train_batch, []

    def train_batch(self, step):
        while len(cached) < REPLAYED_BATCHES:
            cached.append(original(self, len(cached)))
        return cached[step % REPLAYED_BATCHES]

    table.TableData.train_batch = train_batch
    return trainer_main.main(["--config", config_path])


def run(cfg: dict, env: dict[str, str] | None = None, *, replay: bool = False) -> dict:
    """One job in its own process; its last progress record and its eval."""
    trainer = [__file__, "replay-trainer"] if replay else ["-m", "kembed_trainer"]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(cfg, f)
        f.flush()
        proc = subprocess.run([sys.executable, *trainer, "--config", f.name], capture_output=True,
                              text=True, env={**os.environ, **(env or {}), "KEMBED_JOB_ID": "bench",
                                              "PYTHONPATH": str(REPO / "trainer_image")}, check=False)
    recs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        raise RuntimeError(f"job failed ({proc.returncode}): {proc.stderr[-2000:]}")
    progress = [r for r in recs if r["event"] == "progress"]
    # The first window of steps includes start-up (the first unit's read); the steady state is what follows.
    steady = progress[1:] or progress
    done = recs[-1]
    return {
        "samples_per_sec": sum(r["samples_per_sec"] for r in steady) / len(steady),
        "data_share": sum(r["data_share"] for r in steady) / len(steady),
        "memory_mb": max(r["memory_mb"] for r in progress),
        "auc": (done.get("eval") or {}).get("auc"),
        "rows": recs[0]["dataset"].get("train_rows"),
        "steps": done["step"],
    }


def table(rows: list[tuple], header: tuple) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))


def memory(sizes: list[float]) -> None:
    rows = []
    for gb in sizes:
        uri = str(make(gb))
        on_disk = sum(p.stat().st_size for p in pathlib.Path(uri).glob("*.parquet")) / 2**30
        # A light model (width 4, batches of 32768) so that a whole epoch of the big set fits in the time there is;
        # the reader, whose memory is in question, is the same.
        result = run(job(uri, epochs=1, batch_size=1 << 15, dim=4))
        rows.append((f"{on_disk:.1f} GiB", result["rows"], result["steps"], f"{result['memory_mb']:.0f}",
                     f"{result['samples_per_sec']:.0f}", f"{result['data_share']:.3f}"))
        print(rows[-1], flush=True)
    base = float(rows[0][3])
    table([(*r, f"{float(r[3]) / base:.3f}") for r in rows],
          ("data", "rows", "steps", "peak RSS MB", "samples/s", "data share", "RSS ratio"))


def throughput(gb: float, steps: int, repeats: int) -> None:
    """Variants interleaved, `repeats` rounds, medians: on a shared machine the load moves between runs."""
    from tests.fixtures.servers import start_moto

    uri = str(make(gb))
    proc, endpoint = start_moto(timeout_s=60)
    try:
        import s3fs

        env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1"}
        os.environ.update(env)
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        # As many files as the steps read (moto holds objects in its own memory).
        needed = steps * 8192 // (FILE_BYTES // ROW_BYTES) + 1
        for path in sorted(pathlib.Path(uri).glob("*.parquet"))[:needed]:
            fs.put_file(str(path), f"bench/data/{path.name}")
        variants = {
            "the same rows pre-read, replayed": lambda: run(job(uri, steps=steps), replay=True),
            "synthetic, generated each step": lambda: run(job("", steps=steps, kind="synthetic")),
            "Parquet, local disk": lambda: run(job(uri, steps=steps)),
            "Parquet, S3 (moto)": lambda: run(job("s3://bench/data", steps=steps), env),
        }
        rounds = [{name: variant() for name, variant in variants.items()} for _ in range(repeats)]
    finally:
        proc.terminate()
        proc.wait()
    results = {name: {key: float(np.median([r[name][key] for r in rounds]))
                      for key in ("samples_per_sec", "data_share", "memory_mb")} for name in variants}
    base = results["the same rows pre-read, replayed"]["samples_per_sec"]
    table([(name, f"{r['samples_per_sec']:.0f}", f"{r['samples_per_sec'] / base:.3f}", f"{r['data_share']:.3f}",
            f"{r['memory_mb']:.0f}") for name, r in results.items()],
          ("data", "samples/s", "x in memory", "data share", "peak RSS MB"))


def shuffle(num_rows: int) -> None:
    """A log sorted by its most telling feature (c0): each stretch of it holds a few ids and their labels."""
    out = CACHE / f"sorted-log-{num_rows}"
    scores = np.random.default_rng(1).standard_normal((4, 997))
    if not (out / "_DONE").exists():
        out.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(2)
        rows = make_rows(num_rows, rng, scores=scores).sort_by("c0")
        pq.write_table(rows, out / "train.parquet", row_group_size=16384)
        pq.write_table(make_rows(200_000, rng, scores=scores), out / "eval.parquet")
        (out / "_DONE").write_text("")
    results = []
    for name, buffer in [("full shuffle (one window)", num_rows), ("window 262144 (default)", 1 << 18),
                         ("window 16384 (one row group)", 1 << 14),
                         ("row groups shuffled only", 1)]:
        r = run(job(str(out / "train.parquet"), epochs=1, batch_size=1024, shuffle_buffer=buffer,
                    eval_uri=str(out / "eval.parquet")))
        results.append((name, f"{r['auc']:.4f}", f"{r['memory_mb']:.0f}"))
        print(results[-1], flush=True)
    table(results, ("shuffle", "eval AUC", "peak RSS MB"))


# ----------------------------------------------------------------------------------------------- text
TEXT_TYPES, TEXT_FILE_WORDS = 200_000, 10_000_000


def text_corpus(millions: int) -> pathlib.Path:
    """A Zipf corpus of `millions` million words in files of TEXT_FILE_WORDS, generated once."""
    out = CACHE / f"text-zipf-{millions}m"
    if (out / "_DONE").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    types: dict[str, None] = {}
    while len(types) < TEXT_TYPES:
        types.setdefault("".join(rng.choice(letters, rng.integers(3, 11))))
    words = list(types)
    cdf = np.cumsum(1 / np.arange(1, TEXT_TYPES + 1))
    cdf /= cdf[-1]
    for k in range(-(-millions * 1_000_000 // TEXT_FILE_WORDS)):
        file_rng = np.random.default_rng(1000 + k)
        num = min(TEXT_FILE_WORDS, millions * 1_000_000 - k * TEXT_FILE_WORDS)
        ids = np.searchsorted(cdf, file_rng.random(num)).tolist()
        ends = np.cumsum(file_rng.integers(5, 36, num // 5)).tolist()
        with open(out / f"part-{k:03d}.txt", "w", encoding="utf-8") as f:
            start = 0
            for end in ends:
                if start >= num:
                    break
                f.write(" ".join(map(words.__getitem__, ids[start:end])) + "\n")
                start = end
    (out / "_DONE").write_text("")
    return out


def corpus_words(corpus: pathlib.Path) -> int:
    return sum(len(line.split()) for path in sorted(corpus.glob("*.txt")) for line in open(path, encoding="utf-8"))


# The last commit whose text reader held the whole corpus in memory (the next ones stream it).
IN_MEMORY_TEXT = "544815d7b775b8f454322d60adc7409350e7811d"


def main_trainer() -> pathlib.Path:
    """The trainer and contract of IN_MEMORY_TEXT, extracted once (git archive): the in-memory text reader."""
    base = IN_MEMORY_TEXT
    out = CACHE / f"kembed-main-{base[:12]}"
    if not (out / "_DONE").exists():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", base, "trainer_image/kembed_trainer", "contract/kembed_contract"],
                                 capture_output=True, check=True, cwd=REPO).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
        (out / "_DONE").write_text(base)
    return out


def w2v_job(corpus: pathlib.Path, *, dim: int, batch_size: int, threads: int) -> dict:
    tables = [{"name": name, "num_embeddings": TEXT_TYPES, "embedding_dim": dim, "features": [feature]}
              for name, feature in (("words_in", "center"), ("words_out", "context"))]
    return {"model": {"kind": "word2vec"}, "embeddings": {"tables": tables},
            "data": {"kind": "text", "uri": str(corpus)},  # the text defaults (gensim's), the old reader's and ours alike
            "training": {"epochs": 1, "batch_size": batch_size, "log_every": 1, "threads": threads}}


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo += children.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


def run_w2v(cfg: dict, *, ranks: int = 1, trainer: pathlib.Path | None = None) -> dict:
    """One word2vec job in its own process (torchrun for 2 ranks), with this tree's trainer or `trainer`'s; its
    training time (the `progress` records' own) and the CPU time its processes spent from the `started` record
    to the `done` one (training, the reader thread's work included, and the final eval)."""
    path = REPO / "trainer_image" if trainer is None else trainer / "trainer_image"
    contract = REPO / "contract" if trainer is None else trainer / "contract"
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nnodes", "1", "--nproc-per-node", str(ranks)]
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f, tempfile.TemporaryFile("w+") as err:
        json.dump(cfg, f)
        f.flush()
        started = time.time()
        proc = subprocess.Popen([*launcher, "-m", "kembed_trainer", "--config", f.name], stdout=subprocess.PIPE,
                                stderr=err, text=True,
                                env={**os.environ, "KEMBED_JOB_ID": "bench", "PYTHONPATH": f"{path}:{contract}"})
        recs, cpu = [], {}
        for line in proc.stdout:
            if line.startswith("{"):
                recs.append(json.loads(line))
                if recs[-1]["event"] in ("started", "done"):
                    cpu[recs[-1]["event"]] = tree_cpu_seconds(proc.pid)
        code = proc.wait()
        wall = time.time() - started
        if code != 0:
            err.seek(0)
            raise RuntimeError(f"job failed ({code}): {err.read()[-2000:]}")
    first = next(r for r in recs if r["event"] == "started")
    progress = [r for r in recs if r["event"] == "progress"]
    steps = [first["step"], *(r["step"] for r in progress)]
    # Each record's rate covers the steps since the one before: its training time is those steps' words / rate.
    seconds = sum((b - a) * cfg["training"]["batch_size"] * ranks / r["samples_per_sec"]
                  for a, b, r in zip(steps, steps[1:], progress, strict=False))
    return {"seconds": seconds, "cpu_seconds": cpu["done"] - cpu["started"], "startup": first["time"] - started,
            "wall": wall, "dataset": first["dataset"], "memory_mb": max(r["memory_mb"] for r in progress),
            "steps": recs[-1]["step"]}


def text_memory(sizes: list[int]) -> None:
    rows = []
    variants = [(f"{m}M words, streamed", m, None) for m in sizes]
    variants.insert(1, (f"{sizes[0]}M words, in-memory reader", sizes[0], main_trainer()))
    for name, millions, trainer in variants:
        corpus = text_corpus(millions)
        on_disk = sum(p.stat().st_size for p in corpus.glob("*.txt")) / 2**20
        r = run_w2v(w2v_job(corpus, dim=32, batch_size=50_000, threads=os.cpu_count()), trainer=trainer)
        words = r["dataset"]["train_tokens"]
        rows.append((name, f"{on_disk:.0f} MiB", f"{words:,}", r["steps"], f"{r['memory_mb']:.0f}",
                     f"{r['startup']:.1f}", f"{words / r['seconds']:,.0f}", f"{words / r['cpu_seconds']:,.0f}"))
        print(rows[-1], f"load {os.getloadavg()[0]:.1f}", flush=True)
    base = float(rows[0][4])
    table([(*row, f"{float(row[4]) / base:.3f}") for row in rows],
          ("corpus", "on disk", "training words", "steps", "peak RSS MB", "start-up s", "words/s", "words/CPU s",
           "RSS ratio"))


def text_speed(millions: int, repeats: int) -> None:
    corpus = text_corpus(millions)
    words = corpus_words(corpus)
    main = main_trainer()
    variants = {
        "in-memory reader, 1 process x 2 threads": dict(trainer=main, ranks=1, threads=2),  # noqa: C408
        "streamed, 1 process x 2 threads": dict(trainer=None, ranks=1, threads=2),  # noqa: C408
        "in-memory reader, 2 ranks x 1 thread": dict(trainer=main, ranks=2, threads=1),  # noqa: C408
        "streamed, 2 ranks x 1 thread": dict(trainer=None, ranks=2, threads=1),  # noqa: C408
    }
    rounds = []
    for i in range(repeats):
        results = {}
        for name, v in variants.items():
            cfg = w2v_job(corpus, dim=100, batch_size=50_000, threads=v["threads"])
            r = results[name] = run_w2v(cfg, ranks=v["ranks"], trainer=v["trainer"])
            print(f"round {i + 1}: {name}: {words / r['seconds']:,.0f} words/s, {words / r['cpu_seconds']:,.0f} "
                  f"words/CPU s, start-up {r['startup']:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        rounds.append(results)
    print(f"corpus: {words:,} words; in-memory reader: {main.name}")
    rows = []
    for name in variants:
        base = "in-memory reader, " + name.split(", ", 1)[1]
        # Each round's ratio to the in-memory run just before it (the load moves less within a pair than across
        # rounds), then the median over rounds.
        def ratio(key: str, name: str = name, base: str = base) -> float:
            return float(np.median([r[base][key] / r[name][key] for r in rounds]))

        def median(key: str, name: str = name) -> float:
            return float(np.median([r[name][key] for r in rounds]))

        rows.append((name, f"{words / median('seconds'):,.0f}", f"{ratio('seconds'):.3f}",
                     f"{words / median('cpu_seconds'):,.0f}", f"{ratio('cpu_seconds'):.3f}",
                     f"{median('startup'):.1f}", f"{median('memory_mb'):.0f}"))
    table(rows, ("trainer", "words/s (median)", "x in-memory", "words/CPU s", "x in-memory", "start-up s",
                 "peak RSS MB"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("make").add_argument("--gb", type=float, nargs="+", default=[1])
    sub.add_parser("memory").add_argument("--gb", type=float, nargs="+", default=[1, 20])
    p = sub.add_parser("throughput")
    p.add_argument("--gb", type=float, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    sub.add_parser("shuffle").add_argument("--rows", type=int, default=1_000_000)
    sub.add_parser("replay-trainer").add_argument("--config", required=True)  # used by `throughput`
    text = sub.add_parser("text").add_subparsers(dest="part", required=True)
    text.add_parser("make").add_argument("--words", type=int, nargs="+", default=[10, 100], help="millions")
    text.add_parser("memory").add_argument("--words", type=int, nargs="+", default=[10, 100], help="millions")
    p = text.add_parser("speed")
    p.add_argument("--words", type=int, default=10, help="millions")
    p.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.command == "text":
        if args.part == "make":
            for millions in args.words:
                print(text_corpus(millions))
        elif args.part == "memory":
            text_memory(args.words)
        else:
            text_speed(args.words, args.repeats)
        return
    if args.command == "make":
        for gb in args.gb:
            print(make(gb))
    elif args.command == "memory":
        memory(args.gb)
    elif args.command == "throughput":
        throughput(args.gb, args.steps, args.repeats)
    elif args.command == "replay-trainer":
        sys.exit(replay_trainer(args.config))
    else:
        shuffle(args.rows)


if __name__ == "__main__":
    main()
