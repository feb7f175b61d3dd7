"""Data kinds: one module each, `KIND = <its DataKind>` (found by `kembed_contract.kinds`)."""
