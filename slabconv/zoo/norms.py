"""Training-time norm modules with the official SLAB parameter and buffer names.

A model built from these modules has the state_dict layout of the official code
(github xinghaochen/SLAB, ``classification/models/prepbn.py``), so official checkpoints load with
``strict=True``:

- ``RepBN``: ``alpha`` (shape ``(1,)``) and ``bn.{weight,bias,running_mean,running_var,num_batches_tracked}``.
- ``LinearNorm``: buffers ``warm``, ``iter``, ``total_step`` (int64 scalars) and the two branches ``norm1``
  (LayerNorm or RMSNorm) and ``norm2`` (RepBN).

SLAB paper (ICML 2024), Sec. 4: RepBN(X) = BN(X) + eta * X (eq. 4); PRepBN blends
``lambda * LN(X) + (1 - lambda) * RepBN(X)`` with ``lambda = r0 * iter / total_step`` decaying to 0 (eq. 3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class RepBN(nn.Module):
    """Re-parameterised BatchNorm over the channel axis of a ``(B, N, C)`` tensor: ``BN(x) + alpha * x``.

    Args:
        channels: C, the size of the last axis.
        eps: BatchNorm eps (the official vision models use the BatchNorm1d default 1e-5; LLaMA-PRepBN 1e-6).
        alpha_init: initial value of the scalar ``alpha`` (eta in the paper); 1.0 in the official vision code.

    Input and output: float tensor ``(B, N, C)`` (or any ``(..., C)`` when ``flatten_tokens`` is set, as
    the LLaMA variant does with ``x.view(-1, C)``).
    """

    def __init__(self, channels: int, eps: float = 1e-5, alpha_init: float = 1.0, flatten_tokens: bool = False):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.bn = nn.BatchNorm1d(channels, eps=eps)
        self.flatten_tokens = flatten_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flatten_tokens:
            shape = x.shape
            x = x.reshape(-1, shape[-1])
            x = self.bn(x) + self.alpha * x
            return x.reshape(shape)
        x = x.transpose(1, 2)
        x = self.bn(x) + self.alpha * x
        return x.transpose(1, 2)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last axis: ``weight * x / sqrt(mean(x**2) + eps)``.

    Key layout as in Hugging Face LLaMA (``weight`` of shape ``(C,)``); computed in float32 and cast back.
    """

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LinearNorm(nn.Module):
    """Progressive norm (PRepBN): ``lambda * norm1(x) + (1 - lambda) * norm2(x)`` in training, ``norm2(x)`` in eval.

    Args:
        dim: C, the channel count.
        norm1: factory for the norm being replaced (LayerNorm / RMSNorm), called as ``norm1(dim)``.
        norm2: factory for the target norm (RepBN), called as ``norm2(dim)``.
        warm: training steps that use ``norm1`` alone before the blend starts.
        step: length of the blend; ``lambda = r0 * iter / total_step`` with ``iter`` counting down to 0.
        r0: initial blend weight of ``norm1``.

    Buffers ``warm``, ``iter``, ``total_step`` are int64 scalars, as in the official ``LinearNorm``; the
    counters move only in training mode. In eval mode the module is exactly ``norm2`` whatever the counters say,
    which is what slabconv folds.
    """

    warm: torch.Tensor
    iter: torch.Tensor
    total_step: torch.Tensor
    norm1: nn.Module
    norm2: nn.Module

    def __init__(
        self,
        dim: int,
        norm1: Callable[[int], nn.Module],
        norm2: Callable[[int], nn.Module],
        warm: int = 0,
        step: int = 300000,
        r0: float = 1.0,
    ):
        super().__init__()
        self.register_buffer("warm", torch.tensor(warm))
        self.register_buffer("iter", torch.tensor(step))
        self.register_buffer("total_step", torch.tensor(step))
        self.r0 = r0
        self.norm1 = norm1(dim)
        self.norm2 = norm2(dim)

    def blend_weight(self) -> float:
        """The current weight of ``norm1`` in training: 1 during warm-up, then ``r0 * iter / total_step``."""
        if int(self.warm) > 0:
            return 1.0
        return self.r0 * int(self.iter) / max(int(self.total_step), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self.norm2(x)
        if int(self.warm) > 0:
            self.warm.sub_(1)
            return self.norm1(x)
        lam = self.r0 * int(self.iter) / max(int(self.total_step), 1)
        if int(self.iter) > 0:
            self.iter.sub_(1)
        if lam == 0.0:
            return self.norm2(x)
        return lam * self.norm1(x) + (1.0 - lam) * self.norm2(x)
