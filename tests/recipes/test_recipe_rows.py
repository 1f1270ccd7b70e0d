"""Every GPU recipe runs its published row's workload: GPUs, batch sizes, sequence length, parallel sizes (TP, PP, CP,
EP, VP, FSDP degree), the CP exchange, precision, steps, dataset, packing, LoRA rank and alpha, frozen parts, the
data-parallel mode, expert routing (forced or natural), MTP depths and whether one MTP layer serves them all equal
the row's, or the header's ``# Differences:`` block lists the field with the row's value, the recipe's value and the
reason. Every kernel library the row's run used and the recipe replaces (Transformer Engine, DeepEP, HybridEP,
cuDNN, ...) is named in a ``kernels`` entry. An unlisted difference fails, and so does a listed one that is no
longer true (the recipe was fixed: drop the entry) and an entry that calls itself "not a difference"."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import pytest
from recipe_files import (
    CONFIGS,
    PUBLISHED_ROWS,
    ROOT,
    differences_block,
    full_recipes,
    gpus,
    header,
    hub_model_config,
    load_yaml,
    number_format,
    resolved,
)

from lightning_moe.models.config import ModelConfig
from lightning_moe.models.flops import mtp_depths
from lightning_moe.models.hf import HFModelConfig, apply_native_settings
from lightning_moe.parallel.dims import MESH_SIZE_NAMES, ParallelDims

RECIPES = full_recipes()
ROWS = load_yaml(PUBLISHED_ROWS)["rows"]
PARALLEL = ("tp", "pp", "cp", "ep", "vp")
CHECKED = ("gpus", "global_batch_size", "micro_batch_size", "seq_length", *PARALLEL, "cp_comm", "fsdp", "precision",
           "steps", "dataset", "packed", "lora_rank", "lora_alpha", "frozen", "data_parallel", "routing", "mtp",
           "mtp_shared")
# how each source's runs shard their data-parallel ranks where the row does not say: AutoModel's PyTorch backend
# trains with FSDP2 (its tables' FSDP column, "FSDP2" in their notes); Megatron-Bridge's rows carry it in
# recipe_settings (the distributed optimizer, or Megatron FSDP for the FSDP cards)
SOURCE_DATA_PARALLEL = {"automodel": "fsdp2", "automodel-recipe": "fsdp2"}
# the package's data-parallel mode, FSDP2 (HSDP with dp_replicate), and its attention CP exchange
RECIPE_DATA_PARALLEL, RECIPE_CP_COMM = "fsdp2", "all_gather"
# kernel libraries a row's run used that the package has no implementation of (it runs torch's own kernels
# instead): the words a ``kernels`` entry's reason names each by, and how a row's Kernel Optimizations cell names it
KERNEL_LIBRARIES = {"Transformer Engine": ("TE",), "DeepEP": ("DeepEP",), "HybridEP": ("HybridEP",),
                    "cuDNN": ("cuDNN",), "TileLang": ("TileLang",), "FA4": ("FA4",), "Triton": ("triton",),
                    "CUDA graphs": (), "flex": ("FlexAttn",)}


def load_seed_rows():
    spec = importlib.util.spec_from_file_location("seed_rows", ROOT / "benchmarks" / "seed_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DATASET_NAME = load_seed_rows().dataset_name  # the rows' dataset names, from the same words


def recipe_dataset(data: dict[str, Any]) -> tuple[str | None, bool | None]:
    """(dataset name, packed) of a recipe's data module, in the rows' names."""
    kind, args = data["class_path"].rsplit(".", 1)[-1], data["init_args"]
    if kind == "MockDataModule":
        return "mock", None
    if kind == "PretrainDataModule":
        return "indexed", None
    if kind == "TextToImageDataModule":  # one image a row, nothing to pack; a latent cache is named by its source
        return DATASET_NAME(str(args.get("dataset") or args.get("cache_dir") or "")), False
    packed = args.get("packing") != "none" if "packed_sequence_size" in args else None
    return DATASET_NAME(str(args.get("dataset") or args.get("packed_path") or "")), packed


def native_model(model: dict[str, Any]) -> ModelConfig | None:
    """The native ModelConfig a recipe's language model trains: its own, or the hub checkpoint's for ``model.hf``
    with the recipe's native settings (MTP off or shared) applied; None for a transformers-only architecture."""
    if "hf" not in model:
        return ModelConfig.from_dict(model)
    config = hub_model_config(model["hf"])
    if config is not None:
        fields = {f.name for f in dataclasses.fields(HFModelConfig)}
        apply_native_settings(HFModelConfig(**{k: v for k, v in model.items() if k in fields}), config, model["hf"])
    return config


