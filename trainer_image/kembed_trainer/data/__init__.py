"""Training data: every source yields `Batch`es for a given step, so resuming at step N needs only N.

A data kind's trainer half is `kembed_trainer.data.<kind>` with `build(cfg, *, rank, world_size, guard)`, which
`kembed_trainer.kinds.data_source` calls for `cfg.data.kind`; the other modules here are what sources share."""

from kembed_trainer.data.batch import Batch

__all__ = ["Batch"]
