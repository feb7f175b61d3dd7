"""Table kinds: one module each, `KIND = <its TableKind>` (found by `kembed_contract.kinds`)."""
