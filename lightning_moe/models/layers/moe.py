"""Mixture of experts: router, stacked experts (grouped GEMM or the per-expert loop reference), shared experts.

Expert weights are stacked ``[num_experts, out, in]`` per projection (``gate_proj``, ``up_proj``,
``down_proj``), the orientation of ``nn.Linear`` and of the hub's per-expert tensors, so import/export
is a pure stack/unstack and tensor/expert parallelism shard plain dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.checkpoint import checkpoint

from lightning_moe.models.config import MoEConfig
from lightning_moe.models.layers.mlp import MLP
from lightning_moe.models.layers.upcast import upcast


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``: row groups of ``a`` [N, in] (ends ``offs``) times the matrices of ``b`` [G, in, out];
    or, both 2-d, ``a`` [out, N] times ``b`` [N, in] summed per group -> [G, out, in] (a weight gradient)."""
    if a.dtype == torch.float64:
        return _looped_grouped_mm(a, b, offs)
    if a.dtype == torch.bfloat16 or not torch.compiler.is_compiling():
        return torch._grouped_mm(a, b, offs=offs)
    return _eager_grouped_mm(a, b, offs)


def _looped_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The same products group by group, for float64 (which ``torch._grouped_mm`` has no kernel for: a float64
    model is a test reference); reads the group ends on the host."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if a.dim() == 2 and b.dim() == 2:
        return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])
    rows = [a[s:e] @ b[g] for g, (s, e) in enumerate(zip(starts, ends))]
    return torch.cat([*rows, a.new_zeros(a.shape[0] - ends[-1], b.shape[-1])])


@torch.compiler.disable
def _eager_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # under torch.compile the op's shape function accepts bf16 only, while its kernels also run fp32 (CPU)
    return torch._grouped_mm(a, b, offs=offs)


@dataclass
class Routing:
    """Per token: the chosen experts [T, k], their gate weights [T, k] and the router scores [T, E]."""

    experts: torch.Tensor
    weights: torch.Tensor
    scores: torch.Tensor


