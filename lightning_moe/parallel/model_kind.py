"""The declared protocol of a parallelizable model kind, and the table of what each kind does not run.

``parallelize`` (``parallel/parallelize.py``) knows a model only through its kind: the native decoder
(``parallel/native.py``), a transformers model (``parallel/hf.py``) or a diffusers transformer
(``parallel/diffusion.py``). A kind checks a model against the sizes, applies model parallelism (tensor,
expert, context) to it, names the experts expert parallelism split (FSDP shards them on their own mesh), says
whether activation checkpointing wraps the tensor-parallel collectives, and finishes a model FSDP does not wrap.
Its ``refusals`` are the combinations it does not run: the errors are raised from them
(:func:`refuse_unsupported`), and README's "Not supported" is written from them (:func:`not_supported_lines`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import nn

from lightning_moe.parallel.dims import MESH_SIZE_NAMES


@dataclass(frozen=True)
class Refusal:
    """Settings, together, that a model kind does not run. Each is a size (refused above 1), ``compile`` (refused
    when on), ``fsdp`` (FSDP wraps the model: data parallelism, ``param_dtype`` or ``cpu_offload``), a flag of the
    model config (refused when on) or ``pp_schedule=a|b`` (refused at these schedules); ``reason`` completes
    "<model> runs through <kind>, ..."."""

    settings: tuple[str, ...]
    reason: str


class ModelKind(Protocol):
    name: str  # how errors and the README name the kind, e.g. "transformers (model.hf)"
    refusals: tuple[Refusal, ...]

    def check(self, model: nn.Module, dims, options) -> None:
        """Raise a one-line message for what ``model`` cannot run with these sizes and options."""

    def apply_model_parallel(self, model: nn.Module, dims, options) -> None:
        """Tensor (+sequence), expert and context parallelism, in that order, on the meta-device model."""

    def split_experts(self, unit: nn.Module) -> list[nn.Module]:
        """The experts modules of a block that expert parallelism split (FSDP shards them over ``expert_fsdp``)."""

    def checkpoint_outside(self, dims) -> bool:
        """Whether activation checkpointing wraps each block from outside its tensor-parallel hooks."""

    def without_fsdp(self, model: nn.Module, dims) -> None:
        """What a model needs when FSDP does not wrap it (summing partial gradients of replicated weights)."""


def _value(key: str, dims, options, config):
    if key == "fsdp":
        return options.fsdp_applies(dims)
    if key in ("compile", "pp_schedule"):
        return getattr(options, key)
    if key in MESH_SIZE_NAMES:
        return getattr(dims, key)
    return bool(getattr(config, key, False))  # a flag of the model config (none known: off)


def _active(setting: str, value) -> bool:
    _, _, refused = setting.partition("=")
    if refused:
        return value in refused.split("|")
    return value if isinstance(value, bool) else value > 1


def _named(setting: str, value) -> str:
    key, _, refused = setting.partition("=")
    return "FSDP" if key == "fsdp" else f"{key}={value!r}" if refused else f"{key}={value}"


def _off(setting: str, value) -> str:
    key, _, refused = setting.partition("=")
    if key == "fsdp":
        return "no FSDP (one data-parallel rank, no param_dtype or cpu_offload)"
    if refused:
        return f"a {key} other than {refused.replace('|', ', ')}"
    return f"{key}=False" if isinstance(value, bool) else f"{key}=1"


def _listed(setting: str) -> str:
    key, _, refused = setting.partition("=")
    if key == "fsdp":
        return "FSDP"
    if refused:
        return f"`{key}` {refused.replace('|', ' / ')}"
    return f"`{key} > 1`" if key in MESH_SIZE_NAMES else f"`{key}`"


def refuse_unsupported(kind: ModelKind, model_name: str, dims, options, config=None) -> None:
    """The first of ``kind``'s refusals that these sizes, options and model config meet, as a one-line error."""
    for refusal in kind.refusals:
        pairs = [(setting, _value(setting.partition("=")[0], dims, options, config)) for setting in refusal.settings]
        if all(_active(*pair) for pair in pairs):
            named = " with ".join(_named(*pair) for pair in pairs)
            fixes = " or ".join(_off(*pair) for pair in reversed(pairs))
            raise ValueError(f"{named}: {model_name} runs through {kind.name}, {refusal.reason}; use {fixes}")


def not_supported_lines(kinds: list[ModelKind]) -> list[str]:
    """README's "Not supported" rows of every kind's refusals, one Markdown bullet each."""
    lines = []
    for kind in kinds:
        for refusal in kind.refusals:
            settings = " with ".join(_listed(setting) for setting in refusal.settings)
            lines.append(f"- {kind.name}: {settings} ({refusal.reason})")
    return lines
