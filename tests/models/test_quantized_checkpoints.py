"""Quantized hub layouts: block FP8 (DeepSeek-V3) and MXFP4 experts (GPT-OSS).

The reference is transformers' own (de)quantization code and loading path, and torchao's MX encoder:
checkpoints are written in the hub layout by those, imported here, and compared bitwise with what
transformers holds after dequantizing them itself.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_moe_hf import TOL, build_tiny, max_logit_diff, save_tiny

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.io import quantized as Q
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_by_name


def _fp8_quantizer(block):
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = types.SimpleNamespace(weight_block_size=list(block), scale_fmt=None)
    return Fp8Quantize(types.SimpleNamespace(quantization_config=config))


def _write_hub_dir(source: Path, out: Path, tensors: dict[str, torch.Tensor], quantization: dict) -> Path:
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


def _fp8_hub_dir(source: Path, out: Path, block: tuple[int, int]) -> Path:
    """A DeepSeek-V3 checkpoint in the hub's FP8 layout, quantized by transformers' ``Fp8Quantize``."""
    family, quantizer, reader = family_by_name("deepseek_v3"), _fp8_quantizer(block), SafetensorsDir(source)
    tensors = {}
    for name in reader.keys():
        if family.quantizes(name, Q.FP8_BLOCK):
            tensors.update(quantizer._quantize_one(name, reader.get(name)))
        else:
            tensors[name] = reader.get(name)
    config = {**family.hf_quantization_config(Q.FP8_BLOCK), "weight_block_size": list(block)}
    return _write_hub_dir(source, out, tensors, config)


def _mxfp4_hub_dir(source: Path, out: Path) -> Path:
    """A GPT-OSS checkpoint with MXFP4 experts, encoded by torchao (OCP MX, e8m0 scales, low nibble first)."""
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    reader = SafetensorsDir(source)
    tensors = {}
    for name in reader.keys():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = reader.get(name).transpose(-1, -2).contiguous()  # hub: [E, out, in]
            scales, data = to_mx(rows, torch.float4_e2m1fn_x2, 32)
            tensors[name + "_blocks"] = data.view(torch.uint8).reshape(*rows.shape[:-1], -1, 16)
            tensors[name + "_scales"] = scales.view(torch.uint8).reshape(*rows.shape[:-1], -1)
        else:
            tensors[name] = reader.get(name)
    return _write_hub_dir(source, out, tensors, family_by_name("gpt_oss").hf_quantization_config(Q.MXFP4))


def _bf16_as_transformers_saves_it(name: str, out: Path) -> Path:
    """A bf16 checkpoint the way transformers writes one (DeepSeek's router stays fp32)."""
    import transformers

    save_tiny(name, out.with_name(out.name + "_fp32"))
    transformers.AutoModelForCausalLM.from_pretrained(out.with_name(out.name + "_fp32"), dtype=torch.bfloat16).save_pretrained(out)
    return out


def _transformers_dequantized(hub_dir: Path, out: Path, method: str) -> Path:
    """transformers loads the quantized checkpoint, dequantizing it itself, and saves what it holds."""
    import transformers

    config = transformers.FineGrainedFP8Config(dequantize=True) if method == Q.FP8_BLOCK else transformers.Mxfp4Config(
        dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hub_dir, quantization_config=config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------- encodings
@pytest.mark.parametrize("block", [(128, 128), (32, 16)])
def test_fp8_block_encoding_equals_transformers(block):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 256, 384, generator=gen) * torch.logspace(-3, 1, 384)
    weight[0, :128, :128] = 0  # an all-zero tile keeps scale 1
    expected = _fp8_quantizer(block)._quantize_one("w.weight", weight)
    fp8, scale_inv = Q.quantize_fp8_block(weight, block)
    assert torch.equal(fp8.view(torch.uint8), expected["w.weight"].view(torch.uint8))
    assert torch.equal(scale_inv, expected["w.weight_scale_inv"])
    dequantize = Fp8Dequantize(None)._dequantize_one
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(Q.dequantize_fp8_block(fp8, scale_inv, dtype, block), dequantize(fp8, scale_inv, dtype))


def test_fp8_partial_edge_tiles_equal_transformers():
    """DeepSeek's shapes are not all multiples of 128 (e.g. kv_a_proj_with_mqa's 576 rows): edge tiles are partial."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    fp8, scale_inv = Q.quantize_fp8_block(weight)
    assert scale_inv.shape == (2, 3)
    expected = _dequantize_fp8_weight(fp8, scale_inv, [128, 128], torch.float32)
    assert torch.equal(Q.dequantize_fp8_block(fp8, scale_inv, torch.float32), expected)
    assert (expected - weight).abs().max() <= weight.abs().max() / 8  # e4m3: 3 mantissa bits


def test_mxfp4_encoding_equals_torchao_and_transformers():
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 16, 128, generator=gen) * torch.logspace(-4, 2, 16)[:, None]
    rows[0, 0, :32] = 0
    blocks, scales = Q.quantize_mxfp4(rows)
    ao_scales, ao_data = to_mx(rows, torch.float4_e2m1fn_x2, 32)
    assert torch.equal(scales, ao_scales.view(torch.uint8).reshape(scales.shape))
    assert torch.equal(blocks, ao_data.view(torch.uint8).reshape(blocks.shape))
    random_blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    random_scales = torch.randint(100, 150, (3, 8, 4), dtype=torch.uint8, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        expected = convert_moe_packed_tensors(random_blocks, random_scales, dtype=dtype)  # [E, in, out]
        assert torch.equal(Q.dequantize_mxfp4(random_blocks, random_scales, dtype).transpose(1, 2), expected)


# ---------------------------------------------------------------------------------------------- checkpoints
def test_fp8_checkpoint_import_equals_transformers_dequantization(tmp_path):
    import transformers

    bf16 = _bf16_as_transformers_saves_it("deepseek_v3", tmp_path / "bf16")
    fp8 = _fp8_hub_dir(bf16, tmp_path / "fp8", (8, 8))
    reference = _transformers_dequantized(fp8, tmp_path / "reference", Q.FP8_BLOCK)
    import_hf_checkpoint(fp8, tmp_path / "native")
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export")
    report = verify_hf_checkpoints(reference, tmp_path / "export")
    assert report.ok, report.summary()
    assert "quantization_config" not in json.loads((tmp_path / "export" / "config.json").read_text())

    # asked to, export re-quantizes to the source's layout, as transformers' quantizer would
    export_hf_checkpoint(tmp_path / "native", tmp_path / "fp8_export", quantize=Q.FP8_BLOCK)
    requantized = _fp8_hub_dir(tmp_path / "export", tmp_path / "requantized", (8, 8))
    report = verify_hf_checkpoints(requantized, tmp_path / "fp8_export")
    assert report.ok, report.summary()
    written = json.loads((tmp_path / "fp8_export" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "fp8" and written["weight_block_size"] == [8, 8]
    assert set(SafetensorsDir(tmp_path / "fp8_export").keys()) == set(SafetensorsDir(fp8).keys())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8_export", quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    assert model.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16


def test_fp8_export_of_a_bf16_checkpoint_loads_in_transformers(tmp_path):
    import transformers

    hf = build_tiny("deepseek_v3").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    export_hf_checkpoint(tmp_path / "bf16", tmp_path / "fp8", quantize=Q.FP8_BLOCK)
    out = SafetensorsDir(tmp_path / "fp8")
    assert out.dtype("model.layers.1.mlp.experts.0.up_proj.weight") == torch.float8_e4m3fn
    assert out.dtype("model.layers.1.mlp.gate.weight") == torch.bfloat16  # the router stays bf16
    assert out.shape("model.layers.1.self_attn.kv_b_proj.weight_scale_inv") == (1, 1)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).eval()
    ids = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        assert (loaded(ids).logits.float() - hf(ids).logits.float()).abs().max() < 0.1


def test_mxfp4_checkpoint_round_trip(tmp_path):
    bf16 = save_tiny("gpt_oss", tmp_path / "bf16", torch.bfloat16)
    mxfp4 = _mxfp4_hub_dir(bf16, tmp_path / "mxfp4")
    reference = _transformers_dequantized(mxfp4, tmp_path / "reference", Q.MXFP4)
    import_hf_checkpoint(mxfp4, tmp_path / "native")
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export")
    report = verify_hf_checkpoints(reference, tmp_path / "export")
    assert report.ok, report.summary()

    # bf16 holds every MXFP4 value exactly, so re-encoding gives back the hub bytes
    export_hf_checkpoint(tmp_path / "native", tmp_path / "mxfp4_export", quantize=Q.MXFP4)
    report = verify_hf_checkpoints(mxfp4, tmp_path / "mxfp4_export")
    assert report.ok, report.summary()
    config = json.loads((tmp_path / "mxfp4_export" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"


def test_mxfp4_import_logits_equal_transformers(tmp_path):
    import transformers

    from lightning_moe.checkpoint.load import load_pretrained

    mxfp4 = _mxfp4_hub_dir(save_tiny("gpt_oss", tmp_path / "bf16"), tmp_path / "mxfp4")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    ours = load_pretrained(mxfp4, dtype=torch.float32)
    ids = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(5))
    assert max_logit_diff(theirs, ours, ids) <= TOL


def test_fp8_layout_of_the_mtp_layer_is_the_hubs():
    """Which tensors of DeepSeek-V3's MTP layer (``model.layers.61``) the hub stores as FP8 blocks: its decoder
    layer's linears, but not the embedding/head copies, the norms, the router or ``eh_proj`` (bf16 on the hub)."""
    family, layer = family_by_name("deepseek_v3"), "model.layers.61"
    fp8 = [f"{layer}.self_attn.q_a_proj.weight", f"{layer}.self_attn.kv_b_proj.weight",
           f"{layer}.mlp.experts.0.up_proj.weight", f"{layer}.mlp.shared_experts.down_proj.weight"]
    bf16 = [f"{layer}.eh_proj.weight", f"{layer}.enorm.weight", f"{layer}.hnorm.weight",
            f"{layer}.embed_tokens.weight", f"{layer}.shared_head.head.weight", f"{layer}.shared_head.norm.weight",
            f"{layer}.mlp.gate.weight", f"{layer}.mlp.gate.e_score_correction_bias",
            f"{layer}.self_attn.kv_a_layernorm.weight"]
    assert [n for n in fp8 if not family.quantizes(n, Q.FP8_BLOCK)] == []
    assert [n for n in bf16 if family.quantizes(n, Q.FP8_BLOCK)] == []


# ---------------------------------------------------------------------------------------------- errors
def test_quantized_layout_errors(tmp_path):
    from safetensors.torch import load_file

    bf16 = save_tiny("deepseek_v3", tmp_path / "bf16", torch.bfloat16)
    fp8 = _fp8_hub_dir(bf16, tmp_path / "fp8", (8, 8))
    with pytest.raises(ValueError, match="quantize='int4' is not a hub layout"):
        export_hf_checkpoint(fp8, tmp_path / "a", quantize="int4")
    with pytest.raises(ValueError, match="deepseek_v3 checkpoints have no such hub layout"):
        export_hf_checkpoint(fp8, tmp_path / "b", quantize=Q.MXFP4)

    tensors = load_file(fp8 / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv has shape \(1, 1\), expected \(8, 6\)"):
        import_hf_checkpoint(fp8, tmp_path / "c")
    del tensors["model.layers.0.self_attn.o_proj.weight"]
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"scale model.layers.0.self_attn.o_proj.weight_scale_inv has no weight"):
        import_hf_checkpoint(fp8, tmp_path / "d")

    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (bf16 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='bitsandbytes' is not supported"):
        import_hf_checkpoint(bf16, tmp_path / "e")

    with pytest.raises(ValueError, match="cannot store .*down_proj as MXFP4: its input dimension 16"):
        Q.quantized_hub_tensors("model.layers.0.mlp.experts.down_proj", torch.zeros(4, 16, 64), Q.MXFP4)
