"""Training-step tokens/s of the native decoder against transformers, for small DeepSeek-V3 and GPT-OSS models.

    python benchmarks/bench_families.py [--family deepseek_v3 gpt_oss] [--seq 512] [--batch 2] [--steps 5]
                                        [--dtype bfloat16] [--threads N] [--hf-experts grouped_mm]

One step = forward + backward + AdamW step on CPU, weights and activations in ``--dtype`` on both sides (fp32 by
default). Both models hold the same weights (the native model
is imported from the transformers model's saved checkpoint) and train on the same batch; transformers runs
its default attention and experts implementations unless ``--hf-experts`` names one (eager, batched_mm,
grouped_mm). The losses of the first step must agree before anything is timed. Steps alternate between the two
models and the median step time counts (wall and process CPU time; CPU time is the steadier figure on a
shared machine).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from bench_mamba import median_seconds  # alternating rounds, median (wall, CPU) seconds per step

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB = 4096


def hf_config(family: str, seq: int):
    import transformers as t

    if family == "deepseek_v3":
        return t.DeepseekV3Config(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
            num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
            n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
            q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            max_position_embeddings=seq,
        )
    if family == "gpt_oss":
        return t.GptOssConfig(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, num_local_experts=16, num_experts_per_tok=4, sliding_window=128,
            max_position_embeddings=131072,  # the hub value: YaRN factor 32 over 4096 positions
        )
    raise ValueError(f"unknown family {family!r} (deepseek_v3, gpt_oss)")


def build(family: str, seq: int, hf_experts: str | None, dtype: torch.dtype):
    import transformers

    from lightning_moe.checkpoint.load import load_pretrained

    torch.manual_seed(0)
    kwargs = {"experts_implementation": hf_experts} if hf_experts else {}
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config(family, seq), **kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours = load_pretrained(tmp, dtype=dtype)
    return ours.train(), theirs.to(dtype).train()


def bench(family: str, args) -> None:
    dtype = getattr(torch, args.dtype)
    ours, theirs = build(family, args.seq, args.hf_experts, dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=gen)
    shifted = torch.roll(ids, -1, dims=1)
    shifted[:, -1] = -100  # native labels are pre-shifted; transformers shifts its own

    def our_loss():
        out = ours(ids, labels=shifted)
        return out.loss_sum / out.num_label_tokens

    def their_loss():
        return theirs(input_ids=ids, labels=ids).loss

    with torch.no_grad():
        losses = our_loss().item(), their_loss().item()
    if abs(losses[0] - losses[1]) > (1e-4 if dtype == torch.float32 else 1e-2) * abs(losses[1]):
        raise SystemExit(f"{family}: the two models disagree (loss {losses[0]} vs {losses[1]}); not timing them")

    def step(model, loss_fn):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def run():
            loss_fn().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return run

    tokens = args.batch * args.seq
    seconds = median_seconds({"ours": step(ours, our_loss), "theirs": step(theirs, their_loss)}, args.steps)
    experts = getattr(theirs.config, "_experts_implementation", "?")
    attention = getattr(theirs.config, "_attn_implementation", "?")
    params = sum(p.numel() for p in ours.parameters())
    print(f"{family}: {params / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq}, {args.dtype}, "
          f"{torch.get_num_threads()} threads (first loss {losses[0]:.6f} vs {losses[1]:.6f}; transformers "
          f"attention={attention}, experts={experts}); tokens/s by wall time | by process CPU time")
    (ours_wall, ours_cpu), (theirs_wall, theirs_cpu) = seconds["ours"], seconds["theirs"]
    print(f"  lightning_moe Decoder   {tokens / ours_wall:>8,.0f} | {tokens / ours_cpu:>8,.0f}")
    print(f"  transformers            {tokens / theirs_wall:>8,.0f} | {tokens / theirs_cpu:>8,.0f}")
    print(f"  ratio                   {theirs_wall / ours_wall:>8.2f}x | {theirs_cpu / ours_cpu:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", default=["deepseek_v3", "gpt_oss"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--hf-experts", default=None, choices=["eager", "batched_mm", "grouped_mm"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for family in args.family:
        bench(family, args)


if __name__ == "__main__":
    main()
