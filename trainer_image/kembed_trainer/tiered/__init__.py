"""Tiered tables: rows on the node's local disk (`store`), hot rows cached in memory (`cache`), looked up and
updated as in-memory rows (`table`). docs/tiered-tables.md is the design note."""
