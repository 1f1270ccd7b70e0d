"""Gated DeltaNet and KDA mixers: forward + backward tokens/s and peak memory, native against transformers' torch
fallback (Qwen3.5's ``Qwen3_5GatedDeltaNet``, Kimi-Linear's ``KimiLinearDeltaAttention``), at several lengths
in the same run.

    python benchmarks/bench_linear_attention.py [--seqs 2048 8192] [--hidden 512] [--heads 8] [--head-dim 64]
                                                [--steps 3] [--dtype float32] [--mixers gdn kda]

Both sides hold the same weights and must produce the same output before timing starts. Speed: steps
alternate between the two mixers in this process and the median counts (wall time, and CPU time of this
process, steadier when other work shares the cores). Memory: one forward + backward in a fresh process per
(mixer, implementation, length), with glibc's mmap threshold fixed so the resident high-water mark follows the
live tensors (as ``bench_models.py`` measures it); reported above the process's resident size before the step.
Shapes: GDN with ``heads / 2`` key heads for ``heads`` value heads (Qwen3-Next's ratio), KDA with ``heads``
heads; chunks of 64 on both sides.

"bound": transformers' step over the time of the mixer's linear layers alone (forward + backward at the step's
shapes, timed in the same alternation). Both implementations run exactly these GEMMs, so no implementation that
keeps them can be faster than this ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from bench_mamba import median_seconds  # noqa: E402
from bench_models import _rss_bytes  # noqa: E402


def build(mixer: str, hidden: int, heads: int, head_dim: int, dtype: torch.dtype):
    """(ours, theirs) with the same weights."""
    from lightning_moe.models.config import LinearAttentionConfig

    if mixer == "gdn":
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        from lightning_moe.models.layers.gated_deltanet import GatedDeltaNet

        cfg = LinearAttentionConfig(num_k_heads=heads // 2, num_v_heads=heads, head_k_dim=head_dim,
                                    head_v_dim=head_dim, chunk_size=64)
        ours = GatedDeltaNet(cfg, hidden)
        theirs = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(
            hidden_size=hidden, linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, layer_types=["linear_attention"],
            num_hidden_layers=1), layer_idx=0)
        ours.reset_parameters(0.02)
        theirs.load_state_dict(ours.state_dict())
    else:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

        from lightning_moe.models.layers.kda import KimiDeltaAttention

        cfg = LinearAttentionConfig(num_k_heads=heads, num_v_heads=heads, head_k_dim=head_dim, head_v_dim=head_dim,
                                    chunk_size=64, norm_eps=1e-5)  # KimiLinearConfig's rms_norm_eps
        ours = KimiDeltaAttention(cfg, hidden)
        theirs = KimiLinearDeltaAttention(KimiLinearConfig(
            hidden_size=hidden, linear_num_heads=heads, linear_head_dim=head_dim, num_hidden_layers=1,
            layer_types=["linear_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2), layer_idx=0)
        ours.reset_parameters(0.02)
        state = {("forget_gate." + k if k.split(".")[0] in ("f_a_proj", "f_b_proj", "dt_bias", "A_log") else k): v
                 for k, v in ours.state_dict().items()}
        state["forget_gate.A_log"] = state["forget_gate.A_log"].view(1, 1, heads, 1)
        state["o_proj.weight"] = state.pop("out_proj.weight")
        theirs.load_state_dict(state)
    return ours.to(dtype).train(), theirs.to(dtype).train()


def step_fn(mixer: torch.nn.Module, x: torch.Tensor, native: bool):
    from lightning_moe.models.layers.sequence import SequenceLayout

    layout = SequenceLayout.from_inputs(x[..., 0].long(), None)

    def run():
        inp = x.detach().requires_grad_()
        out = mixer(inp, layout) if native else mixer(inp)
        out.float().square().mean().backward()
        mixer.zero_grad(set_to_none=True)

    return run


def projections_fn(mixer: torch.nn.Module, x: torch.Tensor):
    """The mixer's linear layers alone, forward + backward (weights and inputs) at the step's shapes."""
    linears = [m for m in mixer.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(*x.shape[:2], m.in_features, dtype=x.dtype) for m in linears]
    grads = [torch.randn(*x.shape[:2], m.out_features, dtype=x.dtype) for m in linears]

    def run():
        outs = [m(inp.detach().requires_grad_()) for m, inp in zip(linears, inputs)]
        torch.autograd.backward(outs, grads)
        mixer.zero_grad(set_to_none=True)

    return run


def peak_memory(args, mixer: str, impl: str, seq: int) -> int:
    """Peak resident bytes above the start of one forward + backward, in a fresh process."""
    cmd = [sys.executable, __file__, "--child", mixer, impl, str(seq), "--hidden", str(args.hidden),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{mixer}/{impl}/{seq} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_above_start"]


def child(args) -> None:
    mixer, impl, seq = args.child
    torch.manual_seed(0)
    ours, theirs = build(mixer, args.hidden, args.heads, args.head_dim, getattr(torch, args.dtype))
    x = torch.randn(1, int(seq), args.hidden, dtype=getattr(torch, args.dtype))
    run = step_fn(ours, x, True) if impl == "ours" else step_fn(theirs, x, False)
    del ours, theirs
    run()  # warm-up: allocator and lazy inits
    Path("/proc/self/clear_refs").write_text("5")  # reset the resident high-water mark
    start = _rss_bytes("VmRSS")
    run()
    print(json.dumps({"peak_above_start": _rss_bytes("VmHWM") - start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--mixers", nargs="+", default=["gdn", "kda"], choices=["gdn", "kda"])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    dtype = getattr(torch, args.dtype)
    print(f"fwd+bwd of one mixer, batch 1, hidden {args.hidden}, {args.heads} heads x {args.head_dim}, chunk 64, "
          f"{args.dtype}, {torch.get_num_threads()} threads")
    print(f"  {'mixer':5}{'seq':>6}{'ours tok/s':>12}{'theirs tok/s':>14}{'speed (wall)':>14}{'speed (CPU)':>13}"
          f"{'bound':>7}{'ours MiB':>10}{'theirs MiB':>12}{'memory':>8}")
    for mixer in args.mixers:
        for seq in args.seqs:
            torch.manual_seed(0)
            ours, theirs = build(mixer, args.hidden, args.heads, args.head_dim, dtype)
            x = torch.randn(1, seq, args.hidden, dtype=dtype)
            from lightning_moe.models.layers.sequence import SequenceLayout

            with torch.no_grad():
                diff = (ours(x, SequenceLayout.from_inputs(x[..., 0].long(), None)).float()
                        - theirs(x).float()).abs().max().item()
            if diff > (1e-4 if dtype == torch.float32 else 5e-2):
                raise SystemExit(f"{mixer} at {seq}: the mixers disagree (max |out diff| {diff:.2e}); not timing them")
            seconds = median_seconds({"ours": step_fn(ours, x, True), "theirs": step_fn(theirs, x, False),
                                      "linears": projections_fn(ours, x)}, args.steps)
            (ow, oc), (tw, tc), (lw, _) = seconds["ours"], seconds["theirs"], seconds["linears"]
            del ours, theirs
            mine, hub = peak_memory(args, mixer, "ours", seq), peak_memory(args, mixer, "theirs", seq)
            print(f"  {mixer:5}{seq:>6}{seq / ow:>12,.0f}{seq / tw:>14,.0f}{tw / ow:>13.2f}x{tc / oc:>12.2f}x"
                  f"{tw / lw:>6.2f}x{mine / 2**20:>10,.0f}{hub / 2**20:>12,.0f}{mine / hub:>7.2f}x")
    print("targets: >= 3x tokens/s, <= 0.6x peak memory")


if __name__ == "__main__":
    main()
