"""A small HTTP client of the kembed API (used by the CLI; handy in notebooks and tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["ApiError", "Client"]

# How long a call waits in all for the API's rate limits (a 429 with Retry-After) before it gives up with the error.
MAX_RATE_LIMIT_WAIT_S = 60.0


class ApiError(RuntimeError):
    """The API said no; `str()` is a readable explanation naming the field at fault."""

    def __init__(self, status_code: int, detail: Any) -> None:
        self.status_code, self.detail = status_code, detail
        super().__init__(f"HTTP {status_code}: {format_detail(detail)}")


def format_detail(detail: Any) -> str:
    """FastAPI's validation errors as `field.path: message` lines; any other detail as it is."""
    if isinstance(detail, list):
        lines = []
        for error in detail:
            location = ".".join(str(part) for part in error.get("loc", []) if part != "body")
            lines.append(f"{location}: {error.get('msg')}" if location else str(error.get("msg")))
        return "\n".join(lines)
    return str(detail)


class Client:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 30.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._sleep = sleep

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        waited = 0
        while True:
            response = self._http.request(method, path, **kwargs)
            pause = response.headers.get("retry-after", "")
            # A rate limit refuses a request before reading it, so sending it again is safe; a full queue (429
            # without Retry-After) is an answer to show.
            if response.status_code != 429 or not pause.isdigit() or waited + int(pause) > MAX_RATE_LIMIT_WAIT_S:
                break
            self._sleep(int(pause))
            waited += int(pause)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return response

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz").json()

    def submit(self, spec: dict[str, Any], *, idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._call("POST", "/v1/jobs", json=spec, headers=headers).json()

    def jobs(self, *, states: list[str] | None = None, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if states:
            params["state"] = states
        if cursor:
            params["cursor"] = cursor
        return self._call("GET", "/v1/jobs", params=params).json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel").json()

    def logs(self, job_id: str, *, tail: int | None = None) -> str:
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params={"tail": tail} if tail else {}).text

    def export(self, job_id: str, out: Any, *, fmt: str, table: str | None = None, step: int | None = None,
               on_progress: Any = None) -> dict[str, str]:
        """Stream a job's embeddings into the binary file `out`; `on_progress(received, total)` per chunk.

        Returns the server's file name, checkpoint step and table.
        """
        params = {"format": fmt, **({"table": table} if table else {}), **({"step": step} if step is not None else {})}
        with self._http.stream("GET", f"/v1/jobs/{job_id}/export", params=params, timeout=None) as response:
            if response.status_code >= 400:
                response.read()
                try:
                    detail = response.json().get("detail", response.text)
                except ValueError:
                    detail = response.text
                raise ApiError(response.status_code, detail)
            total = int(response.headers.get("content-length") or 0)
            received = 0
            for block in response.iter_bytes():
                out.write(block)
                received += len(block)
                if on_progress:
                    on_progress(received, total)
            disposition = response.headers.get("content-disposition", "")
            filename = disposition.split("filename=", 1)[-1].strip('"') if "filename=" in disposition else ""
            return {"filename": filename, "step": response.headers.get("x-kembed-checkpoint-step", ""),
                    "table": response.headers.get("x-kembed-table", "")}

    def neighbours(self, job_id: str, word: str, *, k: int = 10, table: str | None = None) -> dict[str, Any]:
        params = {"word": word, "k": k, **({"table": table} if table else {})}
        return self._call("GET", f"/v1/jobs/{job_id}/neighbours", params=params).json()

    # ------------------------------------------------------------------------------------------- tenants
    def create_tenant(self, name: str, quota: dict[str, Any], sharing: dict[str, Any] | None = None, *,
                      storage: dict[str, list[str]] | None = None) -> dict[str, Any]:
        body = {"name": name, "quota": quota, **({"sharing": sharing} if sharing is not None else {}),
                **({"storage": storage} if storage is not None else {})}
        return self._call("POST", "/v1/tenants", json=body).json()

    def tenant(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/tenants/{name}").json()

    def set_storage(self, name: str, storage: dict[str, list[str]]) -> dict[str, Any]:
        return self._call("PATCH", f"/v1/tenants/{name}", json={"storage": storage}).json()

    def tenants(self) -> dict[str, Any]:
        return self._call("GET", "/v1/tenants").json()

    def set_quota(self, name: str, quota: dict[str, Any], sharing: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"quota": quota, **({"sharing": sharing} if sharing is not None else {})}
        return self._call("PATCH", f"/v1/tenants/{name}", json=body).json()

    def usage(self, tenant: str | None = None) -> dict[str, Any]:
        return self._call("GET", f"/v1/tenants/{tenant}/usage" if tenant else "/v1/usage").json()

    def create_token(self, tenant: str, *, name: str, role: str, expires_at: str | None = None) -> dict[str, Any]:
        body = {"name": name, "role": role, **({"expires_at": expires_at} if expires_at else {})}
        return self._call("POST", f"/v1/tenants/{tenant}/tokens", json=body).json()

    def tokens(self, tenant: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/tenants/{tenant}/tokens").json()

    def revoke_token(self, tenant: str, token_id: int) -> None:
        self._call("DELETE", f"/v1/tenants/{tenant}/tokens/{token_id}")

