"""Every GPU recipe parses through LightningCLI (``--print_config``), reproduces its published row's workload
(GPU count, batch sizes, sequence length, number format), fits its parallel sizes to its GPUs, model and data with
the strategy's own checks, and, where it spells out an architecture, equals that model's hub config.json."""

from __future__ import annotations

import dataclasses
import importlib
from types import SimpleNamespace

import pytest
import torch
from recipe_files import (
    CONFIGS,
    HUB_CONFIGS,
    PUBLISHED_ROWS,
    ROOT,
    full_recipes,
    gpus,
    header,
    hub_model_config,
    load_yaml,
    resolved,
)

from lightning_moe.models.config import ModelConfig
from lightning_moe.parallel.dims import MESH_SIZE_NAMES, ParallelDims

RECIPES = full_recipes()
HUB = load_yaml(HUB_CONFIGS)
ROWS = load_yaml(PUBLISHED_ROWS)["rows"]


def parallel_dims(cfg: dict) -> ParallelDims:
    strategy = cfg["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_moe.ParallelStrategy", "GPU recipes name their parallel sizes"
    args = strategy["init_args"]
    return ParallelDims(**{name: args[name] for name in MESH_SIZE_NAMES}, world_size=gpus(cfg))


def data_module(cfg: dict):
    module_name, _, class_name = cfg["data"]["class_path"].rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)(**cfg["data"]["init_args"])


