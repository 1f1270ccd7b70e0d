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
    python benchmarks/bench_models.py --allocator heap  # timed runs without glibc's page-by-page faulting

Each run also measures, in the same process and threads, the machine's GEMM rate at the model's own matmul
shapes: every mm / addmm / bmm / grouped mm one training step executes is captured once and replayed exactly as
the step called it (same op, arguments, strides, dtypes, order, grouped GEMMs with the step's group offsets;
warm), right after each timed step. "of shape" is the step's model FLOP/s (the package's FLOP count of the
native config, the same for both implementations) over the replay's FLOP/s (FLOPs counted from the operands,
grouped GEMMs included), the median over steps; "GEMM time" is the replay's time over the step's. Both stay
below 100% unless the model FLOPs outside the captured GEMMs (SDPA's fused attention kernels) run faster than
GEMMs. Also the best square-GEMM rate (4096^3), "of best". "bound" is the "of shape" of a step that ran nothing
but its GEMMs, torch's CPU flash attention kernels (forward and backward, replayed the same way) and the fused
AdamW update (timed in the step itself): what no change to the model code short of new kernels can exceed.
Rows at ``--seqs`` other than the workload's own keep ~2048 tokens per step (batch = 2048 // seq, at least 1).

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
# attention kernels, whose speed is torch's, not the model code's (see "bound")
ATTENTION_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}
# glibc malloc policies for the timed runs (both implementations alike). "default": buffers over the adaptive
# mmap threshold (at most 32 MiB; a [vocab, hidden] gradient is over it) are mapped when allocated and unmapped
# when freed, and the heap's top is trimmed, so every step faults its fresh activations and gradients in page by
# page (in the kernel: 2-10 % of a step's CPU time on a 2-core VM, varying with the host). "heap": no mmap, no trim,
# freed memory is reused, as the caching allocators of GPUs (or jemalloc/tcmalloc on CPUs) do.
ALLOCATORS = {"default": {}, "heap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40)}}


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
    """An operand as captured: shape, strides and dtype (integer tensors, grouped GEMM offsets, by value)."""

    def __init__(self, tensor) -> None:
        self.shape, self.stride, self.dtype = tuple(tensor.shape), tensor.stride(), tensor.dtype
        self.values = None if tensor.is_floating_point() else tensor.clone()

    def __repr__(self) -> str:
        return f"T{self.shape}{self.stride}{self.dtype}{'' if self.values is None else self.values.tolist()}"

    def build(self):
        import torch

        if self.values is not None:
            return self.values
        # random storage viewed with the captured strides (stride 0 included: an expanded bias or gradient)
        storage = 1 + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride) if size > 0)
        return torch.randn(storage, dtype=self.dtype).as_strided(self.shape, self.stride)


def captured_calls(step, *op_sets: tuple[str, ...]) -> list[list[tuple]]:
    """The calls one run of ``step`` makes to the ops of each set (by name), in order: a list per set of
    (op, args, kwargs) with tensors as :class:`TensorSpec`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    calls = [[] for _ in op_sets]

    def describe(value):
        return TensorSpec(value) if isinstance(value, torch.Tensor) else value

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for ops, found in zip(op_sets, calls):
                if func.overloadpacket.__name__ in ops:
                    found.append((func, tree_map(describe, args), tree_map(describe, kwargs or {})))
            return func(*args, **(kwargs or {}))

    with Capture():
        step()
    return calls


def gemm_flops(func, args: tuple, kwargs: dict) -> int:
    """``2*M*K*N`` of one captured GEMM, counted from its operands (``torch.utils.flop_counter`` has no formula
    for ``_grouped_mm`` and would count it as 0). Grouped GEMMs count the rows, columns or contraction the
    offsets cover: 2d x 3d splits M, 3d x 2d splits N, 2d x 2d splits K (the weight gradient), 3d x 3d none."""
    name = func.overloadpacket.__name__
    if name in ("mm", "bmm"):
        a, b = args[0].shape, args[1].shape
    elif name in ("addmm", "baddbmm"):
        a, b = args[1].shape, args[2].shape
    elif name == "_grouped_mm":
        a, b = args[0].shape, args[1].shape
        offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
        used = None if offs is None else int(offs.values[-1])
        m, k, n = a[-2], a[-1], b[-1]
        if len(a) == 2 and len(b) == 3:
            return 2 * (used if used is not None else m) * k * n
        if len(a) == 3 and len(b) == 2:
            return 2 * m * k * (used if used is not None else n)
        if len(a) == 2 and len(b) == 2:
            return 2 * m * (used if used is not None else k) * n
        return 2 * a[0] * m * k * n
    else:
        raise ValueError(f"no FLOP formula for captured GEMM {name}")
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


class Replay:
    """Captured calls re-run exactly as the step made them: same ops, arguments, shapes, strides, dtypes and order
    (grouped GEMMs with the step's own group offsets), on random inputs built once and reused, so the replay runs
    warm. :meth:`run` is timed between training steps, so step and reference share the machine's load at that
    moment."""

    def __init__(self, calls: list[tuple]) -> None:
        from torch.utils._pytree import tree_map

        built: dict[str, object] = {}

        def build(value):
            if not isinstance(value, TensorSpec):
                return value
            key = repr(value)
            if key not in built:
                built[key] = value.build()
            return built[key]

        self.calls = [(func, tree_map(build, args), tree_map(build, kwargs)) for func, args, kwargs in calls]
        self.run()  # warm: first-touch of the inputs, the libraries' own first-call setup

    def run(self) -> float:
        """Seconds to run every captured call once, in the step's order."""
        start = time.perf_counter()
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)
        return time.perf_counter() - start


