"""Skip-gram with negative sampling, one pass of plain SGD over some sentences, compiled by numba.

This is word2vec.c's and gensim's inner loop: each kept word of a sentence is a center whose input vector is
trained against every context word within a random window of 1..window words (rows of the output table) and
`negatives` noise words drawn from the unigram^0.75 distribution (by Walker's alias method: two draws and two
lookups in tables of the vocabulary's size, where a bisection of the cumulative weights, as gensim's, takes a
dozen dependent and mispredicted branches per noise word). Rows are updated in place as soon as their
gradient is known, with no locks: threads running this at once on other sentences of the same tables race
on frequent rows and lose an update now and then, which SGD shrugs off (hogwild; Recht et al. 2011). Without
the interpreter in the loop, a (center, target) sample costs a dot product and two axpys of `dim` floats,
which LLVM vectorises. The sigmoid is word2vec.c's table over (-MAX_EXP, MAX_EXP), and the loss is read from tables at
the same points (no exp or log per sample); a sample whose dot product lies outside is not trained, its gradient
all but zero (as gensim does), and only its loss is computed.

The function is compiled at first use (about a second, cached on disk after) and releases the GIL, so Python
threads run it in parallel. Random numbers come from word2vec.c's 48-bit linear congruential generator,
seeded by the caller: one thread's pass is a pure function of its arguments.
"""

from __future__ import annotations

import math

import numba
import numpy as np

__all__ = ["noise_tables", "train_sentences", "warm"]

_LCG_MUL, _LCG_ADD, _LCG_MASK = 25214903917, 11, (1 << 48) - 1
# word2vec.c's sigmoid table: MAX_EXP 6, 1000 entries.
_MAX_EXP, _SIGMOID_SIZE = 6.0, 1000
_SIGMOID_AT = (np.arange(_SIGMOID_SIZE) / _SIGMOID_SIZE * 2 - 1) * _MAX_EXP
_SIGMOID = (1.0 / (1.0 + np.exp(-_SIGMOID_AT))).astype(np.float32)
# The loss of a true pair, -log sigmoid(x), and of a noise pair, -log(1 - sigmoid(x)), at the same points.
_LOSS_TRUE = np.log1p(np.exp(-_SIGMOID_AT))
_LOSS_NOISE = np.log1p(np.exp(_SIGMOID_AT))
_SIGMOID_SCALE = _SIGMOID_SIZE / (2 * _MAX_EXP)
_UINT32_TOP = 2.0**32 - 1


@numba.njit(nogil=True, fastmath=True, cache=True, boundscheck=False)
def train_sentences(
    tokens: np.ndarray,  # int64 [num_tokens]: word ids of the corpus
    offsets: np.ndarray,  # int64 [num_sentences + 1]: sentence i is tokens[offsets[i]:offsets[i + 1]]
    first: int,  # sentences first..last-1 are trained
    last: int,
    center: np.ndarray,  # float32 [vocab, dim]: input vectors, updated in place
    context: np.ndarray,  # float32 [vocab, dim]: output vectors, updated in place
    keep: np.ndarray,  # uint32 [vocab]: a word is kept when keep[w] >= a uniform uint32 draw (subsampling)
    noise_accept: np.ndarray,  # uint32 [vocab]: the alias method's tables of the unigram^0.75 distribution
    noise_alias: np.ndarray,  # int64 [vocab]   (noise_tables)
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
    num_noise_words = noise_accept.shape[0]
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
                for k in range(negatives + 1):
                    if k == 0:
                        target = kept[j]
                        label = np.float32(1.0)
                    else:
                        # A uniform slot, then the slot's own word or its alias.
                        rand = (rand * np.uint64(_LCG_MUL) + np.uint64(_LCG_ADD)) & np.uint64(_LCG_MASK)
                        draw = (rand >> np.uint64(16)) & np.uint64(0xFFFFFFFF)
                        slot = np.int64((draw * np.uint64(num_noise_words)) >> np.uint64(32))
                        rand = (rand * np.uint64(_LCG_MUL) + np.uint64(_LCG_ADD)) & np.uint64(_LCG_MASK)
                        draw = (rand >> np.uint64(16)) & np.uint64(0xFFFFFFFF)
                        target = slot if draw < noise_accept[slot] else noise_alias[slot]
                        if target == kept[j]:
                            continue
                        label = np.float32(0.0)
                    dot = np.float32(0.0)
                    for d in range(dim):
                        dot += center[c, d] * context[target, d]
                    num_samples += 1
                    if dot <= -_MAX_EXP or dot >= _MAX_EXP:  # saturated: no update, only the loss
                        loss += math.log1p(math.exp(-dot if k == 0 else dot))
                        continue
                    at = int((dot + np.float32(_MAX_EXP)) * np.float32(_SIGMOID_SCALE))
                    loss += _LOSS_TRUE[at] if k == 0 else _LOSS_NOISE[at]
                    g = label - _SIGMOID[at]
                    g_out = g * lr_out
                    g_in = g * lr_in
                    for d in range(dim):
                        grad_center[d] += g_in * context[target, d]
                        context[target, d] += g_out * center[c, d]
                for d in range(dim):
                    center[c, d] += grad_center[d]
    return loss, num_samples, num_kept


def noise_tables(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias tables of the distribution proportional to `weights` (float64 [vocab]): slot i keeps word i
    with probability accept[i] / 2**32, else gives alias[i]; every slot is drawn with probability 1/vocab."""
    share = weights / weights.sum() * len(weights)  # 1.0 is a slot's worth
    accept, alias = _alias(share)
    return np.minimum(accept * 2.0**32, _UINT32_TOP).astype(np.uint32), alias


def _alias(share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vose's construction: each slot below its worth is topped up from one above it. In Python, once per job: a
    compiled function would cost every job that does not find numba's cache a compilation longer than this loop
    takes for all but the largest vocabularies (docs/benchmarks.md)."""
    share_of = share.tolist()
    accept = np.ones(len(share_of))
    alias = np.arange(len(share_of))
    small = [i for i, v in enumerate(share_of) if v < 1.0]
    large = [i for i, v in enumerate(share_of) if v >= 1.0]
    while small and large:
        lo, hi = small.pop(), large.pop()
        accept[lo], alias[lo] = share_of[lo], hi
        share_of[hi] -= 1.0 - share_of[lo]
        (small if share_of[hi] < 1.0 else large).append(hi)
    return accept, alias  # slots left over are worth 1 up to rounding: they keep their own word


def warm() -> None:
    """Compile `train_sentences` for the argument types `sgd.SkipGramSGD` passes it, on no sentences
    (kembed_trainer.kernel_cache builds the platform's cache with this)."""
    table = np.zeros((1, 1), dtype=np.float32)
    accept, alias = noise_tables(np.ones(1))
    train_sentences(np.zeros(0, np.int64), np.zeros(1, np.int64), 0, 0, table, table.copy(),
                    np.zeros(1, np.uint32), accept, alias, 5, 5, 0.025, 0.025, 1.0, 1.0, 0)
