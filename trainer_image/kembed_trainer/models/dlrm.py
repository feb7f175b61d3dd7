"""`dlrm`'s trainer half. DLRM (Naumov et al., 2019): bottom MLP over dense features, pairwise dot interaction,
top MLP. Its contract half: `kembed_contract.kinds.models.dlrm`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kembed_contract import trainer_config as config
from kembed_contract.kinds.models.dlrm import DLRMConfig
from kembed_trainer.models.base import ModelTraining
from kembed_trainer.models.layers import mlp

__all__ = ["DLRM", "KIND", "DLRMTraining"]


class DLRM(nn.Module):
    """The dense part; the pooled embeddings come from the `EmbeddingCollection`."""

    def __init__(
        self, cfg: DLRMConfig, *, num_dense: int, num_sparse: int, embedding_dim: int
    ) -> None:
        super().__init__()
        self.bottom = mlp([num_dense, *cfg.bottom_mlp], last_relu=True) if num_dense > 0 else None
        num_vectors = num_sparse + (1 if num_dense > 0 else 0)
        num_pairs = num_vectors * (num_vectors - 1) // 2
        top_in = num_pairs + (embedding_dim if num_dense > 0 else 0)
        self.top = mlp([top_in, *cfg.top_mlp, 1], last_relu=False)
        rows, cols = torch.tril_indices(num_vectors, num_vectors, offset=-1)
        # Each pair (i > j) as its place in the flattened num_vectors x num_vectors matrix of dots.
        self.register_buffer("pairs", rows * num_vectors + cols, persistent=False)
        # The other way round, for the backward: each place (i, j) of that matrix as its pair's index,
        # (i, j) and (j, i) alike, and the diagonal as one past the last pair (a zero gradient).
        places = torch.full((num_vectors * num_vectors,), num_pairs)
        places[self.pairs] = places[cols * num_vectors + rows] = torch.arange(num_pairs)
        self.register_buffer("pair_of_place", places, persistent=False)

    def forward(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        """Logits [B] from dense features [B, num_dense] and pooled embeddings [B, num_sparse, dim]."""
        (sparse,) = pooled  # dlrm validates a single embedding width
        vectors, first = [sparse], []
        if self.bottom is not None:
            x = self.bottom(dense)
            vectors.insert(0, x.unsqueeze(1))
            first = [x]
        if torch.is_autocast_enabled(sparse.device.type):
            # What autocast does to bmm's inputs, done before the Function so its backward matches, and before the
            # concatenation, which would otherwise promote the bottom MLP's output to float32 and be cast back.
            low = torch.get_autocast_dtype(sparse.device.type)
            vectors = [v.to(low) for v in vectors]
        z = torch.cat(vectors, 1)
        dots = _PairwiseDots.apply(z, self.pairs, self.pair_of_place)
        return self.top(torch.cat([*first, dots], 1)).squeeze(1)


class _PairwiseDots(torch.autograd.Function):
    """[B, num_pairs] dots of z's vectors (z: [B, n, d]) at the flat positions `pairs` of each n x n matrix.

    Autograd through `bmm(z, z^T)[:, rows, cols]` scatters into a zeroed n x n gradient element by element,
    then runs two bmms (one per operand) and adds their results, one of them transposed. The gradient of
    z_i . z_j is z_j for z_i and z_i for z_j, so with G the scattered gradient it is (G + G^T) z: one bmm,
    and G + G^T is one gather of the pairs' gradients (`pair_of_place`). On the benchmark's CPU this
    halved the interaction's time (forward and backward).
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, pairs: torch.Tensor, pair_of_place: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(z, pair_of_place)
        return _columns(torch.bmm(z, z.transpose(1, 2)).flatten(1), pairs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        z, pair_of_place = ctx.saved_tensors
        b, n, _ = z.shape
        g_sym = _columns(F.pad(grad, (0, 1)), pair_of_place).view(b, n, n)
        return torch.bmm(g_sym, z.to(grad.dtype)), None, None


def _columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[:, index]` for a 2-d `x`. `gather` with the index broadcast over the rows took less than half the time
    of `index_select` on the benchmark's CPU, and moves 16-bit floats faster as the 16-bit integers of their
    bits (a copy: no arithmetic, so bit for bit the same)."""
    bits = x.view(torch.int16) if x.element_size() == 2 and x.is_floating_point() else x
    return torch.gather(bits, 1, index.expand(x.shape[0], -1)).view(x.dtype)


class DLRMTraining(ModelTraining):
    def dense_model(self, cfg: config.TrainerConfig) -> nn.Module:
        return DLRM(cfg.model, num_dense=cfg.data.num_dense, num_sparse=len(cfg.embeddings.features),
                    embedding_dim=cfg.embeddings.tables[0].embedding_dim)


KIND = DLRMTraining()
