"""Operator-wide set-up, run once by Kopf before any handler: settings, the API client, Kopf's own knobs."""

from __future__ import annotations

import logging
import random
from typing import Any

import kopf
from kubernetes.client.rest import ApiException

from kembed_contract import resources
from kembed_operator import diffbase
from kembed_operator.kube import Kube, is_conflict
from kembed_operator.observed import Observed
from kembed_operator.settings import OperatorSettings
from kembed_operator.views import JOB_LABEL
from kembed_platform.tenant_credentials import TenantCredentials

_PREFIX = "kembed.io"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    ours = OperatorSettings()
    memo.settings = ours
    memo.kube = Kube(workers=ours.api_workers)
    memo.observed = Observed()
    memo.credentials = (TenantCredentials.connect(endpoint_url=ours.s3_iam_endpoint_url,
                                                  user_prefix=ours.s3_iam_user_prefix)
                        if ours.s3_mint_credentials else None)

    # Kopf keeps its bookkeeping in annotations under our prefix: our status schemas prune unknown fields.
    settings.persistence.finalizer = resources.OPERATOR_FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=_PREFIX)
    # Only Tenants have change handlers (tenant.py): other kinds get no diff base (see diffbase.py).
    settings.persistence.diffbase_storage = diffbase.ChangeHandledKindsDiffBase(
        kinds=[resources.TENANT_KIND], prefix=_PREFIX, key="last-handled-configuration")
    settings.posting.level = logging.INFO
    settings.execution.max_workers = ours.api_workers
    settings.peering.name = ours.peering_name
    settings.peering.clusterwide = True
    settings.peering.lifetime = ours.peering_lifetime_s
    settings.peering.mandatory = not ours.standalone
    settings.peering.standalone = ours.standalone
    # Kopf pauses an operator that sees a peer of higher *or equal* priority: replicas must differ.
    settings.peering.priority = random.randint(1, 2**30)
    settings.peering.stealth = True
    # Kopf logs every handler call at INFO ("Handler 'pod_changed' succeeded"): thousands of lines a minute under
    # load. What matters is in the resources' status and Events; warnings and errors still get logged.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # Only the pods and batch Jobs of EmbeddingJobs, filtered by the API server: the handlers' own label filters
    # act after Kopf has received and decoded every pod and Job of the cluster.
    settings.watching.label_selectors["v1", "pods"] = JOB_LABEL
    settings.watching.label_selectors["batch/v1", "jobs"] = JOB_LABEL
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    if not ours.standalone:
        _ensure_peering(memo.kube, ours.peering_name)
    logger.info("kembed operator configured: peering %s (priority %d), trainer image %s",
                "off" if ours.standalone else ours.peering_name, settings.peering.priority, ours.trainer_image)


def _ensure_peering(kube: Kube, name: str) -> None:
    """The ClusterKopfPeering the replicas elect through; created by whichever replica starts first."""
    body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
    try:
        kube.custom.create_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", body)
    except ApiException as error:
        if not is_conflict(error):
            raise
