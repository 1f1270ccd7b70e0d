"""Training-step throughput and peak memory: native Decoder vs transformers, same config, weights and batch.

Each (workload, dtype, implementation) runs in its own process so peak RSS is its own. One step =
forward + backward + fused AdamW step (both stacks' default optimizer) on CPU, with weights, activations and
optimizer state in the row's dtype on both sides (fp32, and bf16 as the published tables train). Peak memory
is the process's high-water mark during a step after warm-up (reset after it, so both sides hold their
optimizer state), measured in a run of its own with a fixed allocator policy (see ``run_child``), and also
shown net of the weights + gradients + AdamW state every implementation must hold.

    python benchmarks/bench_models.py                 # both workloads
    python benchmarks/bench_models.py --steps 5 --workloads dense --dtypes bfloat16

Targets: native >= 1.3x tokens/s and <= 0.8x peak memory of transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {
    # Llama-like dense: hidden 512, 4 layers, vocab 32k, seq 512, batch 4
    "dense": dict(arch="llama", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, seq=512, batch=4),
    # Qwen3-MoE-like: 32 experts, top-4
    "moe": dict(arch="qwen3_moe", vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, head_dim=64, moe_intermediate_size=256,
                num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, seq=512, batch=4),
}


DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def hf_config(spec: dict):
    import transformers

    kwargs = {k: v for k, v in spec.items() if k not in ("arch", "seq", "batch")}
    if spec["arch"] == "llama":
        return transformers.LlamaConfig(**kwargs)
    return transformers.Qwen3MoeConfig(**kwargs)


def save_weights(spec: dict, path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf_config(spec)).save_pretrained(path)


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(impl: str, spec: dict, weights: Path, dtype: str, steps: int, warmup: int, threads: int | None) -> dict:
    """Runs inside the child process."""
    import torch

    dtype = getattr(torch, dtype)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(1)
    batch, seq = spec["batch"], spec["seq"]
    ids = torch.randint(0, spec["vocab_size"], (batch, seq + 1))
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if impl == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=dtype).train()

        def step_loss():
            # transformers' own training loss; shift_labels: the same (already shifted) targets as ours
            return model(input_ids=inputs, labels=labels, shift_labels=labels).loss
    else:
        from lightning_moe.checkpoint.load import load_pretrained

        model = load_pretrained(weights, dtype=dtype).train()
        count = labels.numel()

        def step_loss():
            return model(inputs, labels=labels).loss_sum / count

    # fused AdamW: transformers' Trainer default (torch >= 2.8) and CausalLM's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def train_step():
        loss = step_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(warmup):
        train_step()
    state_bytes = sum(p.numel() * p.element_size() * 4 for p in model.parameters())  # weight, grad, 2 moments
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    baseline = _rss_bytes("VmRSS")
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = [train_step() for _ in range(steps)]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    return {
        "tokens_per_s": batch * seq * steps / elapsed,
        # tokens per CPU-second of this process: steadier than wall time on a shared machine
        "tokens_per_cpu_s": batch * seq * steps / cpu,
        "peak_rss": _rss_bytes("VmHWM"),
        "peak_above_start": _rss_bytes("VmHWM") - baseline + state_bytes,
        "state_bytes": state_bytes,
        "first_loss": losses[0],
    }


def run_child(impl: str, workload: str, weights: Path, dtype: str, steps: int, warmup: int,
              threads: int | None, memory: bool = False) -> dict:
    """One measurement in a fresh process. ``memory``: with glibc's mmap threshold fixed, so every large buffer
    is mapped when allocated and unmapped when freed; the resident high-water mark then follows the live
    tensors and repeats run for run (the default adaptive threshold keeps freed buffers on the heap in
    whichever pattern the run happened to produce, and peaks vary by +-10%)."""
    cmd = [sys.executable, __file__, "--child", impl, "--workloads", workload, "--weights", str(weights),
           "--dtypes", dtype, "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--threads", str(threads)] if threads else []
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{impl}/{workload} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternate runs; the best of each is kept")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default: torch's)")
    parser.add_argument("--child", choices=["transformers", "native"], help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        spec = WORKLOADS[args.workloads[0]]
        print(json.dumps(measure(args.child, spec, Path(args.weights), args.dtypes[0], args.steps, args.warmup, args.threads)))
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            weights = Path(tmp) / name
            save_weights(WORKLOADS[name], weights)
            for dtype in args.dtypes:
                best: dict[str, dict] = {}
                for _ in range(args.repeats):
                    for impl in ("transformers", "native"):
                        result = run_child(impl, name, weights, dtype, args.steps, args.warmup, args.threads)
                        if impl not in best or result["tokens_per_cpu_s"] > best[impl]["tokens_per_cpu_s"]:
                            best[impl] = result
                for impl in ("transformers", "native"):  # memory: one step more after warm-up, deterministic
                    peak = run_child(impl, name, weights, dtype, 1, args.warmup, args.threads, memory=True)
                    best[impl].update({key: peak[key] for key in ("peak_rss", "peak_above_start", "state_bytes")})
                rows.append((f"{name}/{DTYPE_NAMES[dtype]}", best["transformers"], best["native"]))

    print(f"{'workload':10} {'impl':13} {'tokens/s':>9} {'tok/cpu-s':>10} {'peak RSS MiB':>13} {'peak net MiB':>13} "
          f"{'loss@1':>8}")
    for name, hf, ours in rows:
        for impl, r in (("transformers", hf), ("native", ours)):
            net = (r["peak_above_start"] - r["state_bytes"]) / 2**20
            print(f"{name:10} {impl:13} {r['tokens_per_s']:9.0f} {r['tokens_per_cpu_s']:10.0f} "
                  f"{r['peak_rss'] / 2**20:13.0f} {net:13.0f} {r['first_loss']:8.4f}")
        speed = ours["tokens_per_s"] / hf["tokens_per_s"]
        cpu_speed = ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"]
        memory = ours["peak_above_start"] / hf["peak_above_start"]
        print(f"{name:10} ratio native/transformers: tokens/s {speed:.2f}x wall, {cpu_speed:.2f}x per CPU-second "
              f"(target >= 1.3x); peak memory {memory:.2f}x (target <= 0.8x)")


if __name__ == "__main__":
    main()
