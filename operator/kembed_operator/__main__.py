"""Entry point of the kembed operator (`kembed-operator`).

The Kopf reconcilers of Tenant and EmbeddingJob resources arrive with the operator issue; until then the
embedded default (local backend) is the only way jobs run, and this entry point says so instead of pretending.
"""

import sys


def main() -> int:
    print("kembed-operator: the Kubernetes operator is not built yet; use `kembed serve` (local backend).",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