class Router(nn.Module):
    """Top-k router: softmax or sigmoid scores, optional group-limited selection and selection-only bias."""

    def __init__(self, cfg: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(cfg.num_experts)) if cfg.router_bias else None
        if cfg.score_correction_bias:
            # aux-loss-free balancing (DeepSeek-V3): picks experts, never weights them
            self.register_buffer("score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        else:
            self.score_correction_bias = None

    def reset_parameters(self, init_std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.score_correction_bias is not None:
            nn.init.zeros_(self.score_correction_bias)

    def _apply(self, fn, recurse=True):
        # the selection bias moves by ~1e-3 per step: in bf16 (precision="bf16-true" casts every floating
        # tensor) such steps round away, so it stays fp32 like the hub checkpoints store it
        super()._apply(fn, recurse)
        bias = self.score_correction_bias
        if bias is not None and bias.is_floating_point() and bias.dtype != torch.float32:
            self.score_correction_bias = bias.float()
        return self

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.cfg
        bias = None if self.bias is None else upcast(self.bias)
        # fp32 logits even under autocast (bf16-mixed), which would run this matmul in bf16
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(upcast(x), upcast(self.weight), bias)
        scores = torch.softmax(logits, dim=-1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
        if cfg.force_balanced:
            slots = torch.arange(x.shape[0] * cfg.top_k, device=x.device)
            experts = (slots % cfg.num_experts).view(-1, cfg.top_k)
        else:
            choice = scores if self.score_correction_bias is None else scores + self.score_correction_bias
            if cfg.n_group > 1:
                choice = self._limit_groups(choice)
            experts = torch.topk(choice, cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        return Routing(experts=experts, weights=weights, scores=scores)

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        grouped = choice.view(-1, cfg.n_group, cfg.num_experts // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        return grouped.masked_fill(~group_mask[..., None], float("-inf")).view_as(choice)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Token copies routed to each expert ([num_experts] int64) by a fixed-size scatter: ``bincount``'s output size
    depends on the values, which a GPU makes the host wait for."""
    flat = experts.flatten()
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def load_balancing_loss(scores: torch.Tensor, num_experts: int, top_k: int, score_func: str) -> torch.Tensor:
    """Megatron's switch loss ``E * sum_i f_i * P_i``: ``P_i`` the mean score of expert i (sigmoid scores
    normalized per token), ``f_i`` its share of the top-k slots *by those scores*, as Megatron-core counts them,
    not by the expert bias and group limits that choose where tokens go."""
    probs = scores
    if score_func == "sigmoid":
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    fraction = expert_counts(chosen, num_experts).to(probs.dtype) / chosen.numel()
    return num_experts * torch.sum(fraction * probs.mean(dim=0))


class GroupedExperts(nn.Module):
    """``num_experts`` feed-forwards stored as stacked tensors, run as one grouped GEMM per projection."""

    def __init__(self, cfg: MoEConfig, dim: int, num_experts: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.activation = cfg.activation
        # experts may be split by expert parallelism: this module holds only its local ones
        self.num_experts = num_experts or cfg.num_experts
        inter = cfg.intermediate_size
        gated = cfg.activation != "relu2"
        self.gate_proj = nn.Parameter(torch.empty(self.num_experts, inter, dim)) if gated else None
        self.up_proj = nn.Parameter(torch.empty(self.num_experts, inter, dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, dim, inter))
        if cfg.expert_bias:
            self.gate_bias = nn.Parameter(torch.empty(self.num_experts, inter)) if gated else None
            self.up_bias = nn.Parameter(torch.empty(self.num_experts, inter))
            self.down_bias = nn.Parameter(torch.empty(self.num_experts, dim))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        # low-rank adapters (LoRA, ``lightning_moe.peft``): ``adapter(name, x, offsets)`` is added to the
        # output of projection ``name``
        self.register_module("adapter", None)

    def reset_parameters(self, init_std: float = 0.02) -> None:
        for param in (self.gate_proj, self.up_proj, self.down_proj):
            if param is not None:
                nn.init.normal_(param, std=init_std)
        for bias in (self.gate_bias, self.up_bias, self.down_bias):
            if bias is not None:
                nn.init.zeros_(bias)

    def _activate(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        """The activation, recomputed in backward from ``gate`` and ``up``: autograd would also keep its factors
        (``silu(gate)``) for each of the [tokens * top_k, intermediate] rows."""
        return checkpoint(self._activation, gate, up, use_reentrant=False)

    def _activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return F.silu(gate) * up
        if self.activation == "relu2":
            return torch.square(F.relu(up))
        # GPT-OSS: clamped gate and up, sigmoid-weighted gate, shifted up
        limit, alpha = self.cfg.swiglu_limit, self.cfg.swiglu_alpha
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    def project(self, name: str, inp: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                product: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``inp`` [N, in] sorted by expert through the stacked projection ``name`` ([E, out, in]) -> [N, out]
        (``product``: the weight's product, computed already)."""
        out = grouped_mm(inp, getattr(self, name).transpose(-2, -1), offsets) if product is None else product
        bias = getattr(self, name.replace("_proj", "_bias"))
        if bias is not None:
            out = out + torch.repeat_interleave(bias, counts, dim=0, output_size=inp.shape[0])
        if self.adapter is not None:
            out = out + self.adapter(name, inp, offsets)
        return out

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                copied_from: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x`` [N, dim] sorted by expert, ``counts`` [num_experts] rows per expert -> [N, dim]. ``copied_from``:
        ``(tokens, index)`` when ``x`` is ``tokens[index]``, which backward then copies again instead of keeping
        ``x`` (:class:`_ProjectCopies`)."""
        if self.cfg.backend == "loop":
            return self.forward_loop(x, counts)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        names = ["gate_proj", "up_proj"] if self.gate_proj is not None else ["up_proj"]
        products = [None] * len(names)
        weights = [getattr(self, n) for n in names]
        # adapters read the rows themselves; wrapper weights (torchao's MXFP8) bring their own grouped GEMM backward
        if (copied_from is not None and self.adapter is None
                and not any(is_traceable_wrapper_subclass(w) for w in weights)):
            products = _ProjectCopies.apply(x, *copied_from, offsets, *weights)
        first = [self.project(n, x, counts, offsets, product) for n, product in zip(names, products)]
        hidden = self._activate(first[0] if len(first) == 2 else None, first[-1])
        return self.project("down_proj", hidden, counts, offsets)

    def forward_loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Reference: one plain matmul per expert (kept for tests and for backends without grouped GEMM)."""
        outputs = []
        for e, rows in enumerate(torch.split(x, counts.tolist())):
            def linear(weight, bias, inp, e=e):
                return F.linear(inp, weight[e], None if bias is None else bias[e])

            gate = linear(self.gate_proj, self.gate_bias, rows) if self.gate_proj is not None else None
            hidden = self._activation(gate, linear(self.up_proj, self.up_bias, rows))
            outputs.append(linear(self.down_proj, self.down_bias, hidden))
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


class _CopyRows(torch.autograd.Function):
    """``x[token_index]``: each token's ``k`` copies in expert order. Backward sums each token's copies by a
    gather (``inverse``: the sorted position of every (token, slot)) in slot order, instead of autograd's
    accumulating scatter: deterministic, and it keeps only that index vector."""

    @staticmethod
    def forward(ctx, x, token_index, inverse, top_k):
        ctx.save_for_backward(inverse)
        ctx.top_k = top_k
        return x[token_index]

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _sum_copies(grad, inverse, ctx.top_k), None, None, None


class _SumCopies(torch.autograd.Function):
    """Each token's rows (in expert order) summed: the transpose of :class:`_CopyRows`. Keeps only the indices,
    where ``index_add_`` would keep its ``[tokens * k, dim]`` source."""

    @staticmethod
    def forward(ctx, rows, token_index, inverse, top_k):
        ctx.save_for_backward(token_index)
        return _sum_copies(rows, inverse, top_k)

    @staticmethod
    def backward(ctx, grad):
        (token_index,) = ctx.saved_tensors
        return grad[token_index], None, None, None


def _sum_copies(rows: torch.Tensor, inverse: torch.Tensor, top_k: int) -> torch.Tensor:
    """[tokens * top_k, dim] rows in expert order -> [tokens, dim], each token's ``top_k`` rows summed."""
    return rows[inverse].unflatten(0, (-1, top_k)).sum(1)


class _ProjectCopies(torch.autograd.Function):
    """The products of ``rows`` (``tokens[index]``, the tokens' copies in expert order) with the experts' first
    stacked weights ([E, out, in] each), without keeping ``rows`` for backward: backward copies them from the
    tokens again, one gather, where keeping them would hold [tokens * top_k, dim] per layer until then."""

    @staticmethod
    def forward(ctx, rows, tokens, index, offsets, *weights):
        ctx.save_for_backward(tokens, index, offsets, *weights)
        return tuple(grouped_mm(rows, weight.transpose(-2, -1), offsets) for weight in weights)

    @staticmethod
    def backward(ctx, *grads):
        tokens, index, offsets, *weights = ctx.saved_tensors
        rows = tokens[index]
        grad_rows = grouped_mm(grads[0], weights[0], offsets)
        for g, weight in zip(grads[1:], weights[1:]):  # in place: Python's sum would start with a copy, 0 + rows
            grad_rows += grouped_mm(g, weight, offsets)
        grad_weights = [grouped_mm(g.t(), rows, offsets) if needed else None
                        for g, needed in zip(grads, ctx.needs_input_grad[4:])]
        return grad_rows, None, None, None, *grad_weights


class TokenDispatcher:
    """Sorts token copies by expert and sums each token's weighted expert outputs back. Expert parallelism
    replaces this with an all-to-all dispatcher of the same interface (``parallel/expert.py``)."""

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int):
        flat = routing.experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = expert_counts(flat, num_experts)
        token_index = order // routing.experts.shape[1]
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        copies = (token_index, inverse, routing.experts.shape[1])
        return _CopyRows.apply(x, *copies), counts, (order, copies)

    def copied_from(self, state) -> torch.Tensor | None:
        """``index`` such that the rows :meth:`dispatch` returned are ``x[index]`` (None where they are not)."""
        return state[1][0]

    def end_step(self) -> None:
        """Called after every optimizer step (dispatchers that keep something per step drop it here)."""

    def combine(self, out: torch.Tensor, routing: Routing, state) -> torch.Tensor:
        """[tokens, dim]: each token's rows of ``out`` (in :meth:`dispatch`'s order), weighted and summed."""
        order, copies = state
        weights = routing.weights.flatten()[order].to(out.dtype)
        return _SumCopies.apply(out * weights[:, None], *copies)


class MoE(nn.Module):
    """Routed experts (+ optional shared experts and latent projection) with load-balancing bookkeeping."""

    def __init__(self, cfg: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, hidden_size)
        expert_dim = cfg.latent_size or hidden_size
        if cfg.latent_size:
            self.fc1_latent_proj = nn.Linear(hidden_size, cfg.latent_size, bias=cfg.shared_latent_bias)
            self.fc2_latent_proj = nn.Linear(cfg.latent_size, hidden_size, bias=cfg.shared_latent_bias)
        self.experts = GroupedExperts(cfg, expert_dim)
        self.shared_experts = (
            MLP(hidden_size, cfg.shared_size, "relu2" if cfg.activation == "relu2" else "swiglu", cfg.shared_latent_bias)
            if cfg.num_shared_experts
            else None
        )
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if cfg.shared_expert_gate else None
        self.dispatcher = TokenDispatcher()
        # tokens routed to each expert since the last bias update (aux-loss-free balancing)
        # integer counts: a module-wide cast to bf16 (precision="bf16-true") would round them above 256
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.num_experts, dtype=torch.long), persistent=False)
        self.aux_loss: torch.Tensor | None = None

    def reset_parameters(self, init_std: float = 0.02) -> None:
        self.router.reset_parameters(init_std)
        self.experts.reset_parameters(init_std)
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters(init_std)
        if self.shared_expert_gate is not None:
            nn.init.normal_(self.shared_expert_gate.weight, std=init_std)
        if self.cfg.latent_size:
            for linear in (self.fc1_latent_proj, self.fc2_latent_proj):
                nn.init.normal_(linear.weight, std=init_std)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
        nn.init.zeros_(self.tokens_per_expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = self.router(tokens)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += expert_counts(routing.experts, self.cfg.num_experts)
            if self.cfg.aux_loss_coeff > 0:
                self.aux_loss = self.cfg.aux_loss_coeff * load_balancing_loss(
                    routing.scores, self.cfg.num_experts, self.cfg.top_k, self.cfg.score_func
                )
        routed_in = self.fc1_latent_proj(tokens) if self.cfg.latent_size else tokens
        sorted_x, counts, state = self.dispatcher.dispatch(routed_in, routing, self.cfg.num_experts)
        index = self.dispatcher.copied_from(state)
        out = self.experts(sorted_x, counts, None if index is None else (routed_in, index))
        routed = self.dispatcher.combine(out, routing, state)
        if self.cfg.latent_size:
            routed = self.fc2_latent_proj(routed)
        out = routed.view(shape)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


@torch.no_grad()
def summed_expert_loads(counts: torch.Tensor, process_group=None) -> torch.Tensor:
    """``[layers, experts]`` token counts summed over ``process_group`` (default: all ranks, when distributed), so
    every rank applies the same bias update."""
    if process_group is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
        torch.distributed.all_reduce(counts, group=process_group)
    return counts


def bias_update(load: torch.Tensor, rate: float) -> torch.Tensor:
    """The aux-loss-free balancing step of one layer's expert biases: ``rate * sign(mean_load - load)``."""
    return rate * torch.sign(load.float().mean() - load)


def update_expert_bias(model: nn.Module, process_group=None) -> None:
    """After an optimizer step: ``bias += rate * sign(mean_load - load)`` for every aux-free MoE layer, from the
    token counts summed over ``process_group``."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.router.score_correction_bias is not None]
    if not layers:
        return
    counts = summed_expert_loads(torch.stack([m.tokens_per_expert for m in layers]), process_group)
    for layer, load in zip(layers, counts):
        rate = layer.cfg.bias_update_rate
        if rate > 0:
            # a layer that routed nothing keeps its bias: decided on the device, as a factor 0 or 1
            bias = layer.router.score_correction_bias
            bias += (bias_update(load, rate) * (load.sum() > 0)).to(bias.dtype)
        layer.tokens_per_expert.zero_()