def recipe_model_values(lightning_module: dict[str, Any]) -> dict[str, Any]:
    """Routing, MTP depths and sharing, frozen parts of a recipe's model (None where they do not apply)."""
    module = lightning_module["init_args"]
    model = module.get("model")
    if lightning_module["class_path"].endswith("DiffusionModule"):
        model = None  # a diffusers transformer: no router, no MTP
    config = native_model(model) if isinstance(model, dict) else None
    frozen = [part for part in ("vision", "projector", "embeddings") if module.get(f"freeze_{part}")]
    values = {"frozen": sorted(frozen + list(module.get("freeze") or [])), "routing": None, "mtp": None,
              "mtp_shared": None}
    if config is not None:
        values["mtp"] = mtp_depths(config)
        values["mtp_shared"] = bool(config.mtp and config.mtp.shared)
        if config.moe is not None:
            values["routing"] = "forced" if config.moe.force_balanced else "natural"
    elif isinstance(model, dict) and "hf" in model:  # the transformers path: its experts' routing
        values["routing"] = "forced" if model.get("force_balanced") else "natural"
    return values


def recipe_values(cfg: dict[str, Any]) -> dict[str, Any]:
    args = cfg["trainer"]["strategy"]["init_args"]
    data, module = cfg["data"]["init_args"], cfg["model"]["init_args"]
    dims = ParallelDims(**{name: args[name] for name in MESH_SIZE_NAMES}, world_size=gpus(cfg))
    dataset, packed = recipe_dataset(cfg["data"])
    peft = module.get("peft") or {}
    return {"gpus": gpus(cfg), "global_batch_size": data.get("global_batch_size"),
            "micro_batch_size": data.get("micro_batch_size"),
            "seq_length": data.get("seq_length") or data.get("packed_sequence_size"),
            **{name: args.get(name, 1) for name in PARALLEL}, "fsdp": dims.dp_shard,
            "cp_comm": RECIPE_CP_COMM if dims.cp > 1 else None,
            "precision": number_format(cfg), "steps": cfg["trainer"]["max_steps"], "dataset": dataset,
            "packed": packed, "lora_rank": peft.get("r"), "lora_alpha": peft.get("alpha"),
            "data_parallel": RECIPE_DATA_PARALLEL, **recipe_model_values(cfg["model"])}


def row_values(row: dict[str, Any]) -> dict[str, Any]:
    """The row's checked fields it gives (published, else its unverified recipe_settings); absent ones are not
    checked. A variable sequence length is not a number to compare; MTP sharing matters from two depths on; the
    notes' "balanced routing" is forced routing."""
    settings = row.get("recipe_settings") or {}
    values = {**{k: v for k, v in settings.items() if k != "parallel"}, **settings.get("parallel", {})}
    values.update({k: row[k] for k in CHECKED if k in row})
    values.update(row.get("parallel", {}))
    values.setdefault("data_parallel", SOURCE_DATA_PARALLEL.get(row["source"]))
    words = " ".join([row.get("workload", ""), *row.get("table_notes", [])])
    if "routing" not in values and "balanced routing" in words:
        values["routing"] = "forced"
    if values.get("seq_length") == "variable":
        del values["seq_length"]
    if (values.get("mtp") or 0) < 2:
        values.pop("mtp_shared", None)
    return {k: values[k] for k in CHECKED if values.get(k) is not None}


