"""kembed's trainer: sparse-embedding models trained with torchrun; see docs/trainer.md."""
