"""FP8 / MXFP8 converters: emulated training tracks the high-precision run; the right layers are converted."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.layers.moe import GroupedExperts
from lightning_moe.precision import RECIPES, Float8Config, apply_float8

STEPS = 20


def tiny_config() -> ModelConfig:
    # k/v projections are 32 wide: below min_dim=64, so they must stay in high precision
    return ModelConfig(
        vocab_size=128, hidden_size=64, pattern="*-*E",
        attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=32),
        mlp=MLPConfig(intermediate_size=128), moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64),
    )


def batches(steps: int, batch: int = 2, seq: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Arithmetic sequences mod vocab: learnable within a few steps."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        start = torch.randint(0, 128, (batch, 1), generator=g)
        stride = torch.randint(1, 4, (batch, 1), generator=g)
        ids = (start + stride * torch.arange(seq + 1)) % 128
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def build(fp8: Float8Config | None) -> tuple[Decoder, object]:
    with torch.device("meta"):
        model = Decoder(tiny_config())
    report = apply_float8(model, fp8) if fp8 is not None else None
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model, report


def train(model: Decoder) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids, labels in batches(STEPS):
        out = model(ids, labels=labels)
        loss = out.loss_sum / out.num_label_tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def reference_losses() -> list[float]:
    model, _ = build(None)
    return train(model)


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_recipe_trains_like_high_precision(recipe, reference_losses):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    model, report = build(Float8Config(recipe=recipe, min_dim=64))
    assert report.emulated
    linear_type = MXFP8Linear if recipe == "mxfp8" else Float8Linear
    assert isinstance(model.layers["0"].attn.q_proj, linear_type)
    assert isinstance(model.layers["1"].mlp.down_proj, linear_type)
    # the output layer and the 32-wide k/v projections stay plain
    assert type(model.lm_head) is torch.nn.Linear and "lm_head" in report.skipped
    assert type(model.layers["0"].attn.k_proj) is torch.nn.Linear
    assert "min_dim" in report.skipped["layers.0.attn.k_proj"]
    experts = model.layers["3"].moe.experts
    assert isinstance(experts.up_proj, MXFP8TrainingWeightWrapperTensor) == (recipe == "mxfp8")

    initial = experts.down_proj.detach().clone()
    losses = train(model)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.9 * losses[0]
    assert abs(losses[-1] - reference_losses[-1]) / reference_losses[-1] < 0.05
    # expert weights learn through the MXFP8 grouped GEMM (or the plain one)
    assert not torch.equal(experts.down_proj.detach(), initial)


def _mxfp8_qdq(x: torch.Tensor) -> torch.Tensor:
    """Independent MXFP8 round trip along the last dim: 32-element blocks, E8M0 scale 2^ceil(log2(amax/448))."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(x.shape)


def test_mxfp8_grouped_experts_quantize_in_blocks_of_32():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=3, intermediate_size=64)
    with torch.device("meta"):
        model = torch.nn.Module()
        model.experts = GroupedExperts(cfg, 64)
    apply_float8(model, Float8Config(recipe="mxfp8", min_dim=32))
    model.to_empty(device="cpu")
    model.experts.reset_parameters(0.05)
    x = torch.randn(40, 64)
    counts = torch.tensor([7, 0, 33])  # uneven groups, one empty: padded to the 32-row blocks inside
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    ours = model.experts.project("up_proj", x, counts, offsets)
    weight = model.experts.up_proj._data
    expected = torch.cat([
        _mxfp8_qdq(rows) @ _mxfp8_qdq(weight[e]).T for e, rows in enumerate(torch.split(x, counts.tolist()))
    ])
    plain = torch.cat([rows @ weight[e].T for e, rows in enumerate(torch.split(x, counts.tolist()))])
    assert torch.allclose(ours.float(), expected, atol=1e-2, rtol=1e-2)
    assert (ours.float() - plain).abs().max() > 10 * (ours.float() - expected).abs().max()


def test_mxfp8_leaves_loop_backend_experts_in_high_precision():
    """The MXFP8 weight wrapper quantizes only torch._grouped_mm: the per-expert loop would run unquantized."""
    with torch.device("meta"):
        model = torch.nn.Module()
        model.experts = GroupedExperts(MoEConfig(num_experts=2, intermediate_size=64, backend="loop"), 64)
        model.proj = torch.nn.Linear(64, 64)
    report = apply_float8(model, Float8Config(recipe="mxfp8", min_dim=32))
    assert report.converted == ["proj"]
    assert report.skipped["experts"] == "grouped experts: moe.backend 'loop' runs no grouped GEMM"
    assert type(model.experts.up_proj) is torch.nn.Parameter


def test_filter_fqns_keep_layers_in_high_precision():
    model, report = build(Float8Config(recipe="rowwise", min_dim=64, filter_fqns=["mlp"]))
    assert type(model.layers["1"].mlp.gate_proj) is torch.nn.Linear
    assert report.skipped["layers.1.mlp.gate_proj"] == "filter_fqns 'mlp'"
    assert "layers.0.attn.q_proj" in report.converted


def test_mxfp8_checkpoint_holds_plain_tensors_and_loads_back():
    model, _ = build(Float8Config(recipe="mxfp8", min_dim=64))
    state = model.state_dict()
    assert type(state["layers.3.moe.experts.up_proj"]) is torch.Tensor
    other, _ = build(Float8Config(recipe="mxfp8", min_dim=64))
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(state)
    assert torch.equal(other.layers["3"].moe.experts.up_proj._data, model.layers["3"].moe.experts.up_proj._data)


def test_unknown_recipe_lists_the_recipes():
    with pytest.raises(ValueError, match=r"fp8.recipe 'fp4' is unknown; recipes: tensorwise, rowwise, .*mxfp8"):
        Float8Config(recipe="fp4")


def test_bad_fp8_settings_are_named():
    with pytest.raises(ValueError, match="fsdp_float8_all_gather needs recipe 'tensorwise'"):
        Float8Config(recipe="rowwise", fsdp_float8_all_gather=True)
    with torch.device("meta"):
        model = Decoder(tiny_config())
    with pytest.raises(ValueError, match=r"filter_fqns \['atention'\] match no linear layer"):
        apply_float8(model, Float8Config(min_dim=64, filter_fqns=["atention"]))
    with pytest.raises(ValueError, match="no layer qualifies .* lower fp8.min_dim"):
        apply_float8(model, Float8Config())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="emulate=false .* needs a GPU"):
            apply_float8(model, Float8Config(min_dim=64, emulate=False))


def test_mxfp8_linear_takes_any_number_of_tokens():
    """torchao's MXFP8Linear needs whole 32-row blocks; ours pads with zero rows, which changes nothing else."""
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96))
    reference = MXFP8Linear(64, 96, kernel_preference=KernelPreference.EMULATED,
                            scale_calculation_mode=ScaleCalculationMode.RCEIL)
    reference.load_state_dict(model[0].state_dict())
    apply_float8(model, Float8Config(recipe="mxfp8", min_dim=32))
    x = torch.randn(5, 10, 64)  # 50 tokens
    padded = torch.cat([x.reshape(50, 64), torch.zeros(14, 64)]).requires_grad_()
    x.requires_grad_()
    grad = torch.randn(5, 10, 96)
    model(x).backward(grad)
    out = reference(padded)
    out.backward(torch.cat([grad.reshape(50, 96), torch.zeros(14, 96)]))
    assert torch.equal(model(x).detach().reshape(50, 96), out.detach()[:50])
    assert torch.equal(x.grad.reshape(50, 64), padded.grad[:50])
    assert torch.equal(model[0].weight.grad, reference.weight.grad)
