"""A run card next to the published row it reproduces: step time, TFLOP/s/GPU and tokens/s/GPU, and their ratio.

    python benchmarks/compare.py runs/qwen3_moe_30b_benchmark            # the row named by the card
    python benchmarks/compare.py path/to/run_card.json --row automodel-pretrain-h100-qwen3-moe-30b
    python benchmarks/compare.py --list                                   # the rows, with their recipes

Both sides use the published units: model TFLOP/s per GPU and tokens (of the global batch, padding included)
per second per GPU, averaged over the measured steps. The ratio is ours / published (for step time published /
ours): above 1 is faster than the published run. A row whose workload differs (GPUs, batch sizes, sequence
length) is flagged, since its speed is then not comparable. Rows without a published number show "n/a".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from lightning_moe.callbacks.report import find_card

ROWS = Path(__file__).with_name("published_rows.yaml")
# (label, card field, row field, True when higher is better)
SPEED = [("step time (s)", "step_time_s", "step_time_s", False),
         ("TFLOP/s/GPU", "tflops_per_gpu", "tflops_per_gpu", True),
         ("tokens/s/GPU", "tokens_per_s_per_gpu", "tokens_per_s_per_gpu", True)]
WORKLOAD = [("GPUs", "world_size", "gpus"), ("global batch", "global_batch_size", "global_batch_size"),
            ("micro batch", "micro_batch_size", "micro_batch_size"), ("sequence length", "seq_length", "seq_length")]


def load_rows(path: Path = ROWS) -> dict[str, dict[str, Any]]:
    return yaml.safe_load(path.read_text())["rows"]


def pick_row(card: dict[str, Any], rows: dict[str, dict[str, Any]], row_id: str | None) -> str:
    row_id = row_id or card.get("name")
    if row_id not in rows:
        raise KeyError(f"row {row_id!r} is not in {ROWS.name}; pass --row with one of: {', '.join(rows)}")
    return row_id


def number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, str):  # non-finite values are stored as strings
        return value
    return f"{value:,.4g}" if isinstance(value, float) else f"{value:,}"


def ratio(ours: Any, published: Any, higher_is_better: bool) -> str:
    if not isinstance(ours, (int, float)) or not isinstance(published, (int, float)) or not ours or not published:
        return ""
    return f"{(ours / published) if higher_is_better else (published / ours):.2f}x"


def comparison(card: dict[str, Any], row_id: str, row: dict[str, Any]) -> str:
    lines = [f"{row['title']}  [{row_id}]", f"source: {row['source']}; recipe: {row['recipe']}"]
    if row.get("note"):
        lines.append(f"note: {row['note']}")
    lines.append(f"this run: {card.get('name')} on {card.get('device')}, {card.get('status')}, "
                 f"{card.get('averaged_steps')} measured steps after {card.get('warmup_steps')} warmup steps")
    table = [("", "this run", f"published ({row['gpu']})", "ratio")]
    for label, card_key, row_key in WORKLOAD:
        table.append((label, number(card.get(card_key)), number(row.get(row_key)), ""))
    for label, card_key, row_key, higher in SPEED:
        table.append((label, number(card.get(card_key)), number(row.get(row_key)),
                      ratio(card.get(card_key), row.get(row_key), higher)))
    mfu = card.get("mfu")
    table.append(("MFU", f"{mfu:.2%}" if isinstance(mfu, float) else "n/a", "", ""))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
              for r in table]
    differs = [label for label, card_key, row_key in WORKLOAD if card.get(card_key) != row.get(row_key)]
    if differs:
        lines.append(f"workload differs from the published row ({', '.join(differs)}): the speeds are not comparable")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", help="a run directory or its run_card.json")
    parser.add_argument("--row", help="published row id (default: the card's name)")
    parser.add_argument("--list", action="store_true", help="list the published rows and their recipes")
    args = parser.parse_args(argv)
    rows = load_rows()
    if args.list:
        for row_id, row in rows.items():
            print(f"{row_id}: {row['title']} -> {row['recipe']}")
        return 0
    if args.run is None:
        parser.error("give a run directory or run_card.json (or --list)")
    try:
        card_path = find_card(Path(args.run))
        card = json.loads(card_path.read_text())
        row_id = pick_row(card, rows, args.row)
    except (FileNotFoundError, KeyError) as err:
        print(f"compare: {err.args[0]}", file=sys.stderr)
        return 2
    print(f"run card: {card_path}")
    print(comparison(card, row_id, rows[row_id]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
