"""Model kinds: one module each, `KIND = <its ModelKind>` (found by `kembed_contract.kinds`)."""
