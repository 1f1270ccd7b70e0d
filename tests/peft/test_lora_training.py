"""LoRA training on the native decoder: only adapters move, experts and MTP layers get adapter gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig, MTPConfig
from lightning_moe.models.decoder import Decoder
from lightning_moe.peft import LoraConfig, apply_lora, is_adapter_parameter, reset_lora_parameters


def moe_mtp_config(**moe) -> ModelConfig:
    return ModelConfig(
        vocab_size=96, hidden_size=32, pattern="*-*E",
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8),
        mlp=MLPConfig(intermediate_size=48), moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, **moe),
        mtp=MTPConfig(num_layers=1, pattern="*E"),
    )


def lora_model(cfg: ModelConfig, lora: LoraConfig) -> Decoder:
    with torch.device("meta"):
        model = Decoder(cfg)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reset_lora_parameters(model)
    return model


def step_loss(model: Decoder, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (2, 16), generator=g)
    labels = torch.randint(0, 96, (2, 16), generator=g)
    out = model(ids, labels=labels)
    return (out.loss_sum + 0.3 * sum(out.mtp_loss_sums)) / out.num_label_tokens


@pytest.mark.parametrize("activation", ["swiglu", "relu2"])
def test_only_adapters_change_and_experts_and_mtp_adapters_train(activation):
    model = lora_model(moe_mtp_config(activation=activation),
                       LoraConfig(r=4, alpha=8, target_experts=True, include_mtp=True))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_parameter(n)}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_parameter(n)}
    assert all(p.requires_grad == is_adapter_parameter(n) for n, p in model.named_parameters())
    assert any(".experts.adapter.lora_A" in n for n in adapters)
    assert any(n.startswith("mtp.depths.0.layers.1.moe.experts.adapter") for n in adapters)
    assert any(n.startswith("mtp.depths.0.eh_proj.lora_A") for n in adapters)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    for step in range(3):
        step_loss(model, step).backward()
        if step == 2:  # B moved off zero at step 1, so every A and B has a gradient now
            dead = [n for n, p in model.named_parameters() if p.requires_grad and not p.grad.abs().sum() > 0]
            assert not dead, dead
        opt.step()
        opt.zero_grad()
    for name, value in base.items():
        assert torch.equal(model.get_parameter(name), value), name
    moved = [n for n, v in adapters.items() if not torch.equal(model.get_parameter(n), v)]
    assert len(moved) == len(adapters)


def test_adapted_model_starts_equal_to_base_and_dropout_only_in_training():
    cfg = moe_mtp_config()
    plain = lora_model(cfg, LoraConfig(r=4, dropout=0.5, target_experts=True, include_mtp=True))
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        reference = Decoder(cfg)
    reference.to_empty(device="cpu")
    torch.manual_seed(0)
    reference.init_weights()
    # B = 0: the adapted model computes the base model
    assert torch.equal(plain.eval()(ids), reference.eval()(ids))


def test_frozen_base_in_bf16_with_fp32_adapters_trains():
    model = lora_model(moe_mtp_config(), LoraConfig(r=4, target_experts=True, base_dtype="bfloat16"))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.0.attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["layers.3.moe.experts.up_proj"] == torch.bfloat16
    assert dtypes["layers.0.attn.q_proj.lora_A.default.weight"] == torch.float32
    assert dtypes["layers.3.moe.experts.adapter.lora_B.gate_up"] == torch.float32
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = step_loss(model, 0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_target_patterns_select_and_exclude():
    with torch.device("meta"):
        model = Decoder(moe_mtp_config())
    targets = apply_lora(model, LoraConfig(target_modules=["attn.q_proj", "layers.*.mlp.*"],
                                           exclude_modules=["layers.1.mlp.down_proj"]))
    assert targets.linears == ["layers.0.attn.q_proj", "layers.1.mlp.gate_proj", "layers.1.mlp.up_proj",
                               "layers.2.attn.q_proj"]
    assert targets.experts == []


def test_lora_on_transformer_engine_layers_is_refused():
    """te_modules swaps the dense linears for TE's, which peft's LoRA layer does not wrap: refused, not skipped.
    (Building with te_modules needs TE; the model here is built without it and then carries the key.)"""
    import dataclasses

    with torch.device("meta"):
        model = Decoder(moe_mtp_config())
    model.config = dataclasses.replace(model.config, te_modules=True)
    with pytest.raises(ValueError, match=r"peft with model.te_modules: true: .*use te_modules: false for LoRA"):
        apply_lora(model, LoraConfig())


@pytest.mark.parametrize(
    "lora,message",
    [
        (LoraConfig(target_modules=["q_prj"]), r"target_modules pattern 'q_prj' matches no linear layer \(linear "
                                               r"layers: layers.0.attn.q_proj"),
        (LoraConfig(target_modules=["eh_proj"]), "'eh_proj' matches no linear layer; it matches mtp.* layers: "
                                                 "set include_mtp: true"),
        (LoraConfig(target_modules=["experts"]), "stacked experts are adapted with target_experts: true"),
        (LoraConfig(exclude_modules=["mlp.gate"]), "exclude_modules pattern 'mlp.gate' matches no linear layer"),
        (LoraConfig(target_modules=["q_proj"], exclude_modules=["q_proj"]), "nothing would be trained"),
    ],
)
def test_target_patterns_matching_nothing_are_named(lora, message):
    with torch.device("meta"):
        model = Decoder(moe_mtp_config())
    with pytest.raises(ValueError, match=message):
        apply_lora(model, lora)


def test_bad_lora_settings_are_named():
    with pytest.raises(ValueError, match="peft.r must be a positive integer"):
        LoraConfig(r=0)
    with pytest.raises(ValueError, match="peft.base_dtype 'bf16' is not a torch dtype"):
        LoraConfig(base_dtype="bf16")
    cfg = moe_mtp_config()
    with torch.device("meta"):
        dense = Decoder(ModelConfig(vocab_size=96, hidden_size=32, pattern="*-", attention=cfg.attention, mlp=cfg.mlp))
    with pytest.raises(ValueError, match="target_experts is true but the model has no MoE experts"):
        apply_lora(dense, LoraConfig(target_experts=True))
    with torch.device("meta"):
        loop = Decoder(moe_mtp_config(backend="loop"))
    with pytest.raises(ValueError, match="expert adapters need backend 'grouped_mm'"):
        apply_lora(loop, LoraConfig(target_experts=True))


@pytest.mark.parametrize("rank,dtype", [(3, torch.float32), (4, torch.bfloat16), (8, torch.float32)])
def test_expert_adapter_equals_per_expert_low_rank_products(rank, dtype):
    """The grouped-GEMM adapter (rank zero-padded for aligned strides) against x_e @ A_e^T @ B_e^T per expert."""
    from lightning_moe.models.layers.moe import GroupedExperts
    from lightning_moe.peft.experts import ExpertLora

    torch.manual_seed(0)
    experts = GroupedExperts(MoEConfig(num_experts=3, intermediate_size=16), 32).to(dtype)
    adapter = ExpertLora(experts, r=rank, alpha=2.0 * rank, dropout=0.0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(11, 32).to(dtype)
    counts = torch.tensor([4, 0, 7])
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    for projection, rows_in in (("gate_proj", x), ("up_proj", x), ("down_proj", torch.randn(11, 16).to(dtype))):
        ours = adapter(projection, rows_in, offsets).float()
        a, b = adapter.factors(projection)
        expected = torch.cat([
            2.0 * (rows.float() @ a[e].float().T @ b[e].float().T)
            for e, rows in enumerate(torch.split(rows_in, counts.tolist()))
        ])
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.allclose(ours, expected, atol=tol, rtol=tol), projection


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_lora_over_an_fp8_base(recipe):
    """FP8 converts first (the adapters stay in high precision), then LoRA wraps the FP8 layers."""
    from lightning_moe.precision import Float8Config, apply_float8

    cfg = ModelConfig(vocab_size=96, hidden_size=64, pattern="*E",
                      attention=AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=32),
                      moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=64))
    with torch.device("meta"):
        model = Decoder(cfg)
    report = apply_float8(model, Float8Config(recipe=recipe, min_dim=32))
    apply_lora(model, LoraConfig(r=8, target_experts=True))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reset_lora_parameters(model)
    assert "layers.0.attn.q_proj" in report.converted
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear

    assert isinstance(model.layers["0"].attn.q_proj.base_layer, (Float8Linear, MXFP8Linear))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not is_adapter_parameter(n)}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        out = model(ids, labels=torch.roll(ids, -1, 1))
        loss = out.loss_sum / out.num_label_tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(model.get_parameter(n).detach(), v) for n, v in base.items())


def test_targets_on_a_transformers_moe_model_are_exactly_the_selected_ones():
    """peft's own matching on transformers 5 MoE models turns gate/up/down targets into expert targets and
    loses exclusions; apply_lora adapts exactly what it selected."""
    import transformers
    from tiny_hf import tiny_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    targets = apply_lora(model, LoraConfig(r=4, exclude_modules=["model.layers.1.self_attn.q_proj"]))
    adapted = sorted({n.rsplit(".lora_", 1)[0] for n, _ in model.named_parameters() if ".lora_" in n})
    assert adapted == sorted(targets.linears)
    assert "model.layers.0.mlp.gate_proj" in adapted and "model.layers.1.self_attn.q_proj" not in adapted
    assert not any("experts" in n for n in adapted)


def test_adapter_only_checkpoints_leave_out_tied_frozen_weights():
    """A tied output layer is the frozen embedding under a second name: it stays out of LoRA checkpoints too."""
    import transformers
    from tiny_hf import tiny_config

    from lightning_moe.peft import keep_checkpoints_adapter_only

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config("llama_tied_bias"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    apply_lora(model, LoraConfig(r=4))
    keep_checkpoints_adapter_only(model)
    state = model.state_dict()
    assert state and all(is_adapter_parameter(n) for n in state), [n for n in state if not is_adapter_parameter(n)]
    model.load_state_dict(state, strict=True)  # the frozen weights, under either name, are not asked for
