"""What each embedding row stands for, saved in every checkpoint so its vectors can be used elsewhere.

A checkpoint's `step-N/` holds, besides DCP's files:
- `tables.json` (rank 0): every table (name, rows, width, features, whether ids are hashed) and, for word2vec,
  the vocabulary: row i of the `center` and `context` tables is the word `vocabulary[i]`.
- `ids/<table>.rank-<r>.parquet` (each rank, hashed tables of table data only): the distinct raw ids that rank's
  training rows hold, as text, and the row each one hashes to (`feature`, `id`, `row`). Several ids may share a
  row (a hash collision); the union over ranks is every id trained on.
Tables whose ids are not hashed need no such file: raw id i is row i.
"""

from __future__ import annotations

import io
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import embedding

__all__ = ["IDS_DIR", "TABLES_FILE", "checkpoint_files", "ids_file"]

TABLES_FILE = "tables.json"
IDS_DIR = "ids"
FORMAT_VERSION = 1


def ids_file(table: str, rank: int) -> str:
    return f"{IDS_DIR}/{table}.rank-{rank}.parquet"


def rows_meaning(cfg: config.TrainerConfig, table: config.TableConfig) -> str:
    """`words` (the vocabulary), `hashed_ids` (see the ids files) or `ids` (raw id i is row i)."""
    if cfg.model.kind == "word2vec":
        return "words"
    return "hashed_ids" if table.hash_ids else "ids"


def checkpoint_files(cfg: config.TrainerConfig, data: Any, *, rank: int) -> dict[str, bytes]:
    """This rank's side files for every checkpoint (the data does not change, so they are made once)."""
    files: dict[str, bytes] = {}
    if rank == 0:
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "model": cfg.model.kind,
            # two_tower with biases: the last coordinate of every row is the id's bias, not a factor.
            "bias_column": cfg.model.kind == "two_tower" and cfg.model.biases,
            "tables": [
                {
                    "name": t.name,
                    "num_embeddings": t.num_embeddings,
                    "embedding_dim": t.embedding_dim,
                    "features": t.features,
                    "rows": rows_meaning(cfg, t),
                }
                for t in cfg.embeddings.tables
            ],
        }
        if (vocab := getattr(data, "vocab", None)) is not None:
            manifest["vocabulary"] = list(vocab)
        files[TABLES_FILE] = json.dumps(manifest, ensure_ascii=False).encode()
    raw_ids = data.raw_ids() if hasattr(data, "raw_ids") else {}
    for table in cfg.embeddings.tables:
        if rows_meaning(cfg, table) != "hashed_ids":
            continue
        features, ids, rows = [], [], []
        for feature in table.features:
            if feature not in raw_ids:
                continue
            texts, hashes = raw_ids[feature]
            features += [feature] * len(texts)
            ids += texts
            rows.append(embedding.hash_rows(torch.from_numpy(hashes), table.num_embeddings).numpy())
        out = io.BytesIO()
        row_array = pa.array(torch.cat([torch.from_numpy(r) for r in rows]).numpy() if rows else [], pa.int64())
        pq.write_table(pa.table({"feature": pa.array(features, pa.string()), "id": pa.array(ids, pa.string()),
                                 "row": row_array}), out)
        files[ids_file(table.name, rank)] = out.getvalue()
    return files
