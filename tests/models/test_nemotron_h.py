"""Nemotron-H: config translation, hub-layout round trip with MTP tensors, logits against transformers (plain and
packed rows), the MTP forward against its hub definition and an MTP training step, one hub MTP layer shared over
two depths (Megatron's repeated MTP layer) and MTP switched off through ``model.hf``, training FLOPs against
FlopCounterMode, and LoRA on Mamba, expert and MTP layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_moe.checkpoint.convert import (
    export_hf_checkpoint,
    import_hf_checkpoint,
    verify_hf_checkpoints,
)
from lightning_moe.checkpoint.load import load_pretrained
from lightning_moe.io.safetensors_io import SafetensorsDir
from lightning_moe.models.families import family_by_name, family_for_hf_config

LAYERS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"]
MTP_LAYERS = ["full_attention", "moe"]
DEPTHS = 2
TOL = 1e-4


def hf_config(latent: int | None = 24, **overrides):
    from transformers import NemotronHConfig

    kwargs = dict(
        architectures=["NemotronHForCausalLM"], vocab_size=128, hidden_size=64, layers_block_type=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
        conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, moe_latent_size=latent, n_group=2, topk_group=1,
        routed_scaling_factor=1.5, num_nextn_predict_layers=DEPTHS, mtp_layers_block_type=MTP_LAYERS,
    )
    kwargs.update(overrides)
    return NemotronHConfig(**kwargs)


def build_tiny(latent: int | None = 24, seed: int = 0, depths: int = DEPTHS):
    """Random transformers model; norms near 1 and a non-zero expert bias, so nothing is degenerate."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(hf_config(latent, num_nextn_predict_layers=depths)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") or name.endswith("norm_f.weight") else 0.0, 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    return model


