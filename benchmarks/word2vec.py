"""kembed's word2vec against gensim's, side by side: words/s and the quality of the vectors.

    .venv/bin/pip install --no-deps -r benchmarks/requirements.txt     # gensim, which ships the corpus
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/word2vec.py

The corpus is what gensim ships in `gensim/test/test_data`: the Wikipedia articles of its shortened dump (text
as gensim's WikiCorpus extracts it) and the Lee background corpus (gensim's simple_preprocess), cut into
sentences of at most 10,000 words (gensim's limit), no repetition. Both train skip-gram with negative sampling
on it with the same settings: dim 100, window 5, 5 negatives, min_count 5, subsampling 1e-3, lr 0.025 falling
linearly to 0.0001, `--epochs` epochs. kembed runs as a job would (`python -m kembed_trainer`, or torchrun
for 2 ranks) and its time is its own `progress` records' training time; gensim's is `Word2Vec.train`'s.
Neither counts vocabulary building. Every variant runs `--repeats` times, interleaved; medians are shown.

words/s is corpus words (all tokens, as in the file) times epochs, per second of training: the same
numerator for every variant. gensim's log speaks of "effective words" (after min_count and subsampling),
shown alongside for reference.

Quality, on the vectors of the last repeat: the share of the top-10 neighbours (cosine of the input vectors)
of the `--top` most frequent words that two runs have in common, against gensim with another seed (two gensim
runs differ too: that is the yardstick); Spearman correlation with WordSim-353 and accuracy on Google's
analogies (both files ship with gensim) over the pairs/questions in the vocabulary.
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

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "trainer_image"))

from kembed_contract import trainer_config as config  # noqa: E402 - after the path insert
from kembed_trainer.data import text  # noqa: E402
from kembed_trainer.storage import Guard  # noqa: E402

DIM, WINDOW, NEGATIVES, MIN_COUNT, SAMPLE = 100, 5, 5, 5, 1e-3
MAX_SENTENCE = 10_000  # gensim trains on at most this many words of a sentence
WIKI = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def gensim_data() -> pathlib.Path:
    import gensim

    return pathlib.Path(gensim.__file__).parent / "test" / "test_data"


def build_corpus(path: pathlib.Path) -> None:
    from gensim.corpora.wikicorpus import WikiCorpus
    from gensim.utils import simple_preprocess

    docs = list(WikiCorpus(str(gensim_data() / WIKI), dictionary={}, processes=1).get_texts())
    with open(gensim_data() / "lee_background.cor", encoding="utf-8") as f:
        docs += [simple_preprocess(line) for line in f]
    with open(path, "w", encoding="utf-8") as out:
        for doc in docs:
            for i in range(0, len(doc), MAX_SENTENCE):
                if len(doc[i : i + MAX_SENTENCE]) >= 2:
                    out.write(" ".join(doc[i : i + MAX_SENTENCE]) + "\n")


def read_corpus(path: pathlib.Path) -> list[list[str]]:
    with open(path, encoding="utf-8") as f:
        return [line.split() for line in f]


# ------------------------------------------------------------------------------------------------ gensim
def run_gensim(sentences: list[list[str]], *, workers: int, epochs: int, seed: int):
    from gensim.models import Word2Vec

    model = Word2Vec(
        vector_size=DIM,
        window=WINDOW,
        negative=NEGATIVES,
        sg=1,
        hs=0,
        min_count=MIN_COUNT,
        sample=SAMPLE,
        alpha=0.025,
        min_alpha=0.0001,
        workers=workers,
        seed=seed,
    )
    model.build_vocab(sentences)
    started = time.perf_counter()
    effective, _raw = model.train(sentences, total_examples=len(sentences), epochs=epochs)
    seconds = time.perf_counter() - started
    return seconds, effective, model.wv


# ------------------------------------------------------------------------------------------------ kembed
def kembed_config(
    corpus: pathlib.Path, vocab_size: int, *, steps: int, words_per_step: int, threads: int, ckpt: str
) -> dict:
    tables = [
        {"name": name, "num_embeddings": vocab_size, "embedding_dim": DIM, "features": [feature]}
        for name, feature in (("words_in", "center"), ("words_out", "context"))
    ]
    return {
        "model": {"kind": "word2vec"},
        "embeddings": {"tables": tables},
        "data": {
            "kind": "text",
            "uri": str(corpus),
            "window": WINDOW,
            "negatives": NEGATIVES,
            "min_count": MIN_COUNT,
            "subsample": SAMPLE,
            "eval_fraction": 0.0,
        },
        "optimizer": {"sparse": {"name": "sgd", "lr": 0.025, "min_lr": 0.0001}},
        "training": {"steps": steps, "batch_size": words_per_step, "log_every": steps, "threads": threads},
        "checkpoint": {"uri": ckpt},
    }


def run_kembed(
    corpus: pathlib.Path,
    vocab: list[str],
    *,
    ranks: int,
    threads: int,
    epochs: int,
    words_per_step: int,
    workdir: pathlib.Path,
):
    ckpt = workdir / "ckpt"
    steps = epochs * steps_per_epoch(corpus, ranks, words_per_step)
    cfg = kembed_config(
        corpus, len(vocab), steps=steps, words_per_step=words_per_step, threads=threads, ckpt=f"file://{ckpt}"
    )
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    module = ["-m", "kembed_trainer", "--config", str(path)]
    launcher = (
        [sys.executable]
        if ranks == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
        ]
    )
    env = {**os.environ, "KEMBED_JOB_ID": "bench", "PYTHONPATH": str(REPO / "trainer_image")}
    env.pop("KEMBED_REPORT_URL", None)
    proc = subprocess.run([*launcher, *module], capture_output=True, text=True, env=env, cwd=REPO)  # noqa: PLW1510
    if proc.returncode != 0:
        raise RuntimeError(f"kembed failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (progress,) = [r for r in records if r.get("event") == "progress"]
    seconds = steps * words_per_step * ranks / progress["samples_per_sec"]  # the trainer's training time
    state = {"embeddings": {"words_in.weight": torch.empty(len(vocab), DIM)}}
    dcp.load(state, storage_reader=FsspecReader(f"file://{ckpt}/step-{steps}"))
    return seconds, keyed_vectors(vocab, state["embeddings"]["words_in.weight"].numpy())


def kembed_data(corpus: pathlib.Path, *, batch_size: int = 1, rank: int = 0, world_size: int = 1):
    """The trainer's own view of this corpus (the same code the trainer runs)."""
    cfg = config.TextDataConfig(kind="text", uri=str(corpus), min_count=MIN_COUNT, eval_fraction=0.0)
    table = config.TableConfig(name="t", num_embeddings=10**7, embedding_dim=1, features=["center"])
    return text.TextData(cfg, tables=[table], seed=0, batch_size=batch_size, rank=rank, world_size=world_size,
                         guard=Guard(None))  # the benchmark's own corpus, no policy


