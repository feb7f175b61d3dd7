"""The original word2vec tool's vector formats, which gensim's `KeyedVectors.load_word2vec_format` reads
(binary: `binary=True`): `<count> <dim>`, then each key and its vector. Keys are the words, or the ids as text;
whitespace inside a key becomes `_`. Offered for every job's tables (`kembed_trainer.export`)."""

from __future__ import annotations

from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from kembed_trainer.export import TableRows

__all__ = ["write_binary", "write_text"]

_LINES_PER_WRITE = 8192  # the Python strings of a write: a few MB, however large the range of rows


def write_text(rows: TableRows, out: IO[bytes]) -> None:
    _write(rows, out, binary=False)


def write_binary(rows: TableRows, out: IO[bytes]) -> None:
    _write(rows, out, binary=True)


def _write(rows: TableRows, out: IO[bytes], *, binary: bool) -> None:
    out.write(f"{len(rows.keys)} {rows.vectors.dim}\n".encode())
    for start, stop in rows.chunks():  # a range of rows at a time: the table is never whole in memory
        vectors = rows.vectors_of(start, stop)
        for first in range(start, stop, _LINES_PER_WRITE):
            keys = ["_".join(k.split()) or "_" for k in rows.keys[first:min(stop, first + _LINES_PER_WRITE)]]
            chunk = vectors[first - start:first - start + len(keys)]
            if binary:  # as gensim writes it: "<key> " then the little-endian float32s
                out.write(b"".join(f"{k} ".encode() + v.astype("<f4").tobytes()
                                   for k, v in zip(keys, chunk, strict=True)))
            else:  # %.9g: every float32 reads back exactly
                out.write("".join(f"{k} {' '.join(format(x, '.9g') for x in v.tolist())}\n"
                                  for k, v in zip(keys, chunk, strict=True)).encode())