def add_hub_mtp_tensors(directory: Path, seed: int = 0, depths: int = DEPTHS) -> list[str]:
    """Write MTP tensors in the hub's naming next to a transformers-saved checkpoint (which has none):
    ``mtp.layers.{d*L + j}`` named like the backbone layer of the same type, plus ``eh_proj``/``enorm``/``hnorm``
    on the first inner layer of each depth and ``final_layernorm`` on the last. Returns the names added."""
    from safetensors.torch import load_file, save_file

    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    hidden = tensors["backbone.embeddings.weight"].shape[1]
    gen = torch.Generator().manual_seed(seed)
    added = {}
    for d in range(depths):
        for j, kind in enumerate(MTP_LAYERS):
            template = f"backbone.layers.{LAYERS.index(kind)}."
            flat = f"mtp.layers.{d * len(MTP_LAYERS) + j}."
            for name, t in tensors.items():
                if name.startswith(template):
                    added[flat + name[len(template):]] = torch.randn(t.shape, generator=gen).to(t.dtype) * 0.1
            if j == 0:
                added[flat + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
                added[flat + "enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
                added[flat + "hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
            if j == len(MTP_LAYERS) - 1:
                added[flat + "final_layernorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    save_file({**tensors, **added}, shard, metadata={"format": "pt"})
    return sorted(added)


@pytest.fixture(scope="module")
def hub_checkpoint(tmp_path_factory):
    """(transformers model, directory): the model saved by transformers, plus hub-named MTP tensors."""
    path = tmp_path_factory.mktemp("nemotron_h")
    model = build_tiny()
    model.save_pretrained(path)
    add_hub_mtp_tensors(path)
    return model, path


@pytest.fixture(scope="module")
def one_mtp_layer_hub(tmp_path_factory):
    """(transformers model, directory) of a checkpoint holding one MTP layer, as Nemotron 3.5 Lightning's."""
    path = tmp_path_factory.mktemp("nemotron_h_one_mtp_layer")
    model = build_tiny(depths=1)
    model.save_pretrained(path)
    add_hub_mtp_tensors(path, depths=1)
    return model, path


def native_from_hub(path: Path, **settings):
    """The native decoder ``CausalLM(model={hf: path, **settings})`` trains, with the checkpoint's weights, and
    that checkpoint."""
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.modules.causal_lm import CausalLM, build_decoder

    module = CausalLM(model=HFModelConfig(hf=str(path), native="always", **settings))
    config = module.resolved_config()
    return build_decoder(config, source=module._checkpoint()), module._checkpoint()


# ---------------------------------------------------------------------------------- config
def test_config_reads_pattern_mtp_and_settings():
    hf = hf_config().to_dict()
    cfg = family_for_hf_config(hf).from_hf_config(hf)
    assert cfg.pattern == "ME*-ME"
    assert (cfg.mtp.num_layers, cfg.mtp.pattern, cfg.mtp.loss_scale) == (2, "*E", 0.3)
    assert cfg.attention.rope.type == "none" and (cfg.attention.num_heads, cfg.attention.num_kv_heads) == (4, 2)
    assert (cfg.mlp.activation, cfg.moe.activation, cfg.moe.score_func) == ("relu2", "relu2", "sigmoid")
    assert (cfg.moe.latent_size, cfg.moe.shared_size, cfg.moe.n_group, cfg.moe.topk_group) == (24, 48, 2, 1)
    assert cfg.moe.score_correction_bias and cfg.moe.routed_scaling_factor == 1.5
    assert (cfg.mamba.num_heads, cfg.mamba.head_dim, cfg.mamba.state_size, cfg.mamba.chunk_size) == (8, 16, 16, 8)
    assert cfg.mamba.time_step_limit == (hf["time_step_min"], float("inf"))


def test_legacy_pattern_strings_give_the_same_model():
    hf = hf_config().to_dict()
    legacy = {k: v for k, v in hf.items() if k not in ("layers_block_type", "mtp_layers_block_type")}
    legacy.update(hybrid_override_pattern="ME*-ME", mtp_hybrid_override_pattern="*E")
    family = family_by_name("nemotron_h")
    assert family.from_hf_config(legacy) == family.from_hf_config(hf)


def test_to_hf_config_loads_in_transformers_and_translates_back():
    from transformers import NemotronHConfig

    family = family_by_name("nemotron_h")
    cfg = family.from_hf_config(hf_config().to_dict())
    exported = family.to_hf_config(cfg)
    reloaded = NemotronHConfig(**{k: v for k, v in exported.items() if k != "architectures"})
    assert reloaded.layers_block_type == LAYERS and reloaded.mtp_layers_block_type == MTP_LAYERS
    assert family.from_hf_config(reloaded.to_dict()) == cfg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layers_block_type": ["mamba", "rwkv"]}, "unknown layer types ['rwkv']"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' is not supported"),
        ({"mamba_num_heads": None}, "required key 'mamba_num_heads' is missing"),
    ],
)
def test_config_errors_name_the_key(change, message):
    hf = {**hf_config().to_dict(), **change}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        family_by_name("nemotron_h").from_hf_config(hf)


# ---------------------------------------------------------------------------------- checkpoints
def test_hub_checkpoint_with_mtp_round_trips_bitwise(tmp_path, hub_checkpoint):
    import transformers

    _, hub = hub_checkpoint
    hub_names = SafetensorsDir(hub).keys()
    mtp_names = [n for n in hub_names if n.startswith("mtp.")]
    assert len(mtp_names) > 40
    import_hf_checkpoint(hub, tmp_path / "native")
    native_names = SafetensorsDir(tmp_path / "native").keys()
    assert any(n.startswith("mtp.depths.1.layers.1.moe.experts.") for n in native_names)
    export_hf_checkpoint(tmp_path / "native", tmp_path / "export")

    report = verify_hf_checkpoints(hub, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(hub_names)
    assert set(SafetensorsDir(tmp_path / "export").keys()) >= set(mtp_names)

    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["num_nextn_predict_layers"] == DEPTHS
    original = transformers.AutoModelForCausalLM.from_pretrained(hub)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    for (name, a), (_, b) in zip(original.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_transformers_checkpoint_imports_without_mtp(tmp_path, dtype):
    build_tiny(latent=None).to(dtype).save_pretrained(tmp_path / "hf")
    native = import_hf_checkpoint(tmp_path / "hf", tmp_path / "native")
    assert json.loads((native / "model_config.json").read_text())["mtp"] is None
    export_hf_checkpoint(native, tmp_path / "export")
    report = verify_hf_checkpoints(tmp_path / "hf", tmp_path / "export")
    assert report.ok, report.summary()


def test_tied_native_model_exports_what_transformers_loads(tmp_path):
    """transformers' NemotronH never ties lm_head to the embedding, so a tied native model writes both."""
    import transformers

    from lightning_moe.checkpoint.convert import export_model
    from lightning_moe.models.decoder import Decoder

    cfg = family_by_name("nemotron_h").from_hf_config(hf_config(num_nextn_predict_layers=0).to_dict())
    cfg.tie_embeddings = True
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    model.init_weights()
    export_model(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("latent", [24, None], ids=["latent_moe", "moe"])
def test_logits_equal_transformers(tmp_path, latent):
    hf = build_tiny(latent, seed=3)
    hf.save_pretrained(tmp_path)
    native = load_pretrained(tmp_path)
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(ids).logits, native(ids)
    assert expected.abs().max() > 1.0  # not a degenerate comparison
    assert (got - expected).abs().max().item() <= TOL


def test_packed_row_equals_sequences_alone(hub_checkpoint):
    hf, path = hub_checkpoint
    native = load_pretrained(path)
    assert native.mtp is not None
    lengths = [5, 17, 1, 10]  # starts inside chunks and on a chunk boundary (chunk 8), a 1-token sequence
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        got = native(torch.cat(seqs)[None], position_ids=positions)[0]
        expected = torch.cat([hf(s[None]).logits[0] for s in seqs])
    assert (got - expected).abs().max().item() <= TOL


# ---------------------------------------------------------------------------------- MTP
def hub_block(hf_model, kind: str, tensors: dict[str, torch.Tensor], prefix: str):
    """transformers' own layer of type ``kind`` holding the hub tensors under ``prefix`` (experts stacked as
    transformers keeps them in memory)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    block = NemotronHBlock(hf_model.config, layer_idx=LAYERS.index(kind)).eval()
    state = {}
    for name, param in block.state_dict().items():
        if ".experts." in name:
            proj = name.rsplit(".", 1)[1]
            state[name] = torch.stack([tensors[f"{prefix}mixer.experts.{e}.{proj}.weight"] for e in range(len(param))])
        else:
            state[name] = tensors[prefix + name]
    block.load_state_dict(state, strict=True)
    return block


def hub_mtp_losses(hf_model, tensors: dict[str, torch.Tensor], ids, labels, depths: int = DEPTHS,
                   shared: bool = False):
    """Per-depth loss sums from the hub's MTP definition (Megatron-Bridge / vLLM), built from transformers' layers
    and the hub tensors by their hub names: depth d embeds the tokens d ahead, computes
    ``eh_proj([enorm(embedding), hnorm(previous)])`` where ``previous`` is the main model's final-normed output
    (then the previous depth's output), runs its layers and ``final_layernorm``, and predicts ``labels[t + d]``.
    ``shared``: every depth runs the hub's first MTP layer (``mtp.layers.{j}``), unrolled here depth by depth."""
    import torch.nn.functional as F

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf_model.config.layer_norm_epsilon))

    previous = hf_model.model(ids).last_hidden_state
    sums = []
    for d in range(1, depths + 1):
        layer = 0 if shared else d - 1
        first = f"mtp.layers.{layer * len(MTP_LAYERS)}."
        embedded = hf_model.model.embeddings(ids[:, d:])
        h = torch.cat([rms(embedded, tensors[first + "enorm.weight"]),
                       rms(previous[:, :-1], tensors[first + "hnorm.weight"])], dim=-1)
        h = F.linear(h, tensors[first + "eh_proj.weight"])
        for j, kind in enumerate(MTP_LAYERS):
            prefix = f"mtp.layers.{layer * len(MTP_LAYERS) + j}."
            h = hub_block(hf_model, kind, tensors, prefix)(h)
        previous = rms(h, tensors[prefix + "final_layernorm.weight"])
        logits = hf_model.lm_head(previous).float()
        sums.append(F.cross_entropy(logits.flatten(0, 1), labels[:, d:].flatten(), reduction="sum"))
    return sums


def test_mtp_forward_matches_hub_definition_and_trains(hub_checkpoint):
    from safetensors.torch import load_file

    hf, path = hub_checkpoint
    model = load_pretrained(path).train()
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    out = model(ids, labels=labels)
    assert [int(c) for c in out.mtp_label_tokens] == [2 * (20 - d) for d in range(1, DEPTHS + 1)]
    with torch.no_grad():
        expected = hub_mtp_losses(hf, load_file(path / "model.safetensors"), ids, labels)
    for got, want in zip(out.mtp_loss_sums, expected, strict=True):
        assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=1e-5)
    (out.loss_sum + 0.3 * sum(out.mtp_loss_sums)).backward()
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_mtp_losses_of_a_packed_row_are_those_of_its_sequences(hub_checkpoint):
    """No MTP depth predicts across a packed boundary or lets a sequence see another one."""
    _, path = hub_checkpoint
    model = load_pretrained(path)
    lengths = [6, 13, 2, 9]  # a 2-token sequence has no depth-2 target at all
    gen = torch.Generator().manual_seed(6)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in lengths]
    labels = [torch.cat([s[1:], torch.tensor([-100])]) for s in seqs]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], positions, labels=torch.cat(labels)[None])
        alone = [model(s[None], labels=y[None]) for s, y in zip(seqs, labels)]
    for d in range(DEPTHS):
        assert int(packed.mtp_label_tokens[d]) == sum(int(a.mtp_label_tokens[d]) for a in alone)
        expected = sum(a.mtp_loss_sums[d] for a in alone)
        assert packed.mtp_loss_sums[d].item() == pytest.approx(expected.item(), rel=1e-5)


