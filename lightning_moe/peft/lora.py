"""LoRA on the native decoder: peft adapters on linear layers, grouped-GEMM adapters on stacked experts.

Applied on the meta-device model before parallelism; afterwards only adapter parameters (names containing
``.lora_``) are trainable. peft moves a wrapped layer's own weights under ``base_layer``
(``layers.0.attn.q_proj.base_layer.weight``); checkpoint loading maps the plain names onto them.

Target patterns (``target_modules``, ``exclude_modules``) name modules of the native model:

* ``all-linear``: every linear layer except the output layer;
* a pattern with ``*``, ``?`` or ``[``: a glob over the full name (``layers.*.attn.q_proj``);
* otherwise a name suffix at a dot boundary (``q_proj``, ``attn.o_proj``, ``layers.3.mlp.up_proj``).

Modules under ``mtp.`` take part only with ``include_mtp``; stacked experts only with ``target_experts``
(exclusions apply to them too).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_moe.models.layers.moe import GroupedExperts
from lightning_moe.models.lora_init import reset_lora_parameters  # noqa: F401  (part of this module's API)
from lightning_moe.peft.experts import ExpertLora

# peft (with transformers) is imported inside the functions that use it: it takes seconds to import
ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"
OUTPUT_LAYER = "lm_head"


@dataclass
class LoraConfig:
    """LoRA adapters (scaling ``alpha / r``; B starts at zero so training starts from the base model).

    Args:
        r: adapter rank.
        alpha: scaling numerator.
        dropout: dropout on the adapters' input.
        target_modules: linear layers to adapt (see the module docstring for the pattern forms).
        exclude_modules: layers (or experts) to leave out, same pattern forms.
        target_experts: adapt the stacked MoE experts (one adapter per expert).
        include_mtp: let the multi-token-prediction layers (``mtp.*``) be adapted too.
        base_dtype: store the frozen base weights in this dtype (e.g. ``bfloat16``); adapters keep the run's.
        adapter_path: start from this Hugging Face PEFT adapter directory (same targets, ``r`` and ``alpha``).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    exclude_modules: list[str] = field(default_factory=list)
    target_experts: bool = False
    include_mtp: bool = False
    base_dtype: str | None = None
    adapter_path: str | None = None

    def convert(self, model: nn.Module) -> LoraTargets:
        """The converter step (``models.converters``): adapters on the meta-device model, everything else frozen."""
        return apply_lora(model, self)

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"peft.r must be a positive integer, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"peft.dropout must be in [0, 1), got {self.dropout}")
        if self.base_dtype is not None and not isinstance(getattr(torch, self.base_dtype, None), torch.dtype):
            raise ValueError(f"peft.base_dtype {self.base_dtype!r} is not a torch dtype (e.g. bfloat16, float32)")


def is_adapter_parameter(name: str) -> bool:
    return ".lora_" in name


def keep_checkpoints_adapter_only(module: nn.Module) -> None:
    """``module``'s state dict leaves out its frozen parameters, so a LoRA run's checkpoints (plain or
    distributed, which load exactly the keys the state dict has) hold adapters and buffers only; loading one
    does not ask for the frozen weights but stays strict about everything else."""
    module.register_state_dict_post_hook(_drop_frozen)
    module.register_load_state_dict_post_hook(_forgive_missing_frozen)


def _frozen(module: nn.Module) -> set[str]:
    # every name of a shared parameter (a tied output layer is the embedding under a second name)
    return {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}


def _drop_frozen(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in _frozen(module):
        state_dict.pop(prefix + name, None)


def _forgive_missing_frozen(module: nn.Module, incompatible_keys) -> None:
    frozen = _frozen(module)
    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in frozen]


def matches(name: str, pattern: str) -> bool:
    if pattern == ALL_LINEAR:
        return True
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith(f".{pattern}")


@dataclass
class LoraTargets:
    linears: list[str]
    experts: list[str]


def _eligible(model: nn.Module, include_mtp: bool) -> tuple[list[str], list[str], list[str]]:
    """(linears, experts, MTP modules left out): native names of the modules LoRA may adapt."""
    linears, experts, mtp = [], [], []
    for name, module in model.named_modules():
        kind = (linears if isinstance(module, nn.Linear) else experts if isinstance(module, GroupedExperts) else None)
        if kind is None or name == OUTPUT_LAYER or ".lora_" in name or ".base_layer" in name:
            continue
        if name.startswith("mtp.") and not include_mtp:
            mtp.append(name)
            continue
        kind.append(name)
    return linears, experts, mtp


