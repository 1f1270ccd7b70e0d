"""One prepared GPU check: what works on this GPU and how fast, in one run (under 8 minutes on one H100/H200).

Sections, each timed and recorded even when it fails (the JSON is rewritten after every section, so a run cut
short keeps what it measured):

1. ``environment``: GPU, driver, CUDA, NCCL, torch, torchao, transformer-engine, CPU capability.
2. ``twins``: five tiny recipe twins (``configs/tiny``: dense, Qwen3-MoE, DeepSeek MLA+MoE, Nemotron-H, GPT-OSS)
   trained 5 steps on the device, losses against the same twins on CPU (bf16 tolerance).
3. ``compile``: the dense twin with ``compile: true`` (inductor) against eager, with the kernel checks' verdicts.
4. ``flex``: flex attention on packed rows against SDPA with the same mask, forward and backward, and timings.
5. ``fp8``: torchao FP8 tensorwise and rowwise training steps for real (MXFP8 reported as needing SM100 where
   the GPU is older), against bf16.
6. ``transformer_engine``: ``attention: te`` and ``te_modules: true`` (TE linear/RMSNorm) on the dense twin,
   built on the meta device as the strategy builds models, loss against the default.
7. ``timings``: the two single-GPU published rows (Llama3 8B LoRA, Qwen2.5 7B LoRA: GBS 32, MBS 2, seq 4096) and
   layer-cut proxies of Qwen3-MoE-30B and Nemotron 3 Nano that fit one GPU, through the Trainer as the
   recipes run; measured vs published TFLOP/s/GPU and MFU.

    python benchmarks/gpu_check.py --out runs/gpu_check          # one GPU
    python benchmarks/gpu_check.py --dry-run --out /tmp/check    # the same code paths on CPU at toy sizes

``--dry-run`` runs every section on CPU with toy sizes (the timing rows use the tiny twins instead of the hub
architectures, the compile section uses the ``aot_eager`` backend and the flex section torch's eager
flex_attention, since inductor's CPU compile alone would take minutes), so the script cannot rot before a GPU is
lent; its numbers say nothing about a GPU. ``--budget-s`` (default 450): sections and timing rows that would start
later are recorded as skipped, so one invocation ends inside 8 minutes with its JSON written.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
TWINS = {
    "dense": "configs/tiny/dense_cp_benchmark.yaml",
    "qwen3_moe": "configs/tiny/moe_benchmark.yaml",
    "deepseek_mla_moe": "configs/tiny/mla_moe_benchmark.yaml",
    "nemotron_h": "configs/tiny/nemotron_h_benchmark.yaml",
    "gpt_oss": "configs/tiny/gpt_oss_benchmark.yaml",
}
HUB_CONFIGS = REPO / "tests/recipes/hub_configs.yaml"  # the architectures' hub config.json, as the recipes use them
# (name, hub id, published row, LoRA, layer pattern cut to fit one GPU, micro / global batch, dry-run twin)
TIMINGS = [
    ("Llama3 8B LoRA", "meta-llama/Llama-3.1-8B", "automodel-lora-h100-llama3-8b", True, None, 2, 32, "dense"),
    ("Qwen2.5 7B LoRA", "Qwen/Qwen2.5-7B", "automodel-lora-h100-qwen2.5-7b", True, None, 2, 32, "dense"),
    ("Qwen3-MoE-30B, 4 of 48 layers", "Qwen/Qwen3-30B-A3B", "automodel-pretrain-h100-qwen3-moe-30b", False, 4, 4, 16,
     "qwen3_moe"),
    ("Nemotron 3 Nano, first 6 of 52 layers", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
     "automodel-pretrain-h100-nemotron-v3-nano-30b", False, 6, 4, 16, "nemotron_h"),
]
SEQ = 4096


class Check:
    def __init__(self, out: Path, dry_run: bool, budget_s: float = 450.0) -> None:
        self.out, self.dry_run = out, dry_run
        # past the budget, sections and timing rows not yet started are recorded as skipped (a lent GPU's
        # time is short: the run must end, with its JSON, well inside it)
        self.deadline = time.perf_counter() + budget_s
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.results: dict = {"dry_run": dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def section(self, name: str, run) -> None:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            if self.out_of_time():
                result = {"status": "skipped", "reason": "time budget spent before this section started (--budget-s)"}
            else:
                result = {"status": "ok", **(run(self) or {})}
        except Exception as error:  # noqa: BLE001 - one failing section must not hide the others
            result = {"status": "failed", "error": f"{type(error).__name__}: {error}"[:2000],
                      "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.results["sections"][name] = result
        print(f"   {result['status']} in {result['seconds']} s" + (f": {result['error']}" if "error" in result else ""),
              flush=True)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / ".gpu_check.json.partial"
        tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "gpu_check.json")


# ---------------------------------------------------------------- environment
def environment(check: Check) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "dry_run": check.dry_run}
    for dist in ("torchao", "transformer-engine", "transformer_engine", "lightning", "transformers"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"sm_{props.major}{props.minor}", gpu_memory_gib=props.total_memory / 2**30,
                   gpus=torch.cuda.device_count(), cudnn=torch.backends.cudnn.version())
        try:
            version = torch.cuda.nccl.version()  # a tuple, or one int in some builds
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as error:  # noqa: BLE001
            env["nccl"] = f"unknown ({error})"
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as error:
            env["driver"] = f"unknown ({error})"
    elif not check.dry_run:
        raise RuntimeError("no CUDA device: run on a GPU, or use --dry-run")
    return env


# ---------------------------------------------------------------- tiny twins
def twin_config(name: str):
    from lightning_moe.models.config import ModelConfig

    recipe = yaml.safe_load((REPO / TWINS[name]).read_text())
    return ModelConfig.from_dict(recipe["model"]["init_args"]["model"])


def packed_batch(vocab: int, device, rows: int = 2, seq: int = 64):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels = torch.randint(0, vocab, (rows, seq), generator=gen)
    positions = torch.cat([torch.arange(seq // 3), torch.arange(seq - seq // 3)]).expand(rows, seq).contiguous()
    return ids.to(device), positions.to(device), labels.to(device)


def train_losses(config, device, steps: int = 5, prepare=None, meta: bool = False) -> list[float]:
    """``steps`` AdamW steps of a fresh Decoder (same seed, same packed batch) on ``device``. ``meta``: built on
    the meta device, materialized on ``device`` and initialized there, as the strategy builds models."""
    from lightning_moe.models.decoder import Decoder

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Decoder(config)
        model.to_empty(device=device)
        model.init_weights(seed=0)
    else:
        model = Decoder(config)
        model.init_weights()
        model.to(device)
    if prepare is not None:
        prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, positions, labels = packed_batch(config.vocab_size, device)
    losses = []
    for _ in range(steps):
        out = model(ids, positions, labels=labels)
        loss = out.loss_sum / out.num_label_tokens + (out.aux_loss if out.aux_loss is not None else 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def close(got: list[float], expected: list[float], rel: float = 2e-2) -> bool:
    return all(abs(g - e) <= rel * abs(e) for g, e in zip(got, expected))


def twins(check: Check) -> dict:
    rows = {}
    for name in TWINS:
        config = twin_config(name)
        start = time.perf_counter()
        device_losses = train_losses(config, check.device)
        seconds = time.perf_counter() - start
        # a dry run's device is the CPU: its losses are the reference (the comparison still runs)
        cpu_losses = device_losses if check.device.type == "cpu" else train_losses(config, "cpu")
        rows[name] = {"device_losses": device_losses, "cpu_losses": cpu_losses, "match": close(device_losses, cpu_losses),
                      "device_seconds": round(seconds, 2)}
    failed = [n for n, r in rows.items() if not r["match"]]
    if failed:
        raise AssertionError(f"device losses differ from CPU beyond bf16 tolerance for {failed}: {rows}")
    return {"twins": rows}


# ---------------------------------------------------------------- compile
def compiled(check: Check) -> dict:
    from lightning_moe.kernels import kernel_checks, reset_kernel_checks
    from lightning_moe.parallel.compile import apply_compile

    backend = "aot_eager" if check.dry_run else "inductor"
    torch._dynamo.reset()
    reset_kernel_checks()
    config = twin_config("dense")
    eager = train_losses(config, check.device, steps=3)
    start = time.perf_counter()
    losses = train_losses(config, check.device, steps=3, prepare=lambda m: apply_compile(m, backend, "full", 1))
    result = {"backend": backend, "eager_losses": eager, "compiled_losses": losses, "match": close(losses, eager, 1e-3),
              "seconds_with_compilation": round(time.perf_counter() - start, 2), "kernel_checks": kernel_checks()}
    if not result["match"]:
        raise AssertionError(f"compiled losses {losses} != eager {eager}")
    return result


# ---------------------------------------------------------------- flex vs sdpa
def flex(check: Check) -> dict:
    from lightning_moe.kernels import kernel_checks, reset_kernel_checks
    from lightning_moe.models.layers.attention import attend
    from lightning_moe.models.layers.sequence import SequenceLayout

    if check.dry_run:  # inductor's CPU flex kernel compiles for minutes, and has no backward on CPU
        from torch.nn.attention.flex_attention import flex_attention

        import lightning_moe.kernels.flex as flex_kernels

        flex_kernels._compiled = flex_attention
    reset_kernel_checks()
    rows, seq, heads, kv_heads, dim = (1, 128, 4, 2, 64) if check.dry_run else (2, SEQ, 32, 8, 128)
    dtype = torch.float32 if check.dry_run else torch.bfloat16
    grad = not check.dry_run  # flex_attention has no CPU backward
    gen = torch.Generator(device=check.device).manual_seed(0)
    q, k, v = (torch.randn(rows, h, seq, dim, generator=gen, device=check.device, dtype=dtype).requires_grad_(grad)
               for h in (heads, kv_heads, kv_heads))
    cuts = [0, seq // 5, seq // 2, seq]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).expand(rows, seq).to(check.device)
    timings, outputs = {}, {}
    for backend in ("sdpa", "flex"):
        layout = SequenceLayout(positions)
        out = attend(q, k, v, layout, backend=backend, scale=dim**-0.5)
        if grad:
            out.sum().backward()
        outputs[backend] = (out.detach().float(), *(t.grad.float() if grad else None for t in (q, k, v)))
        for t in (q, k, v):
            t.grad = None
        timings[backend] = time_it(lambda b=backend: step_attention(q, k, v, positions, b, dim, grad), check.device)
    errors = {name: (a - b).abs().max().item() for name, a, b in zip(("out", "dq", "dk", "dv"), outputs["flex"],
                                                                      outputs["sdpa"]) if a is not None}
    result = {"shape": [rows, heads, seq, dim], "dtype": str(dtype), "backward": grad, "max_abs_error": errors,
              "seconds": timings, "kernel_checks": kernel_checks()}
    if max(errors.values()) > (1e-4 if dtype == torch.float32 else 5e-2):
        raise AssertionError(f"flex differs from SDPA: {errors}")
    return result


def step_attention(q, k, v, positions, backend, dim, grad):
    from lightning_moe.models.layers.attention import attend
    from lightning_moe.models.layers.sequence import SequenceLayout

    out = attend(q, k, v, SequenceLayout(positions), backend=backend, scale=dim**-0.5)
    if grad:
        out.sum().backward()


def time_it(fn, device, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------- FP8
def fp8(check: Check) -> dict:
    from lightning_moe.precision.fp8 import Float8Config, hardware_supports

    width, tokens = (512, 256) if check.dry_run else (4096, 16384)
    results = {}
    for recipe in ("tensorwise", "rowwise", "mxfp8"):
        if not check.dry_run and not hardware_supports(recipe):
            major, minor = torch.cuda.get_device_capability()
            results[recipe] = {"status": f"needs SM100 (Blackwell); this GPU is sm_{major}{minor}"}
            continue
        results[recipe] = fp8_step(Float8Config(recipe=recipe), width, tokens, check.device)
    bad = [r for r, v in results.items() if "relative_error" in v and v["relative_error"] > 0.1]
    if bad:
        raise AssertionError(f"FP8 output far from bf16 for {bad}: {results}")
    return {"width": width, "tokens": tokens, "recipes": results}


def fp8_step(config, width: int, tokens: int, device) -> dict:
    from torch import nn

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.GELU(),
                             nn.Linear(4 * width, width, bias=False)).to(device, torch.bfloat16)

    reference, model = stack(), stack()
    report = config.convert(model)
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16, generator=torch.Generator(device).manual_seed(1))
    expected, got = reference(x).float(), model(x).float()
    got.sum().backward()

    def step(m):
        m(x).sum().backward()

    flops = 3 * 2 * tokens * width * 4 * width * 2  # forward + two backward GEMMs, two layers
    fp8_s, bf16_s = time_it(lambda: step(model), device), time_it(lambda: step(reference), device)
    return {"converted": report.converted, "emulated": report.emulated,
            "relative_error": ((got - expected).norm() / expected.norm()).item(),
            "seconds": fp8_s, "bf16_seconds": bf16_s, "speedup_vs_bf16": bf16_s / fp8_s,
            "tflops": flops / fp8_s / 1e12}


# ---------------------------------------------------------------- Transformer Engine
def transformer_engine(check: Check) -> dict:
    import copy
    import importlib.util

    config = twin_config("dense")
    if importlib.util.find_spec("transformer_engine") is None:
        attention_te, te_modules = copy.deepcopy(config), copy.deepcopy(config)
        attention_te.attention.backend, te_modules.te_modules = "te", True
        errors = {}
        for key, chosen in (("error_without_te", attention_te), ("te_modules_error_without_te", te_modules)):
            try:
                train_losses(chosen, check.device, steps=1)
            except ValueError as error:
                errors[key] = str(error)
                continue
            raise AssertionError(f"{key}: choosing Transformer Engine without it installed raised no clear error")
        return {"status": "skipped", "installed": False, **errors}
    if check.dry_run:
        return {"status": "skipped", "installed": True, "reason": "Transformer Engine runs on a GPU only"}
    # both built on meta and initialized on the GPU with one seed: the same weights (te.Linear keeps the
    # package's init), TE's attention kernel plus model.te_modules against SDPA and torch's layers
    default = train_losses(config, check.device, prepare=lambda m: m.to(torch.bfloat16), meta=True)
    config.attention.backend, config.te_modules = "te", True
    te_losses = train_losses(config, check.device, prepare=lambda m: m.to(torch.bfloat16), meta=True)
    result = {"installed": True, "default_losses": default, "te_losses": te_losses, "match": close(te_losses, default, 5e-2)}
    if not result["match"]:
        raise AssertionError(f"TE losses {te_losses} != default backend {default}")
    return result


# ---------------------------------------------------------------- one-GPU timings of published rows
def hub_model_config(hub: str, layers: int | None):
    from lightning_moe.models.families import family_for_hf_config

    hf = yaml.safe_load(HUB_CONFIGS.read_text())[hub]["config"]
    config = family_for_hf_config(hf).from_hf_config(hf)
    if layers is not None:
        config.pattern = config.pattern[:layers]
    return config


def published(row: str) -> dict:
    rows = yaml.safe_load((REPO / "benchmarks/published_rows.yaml").read_text())["rows"]
    return rows[row]


def timings(check: Check) -> dict:
    import lightning as L

    from lightning_moe import ParallelStrategy
    from lightning_moe.callbacks import Throughput
    from lightning_moe.data import MockDataModule
    from lightning_moe.modules.causal_lm import CausalLM
    from lightning_moe.modules.optim import OptimizerConfig
    from lightning_moe.peft.lora import LoraConfig

    table = []
    for name, hub, row, lora, layers, micro, global_batch, twin in TIMINGS:
        start = time.perf_counter()
        entry = {"name": name, "row": row, "published_tflops_per_gpu": published(row).get("tflops_per_gpu")}
        if check.out_of_time():
            table.append({**entry, "status": "skipped", "error": "time budget spent before this row started"})
            continue
        trainer = module = None
        try:
            if check.dry_run:
                config, seq, micro, global_batch = twin_config(twin), 64, 2, 4
            else:
                config, seq = hub_model_config(hub, layers), SEQ
            throughput = Throughput(window=2, warmup_steps=1, peak_precision="bf16",
                                    peak_flops=1e12 if check.dry_run else None)
            trainer = L.Trainer(accelerator=check.device.type, devices=1, max_steps=3, precision="bf16-true",
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, limit_val_batches=0, callbacks=[throughput],
                                strategy=ParallelStrategy(dp_shard=-1, activation_checkpointing="none"),
                                default_root_dir=check.out / "timings")
            module = CausalLM(model=config, optimizer=OptimizerConfig(lr=1e-5),
                              peft=LoraConfig(r=16, alpha=32, dropout=0.1) if lora else None)
            trainer.fit(module, datamodule=MockDataModule(seq_length=seq, micro_batch_size=micro,
                                                          global_batch_size=global_batch, vocab_size=100,
                                                          num_val_samples=0))
            summary = throughput.summary()
            entry.update(status="ok", seq_length=seq, micro_batch_size=micro, global_batch_size=global_batch,
                         tflops_per_gpu=summary.get("tflops_per_gpu"), mfu=summary.get("mfu"),
                         step_time_s=summary.get("step_time_s"), tokens_per_s_per_gpu=summary.get("tokens_per_s_per_gpu"),
                         peak_memory_gib=(torch.cuda.max_memory_allocated() / 2**30 if check.device.type == "cuda" else None))
        except Exception as error:  # noqa: BLE001 - the next row still runs
            entry.update(status="failed", error=f"{type(error).__name__}: {error}"[:1000])
        entry["seconds"] = round(time.perf_counter() - start, 1)
        table.append(entry)
        del trainer, module  # this row's model and optimizer state, before the next row builds its own
        gc.collect()
        if check.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return {"rows": table, "markdown": markdown_table(table, check.dry_run)}


def markdown_table(rows: list[dict], dry_run: bool) -> str:
    lines = ["| Run | Measured TFLOP/s/GPU | Published | Ratio | MFU | Step time (s) | Tokens/s/GPU |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        measured, pub = r.get("tflops_per_gpu"), r.get("published_tflops_per_gpu")
        ratio = f"{measured / pub:.2f}" if measured and pub else "n/a"
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "n/a"
        cell = f"{measured:.4g}" if measured is not None else r.get("error", "n/a")[:80]
        step, tokens = r.get("step_time_s"), r.get("tokens_per_s_per_gpu")
        lines.append(f"| {r['name']} | {cell} | {pub} | {ratio} | {mfu} | {f'{step:.3f}' if step else 'n/a'} | "
                     f"{f'{tokens:,.0f}' if tokens else 'n/a'} |")
    if dry_run:
        lines.append("\nDry run: tiny twins on CPU against a nominal 1 TFLOP/s peak; not a GPU measurement.")
    return "\n".join(lines)


SECTIONS = [("environment", environment), ("twins", twins), ("compile", compiled), ("flex", flex), ("fp8", fp8),
            ("transformer_engine", transformer_engine), ("timings", timings)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="run every section on CPU at toy sizes")
    parser.add_argument("--sections", nargs="+", choices=[n for n, _ in SECTIONS], default=[n for n, _ in SECTIONS])
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="seconds after which sections and timing rows not yet started are skipped")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check = Check(args.out, args.dry_run, args.budget_s)
    for name, run in SECTIONS:
        if name in args.sections:
            check.section(name, run)
    timing = check.results["sections"].get("timings", {})
    if "markdown" in timing:
        print(timing["markdown"])
    failed = [n for n, r in check.results["sections"].items() if r["status"] == "failed"]
    print(f"wrote {args.out / 'gpu_check.json'}; failed sections: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
