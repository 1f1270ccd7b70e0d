"""DeepSeek-V3 (MLA, sigmoid MoE, MTP): logits equal transformers', the hub round trip is bitwise, MTP works."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_moe_hf import (
    TOL,
    add_mtp_layer,
    build_tiny,
    check_bitwise_round_trip,
    max_logit_diff,
    max_packed_diff,
    round_trip,
    save_tiny,
    tiny_config,
)

from lightning_moe.checkpoint.convert import import_hf_checkpoint
from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_by_name
from lightning_moe.models.layers.loss import IGNORE_INDEX
from lightning_moe.models.layers.mla import MLA

VARIANTS = ["deepseek_v3", "moonlight"]

# config.json of deepseek-ai/DeepSeek-V3 (the keys that shape the model)
HUB_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name in VARIANTS:
        path = tmp_path_factory.mktemp(name)
        hf = build_tiny(name)
        hf.save_pretrained(path)
        out[name] = (hf, load_pretrained(path))
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_equal_transformers(models, name):
    hf, native = models[name]
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(hf, native, ids) <= TOL
    assert max_packed_diff(hf, native, [7, 12, 5]) <= TOL


def test_packed_rows_with_flex_attention(models):
    hf, native = models["deepseek_v3"]
    native.config.attention.backend = "flex"  # the attention blocks share this config object
    try:
        assert max_packed_diff(hf, native, [9, 6, 9]) <= TOL
    finally:
        native.config.attention.backend = "sdpa"


def test_translation_of_the_hub_config():
    """DeepSeek-V3's own config: layer pattern, router, MTP, and the yarn rope and softmax scale transformers uses."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = family_by_name("deepseek_v3").from_hf_config(HUB_CONFIG)
    assert cfg.pattern == "*-" * 3 + "*E" * 58
    assert cfg.mtp.num_layers == 1 and cfg.mtp.pattern == "*E"
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group, moe.num_shared_experts) == (256, 8, 8, 4, 1)
    assert moe.score_func == "sigmoid" and moe.score_correction_bias and moe.routed_scaling_factor == 2.5

    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in HUB_CONFIG.items() if k != "quantization_config"})
    with torch.device("meta"):
        theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_config, 0)
        ours = MLA(cfg.attention, cfg.hidden_size, cfg.max_position_embeddings, cfg.norm_eps)
    assert math.isclose(ours.scale, theirs.scaling, rel_tol=1e-12)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    assert torch.allclose(ours.rotary.inv_freq(torch.device("cpu")), inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(ours.rotary.attention_scaling, scaling, rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_export_is_bitwise(tmp_path, dtype):
    check_bitwise_round_trip("deepseek_v3", tmp_path, dtype)
    # transformers declares one MTP layer it never saves: the import has none
    assert load_pretrained(tmp_path / "native").mtp is None


def test_mtp_layer_round_trip_is_bitwise(tmp_path):
    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf", torch.bfloat16)
    written = add_mtp_layer(hf_dir, "deepseek_v3", torch.bfloat16)
    report = round_trip(hf_dir, tmp_path)
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hf_dir).keys())
    assert set(written) <= set(SafetensorsDir(tmp_path / "export").keys())


def test_mtp_copies_of_embedding_must_match(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf_dir = save_tiny("deepseek_v3", tmp_path / "hf")
    add_mtp_layer(hf_dir, "deepseek_v3")
    tensors = load_file(hf_dir / "mtp.safetensors")
    tensors["model.layers.3.embed_tokens.weight"][0, 0] += 1
    save_file(tensors, hf_dir / "mtp.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.3\.embed_tokens\.weight differs from model\.embed_tokens"):
        import_hf_checkpoint(hf_dir, tmp_path / "native")
    assert not (tmp_path / "native").exists()


def _reference_mtp_loss(hf, hf_dir, ids, labels):
    """DeepSeek's MTP depth 1 built from transformers' own decoder layer and the hub tensors:
    ``h = eh_proj([enorm(embed(x[t+1])), hnorm(h_main[t])])`` -> layer -> shared_head.norm -> head,
    scored against the target of position t+1."""
    import transformers
    from safetensors.torch import load_file

    config = hf.config
    mtp = load_file(hf_dir / "mtp.safetensors")
    prefix = f"model.layers.{config.num_hidden_layers}."
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(config, config.num_hidden_layers)
    experts = layer.mlp.experts
    with torch.no_grad():
        for e in range(experts.num_experts):
            gate, up, down = (mtp[f"{prefix}mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down"))
            experts.gate_up_proj[e] = torch.cat([gate, up])
            experts.down_proj[e] = down
    rest = {k.removeprefix(prefix): v for k, v in mtp.items() if ".experts." not in k}
    missing, unexpected = layer.load_state_dict(rest, strict=False)
    assert set(missing) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert set(unexpected) == {"embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
                               "shared_head.norm.weight", "shared_head.head.weight"}

    def rms(x, weight):
        return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=config.rms_norm_eps)

    main = hf.model(ids).last_hidden_state
    ahead = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    h = torch.cat([rms(hf.model.embed_tokens(ahead), mtp[prefix + "enorm.weight"]),
                   rms(main, mtp[prefix + "hnorm.weight"])], dim=-1) @ mtp[prefix + "eh_proj.weight"].T
    positions = torch.arange(ids.shape[1])[None]
    h = layer(h, position_embeddings=hf.model.rotary_emb(h, positions), position_ids=positions,
              attention_mask=None)
    logits = rms(h, mtp[prefix + "shared_head.norm.weight"]) @ mtp[prefix + "shared_head.head.weight"].T
    target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def test_mtp_loss_matches_deepseek_and_trains(tmp_path):
    hf = build_tiny("deepseek_v3")
    hf.save_pretrained(tmp_path)
    add_mtp_layer(tmp_path, "deepseek_v3")
    native = load_pretrained(tmp_path)
    assert native.mtp is not None and len(native.mtp.depths) == 1
    ids = torch.randint(0, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(3))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    out = native(ids, labels=labels)
    (loss,), (count,) = out.mtp_loss_sums, out.mtp_label_tokens
    assert torch.isfinite(loss) and int(count) == 14
    with torch.no_grad():
        expected = _reference_mtp_loss(hf.eval(), tmp_path, ids, labels)
    assert abs(loss.item() - expected.item()) <= 1e-3 * expected.item()

    loss.backward()
    depth = native.mtp.depths[0]
    for param in (depth.eh_proj.weight, depth.layers["0"].attn.kv_b_proj.weight, depth.layers["1"].moe.experts.up_proj):
        assert param.grad is not None and param.grad.abs().sum() > 0


