"""Data benchmarks: packing and indexed-dataset reads.

    python benchmarks/bench_data.py [--num-lengths 1000000] [--pack-size 4096] [--tokens 50000000]

1. Packing: ``--num-lengths`` synthetic sample lengths (log-normal, median ~400, clipped to
   [8, pack size]) packed by first-fit-decreasing and by the greedy in-order packer: time,
   rows and efficiency (sample tokens / row tokens).
2. Indexed dataset: a Megatron ``.bin/.idx`` file of ``--tokens`` uint16 tokens in documents of
   log-normal length; read throughput in tokens/s for sequential and random document reads (each
   read copied into an int64 array, as a DataLoader would), and for GPT samples of 4096 + 1 tokens.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from lightning_moe.data import IndexedDataset, IndexedDatasetWriter, pack_first_fit_decreasing, pack_greedy
from lightning_moe.data.gpt_sampling import GPTDataset
from lightning_moe.data.packing import packing_stats


def bench_packing(num: int, pack_size: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(400), 1.0, num), 8, pack_size).astype(np.int64)
    print(f"packing {num:,} lengths (mean {lengths.mean():.0f}, max {lengths.max()}) into rows of {pack_size}")
    print(f"  {'packer':<28}{'time (s)':>10}{'rows':>12}{'efficiency':>12}{'samples/row':>13}")
    for name, packer in (("first-fit-decreasing", pack_first_fit_decreasing), ("greedy in-order", pack_greedy)):
        t0 = time.perf_counter()
        bins = packer(lengths, pack_size)
        dt = time.perf_counter() - t0
        s = packing_stats(bins, lengths, pack_size)
        print(f"  {name:<28}{dt:>10.2f}{s.num_packs:>12,}{s.packing_efficiency:>11.2%}{s.packing_factor:>13.2f}")


def bench_indexed(num_tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "bench_text_document")
        t0 = time.perf_counter()
        written = 0
        with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
            while written < num_tokens:
                n = int(np.clip(rng.lognormal(np.log(600), 1.0), 16, 32768))
                w.add_document(rng.integers(0, 65000, n, dtype=np.uint16))
                written += n
        dt = time.perf_counter() - t0
        ds = IndexedDataset(prefix)
        print(f"indexed dataset: {len(ds):,} documents, {ds.num_tokens:,} tokens "
              f"({os.path.getsize(prefix + '.bin') / 2**20:.0f} MiB); written in {dt:.2f} s")

        def run(name: str, indices: np.ndarray) -> None:
            t0 = time.perf_counter()
            total = 0
            for i in indices.tolist():
                total += len(np.array(ds[i], dtype=np.int64))
            dt = time.perf_counter() - t0
            print(f"  {name:<34}{total / dt / 1e6:>10.1f} M tokens/s  ({len(indices) / dt:>10,.0f} reads/s)")

        run("sequential document reads", np.arange(len(ds)))
        run("random document reads", rng.permutation(len(ds)))
        gpt = GPTDataset(ds, seq_length=4096, seed=seed)
        count = min(len(gpt), 5000)
        t0 = time.perf_counter()
        for i in range(count):
            gpt[i]
        dt = time.perf_counter() - t0
        print(f"  {'GPT samples (4096 + 1, shuffled)':<34}{count * 4096 / dt / 1e6:>10.1f} M tokens/s  "
              f"({count / dt:>10,.0f} samples/s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-lengths", type=int, default=1_000_000)
    p.add_argument("--pack-size", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=50_000_000)
    args = p.parse_args()
    bench_packing(args.num_lengths, args.pack_size)
    bench_indexed(args.tokens)


if __name__ == "__main__":
    main()
