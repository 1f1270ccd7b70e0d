"""Import -> export -> verify is bitwise for every family, and the export loads in transformers."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_hf import FAMILIES, save_tiny

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.io.safetensors_io import SafetensorsDir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_is_bitwise(tmp_path, family, dtype):
    import transformers

    hf = save_tiny(family, tmp_path / "hf", dtype)
    import_hf_checkpoint(hf, tmp_path / "native")
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export")

    report = verify_hf_checkpoints(hf, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hf).keys())
    assert "all match in name, shape, dtype and value" in report.summary()

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=dtype)
    original = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=dtype)
    for (name, a), (_, b) in zip(original.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_sharded_input_and_output(tmp_path):
    hf = save_tiny("qwen3_moe", tmp_path / "hf", max_shard_size="100KB")
    assert len(list(hf.glob("model-*.safetensors"))) > 1
    import_hf_checkpoint(hf, tmp_path / "native", max_shard_bytes=50_000)
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export", max_shard_bytes=80_000)
    shards = sorted(p.name for p in (tmp_path / "export").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert verify_hf_checkpoints(hf, tmp_path / "export").ok


def test_export_dtype_cast_and_aux_files(tmp_path):
    import transformers

    hf = save_tiny("llama", tmp_path / "hf")
    (hf / "tokenizer_config.json").write_text("{}")
    import_hf_checkpoint(hf, tmp_path / "native")
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export", dtype=torch.bfloat16)
    out = SafetensorsDir(tmp_path / "export")
    assert {out.dtype(n) for n in out.keys()} == {torch.bfloat16}
    assert (tmp_path / "export" / "tokenizer_config.json").exists()
    assert (tmp_path / "export" / "generation_config.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert model.config.architectures == ["LlamaForCausalLM"]


def test_verify_reports_every_mismatch(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = save_tiny("llama", tmp_path / "a")
    other = save_tiny("llama", tmp_path / "b")
    shard = other / "model.safetensors"
    tensors = load_file(shard)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.bfloat16)
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    report = verify_hf_checkpoints(hf, other)
    assert not report.ok
    text = report.summary()
    assert "model.norm.weight: values differ" in text
    assert "lm_head.weight: dtype torch.float32 != torch.bfloat16" in text
    assert "model.embed_tokens.weight: missing from candidate" in text


def test_verify_compares_scalars_and_empty_tensors(tmp_path):
    from safetensors.torch import save_file

    tensors = {"scale": torch.tensor(0.5), "empty": torch.zeros(0, 4), "flags": torch.tensor([True, False])}
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    assert verify_hf_checkpoints(tmp_path / "a", tmp_path / "b").ok
    save_file({**tensors, "scale": torch.tensor(0.25)}, str(tmp_path / "b" / "model.safetensors"))
    report = verify_hf_checkpoints(tmp_path / "a", tmp_path / "b")
    assert report.mismatches == ["scale: values differ (max abs diff 0.25)"]


def test_sharded_writer_refuses_a_name_written_to_an_earlier_shard(tmp_path):
    from lightning_moe.io.safetensors_io import ShardedWriter

    writer = ShardedWriter(tmp_path, max_shard_bytes=8)
    for name in ("a", "b", "c"):
        writer.add(name, torch.zeros(2))
    with pytest.raises(ValueError, match="tensor 'a' written twice"):
        writer.add("a", torch.zeros(2))
    assert writer.finish() == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
