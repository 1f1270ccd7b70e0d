"""FP8 and MXFP8 training with torchao, applied to the meta-device model before parallelism.

Recipes (``Float8Config.recipe``):

* ``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``: torchao's ``Float8Linear`` (dynamic current scaling) on
  linear layers. Expert GEMMs stay in high precision: torchao's FP8 grouped GEMM has no CPU path.
* ``mxfp8``: block scaling (32 elements per E8M0 scale, e4m3 values) in forward and backward, for linear
  layers (torchao's ``MXFP8Linear``, tokens zero-padded to whole 32-row blocks, which its weight gradient
  scales along) and for the grouped expert GEMMs (expert weights wrapped in torchao's
  ``MXFP8TrainingWeightWrapperTensor``, which routes ``torch._grouped_mm`` to torchao's MXFP8 grouped GEMM, with
  each expert's tokens padded likewise; its output is bf16). Experts on the ``loop`` MoE backend run no grouped GEMM
  and stay in high precision.

``emulate="auto"`` uses the hardware kernels on GPUs that have them (FP8: compute capability 8.9+, MXFP8: 10.0+)
and torchao's emulation (quantize, dequantize, high-precision GEMM) elsewhere, so CPU runs train with the same
recipes. The output layer is never converted; layers with a side below ``min_dim`` or not a multiple of the
format's granularity (16 for FP8, 32 for MXFP8) are skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.models.layers.moe import GroupedExperts

log = logging.getLogger(__name__)

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MXFP8_RECIPES = ("mxfp8",)
RECIPES = FLOAT8_RECIPES + MXFP8_RECIPES
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MX_BLOCK = 32  # elements per E8M0 scale
OUTPUT_LAYER = "lm_head"


@dataclass
class Float8Config:
    """Low-precision training of linear layers (and, for MXFP8, of the grouped expert GEMMs).

    Args:
        recipe: tensorwise | rowwise | rowwise_with_gw_hp | mxfp8.
        filter_fqns: layers whose name contains one of these strings stay in high precision (e.g. ``"experts"``,
            ``"mtp"``); each must match at least one layer.
        emulate: ``"auto"`` (hardware kernels where available, emulation elsewhere), True or False.
        min_dim: layers whose smaller side is below this stay in high precision (the casts cost more than the
            low-precision GEMM saves).
        fsdp_float8_all_gather: FSDP2 all-gathers FP8 weights instead of bf16 ones (``tensorwise`` only). The
            weights' scales for the next all-gather are then computed right after each optimizer step, all in one
            all-reduce, instead of one all-reduce per weight inside every all-gather.
    """

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] = "tensorwise"
    filter_fqns: list[str] = field(default_factory=list)
    emulate: Literal["auto"] | bool = "auto"
    min_dim: int = 512
    fsdp_float8_all_gather: bool = False

    def convert(self, model: nn.Module) -> Float8Report:
        """The converter step (``models.converters``): FP8 / MXFP8 training layers in place."""
        return apply_float8(model, self)

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"fp8.recipe {self.recipe!r} is unknown; recipes: {', '.join(RECIPES)}")
        if self.emulate not in ("auto", True, False):
            raise ValueError(f"fp8.emulate {self.emulate!r} must be 'auto', true or false")
        if self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"fp8.fsdp_float8_all_gather needs recipe 'tensorwise' (torchao gathers only tensorwise-scaled "
                f"weights), got {self.recipe!r}"
            )

    @property
    def is_mx(self) -> bool:
        return self.recipe in MXFP8_RECIPES

    @property
    def granularity(self) -> int:
        """Every GEMM dimension of a converted layer must be a multiple of this."""
        return MX_BLOCK if self.is_mx else 16


@dataclass
class Float8Report:
    """What :func:`apply_float8` did: converted layer names, and skipped ones with the reason."""

    recipe: str
    emulated: bool
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        mode = "emulated" if self.emulated else "hardware"
        return (f"fp8 {self.recipe} ({mode}): {len(self.converted)} layer(s) converted, "
                f"{len(self.skipped)} kept in high precision")


def hardware_supports(recipe: str) -> bool:
    """Whether this machine's GPU runs ``recipe`` natively (FP8: sm89+, MXFP8: sm100+)."""
    if not torch.cuda.is_available():
        return False
    needed = (10, 0) if recipe in MXFP8_RECIPES else (8, 9)
    return torch.cuda.get_device_capability() >= needed


def resolve_emulate(cfg: Float8Config) -> bool:
    if cfg.emulate == "auto":
        return not hardware_supports(cfg.recipe)
    if not cfg.emulate and not hardware_supports(cfg.recipe):
        need = "10.0 (Blackwell)" if cfg.is_mx else "8.9 (Ada/Hopper)"
        raise ValueError(
            f"fp8.emulate=false with recipe {cfg.recipe!r} needs a GPU of compute capability {need} or newer; "
            f"this machine has none: use emulate: auto"
        )
    return bool(cfg.emulate)


def _skip_reason(name: str, dims: tuple[int, ...], cfg: Float8Config) -> str | None:
    if ".lora_" in name:
        return "LoRA adapter (apply FP8 before LoRA)"
    if name == OUTPUT_LAYER or name.endswith(f".{OUTPUT_LAYER}"):
        return "output layer"
    hit = next((f for f in cfg.filter_fqns if f in name), None)
    if hit is not None:
        return f"filter_fqns {hit!r}"
    if min(dims) < cfg.min_dim:
        return f"smallest dim {min(dims)} < min_dim {cfg.min_dim}"
    if any(d % cfg.granularity for d in dims):
        return f"dims {dims} not multiples of {cfg.granularity}"
    return None


