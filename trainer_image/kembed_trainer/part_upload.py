"""A write stream to one S3 object whose parts upload while the writer goes on.

s3fs's own write stream (`S3File`) uploads a part each time its buffer fills and waits for it, so one file is one
request at a time: a checkpoint's large table streams at one connection's speed however fast the storage is.
`PartUpload` hands each full part to s3fs's event loop and goes on filling the next, with at most `in_flight`
parts outstanding, so memory stays bounded at about `part_bytes * (in_flight + 1)` per open file. A file smaller
than one part is a single PUT, as with S3File. The object appears on `close()`, as DCP's writer expects; a writer
that fails calls `abort()` instead: the multipart upload is aborted, no object appears and the storage keeps no
parts. A stream collected without either leaves no object.
"""

from __future__ import annotations

import asyncio
import io
from collections import deque
from concurrent.futures import Future
from typing import Any

from fsspec.asyn import sync

__all__ = ["IN_FLIGHT", "PART_BYTES", "PartUpload"]

# S3 takes parts of 5 MiB and up (all but the last); larger parts mean fewer requests for the server to assemble
# (docs/benchmarks.md, incremental checkpoints).
PART_BYTES = 64 * 2**20
IN_FLIGHT = 2


class PartUpload(io.RawIOBase):
    def __init__(self, fs: Any, path: str, *, part_bytes: int = PART_BYTES, in_flight: int = IN_FLIGHT) -> None:
        super().__init__()
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_bytes = part_bytes
        self._in_flight = in_flight
        self._buffer = bytearray()
        self._written = 0
        self._upload_id: str | None = None
        self._pending: deque[tuple[int, Future]] = deque()  # (part number, its upload), oldest first
        self._parts: list[dict[str, Any]] = []

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        while view:
            take = min(len(view), self._part_bytes - len(self._buffer))
            self._buffer += view[:take]
            view = view[take:]
            if len(self._buffer) == self._part_bytes:
                self._send(bytes(self._buffer))
                self._buffer.clear()
        self._written += size
        return size

    def close(self) -> None:
        """Finish the object (DCP closes each file it wrote): the last part and the upload's completion, or one
        PUT for a small file. If that fails, nothing is left behind (`abort`)."""
        if self.closed:
            return
        try:
            if self._upload_id is None:
                self._call("put_object", Body=bytes(self._buffer))
            else:
                if self._buffer:
                    self._send(bytes(self._buffer))
                while self._pending:
                    self._collect()
                parts = sorted(self._parts, key=lambda p: p["PartNumber"])
                self._call("complete_multipart_upload", UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self._fs.invalidate_cache(f"{self._bucket}/{self._key}")
        except BaseException:
            self.abort()
            raise
        self._drop()

    def abort(self) -> None:
        """Drop what was written: outstanding parts are awaited (a part landing after the abort would be kept
        by the storage), then the upload is aborted. Closes the stream without an object."""
        if self.closed:
            return
        try:
            for _, upload in self._pending:
                upload.exception()  # waits; its error does not matter any more
            if self._upload_id is not None:
                self._call("abort_multipart_upload", UploadId=self._upload_id)
        finally:
            self._drop()

    def __del__(self) -> None:
        # io's own finaliser would close(), i.e. finish a file its writer never finished. No request either (the
        # event loop may be gone at exit): a multipart upload begun is left to the bucket's lifecycle rules.
        if not self.closed:
            self._drop()

    def _drop(self) -> None:
        self._pending.clear()
        self._buffer = bytearray()
        super().close()

    def _send(self, body: bytes) -> None:
        if self._upload_id is None:
            self._upload_id = self._call("create_multipart_upload")["UploadId"]
        while len(self._pending) >= self._in_flight:
            self._collect()
        number = len(self._parts) + len(self._pending) + 1
        coroutine = self._fs._call_s3(  # noqa: SLF001 - s3fs's request path: its retries, credentials, endpoint
            "upload_part", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number, Body=body,
        )
        self._pending.append((number, asyncio.run_coroutine_threadsafe(coroutine, self._fs.loop)))

    def _collect(self) -> None:
        number, upload = self._pending.popleft()
        self._parts.append({"PartNumber": number, "ETag": upload.result()["ETag"]})

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, Key=self._key, **kwargs)  # noqa: SLF001