def test_disabled_mtp_keeps_weights_and_skips_its_loss(hub_checkpoint):
    _, path = hub_checkpoint
    model = load_pretrained(path)
    model.config.mtp.enabled = False
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    out = model(ids, labels=ids)
    assert out.mtp_loss_sums == [] and any(n.startswith("mtp.depths.1.") for n in model.state_dict())


def test_one_shared_mtp_layer_imports_and_exports_bitwise(tmp_path, one_mtp_layer_hub):
    """The hub's one MTP layer, applied at 2 depths (``model.mtp_shared_depths``), is one set of weights that the
    export writes back as the hub's files, tensor for tensor and bit for bit."""
    from lightning_moe.checkpoint.convert import export_model

    _, hub = one_mtp_layer_hub
    model, source = native_from_hub(hub, mtp_shared_depths=2)
    assert (model.config.mtp.num_layers, model.config.mtp.shared, len(model.mtp.depths)) == (2, True, 1)
    export_model(model, tmp_path / "export", hf_config=source.hf_config)
    report = verify_hf_checkpoints(hub, tmp_path / "export")
    assert report.ok, report.summary()
    assert report.tensors == len(SafetensorsDir(hub).keys())
    # without the hub's config.json, the family's translation also declares the one stored layer
    assert family_by_name("nemotron_h").to_hf_config(model.config)["num_nextn_predict_layers"] == 1


