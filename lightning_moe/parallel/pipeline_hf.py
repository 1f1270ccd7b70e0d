"""Pipeline stages of a transformers model on the generic path (``models/hf.py``'s ``HFModel``).

The model's repeated decoder layers (``model.model.layers``) are split into stages like the native decoder's
blocks (``parallel/pipeline.py``: an explicit ``pp_layout`` or a split balanced by parameters); the input
embedding sits on the first stage, the final norm and the output layer with the fused loss on the last.

Each stage runs the transformers model's own forward over the model pruned to the stage's layers (a copy of
the model and its base model holding the model's own modules; the layers under their own numbers, so every name
is the whole model's). Positions, the rotary embedding and the attention masks (causal, sliding, packed rows)
are computed by that forward on every stage from the token ids and positions each stage reads from the batch;
past the first stage the pruned model's embedding returns zeros and the hidden states received from the previous
stage replace the first layer's input, so whatever the forward does between the embedding and the layers
(scaling, rotary, masks) is computed on every stage and only the activations travel. Stages that are not the
last end at their last layer (no norm).

Refused before anything is built: tied input and output embeddings, a router load-balancing loss computed by
the model's head over all layers at once (``output_router_logits``; it does not split into per-stage sums),
parameters outside the embedding, layers, final norm and output layer, and models without ``model.layers``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_moe.models.hf import HFModel
from lightning_moe.parallel.pipeline import StageSpec, balanced_split, metadata_pass_inputs, parse_layout


def decoder_parts(hf_model: nn.Module) -> nn.Module:
    """The base model (``model.model``) holding ``embed_tokens``, ``layers`` and ``norm``, or a clear error."""
    name = type(hf_model).__name__
    base = getattr(hf_model, "model", None)
    if not isinstance(base, nn.Module) or not all(isinstance(getattr(base, part, None), nn.Module)
                                                  for part in ("embed_tokens", "layers", "norm")):
        raise ValueError(f"pp > 1: {name} has no model.embed_tokens / model.layers / model.norm to split into "
                         f"pipeline stages (vision-language and other layouts are not split); use pp=1")
    return base


def check_hf_pipeline(model: HFModel) -> None:
    """What the generic path's pipeline does not split, refused on the meta-device model."""
    hf, name = model.hf, type(model.hf).__name__
    base = decoder_parts(hf)
    text = hf.config.get_text_config()
    if getattr(text, "tie_word_embeddings", False) or getattr(hf.config, "tie_word_embeddings", False):
        raise ValueError(f"pp > 1: {name} ties its output layer to the input embedding (tie_word_embeddings), "
                         f"which pipelines on the generic path do not split yet; use pp=1")
    if getattr(text, "output_router_logits", False):
        raise ValueError(f"pp > 1: {name} computes its router load-balancing loss over all layers' router logits at "
                         f"once (output_router_logits=True), which does not split into pipeline stages; set "
                         f"output_router_logits=false in the model config or use pp=1")
    if not isinstance(getattr(hf, "lm_head", None), nn.Linear) or not model.fused_loss:
        raise ValueError(f"pp > 1: {name}'s output layer is not a plain linear lm_head; use pp=1")
    held = {f"model.{part}." for part in ("embed_tokens", "layers", "norm")} | {"lm_head."}
    others = [n for n, _ in hf.named_parameters() if not any(n.startswith(p) for p in held)]
    if others:
        raise ValueError(f"pp > 1: {name} has parameters outside the embedding, layers, final norm and output layer "
                         f"({', '.join(others[:3])}), which no pipeline stage would hold; use pp=1")
    if len(base.layers) == 0:
        raise ValueError(f"pp > 1: {name} has no decoder layers")


def split_hf(model: HFModel, num_stages: int, layout: str | list[str] | None = None) -> list[StageSpec]:
    """The stages of ``model``'s decoder layers: from ``layout`` when given (``parse_layout``'s syntax, without
    MTP), else balanced by parameter count (a dense layer's training FLOPs per token are six times its
    parameters; the output layer's too), the embedding counted on the first stage at half its weight (it holds
    memory but computes no GEMM)."""
    base = decoder_parts(model.hf)
    num_layers = len(base.layers)
    if layout is not None:
        return parse_layout(layout, num_layers, num_stages, has_mtp=False)
    if num_layers < num_stages:
        raise ValueError(f"pp*vp = {num_stages} virtual stages but {type(model.hf).__name__} has {num_layers} "
                         f"decoder layers; use pp*vp <= {num_layers}, or a pp_layout with stages that hold only the "
                         f"embedding or the output")

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    costs = [float(count(layer)) for layer in base.layers]
    output = float(count(base.norm) + count(model.hf.lm_head))
    groups = balanced_split(costs, 0.5 * count(base.embed_tokens), output, num_stages)
    return [StageSpec(s, [str(i) for i in group], s == 0, s == num_stages - 1) for s, group in enumerate(groups)]


