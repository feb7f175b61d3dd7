"""`kembed-operator`: runs the Kopf reconcilers of Tenant and EmbeddingJob cluster-wide.

Settings come from KEMBED_OPERATOR_* variables (kembed_operator/settings.py); the cluster from the in-cluster
ServiceAccount or $KUBECONFIG. Two replicas elect one active through the ClusterKopfPeering named by
KEMBED_OPERATOR_PEERING_NAME (the Helm chart creates it); the other waits and takes over within
KEMBED_OPERATOR_PEERING_LIFETIME_S of the active one's death.
"""

from __future__ import annotations

import sys

import kopf
import uvloop

from kembed_operator import embeddingjob, startup, tenant  # noqa: F401 - importing registers the handlers
from kembed_operator.settings import OperatorSettings


def main() -> int:
    settings = OperatorSettings()  # fail fast, before connecting, on a bad setting
    kopf.configure(verbose=False, log_prefix=True)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    # uvloop: a C event loop for the watch streams and API calls that are most of the operator's work per job.
    uvloop.run(kopf.operator(
        clusterwide=True,
        standalone=settings.standalone,
        peering_name=None if settings.standalone else settings.peering_name,
        liveness_endpoint=liveness,
    ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
