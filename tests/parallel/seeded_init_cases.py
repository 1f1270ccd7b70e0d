"""Worker side of the layout-invariant initialization test: the same seed builds the same weights on one
process and under FSDP, expert and tensor parallelism."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parallel_cases import build_dims, full, global_batches, local_batch, tiny_config

from lightning_moe.modules.causal_lm import build_decoder
from lightning_moe.parallel import parallelize

SEED = 7


def check_layouts(cases: list[tuple[str, dict]]) -> None:
    problems = []
    for model_name, sizes in cases:
        config = tiny_config(model_name)
        reference = build_decoder(config, seed=SEED)
        dims = build_dims(sizes)
        model = build_decoder(config, seed=SEED, parallelize=lambda m, dims=dims: parallelize(m, dims))
        case = f"{model_name} {sizes}"
        for name, param in model.named_parameters():
            if not torch.equal(full(param), reference.get_parameter(name)):
                problems.append(f"{case}: initial {name} differs from the single-process one")
        batch = global_batches(config.vocab_size, steps=1)[0]
        with torch.no_grad():
            expected = reference(batch["input_ids"], batch["position_ids"], labels=batch["labels"]).loss_sum
            local = local_batch(batch, dims)
            got = model(local["input_ids"], local["position_ids"], labels=local["labels"]).loss_sum
            dist.all_reduce(got, group=dims.mesh("dp_cp").get_group())
        if abs(got.item() - expected.item()) > 1e-5 * abs(expected.item()):
            problems.append(f"{case}: first loss sum {got.item():.6f} != single-process {expected.item():.6f}")
        other = build_decoder(config, seed=SEED + 1)
        if torch.equal(other.embed.weight, reference.embed.weight):
            problems.append(f"{case}: another seed gave the same embedding")
    if problems:
        raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(problems))
