"""Masks of packed rows: the dense sdpa mask and the (compiled) flex block mask follow one rule."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lightning_moe.models.layers.sequence import SequenceLayout


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def _attends(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """[batch, 1, seq, seq]: query q sees key k of its own sequence, at most ``window - 1`` tokens back."""
    batch, seq = positions.shape
    mask = torch.zeros(batch, 1, seq, seq, dtype=torch.bool)
    for b in range(batch):
        for q in range(seq):
            for k in range(q + 1):
                same = bool((positions[b, k + 1 : q + 1] != 0).all())  # no sequence starts after k up to q
                mask[b, 0, q, k] = same and (window is None or q - k < window)
    return mask


@pytest.mark.parametrize("window", [None, 5])
def test_dense_mask_of_packed_rows(window):
    positions = _positions([[7, 12, 5], [20, 4]])
    assert torch.equal(SequenceLayout(positions).dense_mask(window), _attends(positions, window))


@pytest.mark.parametrize("window", [None, 40])
def test_block_mask_equals_torchs_eager_construction(window):
    """The compiled construction (which never materializes [batch, seq, seq]) gives torch's eager block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    positions = _positions([[300, 100, 112], [256, 256]])
    layout = SequenceLayout(positions)
    docs = layout.document_ids

    def mask_mod(b, h, q, kv):
        keep = (q >= kv) & (docs[b, q] == docs[b, kv])
        return keep & (q - kv < window) if window is not None else keep

    expected = create_block_mask(mask_mod, 2, None, 512, 512, device="cpu")
    got = layout.block_mask(window)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


@pytest.mark.parametrize("backend,error,message", [
    pytest.param("te", ValueError, "attention backend 'te' needs Transformer Engine, which is not installed",
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                          reason="Transformer Engine is installed")),
    ("xla", ValueError, "attention backend 'xla' is not supported \\(sdpa, flex, te\\)"),
])
def test_unavailable_attention_backends_say_so(backend, error, message):
    from lightning_moe.models.layers.attention import attend

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(error, match=message):
        attend(q, q, q, SequenceLayout(_positions([[4]])), backend=backend, scale=1.0)