def row_kernel_libraries(row: dict[str, Any]) -> set[str]:
    """The kernel libraries of ``KERNEL_LIBRARIES`` the row's run used: its Kernel Optimizations cell's (AutoModel);
    Megatron-Core's Transformer Engine layers in every Megatron-Bridge card, HybridEP where the command chooses it
    and CUDA graphs where the card says they cover modules."""
    if row["source"] == "mbridge":
        used = {"Transformer Engine"}
        if "hybridep" in row.get("command", ""):
            used.add("HybridEP")
        if "CUDA graphs cover" in row.get("expected", ""):
            used.add("CUDA graphs")
        return used
    cells = [c.strip() for c in str(row.get("kernels") or row.get("optimizer") or "").split("+")]
    return {library for library, names in KERNEL_LIBRARIES.items()
            if any(cell.startswith(name) for cell in cells for name in names)}


def recipe_kernel_libraries(cfg: dict[str, Any]) -> set[str]:
    """What the recipe itself runs of ``KERNEL_LIBRARIES``: flex attention; Transformer Engine when both its
    attention and its linears and norms are TE's."""
    model = cfg["model"]["init_args"].get("model")
    model = model if isinstance(model, dict) else {}
    attention = (model.get("attention") or {}).get("backend") or model.get("attention_backend")
    runs = {"flex"} if attention == "flex" else set()
    if attention == "te" and model.get("te_modules"):
        runs.add("Transformer Engine")
    return runs


