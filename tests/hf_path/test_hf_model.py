"""The generic transformers path on one process: loading, the loss, packed rows, routing to native families,
LoRA and FP8 converters, and bad input. References are transformers' own loading and forward."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_hf_models import VOCAB, batch, kimi_linear_config, olmoe_config, qwen3_next_config, save_tiny

from lightning_moe.models.hf import HFModel, HFModelConfig, build_hf_model, hf_converters
from lightning_moe.modules.causal_lm import CausalLM


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory):
    return save_tiny(qwen3_next_config(), tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module")
def olmoe_dir(tmp_path_factory):
    return save_tiny(olmoe_config(), tmp_path_factory.mktemp("olmoe"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    import transformers as t

    config = t.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return save_tiny(config, tmp_path_factory.mktemp("qwen3"))


def reference(directory):
    import transformers as t

    return t.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def test_weights_stream_in_as_from_pretrained_loads_them(next_dir, tmp_path):
    """Hub per-expert tensors are fused by transformers' own conversion; tensors transformers ignores (the
    checkpoint's MTP head) are skipped; rotary buffers survive meta construction."""
    import shutil

    shutil.copytree(next_dir, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(shard)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in tensors  # hub layout on disk
    tensors["mtp.fc.weight"] = torch.ones(4, 4)
    save_file(tensors, shard, metadata={"format": "pt"})
    model = build_hf_model(HFModelConfig(hf=str(tmp_path / "ckpt")))
    expected = reference(next_dir)
    ours, theirs = model.hf.state_dict(), expected.state_dict()
    assert ours.keys() == theirs.keys()
    assert "model.layers.0.mlp.experts.gate_up_proj" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    buffers = dict(expected.named_buffers())
    for name, buffer in model.hf.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert set(model.layers) == {"hf.model.layers.0", "hf.model.layers.1"}


def test_tied_output_layer_stays_the_input_embedding(tmp_path):
    """Checkpoints of tied models hold only the embedding; the output layer must be that same tensor after
    materialization, not an untied copy left uninitialized."""
    import transformers as t

    config = t.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    directory = save_tiny(config, tmp_path)
    assert "lm_head.weight" not in load_file(directory / "model.safetensors")
    model = build_hf_model(HFModelConfig(hf=str(directory), native="never"))
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    data = batch()
    torch.testing.assert_close(model(data["input_ids"]), reference(directory)(data["input_ids"], use_cache=False).logits,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("architecture", ["qwen3_next", "kimi_linear"])
def test_loss_sums_gradients_and_aux_loss_match_transformers(architecture, next_dir, tmp_path):
    directory = next_dir if architecture == "qwen3_next" else save_tiny(kimi_linear_config(), tmp_path)
    model = build_hf_model(HFModelConfig(hf=str(directory)))
    expected = reference(directory)
    data = batch()
    assert model.fused_loss and model.packing_limitation is not None
    out = model(data["input_ids"], labels=data["labels"])
    ref = expected(data["input_ids"], use_cache=False)
    # labels are pre-shifted: position t's logits against labels[t], summed
    ref_sum = torch.nn.functional.cross_entropy(ref.logits.reshape(-1, VOCAB), data["labels"].reshape(-1),
                                                ignore_index=-100, reduction="sum")
    torch.testing.assert_close(out.loss_sum, ref_sum, rtol=1e-5, atol=1e-5)
    assert int(out.num_label_tokens) == int((data["labels"] != -100).sum())
    ref_aux = torch.zeros(()) if ref.get("aux_loss") is None else expected.router_aux_loss_coef * ref.aux_loss
    torch.testing.assert_close(out.aux_loss if out.aux_loss is not None else torch.zeros(()), ref_aux,
                               rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model(data["input_ids"]), ref.logits, rtol=1e-5, atol=1e-6)

    (out.loss_sum + (out.aux_loss if out.aux_loss is not None else 0)).backward()
    (ref_sum + ref_aux).backward()
    grads = dict(expected.named_parameters())
    for name, param in model.hf.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-4, atol=2e-5)


def test_packed_rows_attention_model_and_refusal_for_linear_attention(qwen3_dir, next_dir):
    """Attention models take packed rows (block-diagonal mask from restarting positions): the packed loss is the
    sum of the separate sequences' losses. Linear attention would leak state: a clear error."""
    dense = build_hf_model(HFModelConfig(hf=str(qwen3_dir), native="never"))
    assert dense.packing_limitation is None
    data = batch(rows=1, seq=20)
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    packed = dense(data["input_ids"], positions, labels=data["labels"]).loss_sum
    first = dense(data["input_ids"][:, :12], labels=data["labels"][:, :12]).loss_sum
    second = dense(data["input_ids"][:, 12:], labels=data["labels"][:, 12:]).loss_sum
    torch.testing.assert_close(packed, first + second, rtol=1e-5, atol=1e-5)

    hybrid = build_hf_model(HFModelConfig(hf=str(next_dir)))
    with pytest.raises(ValueError, match="cannot train on packed rows.*linear_attention.*packing: none"):
        hybrid(data["input_ids"], positions, labels=data["labels"])
    padded = data["labels"].clone()
    padded[:, 12:] = -100  # one sample and end padding (its own position run, no labels) is fine
    hybrid(data["input_ids"], positions, labels=padded)


def test_native_families_are_used_automatically(qwen3_dir, olmoe_dir):
    native = CausalLM(model=HFModelConfig(hf=str(qwen3_dir)))
    assert native.resolved_config().family == "qwen3"
    assert native.pretrained == str(qwen3_dir) and native.model_config is None
    forced = CausalLM(model=HFModelConfig(hf=str(qwen3_dir), native="never"))
    forced._route_hf()
    assert isinstance(forced.model_config, HFModelConfig)
    generic = CausalLM(model=HFModelConfig(hf=str(olmoe_dir)))
    generic._route_hf()
    assert isinstance(generic.model_config, HFModelConfig)
    with pytest.raises(ValueError, match="native=always but OlmoeForCausalLM has no native family"):
        CausalLM(model=HFModelConfig(hf=str(olmoe_dir), native="always"))._route_hf()
    with pytest.raises(ValueError, match="drop `pretrained`"):
        CausalLM(model=HFModelConfig(hf=str(olmoe_dir)), pretrained=str(olmoe_dir))


def test_lora_and_fp8_converters_on_transformers_names(next_dir):
    from lightning_moe.peft import LoraConfig, is_adapter_parameter
    from lightning_moe.precision import Float8Config

    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "in_proj_qkvz"])
    model = build_hf_model(HFModelConfig(hf=str(next_dir)), convert=hf_converters(peft=lora, freeze=None))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter_parameter(n) for n in trainable)
    assert any("linear_attn.in_proj_qkvz.lora_A" in n for n in trainable)
    base = reference(next_dir)
    # B starts at zero: the adapted model is the base model
    data = batch()
    torch.testing.assert_close(model(data["input_ids"]), base(data["input_ids"], use_cache=False).logits,
                               rtol=1e-5, atol=1e-6)
    fp8 = build_hf_model(HFModelConfig(hf=str(next_dir)),
                         convert=hf_converters(fp8=Float8Config(recipe="tensorwise", min_dim=16)))
    converted = [type(m).__name__ for m in fp8.hf.modules() if "Float8" in type(m).__name__]
    assert converted, "no linear layer converted"
    assert type(fp8.hf.lm_head).__name__ == "Linear"
    loss = fp8(data["input_ids"], labels=data["labels"]).loss_sum
    assert torch.isfinite(loss)


