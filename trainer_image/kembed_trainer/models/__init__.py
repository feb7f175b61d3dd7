"""Model kinds' trainer halves, one module or package each (`kembed_trainer.kinds` finds them by name): the dense
part of each model on top of the shared `EmbeddingCollection` (the sparse part), and what else the kind trains
or measures its own way. `base` says what a kind answers."""
