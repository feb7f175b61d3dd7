"""The operator's only door to the Kubernetes API: a shared client and the few verbs the reconcilers use.

Every call is synchronous (the kubernetes client) and runs in a bounded thread pool, so the Kopf event loop never
blocks and at most `api_workers` calls are in flight.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kembed_contract import resources

__all__ = ["Kube", "is_conflict", "is_not_found"]

FIELD_MANAGER = "kembed-operator"
T = TypeVar("T")

# (api prefix, plural) of every kind the operator applies; namespaced unless noted.
_PATHS = {
    ("v1", "Namespace"): ("/api/v1", "namespaces", False),
    ("v1", "ResourceQuota"): ("/api/v1", "resourcequotas", True),
    ("v1", "LimitRange"): ("/api/v1", "limitranges", True),
    ("v1", "ServiceAccount"): ("/api/v1", "serviceaccounts", True),
    ("v1", "Secret"): ("/api/v1", "secrets", True),
    ("v1", "ConfigMap"): ("/api/v1", "configmaps", True),
    ("v1", "Service"): ("/api/v1", "services", True),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("/apis/networking.k8s.io/v1", "networkpolicies", True),
    ("batch/v1", "Job"): ("/apis/batch/v1", "jobs", True),
}


def is_not_found(error: Exception) -> bool:
    return isinstance(error, ApiException) and error.status == 404


def is_conflict(error: Exception) -> bool:
    return isinstance(error, ApiException) and error.status == 409


class Kube:
    def __init__(self, *, workers: int, api_client: client.ApiClient | None = None) -> None:
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            configuration = client.Configuration.get_default_copy()
            configuration.connection_pool_maxsize = workers
            api_client = client.ApiClient(configuration)
        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kube")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    # ---- verbs ---------------------------------------------------------------------------------------------------
    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates the object or brings the fields we own to `manifest`, in one call."""
        prefix, plural, namespaced = _PATHS[(manifest["apiVersion"], manifest["kind"])]
        meta = manifest["metadata"]
        path = f"{prefix}/namespaces/{meta['namespace']}/{plural}/{meta['name']}" if namespaced else (
            f"{prefix}/{plural}/{meta['name']}")
        return self._call("PATCH", path, body=manifest, content_type="application/apply-patch+yaml",
                          query=[("fieldManager", FIELD_MANAGER), ("force", "true")])

    def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Creates the object; None when one of that name already exists (the caller decides what that means)."""
        prefix, plural, namespaced = _PATHS[(manifest["apiVersion"], manifest["kind"])]
        meta = manifest["metadata"]
        path = f"{prefix}/namespaces/{meta['namespace']}/{plural}" if namespaced else f"{prefix}/{plural}"
        try:
            return self._call("POST", path, body=manifest, query=[("fieldManager", FIELD_MANAGER)])
        except ApiException as error:
            if is_conflict(error):
                return None
            raise

    def create_or_apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Creates the object, or applies `manifest` to the one that exists already (a retry, a take-over).

        A plain create costs the API server much less than a server-side apply (no managed-fields merge), and
        almost every child is new; the apply keeps the second time as idempotent as before.
        """
        created = self.create(manifest)
        return created if created is not None else self.apply(manifest)

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None, *,
               propagation: str = "Background", uid: str | None = None) -> bool:
        """Deletes an object; False if it was already gone. With `uid`, only that very object (not a namesake)."""
        prefix, plural, namespaced = _PATHS[(api_version, kind)]
        path = f"{prefix}/namespaces/{namespace}/{plural}/{name}" if namespaced else f"{prefix}/{plural}/{name}"
        body: dict[str, Any] = {"propagationPolicy": propagation}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self._call("DELETE", path, body=body)
        except ApiException as error:
            if is_not_found(error) or is_conflict(error):  # gone, or a newer object of that name
                return False
            raise
        return True

    def merge_patch(self, api_version: str, kind: str, name: str, namespace: str | None,
                    patch: dict[str, Any]) -> dict[str, Any]:
        prefix, plural, namespaced = _PATHS[(api_version, kind)]
        path = f"{prefix}/namespaces/{namespace}/{plural}/{name}" if namespaced else f"{prefix}/{plural}/{name}"
        return self._call("PATCH", path, body=patch, content_type="application/merge-patch+json")

    def patch_custom_status(self, plural: str, name: str, namespace: str | None,
                            status: dict[str, Any]) -> dict[str, Any]:
        """Merge-patches `status` through the status subresource (spec and metadata stay untouched)."""
        base = f"/apis/{resources.GROUP}/{resources.VERSION}"
        path = f"{base}/namespaces/{namespace}/{plural}/{name}/status" if namespace else (
            f"{base}/{plural}/{name}/status")
        return self._call("PATCH", path, body={"status": status}, content_type="application/merge-patch+json")

    def list_custom(self, plural: str, namespace: str) -> list[dict[str, Any]]:
        path = f"/apis/{resources.GROUP}/{resources.VERSION}/namespaces/{namespace}/{plural}"
        return self._call("GET", path).get("items", [])

    def read_secret(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        except ApiException as error:
            if is_not_found(error):
                return None
            raise

    def pod_log_tail(self, name: str, namespace: str, *, lines: int) -> str:
        response = self.core.read_namespaced_pod_log(name, namespace, tail_lines=lines, _preload_content=False,
                                                     _request_timeout=10)
        return response.data.decode(errors="replace")

    def _call(self, method: str, path: str, *, body: Any = None, content_type: str = "application/json",
              query: list[tuple[str, str]] | None = None) -> dict[str, Any]:
        response = self.api.call_api(
            path, method, query_params=query or [], body=body,
            header_params={"Content-Type": content_type, "Accept": "application/json"},
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=30,
        )
        data = response[0].data if isinstance(response, tuple) else response.data
        return json.loads(data) if data else {}
