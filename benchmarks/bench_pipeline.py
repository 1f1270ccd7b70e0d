"""Measured pipeline bubble of 1F1B and interleaved 1F1B against the theory, on 2 CPU ranks (gloo).

Each schedule trains a dense decoder with ``ParallelStrategy(pp=2)`` for a few steps of ``m`` micro-batches under a
real ``Trainer``. The measured bubble is the share of each schedule step the ranks spent outside their stages'
forward and backward, summed over both ranks, from the second step on (what the run card records as
``pipeline.bubble_fraction``). Theory, with equal stages and free communication: ``(p-1)/(m+p-1)`` for 1F1B and
``(p-1)/(v*m+p-1)`` for interleaved 1F1B with ``v`` stages per rank. Point-to-point sends through gloo on CPU are
not free, and the first and last stages also hold the embedding and the output layer, so measured figures sit
above the theory; the ratio between the schedules is the comparison that carries over.

    python benchmarks/bench_pipeline.py                       # 1f1b and interleaved_1f1b, pp=2, 4 micro-batches
    python benchmarks/bench_pipeline.py --steps 6 --hidden 256 --seq 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile


def run(schedule: str, vp: int, args) -> dict:
    import lightning as L

    from lightning_moe import ParallelStrategy
    from lightning_moe.data import MockDataModule
    from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig
    from lightning_moe.modules.causal_lm import CausalLM

    config = ModelConfig(
        family="llama", vocab_size=args.vocab, hidden_size=args.hidden, pattern="*-*-*-*-",
        attention=AttentionConfig(num_heads=args.hidden // 64, num_kv_heads=args.hidden // 64, head_dim=64),
        mlp=MLPConfig(4 * args.hidden), max_position_embeddings=args.seq,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ParallelStrategy(pp=2, vp=vp, pp_schedule=schedule),
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tempfile.mkdtemp(),
    )
    module = CausalLM(model=config)
    data = MockDataModule(seq_length=args.seq, micro_batch_size=1, global_batch_size=args.micro_batches,
                          vocab_size=args.vocab, num_val_samples=0)
    trainer.fit(module, datamodule=data)
    pipeline = module._pipeline
    return {"schedule": schedule, "pp": 2, "vp": vp, "micro_batches": pipeline.micro_batches,
            "bubble_measured": pipeline.bubble_fraction(), "bubble_theory": pipeline.theoretical_bubble_fraction()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    rows = [run("1f1b", 1, args), run("interleaved_1f1b", 2, args)]
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        json.dump(rows, sys.stdout, indent=1)
        print()
        for row in rows:
            print(f"{row['schedule']:>18} pp={row['pp']} vp={row['vp']} m={row['micro_batches']}: measured bubble "
                  f"{row['bubble_measured']:.3f}, theory {row['bubble_theory']:.3f}")


if __name__ == "__main__":
    main()