_STEPS_PER_EPOCH: dict[tuple, int] = {}


def steps_per_epoch(corpus: pathlib.Path, ranks: int, words_per_step: int) -> int:
    """Steps in which every rank reads its sentences once (the rank with the most words decides)."""
    key = (corpus, ranks, words_per_step)
    if key not in _STEPS_PER_EPOCH:
        _STEPS_PER_EPOCH[key] = max(
            kembed_data(corpus, batch_size=words_per_step, rank=r, world_size=ranks).steps_per_epoch
            for r in range(ranks)
        )
    return _STEPS_PER_EPOCH[key]


def keyed_vectors(vocab: list[str], vectors: np.ndarray):
    from gensim.models import KeyedVectors

    kv = KeyedVectors(vector_size=vectors.shape[1])
    kv.add_vectors(vocab, vectors)
    return kv


# ------------------------------------------------------------------------------------------------ quality
def neighbour_overlap(a, b, words: list[str], k: int = 10) -> float:
    shared = [w for w in words if w in a.key_to_index and w in b.key_to_index]
    total = 0.0
    for w in shared:
        na = {n for n, _ in a.most_similar(w, topn=k)}
        nb = {n for n, _ in b.most_similar(w, topn=k)}
        total += len(na & nb) / k
    return total / max(len(shared), 1)


def intrinsic(kv) -> tuple[float, float]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _pearson, spearman, _oov = kv.evaluate_word_pairs(str(gensim_data() / "wordsim353.tsv"))
        analogies, _sections = kv.evaluate_word_analogies(str(gensim_data() / "questions-words.txt"))
    return float(spearman.statistic), float(analogies)


