"""Dynamic sparse training: masks over the dense weight matrices, chosen again on a schedule.

In a step: `before_optimizer(step)` (after backward) re-selects the masks when due and zeroes the masked
gradients; `after_optimizer()` zeroes the masked weights again, since Adam's moments (or weight decay) would
otherwise move them. Every rank sees the same averaged gradients and seeds, so every rank picks the same masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kembed_contract import trainer_config as config

__all__ = ["Masks", "masked_fraction"]


def masked_fraction(cfg: config.SparsityConfig, step: int) -> float:
    """The schedule: the fraction of each matrix masked during step `step` (0-based)."""
    if step < cfg.dense_until:
        return 0.0
    rises = 1 + (step - cfg.dense_until) // cfg.increase_every
    return min(cfg.target, round(rises * cfg.increase, 9))


class Masks:
    def __init__(self, cfg: config.SparsityConfig | None, model: nn.Module, *, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.params = {n: p for n, p in model.named_parameters() if p.dim() >= 2} if cfg else {}
        self.masks = {n: torch.ones_like(p, dtype=torch.bool) for n, p in self.params.items()}
        self.fraction = torch.zeros((), dtype=torch.float64)  # a tensor, so checkpoints restore it in place
        self.churn = 0.0  # fraction of mask entries that changed at the last re-selection

    def before_optimizer(self, step: int) -> None:
        if not self.params:
            return
        fraction = masked_fraction(self.cfg, step)
        rose = fraction != float(self.fraction)
        every = self.cfg.every_steps
        again = every > 0 and fraction > 0 and (step - self.cfg.dense_until) % every == 0
        if rose or again:
            self._select(fraction, step)
        for name, p in self.params.items():
            if p.grad is not None:
                p.grad.mul_(self.masks[name])

    @torch.no_grad()
    def after_optimizer(self) -> None:
        for name, p in self.params.items():
            p.mul_(self.masks[name])

    def stats(self) -> dict[str, object]:
        if not self.params:
            return {}
        density = {n: round(m.float().mean().item(), 4) for n, m in self.masks.items()}
        return {"mask_density": density, "mask_churn": round(self.churn, 4)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return (
            {"fraction": self.fraction, **{f"mask.{n}": m for n, m in self.masks.items()}}
            if self.params
            else {}
        )

    @torch.no_grad()
    def _select(self, fraction: float, step: int) -> None:
        changed = total = 0
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        for name, p in self.params.items():
            new = self._choose(p, fraction, gen)
            changed += int((new != self.masks[name]).sum())
            total += new.numel()
            self.masks[name].copy_(new)
            p.mul_(new)
        self.churn = changed / total
        self.fraction.fill_(fraction)

    def _choose(self, p: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
        w = p.detach()
        if self.cfg.method == "random":
            score = torch.rand(w.shape, generator=gen).to(w.device)
        elif self.cfg.method == "topk":
            score = w.abs()
        else:
            score = w.abs() / w.abs().mean().clamp_min(1e-12)
            if p.grad is not None:
                g = p.grad.abs()
                score = score + self.cfg.grad_weight * g / g.mean().clamp_min(1e-12)
        b = self.cfg.block_size
        rows, cols = score.shape[0], score[0].numel()
        blocks = F.avg_pool2d(score.reshape(1, rows, cols), b, ceil_mode=True)[0]  # mean score per block
        keep = max(1, round(blocks.numel() * (1.0 - fraction)))
        chosen = torch.zeros(blocks.numel(), dtype=torch.bool, device=w.device)
        chosen[torch.topk(blocks.flatten(), keep, sorted=False).indices] = True
        full = chosen.view(blocks.shape).repeat_interleave(b, 0).repeat_interleave(b, 1)
        return full[:rows, :cols].reshape(w.shape)
