"""Qwen3-Next's hub MTP layer (``mtp.*``, which transformers ignores) as one native MTP depth: a synthetic hub
checkpoint (a tiny transformers model plus ``mtp.*`` tensors of the hub's names and shapes) imports, exports
bitwise with its MTP tensors, and the native MTP loss equals one computed from the hub tensors with transformers'
own Qwen3-Next decoder layer and norms. Names: vLLM's and LightLLM's Qwen3-Next MTP loaders (``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm``, ``mtp.layers.0.*``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_qwen3_next import build_tiny, hf_config

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_by_name

FULL_ATTENTION_LAYER = 2  # LAYER_TYPES of test_qwen3_next: the hub's MTP layer is a full-attention MoE layer


def hub_mtp_tensors(backbone: dict[str, torch.Tensor], hidden: int, seed: int = 3) -> dict[str, torch.Tensor]:
    """The hub's MTP names: fc [hidden, 2 hidden], three norms, and ``mtp.layers.0`` named and shaped as a
    full-attention MoE layer of the checkpoint (per-expert tensors, as the hub and transformers store them),
    with fresh random values."""
    gen = torch.Generator().manual_seed(seed)
    layer = f"model.layers.{FULL_ATTENTION_LAYER}."
    tensors = {f"mtp.layers.0.{name.removeprefix(layer)}": torch.randn(t.shape, generator=gen) * 0.1
               for name, t in backbone.items() if name.startswith(layer)}
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.1
    return tensors


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("qwen3_next_hub")
    model = build_tiny()
    model.save_pretrained(path)
    backbone = load_file(path / "model.safetensors")
    mtp = hub_mtp_tensors(backbone, model.config.hidden_size)
    save_file({**backbone, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    # transformers' own decoder layer holding the MTP layer's weights: a copy of the checkpoint whose
    # full-attention layer is the MTP layer, loaded by transformers (which fuses the per-expert tensors)
    as_layer = tmp_path_factory.mktemp("mtp_layer_in_transformers")
    model.save_pretrained(as_layer)
    swapped = {**backbone, **{f"model.layers.{FULL_ATTENTION_LAYER}.{k.removeprefix('mtp.layers.0.')}": v
                              for k, v in mtp.items() if k.startswith("mtp.layers.0.")}}
    save_file(swapped, as_layer / "model.safetensors", metadata={"format": "pt"})
    from transformers import Qwen3NextForCausalLM

    layer = Qwen3NextForCausalLM.from_pretrained(as_layer, dtype=torch.float32).model.layers[FULL_ATTENTION_LAYER]
    return model, mtp, path, layer.eval()


def test_import_export_is_bitwise_with_the_mtp_tensors(tmp_path, hub):
    _, mtp, path, _ = hub
    native = import_hf_checkpoint(path, tmp_path / "native")
    names = set(SafetensorsDir(native).keys())
    assert {"mtp.depths.0.eh_proj.weight", "mtp.depths.0.enorm.weight", "mtp.depths.0.final_norm.weight",
            "mtp.depths.0.layers.0.attn.q_proj.weight", "mtp.depths.0.layers.1.moe.shared_expert_gate.weight"} <= names
    export_hf_checkpoint(native, tmp_path / "export")
    report = verify_hf_checkpoints(path, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(path).keys())
    assert set(mtp) <= set(SafetensorsDir(tmp_path / "export").keys())
    assert json.loads((tmp_path / "export" / "config.json").read_text())["mtp_num_hidden_layers"] == 1



def test_the_hub_mtp_layer_shared_by_two_depths_exports_bitwise(tmp_path, hub):
    """``model.mtp_shared_depths: 2`` (Megatron's repeated MTP layer): the hub's one MTP layer runs at both depths
    (two MTP losses) and is exported back as the hub holds it."""
    from test_nemotron_h import native_from_hub

    from lightning_moe.checkpoint.convert import export_model

    hf, _, path, _ = hub
    model, source = native_from_hub(path, mtp_shared_depths=2)
    assert (model.config.mtp.num_layers, len(model.mtp.depths)) == (2, 1)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    out = model(ids, labels=ids.roll(-1, dims=1))
    assert len(out.mtp_loss_sums) == 2 and all(torch.isfinite(loss) for loss in out.mtp_loss_sums)
    export_model(model, tmp_path / "export", hf_config=source.hf_config)
    report = verify_hf_checkpoints(path, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(path).keys())
    assert family_by_name("qwen3_next").to_hf_config(model.config)["mtp_num_hidden_layers"] == 1

def one_plus_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    norm = Qwen3NextRMSNorm(x.shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)


def test_mtp_loss_equals_the_hub_layer_run_by_transformers(hub):
    """depth 1 at position t: ``norm(layer(fc([norm_e(embed(x[t+1])) | norm_h(h[t])])))``, scored by the shared
    output layer against ``labels[t + 1]``."""
    hf, mtp, path, layer = hub
    native = load_pretrained(path).eval()
    assert native.config.mtp.num_layers == 1 and native.config.mtp.pattern == "*E"
    seq = 20
    ids = torch.randint(0, hf.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(4))
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        out = native(ids, labels=labels)
        eps = hf.config.rms_norm_eps
        hidden = hf.model(ids).last_hidden_state  # after the final norm
        ahead = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        x = torch.cat([one_plus_rms_norm(hf.model.embed_tokens(ahead), mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                       one_plus_rms_norm(hidden, mtp["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
        x = F.linear(x, mtp["mtp.fc.weight"])
        positions = torch.arange(seq)[None].expand(2, -1)
        x = layer(x, position_embeddings=hf.model.rotary_emb(x, positions), attention_mask=None,
                  position_ids=positions)
        x = x[0] if isinstance(x, tuple) else x
        logits = hf.lm_head(one_plus_rms_norm(x, mtp["mtp.norm.weight"], eps))
        target = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        want = F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(), ignore_index=-100, reduction="sum")
    assert out.mtp_label_tokens[0].item() == (target != -100).sum().item()
    assert want.item() > 1.0
    torch.testing.assert_close(out.mtp_loss_sums[0], want, atol=1e-4, rtol=1e-5)


def test_transformers_checkpoint_builds_no_mtp_and_other_depths_are_refused():
    family = family_by_name("qwen3_next")
    hf = {**hf_config().to_dict(), "mtp_num_hidden_layers": 1}
    assert family.from_hf_config(hf).mtp.num_layers == 1
    assert family.from_hf_checkpoint(hf, ["model.embed_tokens.weight"]).mtp is None
    with pytest.raises(ValueError, match=r"MTP layers \['0', '1'\]"):
        family.from_hf_checkpoint(hf, ["mtp.fc.weight", "mtp.layers.0.input_layernorm.weight",
                                       "mtp.layers.1.input_layernorm.weight"])
    with pytest.raises(ValueError, match=r"MTP layers \[\]"):
        family.from_hf_checkpoint(hf, ["mtp.fc.weight"])