class _ReceivedHidden(nn.Module):
    """The embedding of a stage past the first: zeros shaped like the received hidden states (which then replace
    the first layer's input), so the model's forward computes its positions, rotary embedding and masks."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(self.hidden)


def _layers(base: nn.Module, names: list[str]) -> nn.ModuleList:
    """The layers named ``names`` under their own numbers (``layers.5`` stays ``layers.5``)."""
    layers = nn.ModuleList()
    for name in names:
        layers._modules[name] = base.layers[int(name)]
    return layers


def _text_config_for(config, names: list[str]):
    """The config the base model's forward reads: per-layer lists (``layer_types``, which some models index by the
    position in ``layers``) and the layer count restricted to the stage's layers."""
    stage = copy.copy(config)
    if getattr(config, "layer_types", None) is not None:
        stage.layer_types = [config.layer_types[int(n)] for n in names]
    stage.num_hidden_layers = len(names)
    return stage


def hf_view(hf_model: nn.Module, layers: list[str], embedding: bool, output: bool) -> nn.Module:
    """The transformers model pruned to ``layers`` (and the embedding / final norm + output layer when asked):
    a copy of the model and its base model, the two modules whose children differ, holding the model's own
    modules, parameters, buffers and configs. What it lacks passes through its forward: the embedding becomes
    the received hidden states' placeholder, the final norm an identity, the output layer None."""
    base = decoder_parts(hf_model)
    own = [*hf_model.modules(), *hf_model.parameters(), *hf_model.buffers(), hf_model.config, base.config]
    memo = {id(x): x for x in own if x is not hf_model and x is not base}
    view = copy.deepcopy(hf_model, memo)
    view.model.layers = _layers(base, layers)
    if not embedding:
        view.model.embed_tokens = _ReceivedHidden()
    if not output:
        view.model.norm, view.lm_head = nn.Identity(), None
    view.model.config = _text_config_for(base.config, layers)
    return view


class _HFPart(HFModel):
    """An ``HFModel`` over :func:`hf_view`. Whether packed rows can be trained on is the whole model's verdict,
    over all its layers."""

    def __init__(self, whole: HFModel, layers: list[str], embedding: bool, output: bool) -> None:
        super().__init__(hf_view(whole.hf, layers, embedding, output), whole.loss_chunk_size)
        self.packing_limitation, self.packed_masks = whole.packing_limitation, whole.packed_masks


class HFStage(_HFPart):
    """One virtual stage of a transformers model, an ``HFModel`` over the stage's part (so that ``parallelize``
    parallelizes it like a model: EP, AC, compile, FSDP with the stage as root).

    ``forward(*inputs, token_ids, labels, position_ids=None)``, as the native ``StageModule``: the token ids
    on the first stage, else the previous stage's hidden states; returns ``(hidden,)``, or on the last stage
    the micro-batch's loss sum. Each forward appends its loss sums to :attr:`sums` (detached)."""

    def __init__(self, whole: HFModel, spec: StageSpec) -> None:
        super().__init__(whole, spec.blocks, spec.embedding, spec.output)
        self.hf.is_pipeline_stage = True  # the generic path's checks read it (e.g. a stage without experts)
        self.spec = spec
        self.sums: list[dict[str, torch.Tensor]] = []
        self.metadata_pass_pending = False  # torch's shape-inference forward leaves no loss sums

    def moe_layers(self) -> list[nn.Module]:
        return []

    def forward(self, *inputs: torch.Tensor, token_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None):
        pending, self.metadata_pass_pending = self.metadata_pass_pending, False
        if pending:
            inputs = metadata_pass_inputs(inputs, self.spec.embedding)
        try:
            return self._forward(*inputs, token_ids=token_ids, labels=labels, position_ids=position_ids)
        finally:
            if pending:
                self.sums.clear()

    def _forward(self, *inputs, token_ids, labels, position_ids):
        base = self.hf.model
        handle = None
        if not self.spec.embedding:
            (hidden,) = inputs
            base.embed_tokens.hidden = hidden
            # ahead of other pre-hooks: activation checkpointing's keeps the inputs it recomputes from
            handle = next(iter(base.layers)).register_forward_pre_hook(_replace_input(hidden), with_kwargs=True,
                                                                        prepend=True)
        try:
            if not self.spec.output:
                out = base(input_ids=token_ids, position_ids=position_ids, use_cache=False)
                self.sums.append({})
                return (out.last_hidden_state,)
            out = super().forward(token_ids, position_ids, labels=labels)
        finally:
            if handle is not None:
                handle.remove()
                base.embed_tokens.hidden = None
        self.sums.append({"loss_sum": out.loss_sum.detach(), "label_tokens": out.num_label_tokens.detach()})
        return out.loss_sum


def _replace_input(hidden: torch.Tensor):
    def replace(module, args, kwargs):
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return replace


class PipelinedHFModel(_HFPart):
    """The parts of a transformers model this rank's stages hold, under the whole model's names: what the
    optimizer, checkpoints and export see. Training and evaluation run through :attr:`stages`."""

    def __init__(self, whole: HFModel, specs: list[StageSpec], local: list[int]) -> None:
        mine = [specs[i] for i in local]
        first, last = any(s.embedding for s in mine), any(s.output for s in mine)
        super().__init__(whole, [name for spec in mine for name in spec.blocks], first, last)
        if not first:  # no placeholder among this rank's parameters' owners
            self.hf.model.embed_tokens = None
        if not last:
            self.hf.model.norm = None
        # a plain list: the stages share these modules, registering them twice would repeat every name
        self.stages = [HFStage(whole, specs[i]) for i in local]

    def sum_names(self, training: bool = True) -> list[str]:
        return ["loss_sum", "label_tokens"]

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipelined model runs through its pipeline schedule (lightning_moe.parallel.pipeline_hf)")
