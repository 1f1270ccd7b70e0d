"""``lightning-moe estimate`` against measurement: five CPU twins, scaled up so the model dominates the process.

For each case the estimate's largest rank is compared with the measured peak RSS increase of a real
``lightning-moe fit`` of the same recipe and overrides (rank 0; from the RSS when the trainer calls ``setup``,
before the model is built, to the high-water mark at the end of training). Each run is a process of its own
with glibc's mmap threshold fixed, so large buffers are returned when freed and the high-water mark follows
the live tensors (as in ``bench_models.py``).

    python benchmarks/bench_estimate.py [--cases dense moe_ep2 ...] [--json out.json]

Target: every estimate within 15 % of its measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
MODEL = "--model.init_args.model."
# (twin, overrides): widths raised so parameters, states and activations are hundreds of MiB
CASES = {
    "dense": ("configs/tiny/dense_cp_benchmark.yaml", [
        f"{MODEL}hidden_size", "1024", f"{MODEL}vocab_size", "32000", f"{MODEL}mlp.intermediate_size", "4096",
        f"{MODEL}attention.num_heads", "16", f"{MODEL}attention.num_kv_heads", "8", f"{MODEL}attention.head_dim", "64",
        f"{MODEL}max_position_embeddings", "1024", "--data.init_args.seq_length", "1024",
        "--data.init_args.vocab_size", "32000"]),
    "moe_ep2": ("configs/tiny/moe_benchmark.yaml", [
        f"{MODEL}hidden_size", "768", f"{MODEL}vocab_size", "32000", f"{MODEL}moe.intermediate_size", "768",
        f"{MODEL}max_position_embeddings", "1024", "--data.init_args.seq_length", "1024",
        "--data.init_args.vocab_size", "32000", "--trainer.devices", "2", "--trainer.strategy.init_args.ep", "2"]),
    "mla": ("configs/tiny/mla_moe_benchmark.yaml", [
        f"{MODEL}hidden_size", "1024", f"{MODEL}vocab_size", "32000", f"{MODEL}mlp.intermediate_size", "2816",
        f"{MODEL}moe.intermediate_size", "1024", f"{MODEL}max_position_embeddings", "1024",
        "--data.init_args.seq_length", "1024", "--data.init_args.vocab_size", "32000"]),
    "nemotron_h": ("configs/tiny/nemotron_h_benchmark.yaml", [
        f"{MODEL}hidden_size", "768", f"{MODEL}vocab_size", "32000", f"{MODEL}moe.intermediate_size", "1024",
        f"{MODEL}moe.shared_intermediate_size", "1536", f"{MODEL}max_position_embeddings", "1024",
        "--data.init_args.seq_length", "1024", "--data.init_args.vocab_size", "32000"]),
    "lora": ("configs/tiny/dense_cp_benchmark.yaml", [
        f"{MODEL}hidden_size", "1536", f"{MODEL}vocab_size", "32000", f"{MODEL}mlp.intermediate_size", "4096",
        f"{MODEL}attention.num_heads", "16", f"{MODEL}attention.num_kv_heads", "8", f"{MODEL}attention.head_dim", "96",
        f"{MODEL}max_position_embeddings", "1024", "--data.init_args.seq_length", "1024",
        "--data.init_args.vocab_size", "32000", "--model.init_args.peft.r", "16"]),
}
RUN = ["--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def child(recipe: str, overrides: list[str], out: str) -> None:
    """A real fit with a callback that records the RSS at setup and the high-water mark at the end (rank 0)."""
    import lightning.pytorch as pl

    from lightning_moe import cli
    from lightning_moe.callbacks.memory import current_rss_bytes, peak_rss_bytes

    class RssProbe(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            self.baseline = current_rss_bytes()

        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                Path(out).write_text(json.dumps({"baseline": self.baseline, "peak": peak_rss_bytes()}))

    defaults = cli.default_callbacks
    cli.default_callbacks = lambda: [*defaults(), RssProbe()]
    cli.main(["fit", "--config", recipe, *overrides, *RUN])


def measure(recipe: str, overrides: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rss.json")
        env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
        cmd = [sys.executable, __file__, "--child", recipe, out, "--", *overrides,
               "--trainer.default_root_dir", tmp]
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(f"{recipe} failed:\n{run.stderr[-3000:]}")
        reading = json.loads(Path(out).read_text())
    return float(reading["peak"] - reading["baseline"])


def estimate(recipe: str, overrides: list[str]) -> dict:
    from lightning_moe.estimate.memory import estimate_memory
    from lightning_moe.estimate.recipe import load_recipe

    ranks = estimate_memory(load_recipe(ROOT / recipe, overrides))
    worst = max(ranks, key=lambda r: r.total)
    return {"total": worst.total, "components": worst.components}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child(args.child[0], [a for a in rest if a != "--"], args.child[1])
        return
    rows = []
    print("| case | estimated (MiB) | measured RSS increase (MiB) | estimate / measured | components (MiB) |")
    print("|---|---:|---:|---:|---|")
    for name in args.cases:
        recipe, overrides = CASES[name]
        est, measured = estimate(recipe, overrides), measure(recipe, overrides)
        ratio = est["total"] / measured
        parts = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in est["components"].items() if v)
        print(f"| {name} | {est['total'] / 2**20:,.0f} | {measured / 2**20:,.0f} | {ratio:.2f} | {parts} |", flush=True)
        rows.append({"case": name, "estimate": est, "measured": measured, "ratio": ratio})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
