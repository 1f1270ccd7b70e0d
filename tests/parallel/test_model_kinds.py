"""The model kinds' refusal tables (``parallel/model_kind.py``): README's list is written from them, and each
refusal is what the kind's check raises, naming the settings and what would work."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_moe.parallel import ParallelDims, ParallelOptions
from lightning_moe.parallel.model_kind import not_supported_lines
from lightning_moe.parallel.parallelize import MODEL_KINDS

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_the_refusal_tables():
    text = README.read_text()
    start, end = "<!-- refusals of the model kinds -->\n", "\n<!-- end of the refusals -->"
    listed = text[text.index(start) + len(start):text.index(end)]
    assert listed.splitlines() == not_supported_lines(list(MODEL_KINDS))


def dims_and_options(settings: tuple[str, ...]) -> tuple[ParallelDims, ParallelOptions]:
    sizes = {name: 2 for name in settings if name != "compile"}
    # expert parallelism is carved out of the other ranks: data-parallel ones when no tensor-parallel ones
    dp_shard = 2 if "ep" in sizes and "tp" not in sizes else 1
    world = 2 ** len(set(sizes) - {"ep"}) * dp_shard
    dims = ParallelDims(**sizes, dp_shard=dp_shard, world_size=world)
    return dims, ParallelOptions(compile="compile" in settings)


@pytest.mark.parametrize("kind, refusal", [(kind, refusal) for kind in MODEL_KINDS for refusal in kind.refusals],
                         ids=lambda item: getattr(item, "name", None) or "+".join(getattr(item, "settings", ())))
def test_each_refusal_is_raised_by_the_kinds_check(kind, refusal):
    dims, options = dims_and_options(refusal.settings)
    # the checks read the wrapped model's class name (and, for transformers' checks, whether it is a module)
    model = SimpleNamespace(hf="config.json", transformer=SimpleNamespace(), layers={"0": None},
                            packing_limitation=None)
    named = " with ".join("compile=True" if s == "compile" else f"{s}=2" for s in refusal.settings)
    with pytest.raises(ValueError, match=f"^{named}: .* runs through {re.escape(kind.name)}, {re.escape(refusal.reason)}; use "):
        kind.check(model, dims, options)
