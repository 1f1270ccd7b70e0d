"""A run card next to the published row it reproduces: every metric the row publishes (step time, TFLOP/s/GPU,
tokens/s, tokens/s/GPU or images/s/GPU, a card's initial and final loss and peak memory) beside the run's, and
which of them are not comparable and why (another GPU, fewer or more GPUs, another batch or sequence length,
another number of steps).

    python benchmarks/compare.py runs/qwen3_moe_30b_benchmark            # the row named by the card
    python benchmarks/compare.py path/to/run_card.json --row automodel-pretrain-h100-qwen3-moe-30b
    python benchmarks/compare.py --list                                   # the rows, with their recipes

Both sides use the published units: model TFLOP/s per GPU and tokens (of the global batch, padding included)
per second (per GPU), averaged over the measured steps; memory in GiB (the card: the maximum over ranks). The
ratio is ours / published (for step time published / ours): above 1 is faster than the published run; for memory
below 1 is less memory. Losses show ours - published. Rows without a published number show "n/a".
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
# (label, field in both the card and the row, kind): kind says how to compare and what can make it incomparable
METRICS = [("step time (s)", "step_time_s", "time"), ("TFLOP/s/GPU", "tflops_per_gpu", "rate"),
           ("tokens/s", "tokens_per_s", "total rate"), ("tokens/s/GPU", "tokens_per_s_per_gpu", "rate"),
           ("images/s/GPU", "images_per_s_per_gpu", "rate"), ("initial loss", "initial_loss", "loss"),
           ("final loss", "final_loss", "final loss"), ("peak allocated (GiB)", "peak_allocated_gib", "memory"),
           ("peak reserved (GiB)", "peak_reserved_gib", "memory")]
WORKLOAD = [("GPUs", "world_size", "gpus"), ("global batch", "global_batch_size", "global_batch_size"),
            ("micro batch", "micro_batch_size", "micro_batch_size"), ("sequence length", "seq_length", "seq_length"),
            ("steps", "steps", "steps")]
# the card's parallel_sizes name -> the row's parallel name
LAYOUT = [("TP", "tp", "tp"), ("PP", "pp", "pp"), ("CP", "cp", "cp"), ("EP", "ep", "ep"), ("FSDP", "dp_shard", "fsdp")]


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


def difference(ours: Any, published: Any) -> str:
    if not isinstance(ours, (int, float)) or not isinstance(published, (int, float)):
        return ""
    return f"{ours - published:+.4g}"


def published_value(row: dict[str, Any], field: str) -> Any:
    approximate = "~" if field in row.get("approximate", ()) else ""
    value = row.get(field)
    return f"~{number(value)}" if approximate and value is not None else value


def incomparable(card: dict[str, Any], row: dict[str, Any]) -> dict[str, list[str]]:
    """Metric kind -> why the run's value cannot be held against the row's (empty: comparable)."""
    reasons: dict[str, list[str]] = {kind: [] for _, _, kind in METRICS}
    speed, memory, losses = ("time", "rate", "total rate"), ("memory",), ("loss", "final loss")
    gpu, device = row.get("gpu"), str(card.get("device") or "")
    if gpu and gpu.lower() not in device.lower():
        for kind in speed + memory:
            reasons[kind].append(f"other GPU ({device or 'unknown'}, published {gpu})")
    ours, theirs = card.get("world_size"), row.get("gpus")
    if ours and theirs and ours != theirs:
        which = "fewer" if ours < theirs else "more"
        for kind in speed + memory:
            reasons[kind].append(f"{which} GPUs ({ours}, published {theirs})")
    for label, card_key, row_key in WORKLOAD[1:4]:
        if isinstance(row.get(row_key), int) and card.get(card_key) != row[row_key]:
            for kind in speed + memory + losses:
                reasons[kind].append(f"other {label} ({number(card.get(card_key))}, published {row[row_key]})")
    if row.get("steps") and card.get("steps") != row["steps"]:
        reasons["final loss"].append(f"other number of steps ({number(card.get('steps'))}, published {row['steps']})")
    return reasons


def table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
            .rstrip() for r in rows]


def comparison(card: dict[str, Any], row_id: str, row: dict[str, Any]) -> str:
    lines = [f"{row['title']}  [{row_id}]",
             f"source: {row['source']}; recipe: {row.get('recipe') or row.get('documented_in') or 'none yet'}"]
    if row.get("note"):
        lines.append(f"note: {row['note']}")
    lines.append(f"this run: {card.get('name')} on {card.get('device')}, {card.get('status')}, "
                 f"{card.get('averaged_steps')} measured steps after {card.get('warmup_steps')} warmup steps")
    published_avg = row.get("averaged_steps") or row.get("measured_steps")
    if published_avg:
        lines.append(f"published: averaged over {published_avg} steps")
    rows = [("", "this run", f"published ({row.get('gpu') or 'hardware not given'})", "")]
    for label, card_key, row_key in WORKLOAD:
        rows.append((label, number(card.get(card_key)), number(row.get(row_key)), ""))
    sizes, parallel = card.get("parallel_sizes") or {}, row.get("parallel") or {}
    for label, card_key, row_key in LAYOUT:
        if row_key in parallel:
            rows.append((label, number(sizes.get(card_key, 1)), number(parallel[row_key]), ""))
    reasons = incomparable(card, row)
    for label, field, kind in METRICS:
        if field not in row and card.get(field) is None:
            continue
        ours, theirs = card.get(field), row.get(field)
        if kind in ("loss", "final loss"):
            compared = difference(ours, theirs)
        elif kind == "memory":
            compared = ratio(ours, theirs, True)
        else:
            compared = ratio(ours, theirs, kind != "time")
        rows.append((label, number(ours), number(published_value(row, field)), compared))
    mfu = card.get("mfu")
    rows.append(("MFU", f"{mfu:.2%}" if isinstance(mfu, float) else "n/a", "", ""))
    lines += table(rows)
    differs = [label for label, card_key, row_key in WORKLOAD[:4]
               if isinstance(row.get(row_key), int) and card.get(card_key) != row[row_key]]
    if differs:
        lines.append(f"workload differs from the published row ({', '.join(differs)}): the speeds are not comparable")
    layout = [label for label, card_key, row_key in LAYOUT
              if row_key in parallel and sizes.get(card_key, 1) != parallel[row_key]]
    if layout:
        lines.append(f"layout differs ({', '.join(layout)}): the recipe header's Differences say why")
    for label, field, kind in METRICS:
        if field in row and reasons[kind]:
            lines.append(f"not comparable: {label}: {'; '.join(reasons[kind])}")
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
            print(f"{row_id}: {row['title']} -> {row.get('recipe') or row.get('documented_in') or 'no recipe yet'}")
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
