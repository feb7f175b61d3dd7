"""Training data: every source yields `Batch`es for a given step, so resuming at step N needs only N."""

from kembed_trainer.data.batch import Batch
from kembed_trainer.data.factory import build_data

__all__ = ["Batch", "build_data"]