def _candidates(model: nn.Module) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """Linear layers and grouped experts with their GEMM dimensions."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found.append((name, module, (module.in_features, module.out_features)))
        elif isinstance(module, GroupedExperts):
            found.append((name, module, tuple(module.down_proj.shape[1:])))
    return found


def apply_float8(model: nn.Module, cfg: Float8Config) -> Float8Report:
    """Convert ``model`` in place (it may still be on the meta device) and report what was converted."""
    emulate = resolve_emulate(cfg)
    report = Float8Report(cfg.recipe, emulate)
    candidates = _candidates(model)
    unmatched = [f for f in cfg.filter_fqns if not any(f in name for name, _, _ in candidates)]
    if unmatched:
        examples = ", ".join(name for name, _, _ in candidates[:4])
        raise ValueError(f"fp8.filter_fqns {unmatched} match no linear layer or experts (names look like {examples})")
    selected = []
    for name, module, dims in candidates:
        if isinstance(module, GroupedExperts) and not cfg.is_mx:
            report.skipped[name] = f"grouped experts: recipe {cfg.recipe!r} converts linear layers only"
            continue
        if isinstance(module, GroupedExperts) and module.cfg.backend != "grouped_mm":
            # the MXFP8 weight wrapper only changes torch._grouped_mm; per-expert matmuls would run unquantized
            report.skipped[name] = f"grouped experts: moe.backend {module.cfg.backend!r} runs no grouped GEMM"
            continue
        reason = _skip_reason(name, dims, cfg)
        if reason is not None:
            report.skipped[name] = reason
        else:
            selected.append((name, module))
    if not selected:
        reasons = "; ".join(f"{n}: {r}" for n, r in list(report.skipped.items())[:4])
        raise ValueError(f"fp8: no layer qualifies for recipe {cfg.recipe!r} ({reasons}); lower fp8.min_dim?")
    convert = _mx_converter(cfg, emulate) if cfg.is_mx else _float8_converter(cfg, emulate)
    for name, module in selected:
        convert(model, name, module)
        report.converted.append(name)
    log.info(report.summary())
    return report


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def _float8_converter(cfg: Float8Config, emulate: bool):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(cfg.recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=cfg.fsdp_float8_all_gather,
    )

    def convert(model: nn.Module, name: str, linear: nn.Linear) -> None:
        _replace(model, name, Float8Linear.from_float(linear, config=config))

    return convert


@functools.cache
def token_padded_mxfp8_linear() -> type[nn.Linear]:
    """torchao's ``MXFP8Linear`` for any number of tokens (it needs a multiple of the 32-row scaling block)."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    class TokenPaddedMXFP8Linear(MXFP8Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]
            pad = -rows % MX_BLOCK
            if not pad:
                return super().forward(x)
            # zero rows change no block's scale and no gradient
            padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad))
            return super().forward(padded)[:rows].reshape(*x.shape[:-1], -1)

    return TokenPaddedMXFP8Linear


def _mx_converter(cfg: Float8Config, emulate: bool):
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    # sharded (DTensor) expert weights reach distributed checkpoints still wrapped: let weights-only loading
    # rebuild them
    torch.serialization.add_safe_globals(
        [MXFP8TrainingWeightWrapperTensor, MXFP8TrainingOpConfig, KernelPreference, ScaleCalculationMode]
    )
    kernels = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
    grouped = MXFP8TrainingOpConfig(
        kernel_preference=kernels,
        scale_calculation_mode=ScaleCalculationMode.RCEIL,
        # our dispatcher does not align expert groups to the 32-row scaling blocks: torchao pads them
        pad_token_groups_for_grouped_mm=True,
    )

    def convert(model: nn.Module, name: str, module: nn.Module) -> None:
        if isinstance(module, GroupedExperts):
            for proj in EXPERT_PROJECTIONS:
                param = getattr(module, proj)
                if param is not None:
                    wrapped = MXFP8TrainingWeightWrapperTensor(param.data, grouped)
                    setattr(module, proj, nn.Parameter(wrapped, requires_grad=param.requires_grad))
            # checkpoints and exports hold plain tensors; loading copies back into the wrappers
            module.register_state_dict_post_hook(_unwrap_expert_weights)
            return
        weight = module.weight
        mx = token_padded_mxfp8_linear()(
            module.in_features, module.out_features, bias=module.bias is not None, device=weight.device,
            dtype=weight.dtype, kernel_preference=kernels, scale_calculation_mode=ScaleCalculationMode.RCEIL,
        )
        mx.weight, mx.bias = module.weight, module.bias
        _replace(model, name, mx)

    return convert


def _unwrap_expert_weights(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for proj in EXPERT_PROJECTIONS:
        key = prefix + proj
        tensor = state_dict.get(key)
        inner = getattr(tensor, "_data", None)
        if inner is not None:
            state_dict[key] = inner


def precompute_fsdp_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the scales of the FP8 weights FSDP2 gathers, from one all-reduce of their amaxes
    (a no-op for weights that are not FSDP-sharded)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