class GemmReplay(Replay):
    """The step's captured GEMMs replayed (:class:`Replay`); the step runs all of them and more, so its time cannot
    honestly be below theirs."""

    def __init__(self, calls: list[tuple]) -> None:
        self.flops = sum(gemm_flops(func, args, kwargs) for func, args, kwargs in calls)
        super().__init__(calls)


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(impl: str, spec: dict, weights: Path, dtype: str, steps: int, warmup: int, threads: int | None,
            rates: bool = True, compile: bool = False) -> dict:
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
        if compile:
            from lightning_moe.parallel.compile import apply_compile

            apply_compile(model)
        count = labels.numel()

        def step_loss():
            return model(inputs, labels=labels).loss_sum / count

    # fused AdamW: transformers' Trainer default (torch >= 2.8) and CausalLM's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    optimizer_seconds = []

    def train_step():
        loss = step_loss()
        loss.backward()
        start = time.perf_counter()
        optimizer.step()
        optimizer_seconds.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(warmup):
        train_step()
    replay = attention = None
    if rates:
        gemm_calls, attention_calls = captured_calls(train_step, GEMM_OPS, ATTENTION_OPS)
        replay, attention = GemmReplay(gemm_calls), Replay(attention_calls)
    state_bytes = sum(p.numel() * p.element_size() * 4 for p in model.parameters())  # weight, grad, 2 moments
    Path("/proc/self/clear_refs").write_text("5")  # reset the RSS high-water mark
    baseline = _rss_bytes("VmRSS")
    losses, step_seconds, gemm_seconds, attention_seconds, cpu = [], [], [], [], 0.0
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        losses.append(train_step())
        step_seconds.append(time.perf_counter() - start)
        cpu += time.process_time() - start_cpu
        if replay is not None:  # right after the step: the same load, threads and process
            gemm_seconds.append(replay.run())
            attention_seconds.append(attention.run())
    elapsed = sum(step_seconds)
    result = {}
    if rates:
        from lightning_moe.callbacks.peak_flops import measure_cpu_peak_flops
        from lightning_moe.models.families import family_for_hf_config
        from lightning_moe.models.flops import flops_per_token

        hf = json.loads((weights / "config.json").read_text())
        config = family_for_hf_config(hf).from_hf_config(hf)  # the native model's config, for both implementations
        step_flops = flops_per_token(config, seq) * batch * seq
        # per step, GEMM time over step time, timed back to back: a load change between steps cancels out
        shares = sorted(g / t for g, t in zip(gemm_seconds, step_seconds))
        share = shares[len(shares) // 2]
        shape_rate = replay.flops / min(gemm_seconds)
        result = {"model_flops_per_s": step_flops * steps / elapsed, "shape_gemm_flops_per_s": shape_rate,
                  # model FLOP/s as a fraction of the GEMM rate at the step's own shapes, per step (median)
                  "of_shape": share * step_flops / replay.flops,
                  "gemm_time_share": share, "gemm_flops_per_model_flop": replay.flops / step_flops,
                  # a step of nothing but these GEMMs and torch's attention and optimizer kernels
                  "of_shape_bound": step_flops / shape_rate / (min(gemm_seconds) + min(attention_seconds)
                                                               + min(optimizer_seconds)),
                  "gemm_seconds": min(gemm_seconds), "attention_seconds": min(attention_seconds),
                  "optimizer_seconds": min(optimizer_seconds),
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
              threads: int | None, memory: bool = False, seq: int | None = None, allocator: str = "default",
              compile: bool = False) -> dict:
    """One measurement in a fresh process. ``memory``: with glibc's mmap threshold fixed, so every large buffer
    is mapped when allocated and unmapped when freed; the resident high-water mark then follows the live
    tensors and repeats run for run (the default adaptive threshold keeps freed buffers on the heap in
    whichever pattern the run happened to produce, and peaks vary by +-10%). ``allocator``: glibc's policy for
    the timed runs, see ``ALLOCATORS``."""
    cmd = [sys.executable, __file__, "--child", impl, "--workloads", workload, "--weights", str(weights),
           "--dtypes", dtype, "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--threads", str(threads)] if threads else []
    cmd += ["--seqs", str(seq)] if seq else []
    cmd += ["--no-rates"] if memory else []  # the memory run measures memory only
    cmd += ["--compile"] if compile else []
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    else:
        env.update(ALLOCATORS[allocator])
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
    parser.add_argument("--allocator", default="default", choices=list(ALLOCATORS),
                        help="glibc's malloc policy for the timed runs (see ALLOCATORS)")
    parser.add_argument("--compile", action="store_true",
                        help="native: torch.compile each block (inductor), as the recipes' compile: true does")
    parser.add_argument("--child", choices=["transformers", "native"], help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    parser.add_argument("--no-rates", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        spec = with_seq(WORKLOADS[args.workloads[0]], args.seqs[0] if args.seqs else None)
        print(json.dumps(measure(args.child, spec, Path(args.weights), args.dtypes[0], args.steps, args.warmup,
                                 args.threads, rates=not args.no_rates, compile=args.compile)))
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
                                               seq=seq, allocator=args.allocator, compile=args.compile)
                            if impl not in best or result["tokens_per_cpu_s"] > best[impl]["tokens_per_cpu_s"]:
                                best[impl] = result
                    for impl in args.impls:  # memory: one step more after warm-up, deterministic
                        peak = run_child(impl, name, weights, dtype, 1, args.warmup, args.threads, memory=True,
                                         seq=seq, compile=args.compile)
                        best[impl].update({key: peak[key] for key in ("peak_rss", "peak_above_start", "state_bytes")})
                    label = f"{name}/{with_seq(WORKLOADS[name], seq)['seq']}/{DTYPE_NAMES[dtype]}"
                    rows.append((label, best))

    print(f"timed runs with glibc malloc policy '{args.allocator}' {ALLOCATORS[args.allocator]}")
    print(f"{'workload':20} {'impl':13} {'tokens/s':>9} {'tok/cpu-s':>10} {'GFLOP/s':>8} {'of shape':>9} "
          f"{'bound':>6} {'GEMM time':>10} {'of best':>8} {'peak RSS MiB':>13} {'peak net MiB':>13} {'loss@1':>8}")
    for name, best in rows:
        for impl, r in best.items():
            net = (r["peak_above_start"] - r["state_bytes"]) / 2**20
            print(f"{name:20} {impl:13} {r['tokens_per_s']:9.0f} {r['tokens_per_cpu_s']:10.0f} "
                  f"{r['model_flops_per_s'] / 1e9:8.1f} {r['of_shape']:9.0%} {r['of_shape_bound']:6.0%} "
                  f"{r['gemm_time_share']:10.0%} "
                  f"{r['model_flops_per_s'] / r['best_gemm_flops_per_s']:8.0%} "
                  f"{r['peak_rss'] / 2**20:13.0f} {net:13.0f} {r['first_loss']:8.4f}")
        for impl, r in best.items():
            print(f"{name:20} {impl} GEMM rates in the same process: {r['shape_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s "
                  f"at the step's own GEMMs (best replay; they hold {r['gemm_flops_per_model_flop']:.0%} of the model "
                  f"FLOPs), {r['best_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s at 4096^3; per step: GEMMs "
                  f"{r['gemm_seconds'] * 1e3:.0f} ms, attention kernels {r['attention_seconds'] * 1e3:.0f} ms, AdamW "
                  f"{r['optimizer_seconds'] * 1e3:.0f} ms")
        if {"transformers", "native"} <= set(best):
            ours, hf = best["native"], best["transformers"]
            speed = ours["tokens_per_s"] / hf["tokens_per_s"]
            cpu_speed = ours["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"]
            memory = ours["peak_above_start"] / hf["peak_above_start"]
            print(f"{name:20} ratio native/transformers: tokens/s {speed:.2f}x wall, {cpu_speed:.2f}x per CPU-second "
                  f"(target >= 1.3x); peak memory {memory:.2f}x (target <= 0.8x)")


if __name__ == "__main__":
    main()
