"""Multi-token prediction (DeepSeek-V3, Nemotron-H, Qwen3-Next): extra depths that each predict one token further ahead.

Depth ``d`` combines the previous depth's normalized hidden state at position ``t`` with the embedding of
token ``t + d``: ``h = eh_proj([enorm(embed(x[t+d])), hnorm(h_prev[t])])``, runs its own small block stack
(``MTPConfig.pattern``) and a final norm, and is scored by the shared output layer against the target of
``t + d`` (labels are pre-shifted, so that is ``labels[t + d]``). Targets that fall into the next packed
sequence, or past the end of the row, are masked.

With ``MTPConfig.shared`` one depth module holds the weights and runs at every depth (Megatron-Core's repeated
MTP layer): depth ``d`` feeds it depth ``d - 1``'s output, exactly as separate depths would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.layers.loss import IGNORE_INDEX
from lightning_moe.models.layers.norm import RMSNorm
from lightning_moe.models.layers.sequence import SequenceLayout, host_label_count

# the decoder's block factory (pattern, config, first attention index) -> ModuleDict, handed in so that the MTP
# depths run the decoder's own blocks without this file importing the decoder that imports it
BuildBlocks = Callable[[str, ModelConfig, int], nn.ModuleDict]


class MTPDepth(nn.Module):
    def __init__(self, config: ModelConfig, build_blocks: BuildBlocks) -> None:
        super().__init__()
        hidden = config.hidden_size
        # the decoder's norms (1 + weight under norm_offset: Qwen3-Next's MTP norms too)
        norm = (config.norm_eps, config.norm_weight_fp32, config.norm_offset)
        self.enorm = RMSNorm(hidden, *norm)
        self.hnorm = RMSNorm(hidden, *norm)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # their attention blocks are numbered after the backbone's (ModelConfig.attention_for)
        self.layers = build_blocks(config.mtp.pattern, config, config.pattern.count("*"))
        self.final_norm = RMSNorm(hidden, *norm)
        self._init_std = config.init_std

    def reset_parameters(self, init_std: float | None = None) -> None:
        nn.init.normal_(self.eh_proj.weight, std=init_std or self._init_std)

    def forward(self, embedded: torch.Tensor, previous: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        for block in self.layers.values():
            h = block(h, layout)
        return self.final_norm(h)


def shift_left(x: torch.Tensor, steps: int, fill: int) -> torch.Tensor:
    """``x[:, t + steps]`` at position ``t``; the last ``steps`` positions get ``fill``."""
    out = torch.full_like(x, fill)
    out[:, :-steps] = x[:, steps:]
    return out


def ids_ahead(ids: torch.Tensor, layout: SequenceLayout, depths: int) -> list[torch.Tensor]:
    """For ``d = 1 .. depths``: the token ``d`` places ahead of each of this rank's tokens (0 past the row's end).
    Under context parallelism they come from the whole row, gathered once, and this rank's positions are kept."""
    if not depths:
        return []
    row = layout.context_parallel
    full = ids if row is None else row.full_row(ids)
    ahead = [shift_left(full, d, 0) for d in range(1, depths + 1)]
    return ahead if row is None else [a[:, row.query_index] for a in ahead]


def take_aux_losses(module: nn.Module) -> list[torch.Tensor]:
    """The auxiliary losses the MoE layers inside ``module`` hold from their last call, cleared there."""
    losses = []
    for layer in module.modules():
        if getattr(layer, "aux_loss", None) is not None:
            losses.append(layer.aux_loss)
            layer.aux_loss = None
    return losses


class MultiTokenPrediction(nn.Module):
    def __init__(self, config: ModelConfig, build_blocks: BuildBlocks) -> None:
        super().__init__()
        self.config = config
        self.depths = nn.ModuleList(MTPDepth(config, build_blocks) for _ in range(config.mtp.stored_layers))

    def depth_modules(self) -> list[MTPDepth]:
        """The module each depth runs, depth 1 first: the one shared module at every depth under ``shared``."""
        if self.config.mtp.shared:
            return [self.depths[0]] * self.config.mtp.num_layers
        return list(self.depths)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, layout: SequenceLayout,
                decoder: nn.Module, ahead: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``hidden``: the main model's final normalized hidden states. Returns per-depth loss sums and counts.
        ``ahead``: the embeddings of the tokens ahead, one per depth, where they come embedded (a pipeline's last
        stage); else the decoder embeds them from ``input_ids``, each as its depth runs.

        Under context parallelism (``layout.context_parallel``) this rank holds some chunks of each row: the
        tokens and targets ahead are taken from the whole row, then this rank's positions kept."""
        row = layout.context_parallel
        local = None
        depths = self.depth_modules()
        if ahead is None:
            ahead = (decoder.embed(ids) for ids in ids_ahead(input_ids, layout, len(depths)))
        if row is not None:
            labels, local = row.full_row(labels), row.query_index
        docs = (row.full_layout if row is not None else layout).document_ids
        loss_sums, counts, aux_losses = [], [], []
        previous = hidden
        for d, (depth, embedded) in enumerate(zip(depths, ahead), start=1):
            target = shift_left(labels, d, IGNORE_INDEX)
            same_sequence = shift_left(docs, d, -1) == docs
            target = target.masked_fill(~same_sequence, IGNORE_INDEX)
            if local is not None:
                target = target[:, local]
            previous = depth(embedded, previous, layout)
            if self.config.mtp.shared:  # the next depth's call replaces them: keep each depth's
                aux_losses += take_aux_losses(depth)
            loss_sum, count = decoder.output_layer.loss(
                previous, decoder.output_weight, target, self.config.loss_chunk_size,
                label_count=host_label_count(layout, d),
            )
            loss_sums.append(loss_sum)
            counts.append(count)
        if aux_losses:  # handed back for the decoder to collect with the other MoE layers'
            next(m for m in depths[0].modules() if hasattr(m, "aux_loss")).aux_loss = torch.stack(aux_losses).sum()
        return loss_sums, counts