def blas_note() -> str:
    try:
        from threadpoolctl import threadpool_info

        kernels = sorted({f"{i['internal_api']} {i.get('architecture')}" for i in threadpool_info()})
    except ImportError:
        kernels = ["threadpoolctl not installed"]
    coretype = os.environ.get("OPENBLAS_CORETYPE", "unset")
    return f"BLAS for gensim: {', '.join(kernels)}; OPENBLAS_CORETYPE={coretype}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--words-per-step", type=int, default=50_000, help="kembed's batch_size, per rank")
    parser.add_argument(
        "--top", type=int, default=200, help="most frequent words whose neighbours are compared"
    )
    parser.add_argument("--corpus", default=None, help="a corpus file to use instead of gensim's test data")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        corpus = pathlib.Path(args.corpus) if args.corpus else tmp / "corpus.txt"
        if not args.corpus:
            build_corpus(corpus)
        sentences = read_corpus(corpus)
        num_words = sum(len(s) for s in sentences)
        vocab = kembed_data(corpus).vocab
        print(
            f"corpus: {len(sentences)} sentences, {num_words} words, vocabulary {len(vocab)} (min_count "
            f"{MIN_COUNT}); {args.epochs} epochs; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}"
        )
        print(blas_note())

        variants = {
            "gensim, 2 worker threads": lambda: run_gensim(sentences, workers=2, epochs=args.epochs, seed=1),
            "kembed, 1 process x 2 threads": lambda: run_kembed(
                corpus,
                vocab,
                ranks=1,
                threads=2,
                epochs=args.epochs,
                words_per_step=args.words_per_step,
                workdir=fresh(tmp / "k1"),
            ),
            "kembed, 2 ranks x 1 thread": lambda: run_kembed(
                corpus,
                vocab,
                ranks=2,
                threads=1,
                epochs=args.epochs,
                words_per_step=args.words_per_step,
                workdir=fresh(tmp / "k2"),
            ),
            "gensim, 1 worker thread": lambda: run_gensim(sentences, workers=1, epochs=args.epochs, seed=1),
            "kembed, 1 process x 1 thread": lambda: run_kembed(
                corpus,
                vocab,
                ranks=1,
                threads=1,
                epochs=args.epochs,
                words_per_step=args.words_per_step,
                workdir=fresh(tmp / "k3"),
            ),
        }
        seconds: dict[str, list[float]] = {name: [] for name in variants}
        vectors, effective = {}, {}
        for r in range(args.repeats):
            for name, run in variants.items():
                out = run()
                seconds[name].append(out[0])
                vectors[name] = out[-1]
                if len(out) == 3:
                    effective[name] = out[1]
                print(
                    f"  repeat {r + 1}: {name}: {num_words * args.epochs / out[0]:,.0f} words/s", flush=True
                )
        other_gensim = run_gensim(sentences, workers=2, epochs=args.epochs, seed=2)[2]
        load = os.getloadavg()[0]

    top = vectors["gensim, 2 worker threads"].index_to_key[: args.top]
    reference = vectors["gensim, 2 worker threads"]
    base = {1: "gensim, 1 worker thread", 2: "gensim, 2 worker threads"}
    print(f"\nload average at the end {load:.1f}\n")
    print(
        "| variant | words/s (median) | x gensim, same threads | effective words/s | top-10 overlap with gensim | WordSim-353 Spearman | analogies |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [("gensim, 2 worker threads (another seed)", None, other_gensim)] + [
        (name, statistics.median(secs), vectors[name]) for name, secs in seconds.items()
    ]
    for name, secs, kv in rows:
        spearman, analogies = intrinsic(kv)
        overlap = neighbour_overlap(reference, kv, top)
        if secs is None:
            print(f"| {name} | | | | {overlap:.2f} | {spearman:.3f} | {analogies:.3f} |")
            continue
        wps = num_words * args.epochs / secs
        threads = 1 if "1 thread" in name or "1 worker" in name else 2
        ratio = statistics.median(seconds[base[threads]]) / secs
        eff = f"{effective[name] / secs:,.0f}" if name in effective else ""
        same = "" if name == "gensim, 2 worker threads" else f"{overlap:.2f}"
        print(f"| {name} | {wps:,.0f} | {ratio:.2f} | {eff} | {same} | {spearman:.3f} | {analogies:.3f} |")


def fresh(path: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


if __name__ == "__main__":
    main()
