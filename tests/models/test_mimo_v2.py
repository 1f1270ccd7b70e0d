"""MiMo-V2 (``mimo_v2``): a tiny checkpoint in the published config's structure (tests/models/tiny_mimo_v2.py)
against transformers' ``mimo_v2_flash`` (the same network) and an MTP reference on transformers' modules, in float64
and fp32 (tests/closeness.py); the fused-QKV hub layout round-trips bitwise, its FP8 / MXFP4 encodings import as an
independent dequantization and export as the hub stores them; the full configs' parameter counts against the
published figures and the hub's own tensor listing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from closeness import assert_matches_float64_reference
from tiny_mimo_v2 import KV, mimo_v2_hub_config, mtp_losses, save_mimo_v2
from transformers_reference import assert_logits_match, assert_packed_logits_match

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io import quantized as Q
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.decoder import Decoder
from lightning_moe.models.families import family_by_name, family_for_hf_config

# the recipes' transcribed hub configs (their MiMo entries cite their sources)
HUB = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "hub_configs.yaml").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mimo_v2") / "hub"
    model, depths = save_mimo_v2(path)
    return path, model, depths


@pytest.fixture(scope="module")
def native(checkpoint):
    return load_pretrained(checkpoint[0])


def ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 96, (rows, length), generator=torch.Generator().manual_seed(seed))


def test_the_checkpoint_reads_as_the_published_structure(native):
    cfg = native.config
    assert cfg.family == "mimo_v2" and cfg.pattern == "*-*E*E"
    assert cfg.attention.sliding_window_layers == [False, True, True, True]  # the MTP layer's attention slides
    full, swa = cfg.attention, cfg.sliding_attention
    assert (full.num_kv_heads, swa.num_kv_heads, full.sinks, swa.sinks) == (KV, 2 * KV, False, True)
    assert (full.head_dim, full.value_dim, full.rope.theta, swa.rope.theta) == (24, 16, 1.0e6, 1.0e4)
    attentions = [b.attn for b in native.layers.values() if b.symbol == "*"]
    assert [a.window for a in attentions] == [None, 5, 5]
    assert [a.v_proj.weight.shape[0] for a in attentions] == [KV * 16, 2 * KV * 16, 2 * KV * 16]
    assert native.mtp.depths[1].layers["0"].attn.window == 5 and native.mtp.depths[1].layers["0"].attn.sinks is not None


def test_logits_equal_transformers_mimo_v2_flash(checkpoint, native):
    _, model, _ = checkpoint
    assert_logits_match(native, model, ids(2, 20, 1))
    assert_packed_logits_match(native, model, list(ids(1, 26, 2)[0].split([7, 12, 7])))


class Reference(torch.nn.Module):
    def __init__(self, model, depths) -> None:
        super().__init__()
        self.model, self.depths = model, torch.nn.ModuleList(depths)


def test_mtp_losses_equal_the_reference(checkpoint, native):
    _, model, depths = checkpoint
    batch = ids(2, 18, 3)
    labels = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)

    def ours(m):
        return {f"depth {d}": loss for d, loss in enumerate(m(batch, labels=labels).mtp_loss_sums)}

    def theirs(m):
        return {f"depth {d}": loss for d, loss in enumerate(mtp_losses(m.model, list(m.depths), batch))}

    with torch.no_grad():
        assert_matches_float64_reference(native, Reference(model, depths), ours, theirs, what="MTP loss sums")


def test_windows_sinks_and_value_scale_take_part(native):
    """Each changes the logits of a 20-token row, so the comparisons above see them."""
    import dataclasses

    batch = ids(1, 20, 4)
    attention = native.layers["2"].attn
    sinks, settings = attention.sinks.detach().clone(), attention.cfg
    changes = {"window": lambda: setattr(attention, "window", None),
               "sinks": lambda: attention.sinks.data.fill_(-1e4),
               "value scale": lambda: setattr(attention, "cfg", dataclasses.replace(settings, value_scale=1.0))}
    with torch.no_grad():
        reference = native(batch)
        for what, change in changes.items():
            change()
            assert (native(batch) - reference).abs().max() > 1e-3, what
            attention.window, attention.cfg = 5, settings
            attention.sinks.data.copy_(sinks)
        assert torch.equal(native(batch), reference)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_qkv", "split"])
def test_import_export_is_bitwise(tmp_path, fused):
    source = tmp_path / "hub"
    save_mimo_v2(source, torch.bfloat16, fused=fused)
    import_hf_checkpoint(source, tmp_path / "native")
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export")
    report = verify_hf_checkpoints(source, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(source).keys())
    assert json.loads((tmp_path / "export" / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    assert json.loads((tmp_path / "native" / "model_config.json").read_text())["family"] == (
        "mimo_v2" if fused else "mimo_v2_split")


def test_config_translates_both_ways():
    hub = mimo_v2_hub_config(torch.float32)
    family = family_for_hf_config(hub)
    cfg = family.from_hf_config(hub)
    back = family.to_hf_config(cfg)
    assert {k: v for k, v in back.items() if k in hub} == {k: v for k, v in hub.items() if k in back}
    assert set(hub) - set(back) == {"torch_dtype"}
    assert family.from_hf_config(back) == cfg
    split = family.from_hf_config({**hub, "attention_projection_layout": "split"})
    assert split.family == "mimo_v2_split" and family.to_hf_config(split)["attention_projection_layout"] == "split"


def test_config_errors_name_the_key():
    hub = mimo_v2_hub_config(torch.float32)
    family = family_by_name("mimo_v2")
    for change, message in (({"n_shared_experts": 1}, "n_shared_experts=1: MiMo-V2 has none"),
                            ({"hybrid_layer_pattern": None, "hybrid_block_size": 6}, "hybrid_block_size"),
                            ({"moe_layer_freq": [0, 1]}, "moe_layer_freq must list 3 values"),
                            ({"head_dim": 21}, "odd rotary width"),
                            ({"scoring_func": "softmax"}, "scoring_func='softmax'")):
        with pytest.raises(ValueError, match=message):
            family.from_hf_config({**hub, **change})
    with pytest.raises(ValueError, match="split in 2 shards .* must divide 3 heads and 3 kv heads"):
        family.weight_map(family.from_hf_config({**hub, "swa_num_key_value_heads": 3, "swa_num_attention_heads": 3}))


# ---------------------------------------------------------------------------------------------- quantized layouts
BLOCK = (16, 16)


def fp8_tiles(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as transformers' ``Fp8Quantize`` computes it (per-tile amax, ``scale = 448 / amax``, stored
    inverted), written out here because that quantizer passes through weights with partial edge tiles, which the
    fused QKV's shards have (as on the hub: 3392 rows per shard of MiMo-V2.5-Pro, 26.5 tiles of 128)."""
    rows, cols = weight.shape
    tiles = -(-rows // BLOCK[0]), -(-cols // BLOCK[1])
    padded = torch.nn.functional.pad(weight.float(), (0, tiles[1] * BLOCK[1] - cols, 0, tiles[0] * BLOCK[0] - rows))
    amax = padded.reshape(tiles[0], BLOCK[0], tiles[1], BLOCK[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, 1.0), 1.0)
    per_element = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    fp8 = (weight.float() * per_element).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return fp8, (1.0 / scale).float()


def fp8_shards(name: str, weight: torch.Tensor, shards: int) -> dict[str, torch.Tensor]:
    """Each row shard (the fused QKV's checkpoint-TP shards) on its own tile grid, concatenated."""
    parts = [fp8_tiles(w) for w in weight.chunk(shards)]
    return {name: torch.cat([p[0] for p in parts]), name + "_scale_inv": torch.cat([p[1] for p in parts])}


def mxfp4_rows(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """torchao's MX encoder on a linear's ``[out, in]`` rows: ``.weight`` packed e2m1, ``.weight_scale`` e8m0."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scales, data = to_mx(weight.contiguous(), torch.float4_e2m1fn_x2, 32)
    return {name: data.view(torch.uint8).reshape(weight.shape[0], -1),
            name + "_scale": scales.view(torch.uint8).reshape(weight.shape[0], -1)}


def v2_6_hub_dir(source, out):
    """The tiny bf16 checkpoint in MiMo-V2.6's hub layout: FP8 blocks (the fused QKV per shard), MXFP4 experts."""
    from safetensors.torch import save_file

    family, reader = family_by_name("mimo_v2"), SafetensorsDir(source)
    config = json.loads((source / "config.json").read_text())
    tensors = {}
    for name in reader.keys():
        tensor = reader.get(name)
        encoding = family.hub_encoding(name, Q.FP8_MXFP4)
        if encoding == Q.MXFP4:
            tensors.update(mxfp4_rows(name, tensor))
        elif encoding == Q.FP8_BLOCK:
            tensors.update(fp8_shards(name, tensor, KV if name.endswith("qkv_proj.weight") else 1))
        else:
            tensors[name] = tensor
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {**family.hf_quantization_config(Q.FP8_MXFP4), "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(config))
    return out


def independent_dequantization(hub) -> dict[str, torch.Tensor]:
    """Every tensor of a V2.6 hub directory as transformers' FP8 and MXFP4 decoders give it."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    reader = SafetensorsDir(hub)
    out = {}
    for name in reader.keys():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        tensor = reader.get(name)
        if name + "_scale_inv" in reader.keys():
            shards = KV if name.endswith("qkv_proj.weight") else 1
            scales = reader.get(name + "_scale_inv").chunk(shards)
            # in fp32, rounded once to bf16 (the import's dtype)
            tensor = torch.cat([_dequantize_fp8_weight(w, s, list(BLOCK), torch.float32)
                                for w, s in zip(tensor.chunk(shards), scales)]).to(torch.bfloat16)
        elif name + "_scale" in reader.keys():
            blocks = tensor.reshape(1, tensor.shape[0], -1, 16)
            scales = reader.get(name + "_scale").reshape(1, tensor.shape[0], -1)
            tensor = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)[0].T  # [in, out] -> [out, in]
        out[name] = tensor
    return out


def test_v2_6_fp8_and_mxfp4_checkpoint_imports_and_exports_as_the_hub_stores_it(tmp_path):
    source = tmp_path / "bf16"
    save_mimo_v2(source, torch.bfloat16)
    hub = v2_6_hub_dir(source, tmp_path / "v2_6")
    stored = SafetensorsDir(hub)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert stored.shape(qkv + "_scale_inv") == (KV * 6, 4)  # 88 rows per shard: 6 tiles each, not ceil(176 / 16)
    assert stored.dtype("model.layers.1.mlp.experts.0.up_proj.weight") == torch.uint8
    assert stored.dtype("model.layers.1.mlp.gate.weight") == torch.bfloat16

    import_hf_checkpoint(hub, tmp_path / "native")
    imported = SafetensorsDir(tmp_path / "native")
    expected = independent_dequantization(hub)
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export")
    exported = SafetensorsDir(tmp_path / "export")
    assert sorted(exported.keys()) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported.get(name), tensor), name
    assert imported.dtype("layers.0.attn.q_proj.weight") == torch.bfloat16

    # re-quantized on export: MXFP4 bytes as the hub's (bf16 holds every MXFP4 value), FP8 as the quantizer does
    export_hf_checkpoint(tmp_path / "native", tmp_path / "requantized", quantize=Q.FP8_MXFP4)
    report = verify_hf_checkpoints(v2_6_hub_dir(tmp_path / "export", tmp_path / "reference"), tmp_path / "requantized")
    assert report.ok, report.summary()
    again = SafetensorsDir(tmp_path / "requantized")
    for name in stored.keys():
        if stored.dtype(name) == torch.uint8:
            assert torch.equal(again.get(name), stored.get(name)), name
    written = json.loads((tmp_path / "requantized" / "config.json").read_text())["quantization_config"]
    assert written["store_dtype"] == "mxfp4" and written["weight_block_size"] == list(BLOCK)


def test_fp8_layouts_encode_the_hubs_tensors():
    """V2.5-Pro (``fp8-block``): every linear but o_proj, the router and eh_proj in FP8 blocks, experts too;
    V2.6 (``fp8-mxfp4``): the routed experts in MXFP4 instead."""
    family = family_by_name("mimo_v2")
    fp8 = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.up_proj.weight",
           "model.mtp.layers.0.self_attn.qkv_proj.weight", "model.mtp.layers.2.mlp.down_proj.weight"]
    kept = ["model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.gate.weight", "lm_head.weight",
            "model.embed_tokens.weight", "model.mtp.layers.0.eh_proj.weight", "model.layers.3.input_layernorm.weight",
            "model.mtp.layers.0.enorm.weight", "model.mtp.layers.1.final_layernorm.weight",
            "model.layers.3.self_attn.attention_sink_bias", "model.layers.3.mlp.gate.e_score_correction_bias"]
    expert = "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert [family.hub_encoding(n, Q.FP8_BLOCK) for n in fp8 + [expert]] == [Q.FP8_BLOCK] * 5
    assert [family.hub_encoding(n, Q.FP8_MXFP4) for n in fp8 + [expert]] == [Q.FP8_BLOCK] * 4 + [Q.MXFP4]
    assert [n for n in kept if family.hub_encoding(n, Q.FP8_BLOCK) or family.hub_encoding(n, Q.FP8_MXFP4)] == []


def test_a_scale_grid_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "bf16"
    save_mimo_v2(source, torch.bfloat16, depths=0)
    hub = v2_6_hub_dir(source, tmp_path / "v2_6")
    tensors = load_file(hub / "model.safetensors")
    qkv = "model.layers.0.self_attn.qkv_proj.weight_scale_inv"
    tensors[qkv] = tensors[qkv][:11]  # one grid over the whole tensor
    save_file(tensors, str(hub / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj.weight_scale_inv has shape \(11, 4\), expected \(12, 4\) .* as 2 "
                                         r"row shards"):
        import_hf_checkpoint(hub, tmp_path / "native")


# ---------------------------------------------------------------------------------------------- full sizes
def parameter_counts(hub_id: str, mtp: bool = False) -> tuple[int, float]:
    """(total, active) parameters of the transcribed full config, on the meta device. Active: what one token's
    forward computes with, the top-k of each layer's routed experts (and the embedding row it reads)."""
    config = family_for_hf_config(HUB[hub_id]["config"]).from_hf_config(HUB[hub_id]["config"])
    if not mtp:
        config.mtp = None
    with torch.device("meta"):
        model = Decoder(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, total - experts * (1 - config.moe.top_k / config.moe.num_experts)


@pytest.mark.parametrize("hub_id, total, active, active_digit", [
    ("XiaomiMiMo/MiMo-V2.6-Flash-RL", 309e9, 15e9, 1e9),  # "309B total parameters and 15B active" (V2-Flash card)
    ("XiaomiMiMo/MiMo-V2.5-Pro", 1.02e12, 42e9, 1e9),  # "1.02T total / 42B active" (SGLang's MiMo-V2.5 cookbook)
    ("XiaomiMiMo/MiMo-V2.6-Pro-RL", 1.02e12, 42e9, 1e9),
])
def test_full_configs_have_the_published_sizes(hub_id, total, active, active_digit):
    """Totals within 2%. The active figures are whole billions: V2.5-Pro's count is 0.3% below 42B, V2.6-Flash's
    15.45B is 3% above 15B (within the figure's own rounding, not within 2%; without the embedding table, 14.82B,
    it is 1.2% below, but Pro's then 2.5%): no one convention puts both within 2%, so the check is the rounding."""
    count, active_count = parameter_counts(hub_id)
    assert count == pytest.approx(total, rel=0.02)
    assert abs(active_count - active) <= active_digit / 2


def test_the_pro_config_builds_the_hubs_tensors():
    """MiMo-V2.5-Pro's hub listing: 1,023,244,718,976 stored elements in its 159,581 tensors (FP8 weights, their
    scale grids, the three MTP layers). Without the scale grids that is this model with its MTP layers, exactly."""
    hub_config = HUB["XiaomiMiMo/MiMo-V2.5-Pro"]["config"]
    family = family_by_name("mimo_v2")
    # the checkpoint's three model.mtp.layers (its config.json does not count them)
    config = family.from_hf_checkpoint(hub_config, [f"model.mtp.layers.{d}.eh_proj.weight" for d in range(3)])
    with torch.device("meta"):
        state = Decoder(config).state_dict()
    scales = 0
    names = 0
    for m in family.weight_map(config):
        for name, part in zip(m.hf, m.hf_from_natives([state[n] for n in m.natives])):
            names += 1
            if family.hub_encoding(name, Q.FP8_BLOCK):
                rows, cols = part.shape
                shards = family.quantization_row_shards(name, hub_config)
                scales += Q.fp8_scale_rows(rows, (128, 128), shards) * -(-cols // 128)
                names += 1
    assert sum(t.numel() for t in state.values()) + scales == 1_023_244_718_976
    assert names == 159_581


def test_model_attention_backend_chooses_the_native_kernel(checkpoint):
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.modules.causal_lm import CausalLM

    config = CausalLM(model=HFModelConfig(hf=str(checkpoint[0]), attention_backend="flex")).resolved_config()
    assert (config.attention.backend, config.sliding_attention.backend) == ("flex", "flex")
    assert CausalLM(model=HFModelConfig(hf=str(checkpoint[0]))).resolved_config().attention.backend == "sdpa"
    through_transformers = CausalLM(model=HFModelConfig(hf=str(checkpoint[0]), native="never", attention_backend="flex"))
    with pytest.raises(ValueError, match="model.attention_backend='flex' chooses the native decoder's kernel"):
        through_transformers.resolved_config()


def test_omni_towers_are_skipped_and_said(tmp_path, caplog):
    """A V2.5/V2.6 omni checkpoint's vision and audio tensors have no native module: import skips them with a
    warning naming them (text-only training); an unknown tensor is still an error."""
    import logging

    from safetensors.torch import load_file, save_file

    source = tmp_path / "hub"
    save_mimo_v2(source, torch.bfloat16, depths=0)
    tensors = load_file(source / "model.safetensors")
    tensors.update({"visual.blocks.0.attn.qkv.weight": torch.zeros(8, 4), "speech_embeddings.weight": torch.zeros(4)})
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="lightning_moe.checkpoint.source"):
        import_hf_checkpoint(source, tmp_path / "native")
    assert "skipping 2 hub tensor(s) 'speech_embeddings.weight', 'visual.blocks.0.attn.qkv.weight'" in caplog.text
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(4)
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected tensor.*q_norm"):
        import_hf_checkpoint(source, tmp_path / "again")
