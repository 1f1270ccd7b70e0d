"""The fused, chunked output-layer cross entropy equals plain logits + F.cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.models.layers.loss import linear_cross_entropy


@pytest.mark.parametrize("chunk", [3, 64])
def test_fused_loss_and_grads_equal_reference(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 50, (2, 9), generator=gen)
    labels[0, :4] = -100
    labels[1, -1] = -100
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, count = linear_cross_entropy(h1, w1, labels, chunk_size=chunk)
    reference = F.cross_entropy((h2 @ w2.T).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    assert count.item() == int((labels != -100).sum())
    assert torch.allclose(loss.double(), reference, atol=1e-6)
    (2.5 * loss).backward()
    (2.5 * reference).backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-6)
    assert torch.allclose(w1.grad, w2.grad, atol=1e-6)


def test_no_label_tokens_gives_zero_loss_and_zero_grads():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    loss, count = linear_cross_entropy(hidden, weight, torch.full((4,), -100))
    loss.backward()
    assert loss.item() == 0.0 and count.item() == 0
    assert hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_evaluation_under_no_grad_computes_no_gradients():
    """Gradients are computed in the forward pass; under no_grad (validation) that work must be skipped,
    although the inputs still require grad."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens, dim, vocab = 12, 16, 40
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    forward_flops = 2 * tokens * dim * vocab
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss, _ = linear_cross_entropy(hidden, weight, labels, chunk_size=5)
    assert counter.get_total_flops() == forward_flops
    assert not loss.requires_grad
    reference = F.cross_entropy(hidden @ weight.T, labels, reduction="sum")
    assert torch.allclose(loss, reference, atol=1e-4)
    with FlopCounterMode(display=False) as counter:  # training: input and weight gradients come with it
        linear_cross_entropy(hidden, weight, labels, chunk_size=5)
    assert counter.get_total_flops() == 3 * forward_flops


@pytest.mark.parametrize("mode", ["bf16-true", "bf16-autocast"])
def test_bf16_loss_and_grads_are_close_to_fp64_with_the_input_dtypes(mode):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 7, 32, generator=gen, dtype=torch.float64)
    weight = torch.randn(50, 32, generator=gen, dtype=torch.float64) / 4
    labels = torch.randint(0, 50, (2, 7), generator=gen)
    labels[1, :3] = -100
    h64, w64 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    reference = F.cross_entropy((h64 @ w64.T).reshape(-1, 50), labels.reshape(-1), ignore_index=-100, reduction="sum")
    reference.backward()
    dtype = torch.bfloat16 if mode == "bf16-true" else torch.float32
    h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-autocast"):
        loss, _ = linear_cross_entropy(h, w, labels, chunk_size=4)
    loss.backward()
    assert loss.dtype == torch.float32 and h.grad.dtype == dtype and w.grad.dtype == dtype
    assert torch.allclose(loss.double(), reference, rtol=2e-2)
    assert torch.allclose(h.grad.double(), h64.grad, atol=5e-2, rtol=5e-2)
    assert torch.allclose(w.grad.double(), w64.grad, atol=5e-2, rtol=5e-2)


def test_second_backward_is_an_error_not_double_scaled_gradients():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    loss, _ = linear_cross_entropy(hidden, weight, torch.randint(0, 20, (6,)), chunk_size=4)
    (2 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="a second time"):
        loss.backward()