def test_mtp_1_and_2_from_one_shared_layer_equal_the_unrolled_hub_layer(one_mtp_layer_hub):
    """MTP-1 and MTP-2 losses of the shared layer equal the hub's MTP layer applied twice by hand; both depths'
    MoE auxiliary losses reach the step's, and both depths' losses reach the shared weights."""
    from safetensors.torch import load_file

    from lightning_moe.models.layers.moe import MoE

    hf, hub = one_mtp_layer_hub
    model, _ = native_from_hub(hub, mtp_shared_depths=2)
    model.train()
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    seen: list[torch.Tensor] = []  # every MoE layer's auxiliary loss, each call
    for moe in model.modules():
        if isinstance(moe, MoE):
            moe.register_forward_hook(lambda m, args, out: seen.append(m.aux_loss))
    out = model(ids, labels=labels)
    assert [int(c) for c in out.mtp_label_tokens] == [2 * 19, 2 * 18]
    with torch.no_grad():
        expected = hub_mtp_losses(hf, load_file(hub / "model.safetensors"), ids, labels, depths=2, shared=True)
    for got, want in zip(out.mtp_loss_sums, expected, strict=True):
        assert got.item() == pytest.approx(want.item(), rel=1e-5)
    moe_layers = hf_config().layers_block_type.count("moe")
    assert len(seen) == moe_layers + 2  # the shared layer's MoE ran once per depth
    torch.testing.assert_close(out.aux_loss, torch.stack(seen).sum())
    (out.loss_sum + 0.3 * sum(out.mtp_loss_sums)).backward()
    for name, p in model.named_parameters():
        if name.startswith("mtp."):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.zero_grad()
    model(ids, labels=labels).mtp_loss_sums[1].backward()
    assert model.mtp.depths[0].eh_proj.weight.grad.abs().sum() > 0  # depth 2 trains the shared layer too


