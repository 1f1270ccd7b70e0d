"""Mamba-2 mixer: forward + backward tokens/s of the native mixer against transformers' NemotronH mixer.

    python benchmarks/bench_mamba.py [--seq 2048] [--batch 1] [--hidden 512] [--steps 7] [--dtype float32]

Both mixers hold the same weights; transformers runs its pure-PyTorch path (no mamba-ssm / causal-conv1d
kernels on CPU). Shapes follow Nemotron-H's ratios: expand 2 (heads * head_dim = 2 * hidden), head_dim 64,
state 128, 8 groups, chunk 128. Steps alternate between the two mixers and the median step counts, in wall
time and in CPU time of this process (steadier when other work shares the cores). Both mixers must
produce the same output before timing starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(hidden: int, chunk: int, dtype: torch.dtype):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from lightning_moe.models.config import MambaConfig
    from lightning_moe.models.layers.mamba2 import Mamba2Mixer

    hf = NemotronHConfig(
        vocab_size=128, hidden_size=hidden, layers_block_type=["linear_attention"], ssm_state_size=128,
        mamba_num_heads=2 * hidden // 64, mamba_head_dim=64, n_groups=8, conv_kernel=4, chunk_size=chunk,
    )
    theirs = NemotronHMamba2Mixer(hf, layer_idx=0)
    ours = Mamba2Mixer(
        MambaConfig(num_heads=hf.mamba_num_heads, head_dim=64, state_size=128, n_groups=8, chunk_size=chunk,
                    time_step_limit=(hf.time_step_min, float("inf")), norm_eps=hf.layer_norm_epsilon),
        hidden,
    )
    ours.reset_parameters(0.02)
    theirs.load_state_dict(ours.state_dict())
    return ours.to(dtype).train(), theirs.to(dtype).train()


def median_seconds(steps: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per step of each candidate, alternating candidates every round so load
    changes hit all alike. CPU time (all threads of this process) is the steadier figure on a shared machine."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm-up
    for _ in range(rounds):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    from lightning_moe.models.layers.sequence import SequenceLayout

    torch.manual_seed(0)
    ours, theirs = build(args.hidden, args.chunk, dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype)
    layout = SequenceLayout.from_inputs(x[..., 0].long(), None)
    with torch.no_grad():
        diff = (ours(x, layout).float() - theirs(x).float()).abs().max().item()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if diff > tolerance:
        raise SystemExit(f"the mixers disagree: max |out diff| {diff:.2e} > {tolerance:g}; not timing them")

    def step(mixer, *extra):
        def run():
            inp = x.detach().requires_grad_()
            mixer(inp, *extra).float().square().mean().backward()
            mixer.zero_grad(set_to_none=True)

        return run

    tokens = args.batch * args.seq
    seconds = median_seconds({"ours": step(ours, layout), "theirs": step(theirs)}, args.steps)
    (ours_wall, ours_cpu), (theirs_wall, theirs_cpu) = seconds["ours"], seconds["theirs"]
    print(f"Mamba-2 mixer fwd+bwd, batch {args.batch} x seq {args.seq}, hidden {args.hidden}, "
          f"{ours.num_heads} heads x {ours.head_dim}, state 128, chunk {args.chunk}, {args.dtype}, "
          f"{torch.get_num_threads()} threads (max |out diff| {diff:.2e})")
    print(f"  {'':34}{'tokens/s (wall)':>16}{'tokens/CPU-s':>14}")
    print(f"  {'lightning_moe Mamba2Mixer':34}{tokens / ours_wall:>16,.0f}{tokens / ours_cpu:>14,.0f}")
    print(f"  {'transformers NemotronH (torch)':34}{tokens / theirs_wall:>16,.0f}{tokens / theirs_cpu:>14,.0f}")
    print(f"  {'ratio':34}{theirs_wall / ours_wall:>15.2f}x{theirs_cpu / ours_cpu:>13.2f}x")


if __name__ == "__main__":
    main()