def test_the_recipes_are_found():
    assert len(RECIPES) >= 30
    assert {r.split("/")[0] for r in RECIPES} >= {"nemotron_h", "deepseek_v3", "qwen3_moe", "gpt_oss", "llama", "qwen2"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_header_names_its_row_hardware_and_twin(recipe):
    """The workload itself (GPUs, batch sizes, parallel sizes, precision, ...) against the row, with the header's
    Differences, is tests/recipes/test_recipe_rows.py."""
    cfg, fields = resolved(recipe), header(recipe)
    assert "Row" in fields and "Hardware" in fields and "CPU twin" in fields, "header names row, hardware and twin"
    row = ROWS[fields["Row"]]
    assert row["recipe"] == f"configs/{recipe}"
    nodes, devices = cfg["trainer"]["num_nodes"], cfg["trainer"]["devices"]
    assert fields["Hardware"].startswith(f"{nodes} node{'s' if nodes > 1 else ''} x {devices} {row['gpu']}")
    assert (ROOT / fields["CPU twin"]).is_file()


@pytest.mark.parametrize("recipe", RECIPES)
def test_parallel_sizes_fit_the_gpus_model_and_data(recipe):
    cfg = resolved(recipe)
    dims = parallel_dims(cfg)
    model = cfg["model"]["init_args"]["model"]
    config = hub_model_config(model["hf"]) if "hf" in model else ModelConfig.from_dict(model)
    if config is None:  # the generic transformers path
        from lightning_moe.parallel.hf import check_hf_model

        check_hf_model(dims, SimpleNamespace(hf=model["hf"], layers={"0": None}))
    else:
        dims.check_model(config)
        if dims.tp > 1:
            check_converters_under_tp(config, cfg["model"]["init_args"], dims)
    data = data_module(cfg)
    dims.check_data_module(data)
    data.trainer = SimpleNamespace(strategy=SimpleNamespace(data_parallel_rank=0, data_parallel_size=dims.dp_size))
    gbs = data.resolved_global_batch_size()  # raises unless micro batch x data-parallel ranks divides the global batch
    if dims.pp > 1 and config is None:  # the generic path's stages: its schedule and micro-batches
        from lightning_moe.parallel.pipeline import check_schedule, default_schedule
        from lightning_moe.parallel.splits import check_micro_batches

        args = cfg["trainer"]["strategy"]["init_args"]
        vp = args.get("vp", 1)
        check_schedule(args.get("pp_schedule") or default_schedule(vp), dims.pp, vp)
        check_micro_batches(gbs // (data.micro_batch_size * dims.dp_size), dims.pp)
    elif dims.pp > 1:
        check_pipeline(config, cfg["trainer"]["strategy"]["init_args"], dims, gbs // (data.micro_batch_size * dims.dp_size))


def check_pipeline(config: ModelConfig, args: dict, dims: ParallelDims, micro_batches: int) -> None:
    """What the pipeline checks before the first step: the model splits into pp x vp stages and each step has
    enough micro-batches for the schedule."""
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.parallel.native import NATIVE
    from lightning_moe.parallel.options import ParallelOptions
    from lightning_moe.parallel.pipeline import check_schedule, default_schedule, split_model
    from lightning_moe.parallel.splits import check_micro_batches

    vp = args.get("vp", 1)
    schedule = args.get("pp_schedule") or default_schedule(vp)
    check_schedule(schedule, dims.pp, vp)
    with torch.device("meta"):
        model = Decoder(config)
    NATIVE.check(model, dims, ParallelOptions(param_dtype=args.get("param_dtype"),
                                              cpu_offload=args.get("cpu_offload", False), vp=vp, pp_schedule=schedule))
    stages = split_model(model, dims.pp * vp, args.get("pp_layout"))
    assert len(stages) == dims.pp * vp
    check_micro_batches(micro_batches, dims.pp)


def check_converters_under_tp(config: ModelConfig, module_args: dict, dims: ParallelDims) -> None:
    """The strategy's check of LoRA / FP8 layers under tensor parallelism, on the converted meta model."""
    from lightning_moe.models.decoder import Decoder
    from lightning_moe.parallel.native import refuse_converted_layers
    from lightning_moe.peft import LoraConfig, apply_lora
    from lightning_moe.precision import Float8Config, apply_float8

    with torch.device("meta"):
        model = Decoder(config)
    if module_args.get("fp8"):
        apply_float8(model, Float8Config(**module_args["fp8"]))
    if module_args.get("peft"):
        apply_lora(model, LoraConfig(**module_args["peft"]))
    refuse_converted_layers(model, dims.tp)


# knobs a recipe chooses for its workload, not part of the architecture
TRAINING_CHOICES = {"moe": ("force_balanced", "backend", "bias_update_rate", "aux_loss_coeff"),
                    "attention": ("backend",)}


def architecture(config: ModelConfig, mtp) -> ModelConfig:
    changes = {"mtp": mtp, "loss_chunk_size": 1024, "init_std": 0.02}
    for sub, names in TRAINING_CHOICES.items():
        if getattr(config, sub) is not None:
            changes[sub] = dataclasses.replace(getattr(config, sub), **dict.fromkeys(names, None))
    return dataclasses.replace(config, **changes)


ARCHITECTURE_RECIPES = [r for r in RECIPES if "Architecture" in header(r)]


@pytest.mark.parametrize("recipe", ARCHITECTURE_RECIPES)
def test_spelled_out_model_is_the_hub_architecture(recipe):
    ours = ModelConfig.from_dict(resolved(recipe)["model"]["init_args"]["model"])
    hub = hub_model_config(header(recipe)["Architecture"])
    assert architecture(ours, ours.mtp) == architecture(hub, ours.mtp)
    if ours.mtp is not None and hub.mtp is not None:
        assert ours.mtp.pattern == hub.mtp.pattern


@pytest.mark.parametrize("hub_id", sorted(HUB))
def test_hub_config_transcription_builds_the_published_model_size(hub_id):
    """Parameters (and persistent buffers such as expert biases, which checkpoints store) vs the model card."""
    from lightning_moe.models.decoder import Decoder

    entry = HUB[hub_id]
    config = hub_model_config(hub_id)
    if config is None:  # no native family: transformers' own model of the config, on meta
        import transformers

        fields = {k: v for k, v in entry["config"].items() if k not in ("model_type", "architectures")}
        hf_config = transformers.AutoConfig.for_model(entry["config"]["model_type"], **fields)
        model_class = getattr(transformers, entry["config"]["architectures"][0])  # causal LM or image-text-to-text
        assert model_class.config_class is type(hf_config)
        with torch.device("meta"):
            hf_model = model_class(hf_config)
        count = sum(t.numel() for t in hf_model.state_dict().values())
        assert count == pytest.approx(entry["total_params"], rel=0.02)
        return
    if not entry.get("with_mtp"):
        config.mtp = None
    with torch.device("meta"):
        count = sum(t.numel() for t in Decoder(config).state_dict().values())
    if isinstance(entry["total_params"], int):
        assert count == entry["total_params"]
    else:
        assert count == pytest.approx(entry["total_params"], rel=0.02)


def test_every_row_recipe_names_its_row():
    """A row's recipe (where it has one: the others are listed in configs/README.md) names the row back."""
    for row_id, row in ROWS.items():
        if row.get("recipe") is None:
            continue
        assert (ROOT / row["recipe"]).is_file(), row_id
        assert header(row["recipe"].removeprefix("configs/"))["Row"] == row_id


def test_benchmark_recipes_measure_after_warmup_and_name_their_row():
    benchmarks = [r for r in RECIPES if r.endswith("benchmark.yaml")]
    assert len(benchmarks) >= 20
    for recipe in benchmarks:
        callbacks = {c["class_path"].rsplit(".", 1)[-1]: c["init_args"]
                     for c in resolved(recipe)["trainer"]["callbacks"]}
        assert callbacks["Throughput"]["warmup_steps"] > 0, recipe
        assert callbacks["RunCard"]["name"] == header(recipe)["Row"], recipe
        model = resolved(recipe)["model"]["init_args"]["model"]
        if model.get("moe"):
            assert model["moe"]["force_balanced"], f"{recipe}: benchmarks route tokens evenly"


def test_configs_readme_maps_every_recipe_to_its_twin():
    readme = (CONFIGS / "README.md").read_text()
    for recipe in RECIPES:
        assert f"`{recipe}`" in readme
        assert f"`{header(recipe)['CPU twin'].removeprefix('configs/')}`" in readme
