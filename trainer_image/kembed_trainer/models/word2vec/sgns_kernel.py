"""Skip-gram with negative sampling, one pass of plain SGD over some sentences, compiled by numba.

This is word2vec.c's and gensim's inner loop: each kept word of a sentence is a center whose input vector is
trained against every context word within a random window of 1..window words (rows of the output table) and
`negatives` noise words drawn from the unigram^0.75 distribution. Rows are updated in place as soon as their
gradient is known, with no locks: threads running this at once on other sentences of the same tables race
on frequent rows and lose an update now and then, which SGD shrugs off (hogwild; Recht et al. 2011). Without
the interpreter in the loop, a (center, target) sample costs a dot product and two axpys of `dim` floats,
which LLVM vectorises.

The function is compiled at first use (about a second, cached on disk after) and releases the GIL, so Python
threads run it in parallel. Random numbers come from word2vec.c's 48-bit linear congruential generator,
seeded by the caller: one thread's pass is a pure function of its arguments.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["CUM_TABLE_DOMAIN", "train_sentences", "warm"]

CUM_TABLE_DOMAIN = 2**31 - 1  # noise draws: a uniform int below the table's last entry, as gensim's cum_table
_LCG_MUL, _LCG_ADD, _LCG_MASK = 25214903917, 11, (1 << 48) - 1


@numba.njit(nogil=True, fastmath=True, cache=True, boundscheck=False)
def train_sentences(
    tokens: np.ndarray,  # int64 [num_tokens]: word ids of the corpus
    offsets: np.ndarray,  # int64 [num_sentences + 1]: sentence i is tokens[offsets[i]:offsets[i + 1]]
    first: int,  # sentences first..last-1 are trained
    last: int,
    center: np.ndarray,  # float32 [vocab, dim]: input vectors, updated in place
    context: np.ndarray,  # float32 [vocab, dim]: output vectors, updated in place
    keep: np.ndarray,  # uint32 [vocab]: a word is kept when keep[w] >= a uniform uint32 draw (subsampling)
    cum_table: np.ndarray,  # int64 [vocab]: cumulative unigram^0.75 weights ending in CUM_TABLE_DOMAIN
    window: int,
    negatives: int,
    lr_first: float,  # learning rate at the first token of `first`, falling linearly to
    lr_last: float,  # the rate after the last token of `last - 1`
    center_lr_scale: float,
    context_lr_scale: float,
    seed: int,
) -> tuple[float, int, int]:
    """Returns (summed loss -log sigmoid(+-dot) over all samples, number of samples, number of kept words)."""
    dim = center.shape[1]
    num_noise_words = cum_table.shape[0]
    rand = np.uint64(seed) & np.uint64(_LCG_MASK)
    grad_center = np.empty(dim, dtype=np.float32)
    longest = 0
    for s in range(first, last):
        longest = max(longest, offsets[s + 1] - offsets[s])
    kept = np.empty(longest, dtype=np.int64)
    span = max(1, offsets[last] - offsets[first])
    loss = 0.0
    num_samples = 0
    num_kept = 0
    for s in range(first, last):
        lo, hi = offsets[s], offsets[s + 1]
        # Subsampling drops frequent words from the sentence before windows are drawn, so a window reaches
        # past them (as word2vec.c and gensim).
        n = 0
        for i in range(lo, hi):
            w = tokens[i]
            rand = (rand * np.uint64(_LCG_MUL) + np.uint64(_LCG_ADD)) & np.uint64(_LCG_MASK)
            if keep[w] >= (rand >> np.uint64(16)) & np.uint64(0xFFFFFFFF):
                kept[n] = w
                n += 1
        num_kept += n
        progress = (lo - offsets[first]) / span
        lr = lr_first + (lr_last - lr_first) * progress
        lr_in = np.float32(lr * center_lr_scale)
        lr_out = np.float32(lr * context_lr_scale)
        for i in range(n):
            rand = (rand * np.uint64(_LCG_MUL) + np.uint64(_LCG_ADD)) & np.uint64(_LCG_MASK)
            reach = window - np.int64(rand % np.uint64(window))  # 1..window
            for j in range(max(0, i - reach), min(n, i + reach + 1)):
                if j == i:
                    continue
                c = kept[i]
                grad_center[:] = 0.0
                prob = 1.0  # product of this pair's sample likelihoods: one log per pair, not per sample
                for k in range(negatives + 1):
                    if k == 0:
                        target = kept[j]
                        label = np.float32(1.0)
                    else:
                        rand = (rand * np.uint64(_LCG_MUL) + np.uint64(_LCG_ADD)) & np.uint64(_LCG_MASK)
                        target = _bisect(
                            cum_table, np.int64((rand >> np.uint64(16)) % np.uint64(CUM_TABLE_DOMAIN))
                        )
                        if target >= num_noise_words:
                            target = num_noise_words - 1
                        if target == kept[j]:
                            continue
                        label = np.float32(0.0)
                    dot = np.float32(0.0)
                    for d in range(dim):
                        dot += center[c, d] * context[target, d]
                    sig = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-dot)))
                    prob *= sig if k == 0 else 1.0 - sig
                    g = label - sig
                    g_out = g * lr_out
                    g_in = g * lr_in
                    for d in range(dim):
                        grad_center[d] += g_in * context[target, d]
                        context[target, d] += g_out * center[c, d]
                    num_samples += 1
                loss -= math.log(max(prob, 1e-300))
                for d in range(dim):
                    center[c, d] += grad_center[d]
    return loss, num_samples, num_kept


@numba.njit(nogil=True, inline="always")
def _bisect(cum_table: np.ndarray, value: np.int64) -> np.int64:
    """The first index whose cumulative weight exceeds `value`."""
    lo, hi = 0, cum_table.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if cum_table[mid] <= value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def warm() -> None:
    """Compile `train_sentences` for the argument types `sgd.SkipGramSGD` passes it, on no sentences
    (kembed_trainer.kernel_cache builds the platform's cache with this)."""
    table = np.zeros((1, 1), dtype=np.float32)
    train_sentences(np.zeros(0, np.int64), np.zeros(1, np.int64), 0, 0, table, table.copy(),
                    np.zeros(1, np.uint32), np.ones(1, np.int64), 5, 5, 0.025, 0.025, 1.0, 1.0, 0)