def test_mtp_switched_off_for_a_hub_checkpoint(one_mtp_layer_hub):
    """``model.mtp_enabled: false``: the MTP layer is loaded (and kept for export) but never runs: no MTP loss,
    no FLOPs counted for it, no gradient on any MTP weight."""
    from safetensors.torch import load_file

    from lightning_moe.models.flops import mtp_depths

    _, hub = one_mtp_layer_hub
    model, _ = native_from_hub(hub, mtp_enabled=False)
    hub_tensors = load_file(hub / "model.safetensors")
    assert torch.equal(model.mtp.depths[0].eh_proj.weight, hub_tensors["mtp.layers.0.eh_proj.weight"])
    calls = []
    model.mtp.register_forward_pre_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    out = model.train()(ids, labels=ids.roll(-1, dims=1))
    assert out.mtp_loss_sums == [] and calls == [] and mtp_depths(model.config) == 0
    (out.loss_sum + out.aux_loss).backward()
    mtp = {n: p.grad for n, p in model.named_parameters() if n.startswith("mtp.")}
    assert mtp and all(grad is None for grad in mtp.values())
    assert model.embed.weight.grad is not None


def test_native_mtp_settings_name_what_is_wrong(tmp_path, hub_checkpoint, one_mtp_layer_hub):
    from lightning_moe.models.hf import HFModelConfig
    from lightning_moe.modules.causal_lm import CausalLM

    _, two_layers = hub_checkpoint
    with pytest.raises(ValueError, match=r"mtp_shared_depths=3: the checkpoint .* holds 2 MTP layers"):
        native_from_hub(two_layers, mtp_shared_depths=3)
    build_tiny(latent=None).save_pretrained(tmp_path / "no_mtp")  # transformers saves no MTP layers
    with pytest.raises(ValueError, match="model.mtp_enabled: the checkpoint .* has no MTP layers"):
        native_from_hub(tmp_path / "no_mtp", mtp_enabled=False)
    with pytest.raises(ValueError, match=r"mtp_shared_depths=0 must be >= 1"):
        HFModelConfig(hf=str(two_layers), mtp_shared_depths=0)
    module = CausalLM(model=HFModelConfig(hf=str(one_mtp_layer_hub[1]), native="never", mtp_enabled=False))
    with pytest.raises(ValueError, match="model.mtp_enabled=False applies to the native decoder's MTP layers"):
        module.resolved_config()


