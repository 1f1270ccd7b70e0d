"""``benchmarks/compare.py`` puts a real run card (a benchmark twin's) next to a published row, in the row's units,
with ours / published ratios, and flags a workload that differs from the row's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from unittest import mock

import pytest
from recipe_files import CONFIGS, PUBLISHED_ROWS, ROOT, load_yaml

ROW = "automodel-pretrain-h100-qwen3-moe-30b"


def load_compare():
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A benchmark twin's run: 3 steps, the first left out of the averages."""
    from lightning_moe.cli import main

    root = tmp_path_factory.mktemp("bench")
    args = ["fit", "--config", str(CONFIGS / "tiny" / "moe_benchmark.yaml"), "--trainer.max_steps=3",
            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={root}"]
    with mock.patch.object(sys, "argv", ["lightning-moe"]):
        main(args)
    return root


def test_card_is_printed_next_to_the_row_with_ratios(run_dir, capsys):
    compare = load_compare()
    assert compare.main([str(run_dir), "--row", ROW]) == 0
    out = capsys.readouterr().out
    card = json.loads(next(run_dir.rglob("run_card.json")).read_text())
    row = load_yaml(PUBLISHED_ROWS)["rows"][ROW]
    assert card["averaged_steps"] == 2 and card["warmup_steps"] == 1
    tokens_line = next(line for line in out.splitlines() if line.startswith("tokens/s/GPU"))
    assert compare.number(card["tokens_per_s_per_gpu"]) in tokens_line and "12,040" in tokens_line
    assert tokens_line.endswith(f"{card['tokens_per_s_per_gpu'] / row['tokens_per_s_per_gpu']:.2f}x")
    step_line = next(line for line in out.splitlines() if line.startswith("step time"))
    assert step_line.endswith(f"{row['step_time_s'] / card['step_time_s']:.2f}x")  # > 1: faster than published
    assert "workload differs from the published row (GPUs, global batch, micro batch, sequence length)" in out


def test_a_matching_workload_is_not_flagged(run_dir, tmp_path, capsys):
    card = json.loads(next(run_dir.rglob("run_card.json")).read_text())
    row = load_yaml(PUBLISHED_ROWS)["rows"][ROW]
    card.update(name=ROW, world_size=row["gpus"], global_batch_size=row["global_batch_size"],
                micro_batch_size=row["micro_batch_size"], seq_length=row["seq_length"],
                tflops_per_gpu=2 * row["tflops_per_gpu"])
    (tmp_path / "run_card.json").write_text(json.dumps(card))
    assert load_compare().main([str(tmp_path / "run_card.json")]) == 0  # the row named by the card
    out = capsys.readouterr().out
    assert "workload differs" not in out
    assert next(line for line in out.splitlines() if line.startswith("TFLOP/s/GPU")).endswith("2.00x")


def test_unknown_rows_and_missing_cards_are_named(run_dir, tmp_path, capsys):
    compare = load_compare()
    assert compare.main([str(run_dir)]) == 2  # the twin's card names no published row
    assert "row 'tiny-moe-benchmark' is not in published_rows.yaml" in capsys.readouterr().err
    assert compare.main([str(tmp_path)]) == 2
    assert "no run_card.json" in capsys.readouterr().err
    assert compare.main(["--list"]) == 0
    assert capsys.readouterr().out.count("\n") == len(load_yaml(PUBLISHED_ROWS)["rows"])


def test_a_card_row_shows_losses_and_memory_and_what_is_not_comparable(run_dir, capsys):
    """A Megatron-Bridge card publishes losses and peak memory: both sides are shown, with the loss difference, and
    the run (one CPU process) is flagged as another device with fewer GPUs for speed and memory, and as another
    batch, sequence length and step count for the losses."""
    row_id = "mbridge-lightning-pretrain-h100"
    assert load_compare().main([str(run_dir), "--row", row_id]) == 0
    out = capsys.readouterr().out.splitlines()
    card = json.loads(next(run_dir.rglob("run_card.json")).read_text())
    row = load_yaml(PUBLISHED_ROWS)["rows"][row_id]
    compare = load_compare()
    initial = next(line for line in out if line.startswith("initial loss"))
    assert compare.number(row["initial_loss"]) in initial and compare.number(card["initial_loss"]) in initial
    assert initial.endswith(f"{card['initial_loss'] - row['initial_loss']:+.4g}")
    assert compare.number(row["final_loss"]) in next(line for line in out if line.startswith("final loss"))
    for label, field in (("peak allocated", "peak_allocated_gib"), ("peak reserved", "peak_reserved_gib")):
        assert compare.number(row[field]) in next(line for line in out if line.startswith(label))
    assert next(line for line in out if line.startswith("CP")).split()[1:] == ["1", "2"]
    device = card["device"]
    assert (f"not comparable: TFLOP/s/GPU: other GPU ({device}, published H100); fewer GPUs (1, published 16); "
            f"other global batch ({card['global_batch_size']}, published 512)") in "\n".join(out)
    assert any(line.startswith("not comparable: peak reserved (GiB): other GPU") for line in out)
    final = next(line for line in out if line.startswith("not comparable: final loss"))
    assert "other number of steps (3, published 20)" in final and "other sequence length" in final
    assert "not comparable: initial loss" in "\n".join(out)
    assert "published: averaged over 10 steps" in out
