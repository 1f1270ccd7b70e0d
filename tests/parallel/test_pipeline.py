"""Pipeline parallelism (``ParallelStrategy(pp=...)``) under a real ``Trainer``: 6 steps of 1F1B (also compiled
with activation checkpointing inside, with LoRA, with emulated FP8, with tied embeddings), interleaved 1F1B and a zero-bubble schedule
(ZBV) on a dense model and on an MoE + MTP model give the losses, gradient norms, validation losses and first-step
gradients of one process; a pipeline with its blocks out of order or a micro-batch dropped does not; one
micro-batch per step is refused before the first step; pipelines compose with FSDP, tensor, expert and context
parallelism on 4 ranks; transformers models on the generic path are split into stages too (2 ranks; with FSDP
and EP on 4). The split, the layout syntax, the generic path's stage views and the size checks are tested
without processes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pipeline_cases
import pytest
import torch
from distributed_harness import run_distributed_test
from parallel_cases import tiny_config

from lightning_moe import ParallelStrategy
from lightning_moe.models.decoder import Decoder
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.pipeline import (
    balanced_split,
    check_schedule,
    parse_layout,
    split_model,
    stage_indices,
)

pytestmark = pytest.mark.distributed


def references(tmp_path, *models, checkpoint_every=None):
    return {model: pipeline_cases.fit(model, None, tmp_path / f"reference_{pipeline_cases.run_name(model)}", devices=1,
                                      checkpoint_every=checkpoint_every) for model in models}


def test_two_rank_pipelines_train_like_one_process(tmp_path):
    """Also: the 1F1B run checkpointed at step 3 resumes exactly with pp=2 and with pp=1 (see
    ``pipeline_cases.check_resume``), and its step-6 checkpoint exports the Hugging Face directory of the
    one-process run's, and so do the PEFT adapter and merged exports of LoRA runs on a checkpoint (native decoder
    and generic path). Transformers models on the generic path are split into stages too; one whose later stage
    ignores the activations it receives fails. Compiled cases check that the compiled blocks, not the eager
    fallback, ran."""
    cases = [
        ("dense_interleaved", "llama", {"pp": 2, "vp": 2}),
        ("dense_1f1b_compiled_checkpointed", "llama",
         {"pp": 2, "compile": True, "compile_backend": "aot_eager", "activation_checkpointing": "full"}),
        ("dense_lora_1f1b", "llama_lora", {"pp": 2}),
        ("dense_fp8_1f1b", "llama_fp8", {"pp": 2}),
        ("tied_embeddings_1f1b", "gpt_oss_like", {"pp": 2}),
        ("dense_zbv", "llama", {"pp": 2, "vp": 2, "pp_schedule": "zbv"}),
        ("dense_zbv_compiled", "llama", {"pp": 2, "vp": 2, "pp_schedule": "zbv", "compile": True,
                                         "compile_backend": "aot_eager"}),
        # the V puts the first and the last stage on rank 0: both use the one embedding module
        ("tied_embeddings_zbv", "gpt_oss_like", {"pp": 2, "vp": 2, "pp_schedule": "zbv"}),
        ("moe_mtp_1f1b", "deepseek_like", {"pp": 2}),
        ("moe_mtp_interleaved", "deepseek_like", {"pp": 2, "vp": 2, "pp_layout": "Et|t|t|tmL"}),
        # one MTP layer applied at 2 depths on the last stage
        ("moe_shared_mtp_1f1b", "deepseek_shared_mtp", {"pp": 2}),
        ("moe_shared_mtp_interleaved", "deepseek_shared_mtp", {"pp": 2, "vp": 2, "pp_layout": "Et|t|t|tmL"}),
    ]
    # the generic transformers path (native: never): Llama, Qwen3 with a sliding-window second layer, Qwen3-MoE
    hf = pipeline_cases.save_hf_models(tmp_path, "llama", "qwen3_sliding", "qwen3_moe")
    cases += [(f"hf_{family}_1f1b", name, {"pp": 2}) for family, name in hf.items()]
    cases.append(("hf_llama_1f1b_checkpointed", hf["llama"], {"pp": 2, "activation_checkpointing": "full"}))
    # inductor's C++ code for the blocks (it passed its first-use check against eager on both ranks), against one
    # process compiled the same way
    inductor = {"compile": True, "compile_backend": "inductor"}
    cases.append(("dense_1f1b_inductor", "llama_inductor", {"pp": 2, **inductor}))
    # LoRA on a Hugging Face checkpoint, native decoder and generic path: their runs' adapter exports are compared
    lora = {"native": "lora+hfnative:" + hf["llama"][3:], "generic": "lora+" + hf["llama"]}
    cases += [(f"lora_{kind}_1f1b", name, {"pp": 2}) for kind, name in lora.items()]
    broken = [("swapped_blocks", "llama", {"pp": 2}), ("dropped_micro_batch", "llama", {"pp": 2}),
              ("ignored_activations", hf["llama"], {"pp": 2})]
    expected = references(tmp_path, "llama", "deepseek_like", *lora.values(), checkpoint_every=pipeline_cases.STEPS)
    expected.update(references(tmp_path, "llama_lora", "llama_fp8", "gpt_oss_like", "deepseek_shared_mtp", *hf.values()))
    expected["llama_inductor"] = pipeline_cases.fit("llama_inductor", inductor, tmp_path / "reference_inductor",
                                                    devices=1)
    run_distributed_test(pipeline_cases.check_pipelines, 2, str(tmp_path), expected, cases, broken, True,
                         tuple(f"lora_{kind}_1f1b" for kind in lora), init_process_group=False)
    step = f"*step={pipeline_cases.STEPS}.ckpt"
    check_same_export(next((tmp_path / "pp2" / "ckpt").glob(step)),
                      next((tmp_path / "reference_llama" / "ckpt").glob(step)), tmp_path)
    for kind, name in lora.items():  # the PEFT adapter and the merged model
        check_same_export(next((tmp_path / f"lora_{kind}_1f1b" / "ckpt").glob(step)),
                          next((tmp_path / f"reference_{pipeline_cases.run_name(name)}" / "ckpt").glob(step)),
                          tmp_path / f"export_lora_{kind}", lora=True)


def check_same_export(pipelined, unpipelined, tmp_path, lora: bool = False):
    """``convert export`` (``export-lora`` with ``lora``: the PEFT adapter and the merged model) of a pipelined run
    writes what the one-process run's export writes (the same files, configs and tensor names, shapes and dtypes;
    values equal to fp32 reduction-order noise)."""
    from lightning_moe.convert_command import main as convert_main

    outs = {}
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name, checkpoint in (("pipelined", pipelined), ("unpipelined", unpipelined)):
        if lora:
            outs[name] = [tmp_path / f"adapter_{name}", tmp_path / f"merged_{name}"]
            args = ["export-lora", "--ckpt", str(checkpoint), "--adapter-out", str(outs[name][0]),
                    "--merged-out", str(outs[name][1])]
        else:
            outs[name] = [tmp_path / f"export_{name}"]
            args = ["export", "--ckpt", str(checkpoint), "--out", str(outs[name][0])]
        assert convert_main(args) == 0
    for got, expected in zip(outs["pipelined"], outs["unpipelined"]):
        check_same_directory(got, expected)


def check_same_directory(got_dir, expected_dir):
    import json

    from safetensors.torch import load_file

    outs = [got_dir, expected_dir]
    files = [sorted(p.name for p in out.iterdir()) for out in outs]
    assert files[0] == files[1], files
    assert any(f.endswith(".safetensors") for f in files[0]), files
    for config in [f for f in files[0] if f.endswith("config.json")]:
        assert json.loads((outs[0] / config).read_text()) == json.loads((outs[1] / config).read_text()), config
    for weights in [f for f in files[0] if f.endswith(".safetensors")]:
        got, expected = load_file(outs[0] / weights), load_file(outs[1] / weights)
        assert sorted(got) == sorted(expected)
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape, key
            assert torch.allclose(got[key], tensor, rtol=1e-4, atol=1e-6), key


def test_four_rank_pipelines_with_fsdp_tensor_and_expert_parallelism(tmp_path):
    """Each stage split by tensor parallelism too (vocabulary-parallel loss on the last stage; with tied embeddings
    the last stage's copy split like the first's), or by context parallelism with MTP (the tokens ahead taken from
    the whole row); a tensor-parallel pipeline with its blocks out of order fails, and so does one whose first stage
    shifts its own chunks for MTP. The generic transformers path under FSDP2 and EP."""
    cases = [
        ("pp2_fsdp2", "llama", {"pp": 2, "dp_shard": 2}),
        ("pp2_ep2", "deepseek_like", {"pp": 2, "ep": 2}),
        ("pp2_fsdp2_tied_embeddings", "gpt_oss_like", {"pp": 2, "dp_shard": 2}),
        ("pp2_tp2", "llama", {"pp": 2, "tp": 2}),
        ("pp2_tp2_ep2_mtp", "deepseek_like", {"pp": 2, "tp": 2, "ep": 2}),
        ("pp2_tp2_tied_embeddings", "gpt_oss_like", {"pp": 2, "tp": 2}),
        ("pp2_cp2_mtp", "deepseek_like", {"pp": 2, "cp": 2}),
    ]
    hf = pipeline_cases.save_hf_models(tmp_path, "llama", "qwen3_moe")
    cases += [("hf_llama_pp2_fsdp2", hf["llama"], {"pp": 2, "dp_shard": 2}),
              ("hf_qwen3_moe_pp2_ep2", hf["qwen3_moe"], {"pp": 2, "ep": 2})]
    broken = [("swapped_blocks", "llama", {"pp": 2, "tp": 2}), ("local_tokens_ahead", "deepseek_like", {"pp": 2, "cp": 2})]
    run_distributed_test(pipeline_cases.check_pipelines, 4, str(tmp_path),
                         references(tmp_path, "llama", "deepseek_like", "gpt_oss_like", *hf.values()), cases, broken,
                         init_process_group=False)


# ---------------------------------------------------------------------------------------------- no processes
def meta_decoder(name: str) -> Decoder:
    import torch

    with torch.device("meta"):
        return Decoder(tiny_config(name))


def test_balanced_split_minimizes_the_largest_stage():
    import itertools

    costs = [3.0, 1.0, 1.0, 1.0, 4.0, 1.0, 2.0]
    for stages in (1, 2, 3, 4, 7):
        split = balanced_split(costs, 0.5, 2.0, stages)
        assert [i for group in split for i in group] == list(range(len(costs))) and all(split)

        def largest(groups):
            sums = [sum(costs[i] for i in g) for g in groups]
            sums[0] += 0.5
            sums[-1] += 2.0
            return max(sums)

        best = min(largest([list(range(a, b)) for a, b in zip((0, *cuts), (*cuts, len(costs)))])
                   for cuts in itertools.combinations(range(1, len(costs)), stages - 1))
        assert largest(split) == pytest.approx(best)


def test_default_split_counts_embedding_and_output():
    specs = split_model(meta_decoder("deepseek_like"), 2)
    assert [s.blocks for s in specs] == [["0", "1", "2"], ["3"]]  # the MoE block + output + MTP weigh most
    assert (specs[0].embedding, specs[0].output, specs[1].embedding, specs[1].output) == (True, False, False, True)
    assert [s.blocks for s in split_model(meta_decoder("llama"), 4)] == [["0"], ["1"], ["2"], ["3"]]


def test_layout_syntax_and_its_errors():
    specs = parse_layout("Et*2|t|tmL", 4, 3, has_mtp=True)
    assert [s.blocks for s in specs] == [["0", "1"], ["2"], ["3"]]
    assert parse_layout(["E", "t*4", "L"], 4, 3, has_mtp=False)[1].blocks == ["0", "1", "2", "3"]
    for layout, message in [
        ("Et|t|t", "pp*vp = 4 are needed"),
        ("Et*2|t|tL|L", "output layer and loss"),
        ("Et|t|t|t*2L", "the model has 4"),
        ("Et|t|t|L", "places 3 blocks"),
        ("tE|t|t|tL", None),
        ("t|Et|t|tL", "embedding (E) must be on the first stage"),
        ("E*2t|t|t|tL", "embedding (E) must be on the first stage, once"),
        ("Et|t*2||tL", "stage 2 holds nothing"),
        ("Et|t|t|tL", "put m on the last stage"),
        ("Et|t|t|tx", "stage 3 has 'x'"),
    ]:
        if message is None:
            parse_layout(layout, 4, 4, has_mtp=False)
            continue
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
            parse_layout(layout, 4, 4, has_mtp=layout == "Et|t|t|tL")


def test_sizes_that_do_not_fit_fail_with_what_fits():
    with pytest.raises(ValueError, match="8 virtual stages but the model has 4 blocks"):
        split_model(meta_decoder("llama"), 8)
    with pytest.raises(ValueError, match="runs one stage per rank, but vp=2"):
        check_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="exactly two stages on each rank"):
        check_schedule("zbv", 2, 4)
    with pytest.raises(ValueError, match="pp_schedule='bogus' is not one of"):
        ParallelStrategy(pp=2, pp_schedule="bogus")
    from lightning_moe.parallel.splits import check_micro_batches

    with pytest.raises(ValueError, match="pp=4 pipeline stages need at least 4 micro-batches per step, got 2"):
        check_micro_batches(2, 4)
    with pytest.raises(ValueError, match="Linear .* is not split into stages yet: use pp=1"):
        ParallelStrategy(pp=2).parallelize(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"pp\*dp_replicate\*dp_shard\*cp\*tp = 2\*1\*2\*1\*1 = 4 != world size 8"):
        ParallelDims(pp=2, dp_shard=2, world_size=8)
    assert ParallelDims(pp=2, ep=2, world_size=8).dp_shard == 4
    assert ParallelStrategy(pp=2, vp=2).parallel_options.pp_schedule == "interleaved_1f1b"
    assert stage_indices(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_indices(1, 4, 2, "zbv") == [1, 6]
    from lightning_moe.parallel.native import NATIVE

    tied = SimpleNamespace(config=tiny_config("gpt_oss_like"))
    v = {"vp": 2, "pp_schedule": "zbv"}
    NATIVE.check(tied, ParallelDims(pp=2, world_size=2), ParallelOptions(**v))
    with pytest.raises(ValueError, match="pp_schedule='zbv' with tie_embeddings=True with FSDP: .*, whose V "
                                         "schedules put the first and last stages on one rank"):
        NATIVE.check(tied, ParallelDims(pp=2, world_size=2), ParallelOptions(**v, cpu_offload=True))
    with pytest.raises(ValueError, match="pp_schedule='dualpipev' with tie_embeddings=True with tp=2: "):
        NATIVE.check(tied, ParallelDims(pp=2, tp=2, world_size=4), ParallelOptions(vp=2, pp_schedule="dualpipev"))


def test_generic_path_stages_views_and_refusals(tmp_path):
    """A stage's view of a transformers model holds only its parts, under the whole model's names, and a config
    whose per-layer lists are its own layers'; what the generic path does not split is refused."""
    from lightning_moe.models.hf import HFModel, HFModelConfig, construct_hf_model
    from lightning_moe.parallel.pipeline_hf import check_hf_pipeline, hf_view, split_hf

    names = pipeline_cases.save_hf_models(tmp_path, "qwen3_sliding", "llama_tied_bias", "qwen3_moe")

    def meta(family: str) -> HFModel:
        directory = Path(names[family][3:])
        return HFModel(construct_hf_model(HFModelConfig(hf=str(directory), native="never"), directory))

    model = meta("qwen3_sliding")
    check_hf_pipeline(model)
    assert [s.blocks for s in split_hf(model, 2)] == [["0"], ["1"]]
    assert [s.blocks for s in split_hf(model, 2, "E|t*2L")] == [[], ["0", "1"]]
    view = hf_view(model.hf, ["1"], embedding=False, output=True)
    whole = [n for n, _ in model.hf.named_parameters()]
    assert [n for n, _ in view.named_parameters()] == [n for n in whole if not n.startswith(("model.embed_tokens.",
                                                                                              "model.layers.0."))]
    assert view.model.config.layer_types == ["sliding_attention"] and view.model.config.num_hidden_layers == 1
    assert model.hf.model.config.layer_types == ["full_attention", "sliding_attention"]  # the model's own is kept
    with pytest.raises(ValueError, match="3 virtual stages but Qwen3ForCausalLM has 2 decoder layers"):
        split_hf(model, 3)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check_hf_pipeline(meta("llama_tied_bias"))
    moe = meta("qwen3_moe")
    moe.hf.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits=True"):
        check_hf_pipeline(moe)
    from lightning_moe.parallel.pipeline_stages import split_into_stages

    for schedule, vp, options, message in [
        ("zbv", 2, {}, "pp_schedule='zbv': Qwen3MoeForCausalLM runs through transformers .*zero-bubble"),
        ("1f1b", 1, {"compile": True}, "compile=True with pp=2: Qwen3MoeForCausalLM runs through transformers"),
    ]:
        with pytest.raises(ValueError, match=message):
            split_into_stages(meta("qwen3_moe"), ParallelDims(pp=2, world_size=2),
                              ParallelOptions(vp=vp, pp_schedule=schedule, **options), "cpu")
