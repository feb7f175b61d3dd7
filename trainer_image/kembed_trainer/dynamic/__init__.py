"""Dynamic tables: raw ids get rows of their own, up to a capacity (`index`: the id -> row index, admission and
eviction; `group`: the tables of one width as `embedding.EmbeddingCollection` sees them). The markers of a
row's id, here for readers without numba (exports)."""

import numpy as np

EMPTY = int(np.iinfo(np.int64).min)  # a free row's (or map slot's) id
SHARED = EMPTY + 1  # the shared row's id: ids without a row of their own look it up
