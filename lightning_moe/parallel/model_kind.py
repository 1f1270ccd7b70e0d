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


@dataclass(frozen=True)
class Refusal:
    """A setting, or two together, that a model kind does not run: ``settings`` are sizes (refused above 1) or
    ``compile`` (refused when on); ``reason`` completes "<model> runs through <kind>, ..."."""

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


def _active(setting: str, dims, options) -> bool:
    return options.compile if setting == "compile" else getattr(dims, setting) > 1


def _named(setting: str, dims) -> str:
    return "compile=True" if setting == "compile" else f"{setting}={getattr(dims, setting)}"


def _off(setting: str) -> str:
    return "compile=False" if setting == "compile" else f"{setting}=1"


def refuse_unsupported(kind: ModelKind, model_name: str, dims, options) -> None:
    """The first of ``kind``'s refusals that these sizes and options meet, as a one-line error."""
    for refusal in kind.refusals:
        if all(_active(setting, dims, options) for setting in refusal.settings):
            named = " with ".join(_named(setting, dims) for setting in refusal.settings)
            fixes = " or ".join(_off(setting) for setting in reversed(refusal.settings))
            raise ValueError(f"{named}: {model_name} runs through {kind.name}, {refusal.reason}; use {fixes}")


def not_supported_lines(kinds: list[ModelKind]) -> list[str]:
    """README's "Not supported" rows of every kind's refusals, one Markdown bullet each."""
    lines = []
    for kind in kinds:
        for refusal in kind.refusals:
            settings = " with ".join(f"`{s}`" if s == "compile" else f"`{s} > 1`" for s in refusal.settings)
            lines.append(f"- {kind.name}: {settings} ({refusal.reason})")
    return lines
