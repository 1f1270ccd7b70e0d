"""``lightning-moe report RUN_DIR [--out PNG]``: loss and throughput curves of a run, from its run card.

Reads the per-step series of ``RUN_DIR/run_card.json`` (written by :class:`RunCard`) and draws loss,
tokens/s/GPU and model TFLOP/s/GPU against the step into one PNG (default ``RUN_DIR/run_report.png``);
red lines mark steps with a non-finite loss or gradients.
Needs matplotlib, imported only here.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

from lightning_moe.callbacks.card_format import CARD_JSON
from lightning_moe.io.atomic import atomic_write_bytes

PANELS = (
    ("loss", "loss"),
    ("tokens_per_s_per_gpu", "tokens/s/GPU"),
    ("tflops_per_gpu", "model TFLOP/s/GPU"),
)


def find_card(path: Path) -> Path:
    """``path`` itself, or the newest run card under a run directory (the logger's version folder holds it)."""
    if path.is_file():
        return path
    cards = sorted(path.rglob(CARD_JSON), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not cards:
        raise FileNotFoundError(f"{path}: no run card: no {CARD_JSON} here or below (the RunCard callback writes it "
                                f"into the run's log directory at the end of a run)")
    return cards[-1]


def load_card(run_dir: Path) -> dict[str, Any]:
    path = find_card(run_dir)
    try:
        card = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a run card, the JSON is truncated or corrupt ({error})") from None
    if not isinstance(card, dict):
        raise ValueError(f"{path}: not a run card (a JSON {type(card).__name__}, not an object)")
    if "series" not in card or "step" not in card["series"]:
        raise ValueError(f"{path}: no per-step 'series' in the run card")
    return card


def plot_card(card: dict[str, Any]) -> bytes:
    """The curves as PNG bytes; panels without any value are left out."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("lightning-moe report needs matplotlib: pip install matplotlib") from error
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    series = card["series"]
    panels = [(key, label) for key, label in PANELS if any(v is not None for v in series.get(key, []))]
    if not panels:
        raise ValueError("the run card has no loss or throughput values to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, label) in zip(axes[:, 0], panels):
        points = [(s, v) for s, v in zip(series["step"], series[key]) if v is not None]
        ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
        for step in card.get("nan_step_numbers") or []:
            ax.axvline(step, color="tab:red", alpha=0.4, linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(f"{card.get('name', '')} ({card.get('status', '')})")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-moe report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (its newest run_card.json is used) or the card")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: beside the run card)")
    args = parser.parse_args(argv)
    try:
        png = plot_card(load_card(args.run_dir))
    except (OSError, ValueError, ImportError) as error:
        print(f"lightning-moe report: {error}", file=sys.stderr)
        return 1
    out = args.out or find_card(args.run_dir).parent / "run_report.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, png)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
