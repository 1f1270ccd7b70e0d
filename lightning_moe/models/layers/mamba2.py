"""Mamba-2 mixer in plain PyTorch: in-projection, causal depthwise conv1d, chunked SSD scan, gated RMSNorm,
out-projection. Parameter names and shapes are the hub's (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
``D``, ``norm``, ``out_proj``), so checkpoints map by rename.

Packed rows: the conv and the scan read sequence boundaries from the :class:`SequenceLayout`; neither sees
a token of an earlier sequence in the row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.config import MambaConfig
from lightning_moe.models.layers.sequence import SequenceLayout
from lightning_moe.models.layers.ssd import ssd_chunk_scan
from lightning_moe.models.layers.upcast import upcast


class _CausalConv1dFunction(torch.autograd.Function):
    """Depthwise causal conv as ``kernel`` shifted multiply-adds, forward and backward.

    Saves only the input (autograd through the shifted products would keep ``kernel`` copies of it), and
    avoids oneDNN's depthwise ``conv1d`` backward, which is slow on CPU. ``same[j - 1]`` marks output
    positions whose token ``j`` steps back lies in the same packed sequence (None: no packing).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, same):
        ctx.save_for_backward(x, weight)
        ctx.same, ctx.has_bias = same, bias is not None
        # accumulate in fp32, as the CUDA causal-conv1d kernel does
        dtype, x, taps = x.dtype, upcast(x), upcast(weight[:, 0])
        out = x * taps[:, -1]
        for j in range(1, min(taps.shape[-1], x.shape[1])):
            back = x[:, :-j] if same is None else x[:, :-j] * same[j - 1]
            out[:, j:].addcmul_(back, taps[:, -1 - j])
        if bias is not None:
            out += upcast(bias)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        same, kernel = ctx.same, weight.shape[-1]
        grad, xf, taps = upcast(grad), upcast(x), upcast(weight[:, 0])
        grad_x = grad * taps[:, -1]
        grad_taps = [(grad * xf).sum((0, 1))]
        for j in range(1, min(kernel, x.shape[1])):
            ahead = grad[:, j:] if same is None else grad[:, j:] * same[j - 1]
            grad_x[:, :-j].addcmul_(ahead, taps[:, -1 - j])
            grad_taps.append((ahead * xf[:, :-j]).sum((0, 1)))
        grad_taps += [torch.zeros_like(grad_taps[0])] * (kernel - len(grad_taps))
        grad_weight = torch.stack(grad_taps[::-1], dim=-1).unsqueeze(1).to(weight.dtype)
        grad_bias = grad.sum((0, 1)).to(weight.dtype) if ctx.has_bias else None
        return grad_x.to(x.dtype), grad_weight, grad_bias, None


