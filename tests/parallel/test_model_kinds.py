"""The model kinds' refusal tables (``parallel/model_kind.py``): README's list is written from them, and each
refusal is what the kind's check raises, naming the settings and what would work."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_moe.parallel import ParallelDims, ParallelOptions
from lightning_moe.parallel.dims import MESH_SIZE_NAMES
from lightning_moe.parallel.model_kind import not_supported_lines
from lightning_moe.parallel.parallelize import MODEL_KINDS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_the_refusal_tables():
    text = README.read_text()
    start, end = "<!-- refusals of the model kinds -->\n", "\n<!-- end of the refusals -->"
    listed = text[text.index(start) + len(start):text.index(end)]
    assert listed.splitlines() == not_supported_lines(list(MODEL_KINDS))


def dims_and_options(settings: tuple[str, ...]) -> tuple[ParallelDims, ParallelOptions]:
    keys = [setting.partition("=")[0] for setting in settings]
    sizes = {key: 2 for key in keys if key in MESH_SIZE_NAMES}
    # expert parallelism is carved out of the other ranks: data-parallel ones when no tensor-parallel ones; FSDP
    # shards over data-parallel ones
    dp_shard = 2 if "fsdp" in keys or ("ep" in sizes and "tp" not in sizes) else 1
    world = 2 ** len(set(sizes) - {"ep"}) * dp_shard
    dims = ParallelDims(**sizes, dp_shard=dp_shard, world_size=world)
    schedule = next((refused(setting) for setting in settings if setting.startswith("pp_schedule=")), "1f1b")
    return dims, ParallelOptions(compile="compile" in keys, pp_schedule=schedule)


def refused(setting: str) -> str:
    """The first value a ``key=a|b`` setting refuses."""
    return setting.partition("=")[2].split("|")[0]


def named(setting: str) -> str:
    """How the error names a setting in force."""
    key, _, values = setting.partition("=")
    if key in ("compile", "fsdp"):
        return {"compile": "compile=True", "fsdp": "FSDP"}[key]
    return f"{key}={refused(setting)!r}" if values else f"{key}=2" if key in MESH_SIZE_NAMES else f"{key}=True"


@pytest.mark.parametrize("kind, refusal", [(kind, refusal) for kind in MODEL_KINDS for refusal in kind.refusals],
                         ids=lambda item: getattr(item, "name", None) or "+".join(getattr(item, "settings", ())))
def test_each_refusal_is_raised_by_the_kinds_check(kind, refusal):
    dims, options = dims_and_options(refusal.settings)
    # the checks read the wrapped model's class name (and, for transformers' checks, whether it is a module), the
    # native decoder's the flags of its config
    flags = [s for s in refusal.settings if s not in (*MESH_SIZE_NAMES, "compile", "fsdp") and "=" not in s]
    model = SimpleNamespace(hf="config.json", transformer=SimpleNamespace(), layers={"0": None},
                            packing_limitation=None, config=SimpleNamespace(**dict.fromkeys(flags, True)))
    expected = " with ".join(named(s) for s in refusal.settings)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}: .* runs through {re.escape(kind.name)}, "
                                         f"{re.escape(refusal.reason)}; use "):
        kind.check(model, dims, options)
