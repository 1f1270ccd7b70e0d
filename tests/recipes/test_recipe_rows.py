"""Every GPU recipe runs its published row's workload: GPUs, batch sizes, sequence length, parallel sizes (TP, PP,
CP, EP, FSDP degree), precision, steps, dataset, packing, LoRA rank and MTP depths equal the row's, or the header's
``# Differences:`` block lists the field with the row's value, the recipe's value and the reason. An unlisted
difference fails, and so does a listed one that is no longer true (the recipe was fixed: drop the entry)."""

from __future__ import annotations

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

from lightning_moe.parallel.dims import MESH_SIZE_NAMES, ParallelDims

RECIPES = full_recipes()
ROWS = load_yaml(PUBLISHED_ROWS)["rows"]
PARALLEL = ("tp", "pp", "cp", "ep")
CHECKED = ("gpus", "global_batch_size", "micro_batch_size", "seq_length", *PARALLEL, "fsdp", "precision", "steps",
           "dataset", "packed", "lora_rank", "mtp")


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
    packed = args.get("packing") != "none" if "packed_sequence_size" in args else None
    return DATASET_NAME(str(args.get("dataset") or args.get("packed_path") or "")), packed


def recipe_mtp(model: dict[str, Any]) -> int | None:
    """MTP depths the recipe's model runs: its ModelConfig's, or the hub checkpoint's for ``model.hf``."""
    if "hf" in model:
        config = hub_model_config(model["hf"])
        if config is None:
            return None
        mtp = config.mtp
    else:
        mtp = model.get("mtp")
        mtp = mtp and type("MTP", (), mtp)
    return mtp.num_layers if mtp else 0


def recipe_values(cfg: dict[str, Any]) -> dict[str, Any]:
    args = cfg["trainer"]["strategy"]["init_args"]
    data, module = cfg["data"]["init_args"], cfg["model"]["init_args"]
    dims = ParallelDims(**{name: args[name] for name in MESH_SIZE_NAMES}, world_size=gpus(cfg))
    dataset, packed = recipe_dataset(cfg["data"])
    model = module.get("model")  # a language model's; other modules (diffusion) have none
    return {"gpus": gpus(cfg), "global_batch_size": data.get("global_batch_size"),
            "micro_batch_size": data.get("micro_batch_size"),
            "seq_length": data.get("seq_length") or data.get("packed_sequence_size"),
            **{name: args.get(name, 1) for name in PARALLEL}, "fsdp": dims.dp_shard,
            "precision": number_format(cfg), "steps": cfg["trainer"]["max_steps"], "dataset": dataset,
            "packed": packed, "lora_rank": (module.get("peft") or {}).get("r"),
            "mtp": recipe_mtp(model) if isinstance(model, dict) else None}


def row_values(row: dict[str, Any]) -> dict[str, Any]:
    """The row's checked fields it gives (published, else its unverified recipe_settings); absent ones are not
    checked. A variable sequence length is not a number to compare."""
    settings = row.get("recipe_settings") or {}
    values = {**{k: v for k, v in settings.items() if k != "parallel"}, **settings.get("parallel", {})}
    values.update({k: row[k] for k in CHECKED if k in row})
    values.update(row.get("parallel", {}))
    if values.get("seq_length") == "variable":
        del values["seq_length"]
    return {k: values[k] for k in CHECKED if values.get(k) is not None}


def problems(recipe: str) -> list[str]:
    """Each checked field that differs from the row without an entry, each entry that is not true, each malformed
    entry."""
    row = ROWS[header(recipe)["Row"]]
    ours, theirs = recipe_values(resolved(recipe)), row_values(row)
    differs = {f: (theirs[f], ours[f]) for f in theirs if ours[f] != theirs[f]}
    found = []
    listed: dict[str, dict] = {}
    for entry in differences_block(recipe):
        field = entry.get("field")
        if not field or not str(entry.get("reason") or "").strip():
            found.append(f"entry {entry} needs a field and a reason")
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
    return found


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


def entry(field: str, row: object, recipe: object) -> str:
    return (f"# Differences:\n#   - field: {field}\n#     row: {row}\n#     recipe: {recipe}\n#     reason: >-\n"
            f"#       planted\n# CPU twin:")


def test_planted_differences_fail(planted):
    base = "qwen3_moe/qwen3_moe_30b_benchmark.yaml"
    assert problems(base) == []
    batch = ("global_batch_size: 512", "global_batch_size: 256")
    assert problems(planted(base, batch)) == [
        "global_batch_size: the row has 512, the recipe 256, and no Differences entry says why"]
    assert [p.split(":")[0] for p in problems(planted(base, ("ep: 8", "ep: 4")))] == ["ep"]
    # listed with the actual values: accepted; under another field name or with other values: not
    assert problems(planted(base, batch, ("# CPU twin:", entry("global_batch_size", 512, 256)))) == []
    assert problems(planted(base, batch, ("# CPU twin:", entry("batch", 512, 256)))) == [
        "global_batch_size: the row has 512, the recipe 256, and no Differences entry says why"]
    assert problems(planted(base, batch, ("# CPU twin:", entry("global_batch_size", 511, 256)))) == [
        "global_batch_size: the entry says row 511 / recipe 256, they are 512 / 256"]
    # listed but no longer a difference (the recipe now runs as published): the entry must go
    assert problems(planted(base, ("# CPU twin:", entry("ep", 8, 4)))) == [
        "ep: listed as a difference (row 8, recipe 4) but the recipe and the row agree (8): drop the entry"]