def test_mtp_loss_is_logged_by_the_training_module(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_moe.modules.causal_lm import CausalLM

    save_tiny("deepseek_v3", tmp_path / "hf")
    add_mtp_layer(tmp_path / "hf", "deepseek_v3")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (4, 16), generator=gen)
    batches = [{"input_ids": ids[i : i + 2], "labels": torch.roll(ids[i : i + 2], -1, 1),
                "position_ids": torch.arange(16).expand(2, -1)} for i in (0, 2)]
    trainer = L.Trainer(max_steps=2, logger=CSVLogger(tmp_path / "logs"), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1)
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer.fit(CausalLM(pretrained=str(tmp_path / "hf")), train_dataloaders=loader)
    metrics = (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    column = header.index("train/mtp_1_loss")
    values = [float(row.split(",")[column]) for row in metrics[1:] if row.split(",")[column]]
    assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values)


def test_export_config_loads_in_transformers(tmp_path):
    """A native DeepSeek-V3 config exported from scratch builds the same model in transformers."""
    import transformers

    from lightning_moe.checkpoint.convert import export_model

    native = load_pretrained(save_tiny("deepseek_v3", tmp_path / "hf"))
    export_model(native, tmp_path / "export")
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf["first_k_dense_replace"] == 1 and hf["rope_interleave"] is True
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    ids = torch.randint(0, 96, (1, 20))
    assert max_logit_diff(reloaded, native, ids) <= TOL


def test_flops_match_flop_counter():
    """The MLA term of ``models.flops`` on a tiny DeepSeek-V3 (MTP included), against FlopCounterMode on a
    packed training step. sdpa's math path (what the counter sees) scores the full S x S square of each row:
    that term is swapped for torch's own formula, the rest must agree."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    from lightning_moe.models.decoder import Decoder
    from lightning_moe.models.flops import Sequences, forward_flops, output_token_counts

    hf = tiny_config("deepseek_v3").to_dict()
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg = family_by_name("deepseek_v3").from_hf_config(hf)
    cfg.moe.backend = "loop"  # plain matmuls the counter sees
    assert cfg.mtp is not None and cfg.attention.q_lora_rank
    torch.manual_seed(0)
    model = Decoder(cfg)
    model.init_weights()
    seq = 40
    positions = torch.cat([torch.cat([torch.arange(15), torch.arange(25)])[None], torch.arange(seq)[None]])
    ids = torch.randint(0, cfg.vocab_size, (2, seq))
    labels = torch.randint(0, cfg.vocab_size, (2, seq))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(ids, positions, labels=labels)
        (out.loss_sum + sum(out.mtp_loss_sums)).backward()

    att = cfg.attention
    qk = (2, att.num_heads, seq, att.qk_nope_head_dim + att.qk_rope_head_dim)
    v = (2, att.num_heads, seq, att.v_head_dim)
    blocks = cfg.pattern.count("*") + cfg.mtp.num_layers * cfg.mtp.pattern.count("*")
    full_square = 3 * blocks * sdpa_flop_count(qk, qk, v)
    forward = forward_flops(cfg, Sequences.from_position_ids(positions), output_token_counts(cfg, positions, labels))
    assert counter.get_total_flops() == pytest.approx(3 * forward.weights + full_square, rel=1e-6)
