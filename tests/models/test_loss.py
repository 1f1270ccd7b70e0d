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