# ---------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("shared", [False, True], ids=["own_mtp_layers", "shared_mtp_layer"])
def test_flops_match_flop_counter(shared):
    """Training FLOPs from the config (Mamba scan, MoE, attention, MTP) against FlopCounterMode on a real step;
    a shared MTP layer runs (and counts) once per depth.

    FlopCounterMode counts matmuls only, so two terms are swapped for what it sees: the causal attention
    score pairs for sdpa's math path full square (torch's own formula), and the conv's multiply-adds
    (elementwise taps) are left out. Rows are whole chunks, so the scan's chunk squares are what runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    from lightning_moe.models.decoder import Decoder
    from lightning_moe.models.flops import batch_flops

    cfg = family_by_name("nemotron_h").from_hf_config(hf_config().to_dict())
    cfg.moe.backend = "loop"  # per-expert matmuls, which FlopCounterMode counts
    cfg.mtp.shared = shared
    batch, seq = 2, 4 * cfg.mamba.chunk_size
    torch.manual_seed(0)
    model = Decoder(cfg).train()
    model.init_weights()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    labels = ids.roll(-1, dims=1).masked_fill(torch.rand(batch, seq, generator=gen) < 0.3, -100)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(ids, labels=labels)
        (out.loss_sum + sum(out.mtp_loss_sums) + out.aux_loss).backward()

    expected = batch_flops(cfg, torch.arange(seq).expand(batch, -1), labels)
    att, mamba = cfg.attention, cfg.mamba
    attention_blocks = cfg.pattern.count("*") + cfg.mtp.num_layers * cfg.mtp.pattern.count("*")
    causal_scores = 2 * 2 * att.num_heads * att.head_dim * batch * seq * (seq + 1) // 2
    q, kv = (batch, att.num_heads, seq, att.head_dim), (batch, att.num_kv_heads, seq, att.head_dim)
    expected += 3 * attention_blocks * (sdpa_flop_count(q, kv, kv) - causal_scores)
    conv_dim = mamba.num_heads * mamba.head_dim + 2 * mamba.n_groups * mamba.state_size
    expected -= 3 * cfg.pattern.count("M") * 2 * batch * seq * mamba.conv_kernel * conv_dim
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------------------------- LoRA
def test_lora_adapts_mamba_experts_and_mtp_layers(tmp_path):
    """Adapters on Mamba projections, stacked experts and MTP layers: the adapted model equals transformers
    loading the merged export (backbone logits), and a plain model holding the merged weights (MTP losses)."""
    import transformers

    from lightning_moe.checkpoint.merged_export import export_merged_hf
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.peft import LoraConfig, apply_lora, merged_state_dict, reset_lora_parameters

    cfg = family_by_name("nemotron_h").from_hf_config(hf_config().to_dict())
    with torch.device("meta"):
        model = Decoder(cfg)
    targets = apply_lora(model, LoraConfig(r=4, target_experts=True, include_mtp=True))
    for name in ("layers.0.mamba.in_proj", "layers.4.mamba.out_proj", "mtp.depths.0.eh_proj",
                 "mtp.depths.1.layers.0.attn.q_proj", "mtp.depths.1.layers.1.moe.shared_experts.up_proj"):
        assert name in targets.linears, name
    assert {"layers.1.moe.experts", "mtp.depths.1.layers.1.moe.experts"} <= set(targets.experts)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    reset_lora_parameters(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.normal_(0.0, 0.05)  # adapters that change the output

    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    plain = Decoder(cfg)
    plain.load_state_dict(merged_state_dict(model))
    out, want = model(ids, labels=ids), plain(ids, labels=ids)
    for got, ref in zip([out.loss_sum, *out.mtp_loss_sums], [want.loss_sum, *want.mtp_loss_sums], strict=True):
        assert got.item() == pytest.approx(ref.item(), rel=1e-5)

    export_merged_hf(model, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL

    (out.loss_sum + sum(out.mtp_loss_sums)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_" in n for n in grads)
    for name in ("layers.0.mamba.in_proj.lora_A.default.weight", "mtp.depths.1.layers.1.moe.experts.adapter.lora_B.up"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name


# ---------------------------------------------------------------------------------- expert parallelism
def check_expert_parallel_with_mtp() -> None:
    """One rank of ``dp_shard=2, ep=2``: each rank runs one row; the summed main and per-depth MTP losses and
    the gradients (experts of backbone and MTP layers included) equal one process running both rows, with two
    MTP depths of their own and with one MTP layer shared by both depths (run twice per forward and recomputed
    twice under activation checkpointing)."""
    import torch.distributed as dist

    from lightning_moe.parallel import ParallelDims

    dims = ParallelDims(dp_shard=2, ep=2, world_size=dist.get_world_size())
    dims.build_meshes("cpu")
    for shared in (False, True):
        cfg = family_by_name("nemotron_h").from_hf_config(hf_config().to_dict())
        cfg.moe.aux_loss_coeff = 0.0  # a batch statistic: differs between one row and two by definition
        cfg.mtp.shared = shared
        check_expert_parallel_layout(cfg, dims, activation_checkpointing="full" if shared else "none")


def check_expert_parallel_layout(cfg, dims, activation_checkpointing: str) -> None:
    import torch.distributed as dist

    from lightning_moe.checkpoint.load import copy_tensors_into
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.parallel import ParallelOptions, parallelize

    torch.manual_seed(0)
    reference = Decoder(cfg)
    reference.init_weights()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=gen)
    labels = ids.roll(-1, dims=1).masked_fill(torch.rand(2, 24, generator=gen) < 0.2, -100)

    with torch.device("meta"):
        model = Decoder(cfg)
    parallelize(model, dims, ParallelOptions(activation_checkpointing=activation_checkpointing))
    model.to_empty(device="cpu")
    model.init_weights()
    copy_tensors_into(model, reference.state_dict().items())

    def run(decoder, rows):
        out = decoder(ids[rows], labels=labels[rows])
        (out.loss_sum + cfg.mtp.loss_scale * sum(out.mtp_loss_sums)).backward()
        return torch.stack([out.loss_sum.detach(), *[s.detach() for s in out.mtp_loss_sums]])

    expected = run(reference, slice(0, 2))
    assert len(expected) == 1 + cfg.mtp.num_layers
    rank = dist.get_rank()
    got = run(model, slice(rank, rank + 1))
    dist.all_reduce(got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    experts = {n: p for n, p in model.named_parameters() if n.endswith(("experts.up_proj", "experts.down_proj"))}
    assert any(n.startswith("mtp.") for n in experts) and any(n.startswith("layers.") for n in experts)
    for name, param in experts.items():
        assert param.to_local().shape[0] == cfg.moe.num_experts // 2, name  # this rank's half of the experts
    reference_grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        # FSDP averages gradients over the two data-parallel ranks; the reference summed both rows
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        torch.testing.assert_close(grad * 2, reference_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_expert_parallel_covers_backbone_and_mtp_experts():
    from distributed_harness import run_distributed_test

    run_distributed_test(check_expert_parallel_with_mtp, 2)
