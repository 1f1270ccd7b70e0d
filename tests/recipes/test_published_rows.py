"""``benchmarks/published_rows.yaml`` holds every row of the two published pages (the saved pages in the shared
seeds folder, ``../shared/seeds`` beside the repository), each field as the page gives it: the pages are parsed
here and compared field by field, so the YAML and its sources cannot drift. A planted difference fails.

The seeds folder is required: without it this test fails (it cannot check anything, and a skip would hide that)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
from recipe_files import PUBLISHED_ROWS, ROOT, load_yaml

SEEDS = ROOT.parent / "shared" / "seeds"
ROWS = load_yaml(PUBLISHED_ROWS)["rows"]


def load_seed_rows():
    spec = importlib.util.spec_from_file_location("seed_rows", ROOT / "benchmarks" / "seed_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


seed_rows = load_seed_rows()


@pytest.fixture(scope="module")
def pages() -> dict:
    if not SEEDS.is_dir():
        pytest.fail(f"the published pages are not at {SEEDS} (the shared seeds folder beside the repository); "
                    "published_rows.yaml cannot be checked without them")
    return seed_rows.seed_rows(SEEDS)


def test_every_published_row_is_in_the_yaml_as_its_page_gives_it(pages):
    assert len(pages) == 53
    assert sum(key.startswith(seed_rows.AUTOMODEL_PAGE) for key in pages) == 37  # incl. 2 image-generation rows
    assert sum(key.startswith(seed_rows.MBRIDGE_PAGE) for key in pages) == 16
    assert seed_rows.differences(ROWS, pages) == []
    unsourced = {row_id: row["source"] for row_id, row in ROWS.items() if not row.get("seed")}
    assert set(unsourced.values()) <= {"automodel-recipe"}, "rows without a page entry are marked as recipe-only"


def test_the_pages_are_read_as_published(pages):
    """Values read off the pages by hand: the parser's reading of cells, notes and card prose."""
    mx = pages[f"{seed_rows.AUTOMODEL_PAGE} | GPU: NVIDIA GB200, Precision: MXFP8 | Qwen3 MoE 235B | 32 GPUs"]
    assert (mx["global_batch_size"], mx["micro_batch_size"], mx["grad_accumulation"]) == (8192, 4, 64)
    assert (mx["warmup_steps"], mx["measured_steps"], mx["steps"]) == (2, 3, 5)  # the note's exception
    assert mx["tokens_per_s_per_gpu"] == 5402.30 and mx["parallel"] == {"tp": 1, "pp": 1, "cp": 1, "ep": 32, "fsdp": 32}
    ds = pages[f"{seed_rows.AUTOMODEL_PAGE} | GPU: NVIDIA H100 80GB, Precision: BF16 | DeepSeek V3 671B | 1024 GPUs"]
    assert ds["parallel"] == {"tp": 1, "pp": 4, "cp": 1, "ep": 64, "vp": 8, "fsdp": 256} and ds["tokens_per_s"] == 885760
    image = pages[f"{seed_rows.AUTOMODEL_PAGE} | Image Generation, Full Fine-Tuning: NVIDIA H100 80GB, Precision: BF16"
                  " | Qwen-Image-2.1 | 8 GPUs"]
    assert image["images_per_s_per_gpu"] == 1.45 and image["approximate"] == ["step_time_s", "images_per_s_per_gpu"]
    lightning = pages[f"{seed_rows.AUTOMODEL_PAGE} | Full Fine-Tuning: NVIDIA H100 80GB, Precision: BF16 | "
                      "Nemotron-3.5-Lightning-30B-A3B-BF16 | 8 GPUs"]
    assert lightning["mtp"] == 0 and lightning["dataset"] == "tulu-3" and lightning["packed"] is True
    full = f"{seed_rows.AUTOMODEL_PAGE} | Full Fine-Tuning: NVIDIA H100 80GB, Precision: BF16 | "
    # the note "Qwen3.8-27B freezes vision; GLM-5.3-Flash and Nemotron-3.5-Super-VL freeze vision and embeddings."
    assert pages[full + "Qwen3.8-27B | 8 GPUs"]["frozen"] == ["vision"]
    assert pages[full + "GLM-5.3-Flash | 72 GPUs"]["frozen"] == ["embeddings", "vision"]
    assert "frozen" not in pages[full + "GLM-5.3 | 256 GPUs"] and "frozen" not in lightning
    card = pages[f"{seed_rows.MBRIDGE_PAGE} | Pretrain · H100"]
    assert (card["gpus"], card["global_batch_size"], card["micro_batch_size"], card["parallel"]) == (16, 512, 1, {"cp": 2})
    assert (card["initial_loss"], card["final_loss"], card["step_time_s"]) == (12.18927, 7.239111, 36.86927)
    assert (card["peak_allocated_gib"], card["peak_reserved_gib"], card["save_interval"]) == (68.547, 73.893, 10)
    assert card["steps"] == 20 and card["mtp"] == 2 and card["command"].startswith("./scripts/training/train.sh --nodes 2")
    fp8 = pages[f"{seed_rows.MBRIDGE_PAGE} | Pretrain · FSDP · GB200 · fp8_mx"]
    assert (fp8["precision"], fp8["global_batch_size"], fp8["micro_batch_size"], fp8["dataset"]) == ("mxfp8", 384, 3, "mock")
    lora = pages[f"{seed_rows.MBRIDGE_PAGE} | LoRA · GB200"]
    assert (lora["lora_rank"], lora["lora_alpha"], lora["parallel"]) == (32, 32, {"tp": 2, "ep": 8, "etp": 1})
    export = pages[f"{seed_rows.MBRIDGE_PAGE} | Export · GPU"]
    assert export["distributed_save"] is True and export["tensors"] == 6513 and export["gpu"] is None


def test_a_planted_difference_fails(pages):
    qwen, card = "automodel-pretrain-h100-qwen3-moe-30b", "mbridge-lightning-sft-gb200"
    for edit, expected in [
        (lambda rows: rows[qwen].update(tflops_per_gpu=278), f"{qwen}: tflops_per_gpu is 278, the page gives 277"),
        (lambda rows: rows[qwen]["parallel"].update(ep=4), f"{qwen}: parallel is"),
        (lambda rows: rows[card].pop("peak_reserved_gib"), f"{card}: peak_reserved_gib is '<absent>', the page gives 103.96"),
        (lambda rows: rows[card].update(extra_speed=1.0), f"{card}: extra_speed is 1.0, the page gives '<absent>'"),
        (lambda rows: rows.pop(card), f"no row has seed '{seed_rows.MBRIDGE_PAGE} | SFT · GB200'"),
        (lambda rows: rows[qwen].update(seed="nowhere"), f"{qwen}: seed 'nowhere' is not an entry of the pages"),
    ]:
        rows = copy.deepcopy(ROWS)
        edit(rows)
        found = seed_rows.differences(rows, pages)
        assert any(line.startswith(expected) for line in found), (expected, found)


def test_a_planted_page_change_fails(pages):
    text = (SEEDS / seed_rows.AUTOMODEL_PAGE).read_text().replace("\t21.773\t277\t96,320\t12,040", "\t21.773\t277\t96,320\t12,041")
    changed = dict(pages, **{f"{seed_rows.AUTOMODEL_PAGE} | {k}": v for k, v in seed_rows.automodel_rows(text).items()})
    assert seed_rows.differences(ROWS, changed) == [
        "automodel-pretrain-h100-qwen3-moe-30b: tokens_per_s_per_gpu is 12040, the page gives 12041"]
