"""Dynamic tables: raw ids get rows of their own, up to a capacity (`index`: the id -> row index, admission and
eviction; `group`: the tables of one width as `embedding.EmbeddingCollection` sees them)."""