# ---------------------------------------------------------------------------------------------- bad input
def test_remote_code_must_be_granted(tmp_path):
    config = {"architectures": ["MyLMForCausalLM"], "model_type": "my_lm",
              "auto_map": {"AutoConfig": "configuration_my_lm.MyLMConfig",
                           "AutoModelForCausalLM": "modeling_my_lm.MyLMForCausalLM"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model_type 'my_lm' needs the checkpoint's own code .*"
                                         r"set model.trust_remote_code: true"):
        build_hf_model(HFModelConfig(hf=str(tmp_path)))


def test_checkpoint_problems_are_named(next_dir, tmp_path):
    import shutil

    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_hf_model(HFModelConfig(hf=str(tmp_path / "missing")))
    for case, edit in (("missing", lambda t: t.pop("model.norm.weight")),
                       ("extra", lambda t: t.__setitem__("model.layers.0.bogus.weight", torch.ones(2)))):
        directory = tmp_path / case
        shutil.copytree(next_dir, directory)
        tensors = load_file(directory / "model.safetensors")
        edit(tensors)
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        message = ("no tensor for model.norm.weight" if case == "missing"
                   else "'model.layers.0.bogus.weight' has no counterpart in Qwen3NextForCausalLM")
        with pytest.raises(ValueError, match=message):
            build_hf_model(HFModelConfig(hf=str(directory)))
    with pytest.raises(ValueError, match="model.native='sometimes'"):
        HFModelConfig(hf=str(next_dir), native="sometimes")
    assert isinstance(build_hf_model(HFModelConfig(hf=str(next_dir))), HFModel)


@pytest.mark.parametrize("sizes, message", [
    ({"cp": 2}, r"cp=2: Qwen3NextForCausalLM runs through transformers .* \(Qwen3NextGatedDeltaNet, layer type "
                r"'linear_attention' carry a state along the sequence.* use cp=1"),
    ({"tp": 2, "ep": 2}, r"ep=2 with tp=2: Qwen3NextForCausalLM runs through transformers .* use tp=1 or ep=1"),
    ({"tp": 2}, r"tp=2: Qwen3NextForCausalLM's tp_plan uses moe_tp_experts, packed_colwise, which the generic "
                r"path does not split .* use tp=1"),
])
def test_parallel_layouts_the_generic_path_does_not_split_are_refused(next_dir, sizes, message):
    from lightning_moe.parallel import ParallelDims
    from lightning_moe.parallel.hf import check_hf_model

    model = HFModel(build_hf_model(HFModelConfig(hf=str(next_dir))).hf)
    with pytest.raises(ValueError, match=message):
        check_hf_model(ParallelDims(**sizes, world_size=4 if len(sizes) == 2 and "tp" in sizes else 2), model)


def test_expert_parallelism_of_standardized_experts_is_accepted(next_dir):
    """Qwen3-Next's experts are transformers' standardized module: ep splits them (tests/hf_path/test_hf_expert_parallel.py)."""
    from lightning_moe.parallel import ParallelDims
    from lightning_moe.parallel.hf import check_hf_model

    check_hf_model(ParallelDims(dp_shard=2, ep=2, world_size=2), HFModel(build_hf_model(HFModelConfig(hf=str(next_dir))).hf))


def test_compiled_transformers_layers_train_like_eager(qwen3_dir):
    from torch._dynamo.utils import counters

    from lightning_moe.parallel.compile import apply_compile

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = build_hf_model(HFModelConfig(hf=str(qwen3_dir))), build_hf_model(HFModelConfig(hf=str(qwen3_dir)))
    assert apply_compile(compiled, "aot_eager", "full") == [f"layers.{name}" for name in compiled.layers]
    data = batch()
    for model in (eager, compiled):
        out = model(data["input_ids"], labels=data["labels"])
        out.loss_sum.backward()
        model.loss = out.loss_sum.item()
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert compiled.loss == pytest.approx(eager.loss, rel=1e-6)
    grads = dict(eager.hf.named_parameters())
    assert [name for name, _ in compiled.hf.named_parameters()] == list(grads)
    for name, param in compiled.hf.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6)