def select_targets(model: nn.Module, cfg: LoraConfig) -> LoraTargets:
    """The module names ``cfg`` selects, with a clear error for every pattern that selects nothing."""
    linears, experts, mtp = _eligible(model, cfg.include_mtp)
    chosen: set[str] = set()
    for pattern in cfg.target_modules:
        hits = [n for n in linears if matches(n, pattern)]
        if not hits:
            hint = ""
            if any(matches(n, pattern) for n in experts):
                hint = "; stacked experts are adapted with target_experts: true"
            elif any(matches(n, pattern) for n in mtp):
                hint = "; it matches mtp.* layers: set include_mtp: true"
            raise ValueError(
                f"peft.target_modules pattern {pattern!r} matches no linear layer{hint} "
                f"(linear layers: {_examples(linears)})"
            )
        chosen.update(hits)
    chosen_experts = list(experts) if cfg.target_experts else []
    if cfg.target_experts and not experts:
        raise ValueError("peft.target_experts is true but the model has no MoE experts"
                         + (" outside mtp.* (set include_mtp: true)" if any("experts" in n for n in mtp) else ""))
    for pattern in cfg.exclude_modules:
        if not any(matches(n, pattern) for n in linears + experts):
            raise ValueError(
                f"peft.exclude_modules pattern {pattern!r} matches no linear layer or experts "
                f"(names: {_examples(linears + experts)})"
            )
        chosen = {n for n in chosen if not matches(n, pattern)}
        chosen_experts = [n for n in chosen_experts if not matches(n, pattern)]
    if not chosen and not chosen_experts:
        raise ValueError("peft: exclude_modules removes every target; nothing would be trained")
    for name in chosen_experts:
        backend = model.get_submodule(name).cfg.backend
        if backend != "grouped_mm":
            raise ValueError(f"peft.target_experts: {name} uses moe.backend={backend!r}; "
                             f"expert adapters need backend 'grouped_mm'")
    return LoraTargets([n for n in linears if n in chosen], chosen_experts)


def _examples(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "none"


def apply_lora(model: nn.Module, cfg: LoraConfig) -> LoraTargets:
    """Add adapters to ``model`` in place (meta device is fine) and freeze everything else."""
    if getattr(getattr(model, "config", None), "te_modules", False):
        # peft's LoRA layer wraps torch.nn.Linear; TE's Linear is not one, so the dense projections would be left
        # without adapters (and all-linear would quietly mean fewer layers)
        raise ValueError("peft with model.te_modules: true: LoRA adapts torch.nn.Linear layers, and Transformer "
                         "Engine's are not; use te_modules: false for LoRA")
    targets = select_targets(model, cfg)
    if targets.linears:
        import peft
        from peft.tuners.lora import Linear as LoraLinear

        # peft's LoRA layer on exactly the selected linears. (peft's own name matching would, on transformers 5
        # MoE models, turn gate/up/down targets into expert targets and drop exclusions.)
        config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout)
        for name in targets.linears:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = LoraLinear(getattr(parent, leaf), ADAPTER_NAME, config=config, r=cfg.r, lora_alpha=cfg.alpha)
            setattr(parent, leaf, layer)
    for name in targets.experts:
        experts = model.get_submodule(name)
        experts.adapter = ExpertLora(experts, cfg.r, cfg.alpha, cfg.dropout)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))
    if cfg.base_dtype is not None:
        _cast_frozen(model, getattr(torch, cfg.base_dtype))
    return targets


def _cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        for leaf, param in module._parameters.items():
            if param is not None and not param.requires_grad and param.is_floating_point():
                module._parameters[leaf] = nn.Parameter(param.detach().to(dtype), requires_grad=False)


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Native module name -> its adapter owner: peft's LoRA layer, or the experts module holding an ExpertLora."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            found[name] = module
        elif isinstance(module, GroupedExperts) and isinstance(module.adapter, ExpertLora):
            found[name] = module
    return found
