"""What each embedding row stands for, saved in every checkpoint so its vectors can be used elsewhere.

A checkpoint's `step-N/` holds, besides DCP's files:
- `tables.json` (rank 0): every table (name, rows, width, features, whether ids are hashed) and, for a model
  kind with a vocabulary, the vocabulary: row i of its tables is the word `vocabulary[i]`.
- `ids/<table>.rank-<r>.parquet` (each rank, tables with raw ids (hashed or dynamic) of table data only): the
  distinct raw ids that rank has read, as text, the row each one hashes to and the int64 it hashes from (`feature`,
  `id`, `row`, `hash`). Several ids may share a row of a hashed table (a hash collision); the union over ranks is
  every id trained on. Table data is streamed and the index grows as it is read: a full checkpoint holds every id
  read so far, a delta those read since the save before it (the union over a chain is the index), and a resumed
  rank starts from the union over the chain it resumed from (`read_raw_ids`). A dynamic table's rows move as ids come and go: its `row` is -1 here, and the
  int64 id of each row is the table's `ids` field in the checkpoint itself (`kembed_trainer.dynamic`); the text
  of an id is found here by that int64.
Tables whose ids are neither hashed nor dynamic need no such file: raw id i is row i.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from kembed_contract import trainer_config as config
from kembed_trainer import embedding

__all__ = ["IDS_DIR", "TABLES_FILE", "checkpoint_files", "id_counts", "ids_file", "read_raw_ids"]

TABLES_FILE = "tables.json"
IDS_DIR = "ids"
FORMAT_VERSION = 1


def ids_file(table: str, rank: int) -> str:
    return f"{IDS_DIR}/{table}.rank-{rank}.parquet"


def rows_meaning(cfg: config.TrainerConfig, table: config.TableConfig) -> str:
    """`words` (the vocabulary), `hashed_ids` (see the ids files), `dynamic_ids` (each row's id is the table's
    `ids` field; their texts in the ids files) or `ids` (raw id i is row i)."""
    if cfg.model.has_vocabulary:
        return "words"
    if table.dynamic is not None:
        return "dynamic_ids"
    return "hashed_ids" if table.hash_ids else "ids"


def id_counts(data: Any) -> dict[str, int]:
    """Per feature, the raw ids the data has read so far (a delta's ids files hold those read after these)."""
    return {f: len(texts) for f, (texts, _) in (data.raw_ids() if hasattr(data, "raw_ids") else {}).items()}


def checkpoint_files(cfg: config.TrainerConfig, data: Any, *, rank: int, ids_since: dict[str, int] | None = None
                     ) -> tuple[dict[str, bytes], dict[str, int]]:
    """This rank's side files for a checkpoint, and the ids counted in them (`id_counts`). A full checkpoint
    (`ids_since` None) has the manifest and every raw id read so far; a delta only the ids read after
    `ids_since` (the counts the save before it returned)."""
    files: dict[str, bytes] = {}
    if rank == 0 and ids_since is None:
        manifest: dict[str, Any] = {
            "format": FORMAT_VERSION,
            "model": cfg.model.kind,
            # The last coordinate of every row is the id's bias, not a factor.
            "bias_column": cfg.model.bias_column,
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
    counts = {f: len(texts) for f, (texts, _) in raw_ids.items()}
    if ids_since is not None:  # a delta: the ids read since the save before it
        raw_ids = {f: (texts[ids_since.get(f, 0):], hashes[ids_since.get(f, 0):])
                   for f, (texts, hashes) in raw_ids.items()}
    for table in cfg.embeddings.tables:
        meaning = rows_meaning(cfg, table)
        if meaning not in ("hashed_ids", "dynamic_ids"):
            continue
        features, ids, rows, all_hashes = [], [], [], []
        for feature in table.features:
            if feature not in raw_ids or not len(raw_ids[feature][0]):
                continue
            texts, hashes = raw_ids[feature]
            features += [feature] * len(texts)
            ids += texts
            rows.append(embedding.hash_rows(torch.from_numpy(hashes), table.num_embeddings).numpy()
                        if meaning == "hashed_ids" else np.full(len(texts), -1, np.int64))
            all_hashes.append(hashes)
        out = io.BytesIO()
        row_array = pa.array(torch.cat([torch.from_numpy(r) for r in rows]).numpy() if rows else [], pa.int64())
        hash_array = pa.array(np.concatenate(all_hashes) if all_hashes else [], pa.int64())
        pq.write_table(pa.table({"feature": pa.array(features, pa.string()), "id": pa.array(ids, pa.string()),
                                 "row": row_array, "hash": hash_array}), out)
        if ids_since is None or features:
            files[ids_file(table.name, rank)] = out.getvalue()
    return files, counts


def read_raw_ids(guard: Any, step_uris: list[str], *, rank: int, world_size: int
                 ) -> dict[str, tuple[list[str], np.ndarray]]:
    """The raw ids the index of a checkpoint's chain (`step_uris`: its full checkpoint, then its deltas) lists for
    the ranks this rank takes over (old rank r goes to r mod world_size), per feature as `raw_ids()` gives them;
    none from an index written before it kept the hashes."""
    files = []
    for step_uri in step_uris:
        try:
            files += guard.list_files(f"{step_uri}/{IDS_DIR}", where="checkpoint.uri")
        except FileNotFoundError:
            continue
    found: dict[str, tuple[list[str], list[np.ndarray]]] = {}
    for uri in files:
        name = uri.rsplit("/", 1)[-1]
        old_rank = name.removesuffix(".parquet").rsplit(".rank-", 1)[-1]
        if not old_rank.isdigit() or int(old_rank) % world_size != rank:
            continue
        with guard.open(uri, "rb", where="checkpoint.uri") as f:
            ids = pq.read_table(f)
        if "hash" not in ids.column_names:
            continue
        for feature, text, hashed in zip(ids["feature"].to_pylist(), ids["id"].to_pylist(),
                                         ids["hash"].to_numpy(), strict=True):
            texts, hashes = found.setdefault(feature, ([], []))
            texts.append(text)
            hashes.append(hashed)
    return {f: (texts, np.array(hashes, dtype=np.int64)) for f, (texts, hashes) in found.items()}