def kernel_problems(recipe: str, row: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    # the optimizer's kernels (Transformer Engine's FusedAdam) are named in its own entry
    reasons = " ".join(str(e.get("reason") or "") for e in entries if e.get("field") in ("kernels", "optimizer"))
    reasons = reasons.lower()
    replaced = row_kernel_libraries(row) - recipe_kernel_libraries(resolved(recipe))
    return [f"kernels: the row's run used {library}, which the recipe replaces, and no kernels (or optimizer) "
            "entry names it"
            for library in sorted(replaced) if library.lower() not in reasons]


def problems(recipe: str) -> list[str]:
    """Each checked field that differs from the row without an entry, each entry that is not true, each malformed
    entry, each kernel library replaced without a word."""
    row = ROWS[header(recipe)["Row"]]
    ours, theirs = recipe_values(resolved(recipe)), row_values(row)
    # a model without a router has no routing to compare
    differs = {f: (theirs[f], ours[f]) for f in theirs if ours[f] != theirs[f] and not (f == "routing" and ours[f] is None)}
    found = []
    listed: dict[str, dict] = {}
    entries = differences_block(recipe)
    for entry in entries:
        field = entry.get("field")
        if not field or not str(entry.get("reason") or "").strip():
            found.append(f"entry {entry} needs a field and a reason")
        elif "not a difference" in str(entry["reason"]).lower():
            found.append(f"{field}: the entry calls it not a difference: say how the recipe differs, or drop it")
        elif field in CHECKED:
            if field in listed:
                found.append(f"{field} is listed twice")
            listed[field] = entry
    for field, (published, value) in differs.items():
        entry = listed.pop(field, None)
        if entry is None:
            found.append(f"{field}: the row has {published!r}, the recipe {value!r}, and no Differences entry says why")
        elif (entry.get("row"), entry.get("recipe")) != (published, value):
            found.append(f"{field}: the entry says row {entry.get('row')!r} / recipe {entry.get('recipe')!r}, "
                         f"they are {published!r} / {value!r}")
    for field, entry in listed.items():
        found.append(f"{field}: listed as a difference (row {entry.get('row')!r}, recipe {entry.get('recipe')!r}) "
                     f"but the recipe and the row agree ({theirs.get(field, 'not published')!r}): drop the entry")
    return found + kernel_problems(recipe, row, entries)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_matches_its_row_or_lists_the_difference(recipe):
    assert not (found := problems(recipe)), f"{recipe} vs row {header(recipe)['Row']}:\n  " + "\n  ".join(found)


@pytest.fixture
def planted(tmp_path):
    """A copy of a recipe with edits (``(old, new)`` pairs), outside configs/ (``CONFIGS / absolute path`` is that
    path)."""
    def plant(recipe: str, *edits: tuple[str, str]) -> str:
        text = (CONFIGS / recipe).read_text()
        for old, new in edits:
            assert old in text, f"{old!r} not in {recipe}"
            text = text.replace(old, new, 1)
        path = tmp_path / f"planted_{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(text)
        return str(path)

    return plant


def entry(field: str, row: object, recipe: object, reason: str = "planted") -> tuple[str, str]:
    """The edit that lists a difference first in a recipe's Differences block."""
    return ("# Differences:\n", f"# Differences:\n#   - field: {field}\n#     row: {row}\n#     recipe: {recipe}\n"
                                 f"#     reason: >-\n#       {reason}\n")


def test_planted_differences_fail(planted):
    base = "qwen3_moe/qwen3_moe_30b_benchmark.yaml"
    assert problems(base) == []
    batch = ("global_batch_size: 512", "global_batch_size: 256")
    assert problems(planted(base, batch)) == [
        "global_batch_size: the row has 512, the recipe 256, and no Differences entry says why"]
    assert [p.split(":")[0] for p in problems(planted(base, ("ep: 8", "ep: 4")))] == ["ep"]
    # listed with the actual values: accepted; under another field name or with other values: not
    assert problems(planted(base, batch, entry("global_batch_size", 512, 256))) == []
    assert problems(planted(base, batch, entry("batch", 512, 256))) == [
        "global_batch_size: the row has 512, the recipe 256, and no Differences entry says why"]
    assert problems(planted(base, batch, entry("global_batch_size", 511, 256))) == [
        "global_batch_size: the entry says row 511 / recipe 256, they are 512 / 256"]
    # listed but no longer a difference (the recipe now runs as published): the entry must go
    assert problems(planted(base, entry("ep", 8, 4))) == [
        "ep: listed as a difference (row 8, recipe 4) but the recipe and the row agree (8): drop the entry"]


def test_planted_mismatches_of_the_model_and_data_parallel_fields_fail(planted):
    pretrain = "nemotron_h/lightning_30b_a3b_pretrain_gb200.yaml"
    assert problems(pretrain) == []
    own_layers = ('loss_scale: 0.3, shared: true}', 'loss_scale: 0.3}')
    assert problems(planted(pretrain, own_layers)) == [
        "mtp_shared: the row has True, the recipe False, and no Differences entry says why"]
    assert problems(planted(pretrain, ("force_balanced: false", "force_balanced: true"))) == [
        "routing: the row has 'natural', the recipe 'forced', and no Differences entry says why"]
    unstated = ("#   - field: data_parallel\n#     row: distributed_optimizer", "#   - field: dp\n#     row: distributed_optimizer")
    assert problems(planted(pretrain, unstated)) == [
        "data_parallel: the row has 'distributed_optimizer', the recipe 'fsdp2', and no Differences entry says why"]
    long_context = "nemotron_h/lightning_30b_a3b_long_context_sft_gb200.yaml"
    assert problems(planted(long_context, ("#   - field: cp_comm\n", "#   - field: cp_exchange\n"))) == [
        "cp_comm: the row has 'a2a', the recipe 'all_gather', and no Differences entry says why"]
    lora = "nemotron_h/lightning_30b_a3b_lora_h100.yaml"
    assert problems(planted(lora, ("      alpha: 32 ", "      alpha: 64 ")))[0].startswith("lora_alpha: the row has 32, the recipe 64.0")
    vision = "qwen3_5/qwen3_8_27b_medpix_sft.yaml"
    assert problems(planted(vision, ("freeze_embeddings: false", "freeze_embeddings: true"))) == [
        "frozen: the row has ['vision'], the recipe ['embeddings', 'vision'], and no Differences entry says why"]
    kimi = "deepseek_v3/kimi_k2_benchmark.yaml"
    assert [p.split(":")[0] for p in problems(planted(kimi, ("vp: 4", "vp: 2")))] == ["vp"]


def test_planted_kernel_and_not_a_difference_entries_fail(planted):
    base = "qwen3_moe/qwen3_moe_30b_benchmark.yaml"
    assert problems(base) == []
    assert problems(planted(base, ("in place of DeepEP", "in place of the row's dispatcher"))) == [
        "kernels: the row's run used DeepEP, which the recipe replaces, and no kernels (or optimizer) entry names it"]
    assert problems(planted(base, entry("gpus", 8, 8, reason="not a difference: planted"))) == [
        "gpus: the entry calls it not a difference: say how the recipe differs, or drop it"]
