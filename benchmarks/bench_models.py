"""Training-step throughput and peak memory: native Decoder vs transformers, same config, weights and batch.

Each (workload, dtype, implementation) runs in its own process so peak RSS is its own. One step =
forward + backward + fused AdamW step (both stacks' default optimizer) on CPU, with weights, activations and
optimizer state in the row's dtype on both sides (fp32, and bf16 as the published tables train). Peak memory
is the process's high-water mark during a step after warm-up (reset after it, so both sides hold their
optimizer state), measured in a run of its own with a fixed allocator policy (see ``run_child``), and also
shown net of the weights + gradients + AdamW state every implementation must hold.

    python benchmarks/bench_models.py                 # both workloads
    python benchmarks/bench_models.py --steps 5 --workloads dense --dtypes bfloat16
    python benchmarks/bench_models.py --workloads dense moe mla nemotron_h --seqs 512 4096 --dtypes float32

Each run also measures, in the same process and threads, the machine's GEMM rate at the model's own matmul
shapes (every mm / addmm / bmm / grouped mm a training step of that run executes, captured once and re-timed on
its own) and the best square-GEMM rate (4096^3), and reports the step's model FLOP/s (the package's FLOP count
of the native config, the same for both implementations) as a fraction of each. Rows at ``--seqs`` other than
the workload's own keep ~2048 tokens per step (batch = 2048 // seq, at least 1).

Targets: native >= 1.3x tokens/s and <= 0.8x peak memory of transformers; step model FLOP/s >= 90% of the shape
GEMM rate up to seq 2048 and >= 85% at 4096.
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
    # DeepSeek-V3-like: MLA (unequal q/k and v head dims), one dense then MoE blocks with a shared expert
    "mla": dict(native=dict(family="deepseek_v3", vocab_size=32000, hidden_size=512, pattern="*-*E*E*E",
                            attention=dict(type="mla", num_heads=8, num_kv_heads=8, q_lora_rank=256, kv_lora_rank=128,
                                           qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
                            mlp=dict(intermediate_size=1408),
                            moe=dict(num_experts=32, top_k=4, intermediate_size=256, num_shared_experts=1,
                                     score_func="sigmoid", norm_topk_prob=True, score_correction_bias=True),
                            max_position_embeddings=4096),
                seq=512, batch=4),
    # Nemotron-H-like: Mamba-2, MoE and attention blocks
    "nemotron_h": dict(native=dict(family="nemotron_h", vocab_size=32000, hidden_size=512, pattern="MEM*EM",
                                   attention=dict(num_heads=8, num_kv_heads=2, head_dim=64, rope=dict(type="none")),
                                   mlp=None, norm_weight_fp32=True, norm_eps=1e-5,
                                   moe=dict(num_experts=32, top_k=4, intermediate_size=256, activation="relu2",
                                            num_shared_experts=1, score_func="sigmoid", norm_topk_prob=True, score_correction_bias=True),
                                   mamba=dict(num_heads=16, head_dim=64, state_size=64, n_groups=2, chunk_size=128,
                                              time_step_limit=(0.001, float("inf"))),
                                   max_position_embeddings=4096),
                       seq=512, batch=4),
}
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")


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
    if "native" in spec:  # a native config, exported in the Hugging Face layout transformers loads
        from lightning_moe.checkpoint.convert import export_model
        from lightning_moe.models.config import ModelConfig
        from lightning_moe.models.decoder import Decoder

        model = Decoder(ModelConfig.from_dict(spec["native"]))
        model.init_weights()
        export_model(model, path)
        return
    transformers.AutoModelForCausalLM.from_config(hf_config(spec)).save_pretrained(path)


def with_seq(spec: dict, seq: int | None) -> dict:
    """The workload at another sequence length, ~2048 tokens per step."""
    if seq is None or seq == spec["seq"]:
        return spec
    return {**spec, "seq": seq, "batch": max(1, 2048 // seq)}


class TensorSpec:
    """A GEMM operand as captured: shape, strides and dtype (integer tensors, grouped GEMM offsets, by value)."""

    def __init__(self, tensor) -> None:
        self.shape, self.stride, self.dtype = tuple(tensor.shape), tensor.stride(), tensor.dtype
        self.values = None if tensor.is_floating_point() else tensor.clone()

    def __repr__(self) -> str:
        return f"T{self.shape}{self.stride}{self.dtype}{'' if self.values is None else self.values.tolist()}"

    def build(self):
        import torch

        if self.values is not None:
            return self.values
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype).normal_()


def captured_gemms(step) -> list[tuple]:
    """The GEMMs one call of ``step`` executes: (op, args, kwargs) with tensors as :class:`TensorSpec`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    calls = []

    def describe(value):
        return TensorSpec(value) if isinstance(value, torch.Tensor) else value

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in GEMM_OPS:
                calls.append((func, tree_map(describe, args), tree_map(describe, kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Capture():
        step()
    return calls


def shape_gemm_rate(calls: list[tuple], repeats: int = 3) -> float:
    """FLOP/s of the captured GEMMs, each re-run alone on random inputs of its shapes (best of ``repeats``)."""
    from torch.utils._pytree import tree_map
    from torch.utils.flop_counter import FlopCounterMode

    def build(value):
        return value.build() if isinstance(value, TensorSpec) else value

    unique: dict[str, list] = {}
    for func, args, kwargs in calls:
        unique.setdefault(repr((func, args, kwargs)), [func, args, kwargs, 0])[3] += 1
    flops = seconds = 0.0
    for func, args, kwargs, count in unique.values():
        real_args, real_kwargs = tree_map(build, args), tree_map(build, kwargs)
        with FlopCounterMode(display=False) as counter:
            func(*real_args, **real_kwargs)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            func(*real_args, **real_kwargs)
            best = min(best, time.perf_counter() - start)
        flops += counter.get_total_flops() * count
        seconds += best * count
    return flops / seconds


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(impl: str, spec: dict, weights: Path, dtype: str, steps: int, warmup: int, threads: int | None,
            rates: bool = True) -> dict:
    """Runs inside the child process."""
    import torch

    dtype = getattr(torch, dtype)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(1)
    batch, seq = spec["batch"], spec["seq"]
    ids = torch.randint(0, spec.get("vocab_size") or spec["native"]["vocab_size"], (batch, seq + 1))
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
    gemms = captured_gemms(train_step) if rates else []
    state_bytes = sum(p.numel() * p.element_size() * 4 for p in model.parameters())  # weight, grad, 2 moments
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    baseline = _rss_bytes("VmRSS")
    start, start_cpu = time.perf_counter(), time.process_time()
    losses = [train_step() for _ in range(steps)]
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    result = {}
    if rates:
        from lightning_moe.callbacks.peak_flops import measure_cpu_peak_flops
        from lightning_moe.models.families import family_for_hf_config
        from lightning_moe.models.flops import flops_per_token

        hf = json.loads((weights / "config.json").read_text())
        config = family_for_hf_config(hf).from_hf_config(hf)  # the native model's config, for both implementations
        step_flops = flops_per_token(config, seq) * batch * seq
        result = {"model_flops_per_s": step_flops * steps / elapsed, "shape_gemm_flops_per_s": shape_gemm_rate(gemms),
                  "best_gemm_flops_per_s": measure_cpu_peak_flops(dtype, 4096, repeats=2)}
    return {**result,
        "tokens_per_s": batch * seq * steps / elapsed,
        # tokens per CPU-second of this process: steadier than wall time on a shared machine
        "tokens_per_cpu_s": batch * seq * steps / cpu,
        "peak_rss": _rss_bytes("VmHWM"),
        "peak_above_start": _rss_bytes("VmHWM") - baseline + state_bytes,
        "state_bytes": state_bytes,
        "first_loss": losses[0],
    }


def run_child(impl: str, workload: str, weights: Path, dtype: str, steps: int, warmup: int,
              threads: int | None, memory: bool = False, seq: int | None = None) -> dict:
    """One measurement in a fresh process. ``memory``: with glibc's mmap threshold fixed, so every large buffer
    is mapped when allocated and unmapped when freed; the resident high-water mark then follows the live
    tensors and repeats run for run (the default adaptive threshold keeps freed buffers on the heap in
    whichever pattern the run happened to produce, and peaks vary by +-10%)."""
    cmd = [sys.executable, __file__, "--child", impl, "--workloads", workload, "--weights", str(weights),
           "--dtypes", dtype, "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--threads", str(threads)] if threads else []
    cmd += ["--seqs", str(seq)] if seq else []
    cmd += ["--no-rates"] if memory else []  # the memory run measures memory only
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
    parser.add_argument("--seqs", nargs="+", type=int, default=None,
                        help="sequence lengths (default: each workload's own, 512)")
    parser.add_argument("--impls", nargs="+", default=["transformers", "native"], choices=["transformers", "native"])
    parser.add_argument("--child", choices=["transformers", "native"], help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--no-rates", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        spec = with_seq(WORKLOADS[args.workloads[0]], args.seqs[0] if args.seqs else None)
        print(json.dumps(measure(args.child, spec, Path(args.weights), args.dtypes[0], args.steps, args.warmup,
                                 args.threads, rates=not args.no_rates)))
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            weights = Path(tmp) / name
            save_weights(WORKLOADS[name], weights)
            for seq in args.seqs or [None]:
                for dtype in args.dtypes:
                    best: dict[str, dict] = {}
                    for _ in range(args.repeats):
                        for impl in args.impls:
                            result = run_child(impl, name, weights, dtype, args.steps, args.warmup, args.threads,
                                               seq=seq)
                            if impl not in best or result["tokens_per_cpu_s"] > best[impl]["tokens_per_cpu_s"]:
                                best[impl] = result
                    for impl in args.impls:  # memory: one step more after warm-up, deterministic
                        peak = run_child(impl, name, weights, dtype, 1, args.warmup, args.threads, memory=True,
                                         seq=seq)
                        best[impl].update({key: peak[key] for key in ("peak_rss", "peak_above_start", "state_bytes")})
                    label = f"{name}/{with_seq(WORKLOADS[name], seq)['seq']}/{DTYPE_NAMES[dtype]}"
                    rows.append((label, best))

    print(f"{'workload':20} {'impl':13} {'tokens/s':>9} {'tok/cpu-s':>10} {'GFLOP/s':>8} {'of shape':>9} "
          f"{'of best':>8} {'peak RSS MiB':>13} {'peak net MiB':>13} {'loss@1':>8}")
    for name, best in rows:
        for impl, r in best.items():
            net = (r["peak_above_start"] - r["state_bytes"]) / 2**20
            print(f"{name:20} {impl:13} {r['tokens_per_s']:9.0f} {r['tokens_per_cpu_s']:10.0f} "
                  f"{r['model_flops_per_s'] / 1e9:8.1f} {r['model_flops_per_s'] / r['shape_gemm_flops_per_s']:9.0%} "
                  f"{r['model_flops_per_s'] / r['best_gemm_flops_per_s']:8.0%} "
                  f"{r['peak_rss'] / 2**20:13.0f} {net:13.0f} {r['first_loss']:8.4f}")
        for impl, r in best.items():
            print(f"{name:20} {impl} GEMM rates in the same process: {r['shape_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
                  f"at the model's shapes, {r['best_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s at 4096^3")
        if {"transformers", "native"} <= set(best):
            ours, hf = best["native"], best["transformers"]
            speed = ours["tokens_per_s"] / hf["tokens_per_s"]
            cpu_speed = ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"]
            memory = ours["peak_above_start"] / hf["peak_above_start"]
            print(f"{name:20} ratio native/transformers: tokens/s {speed:.2f}x wall, {cpu_speed:.2f}x per CPU-second "
                  f"(target >= 1.3x); peak memory {memory:.2f}x (target <= 0.8x)")


if __name__ == "__main__":
    main()
