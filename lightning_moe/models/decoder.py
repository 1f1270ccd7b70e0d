"""The generic decoder: embeddings -> one pre-norm residual block per pattern symbol -> norm -> output layer.

Every family (Llama, Qwen, Mixtral, DeepSeek-V3, GPT-OSS, Nemotron-H, ...) is this module with a different
:class:`ModelConfig`; parallelism, precision converters and LoRA are applied from outside.

A pipeline stage is a pruned decoder (``parallel/pipeline.py``): its ``layers`` hold only its blocks, under their
numbers in the whole model, and the parts it lacks are None. The forward passes through them: without the
embedding the input is the hidden states of the stage before, without the final norm it returns its blocks' output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.models.blocks import BlockKind, pattern_kinds
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.layers.loss import OutputLayer
from lightning_moe.models.layers.moe import MoE
from lightning_moe.models.layers.mtp import MultiTokenPrediction
from lightning_moe.models.layers.norm import RMSNorm
from lightning_moe.models.layers.sequence import SequenceLayout, host_label_count
from lightning_moe.models.layers.te import use_te_modules
from lightning_moe.models.seeded_init import seeded_init


@dataclass
class LossOutput:
    """Sums, not means: the training module divides by the label tokens of the whole global batch."""

    loss_sum: torch.Tensor  # summed cross entropy of the main head (fp32)
    num_label_tokens: torch.Tensor  # tokens with a label in this micro-batch
    aux_loss: torch.Tensor | None = None  # MoE load-balancing losses, coefficients applied (a mean)
    mtp_loss_sums: list[torch.Tensor] = field(default_factory=list)  # per MTP depth, unscaled sums
    mtp_label_tokens: list[torch.Tensor] = field(default_factory=list)


class Block(nn.Module):
    """``x + op(norm(x))`` where op is attention, Mamba-2, Gated DeltaNet, KDA, MLP or MoE: ``kind`` is its record
    (``models/blocks.py``), whose attribute name the op takes."""

    def __init__(self, kind: BlockKind, cfg: ModelConfig, attention_index: int) -> None:
        super().__init__()
        self.kind, self.symbol = kind, kind.symbol
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_weight_fp32, cfg.norm_offset)
        self.op_name = self.kind.attribute
        self.add_module(self.op_name, self.kind.build(cfg, attention_index))
        self.mixes_sequence = self.kind.mixes_sequence

    @property
    def op(self) -> nn.Module:
        return getattr(self, self.op_name)

    def forward(self, x: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        h = self.norm(x)
        return x + (self.op(h, layout) if self.mixes_sequence else self.op(h))


def build_blocks(pattern: str, cfg: ModelConfig, first_attention_index: int = 0) -> nn.ModuleDict:
    """One block per symbol; attention blocks are numbered from ``first_attention_index`` (the MTP pattern's
    after the backbone's), which picks their window and settings."""
    return nn.ModuleDict({str(i): Block(kind, cfg, attention_index)
                          for i, (kind, attention_index) in enumerate(pattern_kinds(cfg, pattern, first_attention_index))})


class Decoder(nn.Module):
    """``forward(input_ids, position_ids=None)`` -> logits [batch, seq, vocab];
    ``forward(input_ids, position_ids, labels=labels)`` -> :class:`LossOutput` (fused, chunked output layer)."""

    # checkpoint tensors of the model that other pipeline ranks hold (a pipelined model's, parallel/pipeline_stages.py)
    held_elsewhere: frozenset[str] = frozenset()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = build_blocks(config.pattern, config)
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, config.norm_weight_fp32, config.norm_offset)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.output_layer = OutputLayer()
        self.mtp = None
        if config.mtp is not None and config.mtp.num_layers > 0:
            self.mtp = MultiTokenPrediction(config, build_blocks)
        if config.te_modules:
            use_te_modules(self)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialize every parameter (after meta-device construction and ``to_empty``). Each module draws from
        a generator seeded by ``(seed, its name)`` on whole tensors, so that any parallel layout, pipeline stages
        included, starts from the same weights (``seed`` defaults to a draw from the torch generator)."""
        std = self.config.init_std
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        for name, module in self.named_modules():
            if module is self:
                continue
            if isinstance(module, (nn.Embedding, nn.Linear)):
                # plain torch layers outside blocks (embedding, output layer) get the config's std; those inside
                # are initialized by the block that owns them
                if name.removesuffix(".base_layer") in ("embed", "lm_head"):
                    seeded_init(module, name, seed, lambda m: nn.init.normal_(m.weight, std=std))
            elif hasattr(module, "reset_parameters"):
                seeded_init(module, name, seed, lambda m: m.reset_parameters(std))

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def hidden_states(self, input_ids: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        """Output of the last block, before the final norm. Floating-point ``input_ids`` are hidden states
        already (a pipeline stage's input from the stage before)."""
        h = input_ids if input_ids.is_floating_point() else self.embed(input_ids)
        for block in self.layers.values():
            h = block(h, layout)
        return h

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        batch_layout: BatchLayout | None = None,
        *,
        layout: SequenceLayout | None = None,
        ahead: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | LossOutput:
        """``batch_layout``: the batch's layout on the host (this rank's share of it), which spares the forward
        its reads of the device (whether rows are packed, label counts). A pipeline stage passes the ``layout``
        it made from the token ids, and on the last stage the embeddings of the tokens ``ahead`` that the MTP
        depths read (received from the first stage, which holds the embedding)."""
        if layout is None:
            layout = SequenceLayout.from_inputs(input_ids, position_ids, batch_layout)
        hidden = self.hidden_states(input_ids, layout)
        if self.norm is None:  # a stage before the last: its MoE layers keep their losses for the stage to take
            return hidden
        final = self.norm(hidden)
        if labels is None:
            self._collect_aux_loss()  # a logits-only forward has no loss to add them to
            return self.output_layer.logits(final, self.output_weight)
        loss_sum, count = self.output_layer.loss(final, self.output_weight, labels, self.config.loss_chunk_size,
                                                 label_count=host_label_count(layout))
        out = LossOutput(loss_sum=loss_sum, num_label_tokens=count)
        if self.mtp is not None and self.config.mtp.enabled:
            out.mtp_loss_sums, out.mtp_label_tokens = self.mtp(final, input_ids, labels, layout, self, ahead)
        # after the MTP depths: their MoE layers' losses too, or they would linger into the next forward
        out.aux_loss = self._collect_aux_loss()
        return out

    def _collect_aux_loss(self) -> torch.Tensor | None:
        return collect_aux_loss(self.moe_layers())


def collect_aux_loss(moe_layers: list[MoE]) -> torch.Tensor | None:
    """The sum of the load-balancing losses the MoE layers' last forwards left (then cleared), or None."""
    losses = []
    for moe in moe_layers:
        if moe.aux_loss is not None:
            losses.append(moe.aux_loss)
            moe.aux_loss = None
    return torch.stack(losses).sum() if losses else None
