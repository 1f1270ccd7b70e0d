"""Bad checkpoints fail with one clear line, a non-zero exit and no output directory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from distributed_harness import HANG_GUARD_S
from safetensors.torch import load_file, save_file
from tiny_hf import save_tiny

from lightning_moe.convert_command import main as convert_main


def _edit_tensors(hf_dir, edit):
    shard = next(hf_dir.glob("model*.safetensors"))
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def _import_fails(tmp_path, capsys, hf_dir, *expected):
    out = tmp_path / "out"
    capsys.readouterr()  # drop what building the fixture printed
    assert convert_main(["import", "--hf-path", str(hf_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    for text in expected:
        assert text in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]


@pytest.fixture
def hf_dir(tmp_path):
    return save_tiny("llama", tmp_path / "hf")


def test_missing_config(tmp_path, capsys, hf_dir):
    (hf_dir / "config.json").unlink()
    _import_fails(tmp_path, capsys, hf_dir, "missing config.json")


def test_unknown_architecture_lists_supported(tmp_path, capsys, hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    _import_fails(tmp_path, capsys, hf_dir, "'FalconForCausalLM'", "LlamaForCausalLM", "Qwen3MoeForCausalLM")


def test_missing_tensor_is_named(tmp_path, capsys, hf_dir):
    _edit_tensors(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _import_fails(tmp_path, capsys, hf_dir, "missing tensor", "model.layers.1.mlp.up_proj.weight")


def test_unexpected_tensor_is_named(tmp_path, capsys, hf_dir):
    _edit_tensors(hf_dir, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    _import_fails(tmp_path, capsys, hf_dir, "unexpected tensor", "model.layers.0.extra.weight")


def test_shape_mismatch_names_tensor_and_shapes(tmp_path, capsys, hf_dir):
    _edit_tensors(hf_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 60)}))
    _import_fails(tmp_path, capsys, hf_dir, "model.layers.0.self_attn.q_proj.weight", "(64, 60)", "(64, 64)")


def test_unreadable_file(tmp_path, capsys, hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    _import_fails(tmp_path, capsys, hf_dir, "model.safetensors", "unreadable")


def test_existing_output_is_not_overwritten(tmp_path, capsys, hf_dir):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert convert_main(["import", "--hf-path", str(hf_dir), "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (out / "keep.txt").exists()


def test_console_script_round_trip(tmp_path, hf_dir):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "lightning_moe.cli", "convert", *args],
                              capture_output=True, text=True, timeout=HANG_GUARD_S)

    assert run("import", "--hf-path", str(hf_dir), "--out", str(tmp_path / "native")).returncode == 0
    assert run("export", "--ckpt", str(tmp_path / "native"), "--out", str(tmp_path / "export")).returncode == 0
    ok = run("verify", "--reference", str(hf_dir), "--candidate", str(tmp_path / "export"))
    assert ok.returncode == 0
    assert ok.stdout.strip().endswith("parameters: all match in name, shape, dtype and value")
    _edit_tensors(tmp_path / "export", lambda t: t["model.norm.weight"].mul_(2))
    bad = run("verify", "--reference", str(hf_dir), "--candidate", str(tmp_path / "export"))
    assert bad.returncode == 1 and "model.norm.weight: values differ" in bad.stdout


def test_outputs_have_the_permissions_of_any_new_directory(tmp_path, hf_dir):
    """Written under a temporary name, an output still gets the umask's permissions (shared model directories)."""
    import os

    (tmp_path / "plain").mkdir()
    assert convert_main(["import", "--hf-path", str(hf_dir), "--out", str(tmp_path / "native")]) == 0
    assert convert_main(["export", "--ckpt", str(tmp_path / "native"), "--out", str(tmp_path / "export")]) == 0
    expected = os.stat(tmp_path / "plain").st_mode
    assert os.stat(tmp_path / "native").st_mode == expected
    assert os.stat(tmp_path / "export").st_mode == expected


def test_overwrite_replaces_an_output_file_or_directory(tmp_path):
    from lightning_moe.io.atomic import atomic_directory

    for existing in ("dir", "file"):
        out = tmp_path / existing
        if existing == "dir":
            out.mkdir()
            (out / "old.txt").write_text("old")
        else:
            out.write_text("old")
        with atomic_directory(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
        assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]  # no temporary left behind


def test_cached_rotary_tables_of_old_hub_files_are_skipped(tmp_path, hf_dir):
    """Llama-2's hub safetensors still hold each layer's ``rotary_emb.inv_freq`` buffer: not a weight."""
    from lightning_moe.checkpoint.load import load_pretrained

    reference = load_pretrained(hf_dir)
    _edit_tensors(hf_dir, lambda t: t.update(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(2)}))
    assert convert_main(["import", "--hf-path", str(hf_dir), "--out", str(tmp_path / "native")]) == 0
    ids = torch.randint(0, 160, (1, 12))
    assert torch.equal(load_pretrained(tmp_path / "native")(ids), reference(ids))
