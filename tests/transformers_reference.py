"""The native model against transformers' on the same weights: logits (plain rows, and packed rows against each
sequence alone) and a training step's loss and gradients, each checked against transformers run in true float64
(tests/closeness.py): the native model in float64 within float64 rounding, and as loaded (fp32) within fp32
rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from closeness import assert_matches_float64_reference


def assert_logits_match(native, hf, ids: torch.Tensor) -> float:
    with torch.no_grad():
        assert hf(ids).logits.abs().max() > 1.0  # not a degenerate comparison
        return assert_matches_float64_reference(native, hf, lambda m: m(ids), lambda m: m(ids).logits, what="logits")


def assert_packed_logits_match(native, hf, seqs: list[torch.Tensor]) -> float:
    """``seqs`` packed in one row (positions restarting per sequence) against each run alone by transformers."""
    packed = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        return assert_matches_float64_reference(
            native, hf, lambda m: m(packed, position_ids=positions)[0],
            lambda m: torch.cat([m(s[None]).logits[0] for s in seqs]), what="packed logits")


def assert_step_gradients_match(native, hf, ids: torch.Tensor, pairs: dict[str, str]) -> float:
    """The summed next-token loss of ``ids`` and the gradients of ``pairs`` (native name -> transformers name;
    compared flattened, as some families store a tensor in another shape)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)

    def native_step(model):
        loss = model.train()(ids, labels=labels).loss_sum
        loss.backward()
        grads = dict(model.named_parameters())
        return {"loss": loss.detach(), **{ours: grads[ours].grad.flatten() for ours in pairs}}

    def transformers_step(model):
        logits = model.train()(ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        loss.backward()
        grads = dict(model.named_parameters())
        return {"loss": loss.detach(), **{ours: grads[theirs].grad.flatten() for ours, theirs in pairs.items()}}

    return assert_matches_float64_reference(native, hf, native_step, transformers_step, what="step")