class CausalConv1d(nn.Module):
    """Depthwise causal convolution over [batch, seq, channels]; weight [channels, 1, kernel] as in ``nn.Conv1d``."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def reset_parameters(self, init_std: float | None = None) -> None:
        # nn.Conv1d's default init, as Mamba and Megatron use for the conv
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.kernel)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, layout: SequenceLayout, channels: torch.Tensor | None = None) -> torch.Tensor:
        """``channels``: the channels ``x`` holds, when it holds a subset (context parallelism)."""
        same = None
        if layout.packed:
            docs = layout.document_ids
            same = [(docs[:, j:] == docs[:, :-j]).unsqueeze(-1).to(x.dtype) for j in range(1, self.kernel)]
        weight, bias = self.weight, self.bias
        if channels is not None:
            weight = weight.index_select(0, channels)
            bias = None if bias is None else bias.index_select(0, channels)
        return _CausalConv1dFunction.apply(x, weight, bias, same)


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x * silu(gate))`` over groups of ``group_size`` channels (Mamba-2's norm before out_proj), in fp32."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self, init_std: float | None = None) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, channels: slice = slice(None)) -> torch.Tensor:
        """``channels``: the (whole groups of) channels ``x`` holds, when it holds a subset."""
        h = upcast(x) * F.silu(upcast(gate))
        groups = h.unflatten(-1, (-1, self.group_size))
        normed = F.rms_norm(groups, (self.group_size,), eps=self.eps).flatten(-2)
        return upcast(self.weight[channels]) * normed


class Mamba2Mixer(nn.Module):
    """``forward(x [batch, seq, hidden], layout) -> [batch, seq, hidden]``."""

    def __init__(self, cfg: MambaConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.inner_size = cfg.num_heads * cfg.head_dim
        self.bc_size = cfg.n_groups * cfg.state_size
        conv_dim = self.inner_size + 2 * self.bc_size
        # in_proj rows: gate z | conv input (x, B, C) | dt per head
        self.in_proj = nn.Linear(hidden_size, self.inner_size + conv_dim + cfg.num_heads, bias=cfg.proj_bias)
        self.conv1d = CausalConv1d(conv_dim, cfg.conv_kernel, cfg.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(cfg.num_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_heads))
        self.D = nn.Parameter(torch.empty(cfg.num_heads))
        self.norm = GatedRMSNorm(self.inner_size, self.inner_size // cfg.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(self.inner_size, hidden_size, bias=cfg.proj_bias)

    @torch.no_grad()
    def reset_parameters(self, init_std: float = 0.02) -> None:
        """Mamba's init: A uniform in [1, 16], D = 1, dt = softplus(dt_bias) log-uniform in [dt_min, dt_max]."""
        cfg = self.cfg
        for linear in (self.in_proj, self.out_proj):
            nn.init.normal_(linear.weight, std=init_std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.conv1d.reset_parameters()
        self.norm.reset_parameters()
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
        nn.init.ones_(self.D)
        low, high = math.log(cfg.time_step_min), math.log(cfg.time_step_max)
        dt = torch.exp(torch.rand_like(self.dt_bias, dtype=torch.float32) * (high - low) + low)
        dt = dt.clamp(min=cfg.time_step_floor)
        # inverse of softplus
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        return self.out_proj(self.mix(self.project(x), layout).to(x.dtype))

    @property
    def head_groups(self) -> int:
        """Units the heads split into when ranks share them out (B/C groups, ``parallel/mamba.py``)."""
        return self.cfg.n_groups

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``in_proj``'s output as the parts :meth:`mix` reads: gate z | conv input (x, B, C) | dt per head."""
        return list(self.in_proj(x).split(self.in_proj_sizes, -1))

    @property
    def in_proj_sizes(self) -> list[int]:
        """Output channels of ``in_proj``: gate z | conv input (x, B, C) | dt per head."""
        return [self.inner_size, self.inner_size + 2 * self.bc_size, self.num_heads]

    def group_channels(self, first: int, last: int) -> tuple[slice, torch.Tensor, slice]:
        """Where B/C groups ``[first, last)`` and their heads sit: in the gate (and x, and the norm), in the conv
        input (x | B | C rows), and in dt."""
        inner, heads = self._group_slices(first, last)
        state, device = self.cfg.state_size, self.conv1d.weight.device
        b = torch.arange(first * state, last * state, device=device) + self.inner_size
        conv = torch.cat([torch.arange(inner.start, inner.stop, device=device), b, b + self.bc_size])
        return inner, conv, heads

    def _group_slices(self, first: int, last: int) -> tuple[slice, slice]:
        """The inner (gate, x, norm) channels and the heads of B/C groups ``[first, last)``."""
        heads_per_group = self.num_heads // self.cfg.n_groups
        h0, h1 = first * heads_per_group, last * heads_per_group
        return slice(h0 * self.head_dim, h1 * self.head_dim), slice(h0, h1)

    def mix(self, parts: list[torch.Tensor], layout: SequenceLayout, groups: tuple[int, int] | None = None,
            channels: tuple | None = None) -> torch.Tensor:
        """Conv, scan and gated norm of the heads of B/C groups ``groups`` (default: all), whose channels
        ``channels`` (of :meth:`group_channels`) of :meth:`project`'s parts ``gate``, ``conv_in`` and ``dt`` hold;
        fp32 [batch, seq, their inner channels]."""
        gate, conv_in, dt = parts
        conv_channels = None if channels is None else channels[1]
        cfg = self.cfg
        first, last = groups or (0, cfg.n_groups)
        inner, heads = self._group_slices(first, last)
        batch, seq, _ = conv_in.shape
        num_heads, num_groups = heads.stop - heads.start, last - first
        bc_size = num_groups * cfg.state_size
        conv_out = F.silu(self.conv1d(conv_in, layout, conv_channels))
        hidden, B, C = conv_out.split([num_heads * self.head_dim, bc_size, bc_size], dim=-1)
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias[heads])).clamp(*cfg.time_step_limit)
        y = ssd_chunk_scan(
            hidden.reshape(batch, seq, num_heads, self.head_dim),
            dt,
            -torch.exp(upcast(self.A_log[heads])),
            B.reshape(batch, seq, num_groups, cfg.state_size),
            C.reshape(batch, seq, num_groups, cfg.state_size),
            cfg.chunk_size,
            D=self.D[heads],
            seq_idx=layout.document_ids if layout.packed else None,
        )
        return self.norm(y.flatten(2), gate, inner)
