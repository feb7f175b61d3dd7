"""The original word2vec tool's vector formats, which gensim's `KeyedVectors.load_word2vec_format` reads
(binary: `binary=True`): `<count> <dim>`, then each key and its vector. Keys are the words, or the ids as text;
whitespace inside a key becomes `_`. Offered for every job's tables (`kembed_trainer.export`)."""

from __future__ import annotations

from typing import IO, TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kembed_trainer.export import TableRows

__all__ = ["write_binary", "write_text"]

_CHUNK_ROWS = 8192


def write_text(rows: TableRows, out: IO[bytes]) -> None:
    _write(rows, out, binary=False)


def write_binary(rows: TableRows, out: IO[bytes]) -> None:
    _write(rows, out, binary=True)


def _keys(rows: TableRows) -> list[str]:
    return ["_".join(k.split()) or "_" for k in rows.keys]


def _write(rows: TableRows, out: IO[bytes], *, binary: bool) -> None:
    keys = _keys(rows)
    out.write(f"{len(keys)} {rows.vectors.shape[1]}\n".encode())
    for start in range(0, len(keys), _CHUNK_ROWS):
        chunk = rows.vectors[rows.rows[start : start + _CHUNK_ROWS]].astype(np.float32, copy=False)
        if binary:  # as gensim writes it: "<key> " then the little-endian float32s
            out.write(b"".join(f"{k} ".encode() + v.astype("<f4").tobytes()
                               for k, v in zip(keys[start : start + _CHUNK_ROWS], chunk, strict=True)))
        else:  # %.9g: every float32 reads back exactly
            out.write("".join(f"{k} {' '.join(format(x, '.9g') for x in v.tolist())}\n"
                              for k, v in zip(keys[start : start + _CHUNK_ROWS], chunk, strict=True)).encode())
