"""Worker side of the generic path's context-parallel tests: a tiny transformers model trained with its rows split
over ``cp`` ranks (optionally with FSDP, expert parallelism, activation checkpointing) against the same model on
one process in the same rank (``parallel_cases``' loop, packed batches and comparisons); the context-parallel
attention function is counted, so a run where transformers attended the local tokens only cannot pass."""

from __future__ import annotations

import sys
from pathlib import Path

from parallel_cases import (
    SEQ,
    STEPS,
    build_dims,
    compare,
    compare_logits,
    global_batches,
    new_optimizer,
    train,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "hf_path"))
from tiny_hf_models import VOCAB  # noqa: E402

from lightning_moe.models.hf import HFModelConfig, build_hf_model  # noqa: E402
from lightning_moe.parallel import (
    hf_context,  # noqa: E402
    parallelize,  # noqa: E402
)
from lightning_moe.parallel.hf_context import ATTENTION_NAME, context_parallel_attention  # noqa: E402
from lightning_moe.parallel.options import ParallelOptions  # noqa: E402

GRAD_ATOL = 1e-5  # the first step's gradients, element by element


def count_attention_calls() -> list[tuple[int, bool]]:
    """Wrap the context-parallel attention (registered now and by models parallelized later): each call's local
    query length and whether it had sinks."""
    from transformers import AttentionInterface

    calls: list[tuple[int, bool]] = []

    def counted(module, query, *args, **kwargs):
        calls.append((query.shape[-2], kwargs.get("s_aux") is not None))
        return context_parallel_attention(module, query, *args, **kwargs)

    AttentionInterface.register(ATTENTION_NAME, counted)
    hf_context.context_parallel_attention = counted
    return calls


def run_hf_layout(case: str, model_dir: str, sizes: dict[str, int], **options) -> list[str]:
    """Five AdamW steps on packed batches under ``sizes`` and on one process; logits, losses, gradient norms and
    the first step's gradients must match, and every attention layer must have run the split attention."""
    dims = build_dims(sizes)
    config = HFModelConfig(hf=model_dir, native="never")
    reference = build_hf_model(config)
    parallel = build_hf_model(config, parallelize=lambda model: parallelize(model, dims, ParallelOptions(**options)))
    calls = count_attention_calls()
    batches = global_batches(VOCAB)
    problems = compare_logits(case, reference, parallel, batches[0], dims)
    expected, _ = train(reference, batches, optimizer=new_optimizer(reference))
    got, _ = train(parallel, batches, dims, new_optimizer(parallel))
    problems += compare(case, expected, got)
    for name, grad in expected.grads.items():
        error = (got.grads[name] - grad).abs().max().item() if name in got.grads else float("inf")
        if error > GRAD_ATOL:
            problems.append(f"{case}: step-1 gradient of {name} differs by {error:.3g} > {GRAD_ATOL}")
    text = reference.hf.config.get_text_config()
    layers, forwards = text.num_hidden_layers, 1 + STEPS
    if parallel.hf.config._attn_implementation != ATTENTION_NAME:
        problems.append(f"{case}: the model attends with {parallel.hf.config._attn_implementation}")
    if len(calls) < layers * forwards or {length for length, _ in calls} != {SEQ // dims.cp}:
        problems.append(f"{case}: {len(calls)} context-parallel attention calls of query lengths "
                        f"{sorted({length for length, _ in calls})}, expected >= {layers * forwards} of {SEQ // dims.cp}")
    sinks = sum(getattr(m, "sinks", None) is not None for m in reference.hf.modules())
    if sinks and not any(has_sinks for _, has_sinks in calls):
        problems.append(f"{case}: {sinks} layers have attention sinks, none reached the context-parallel attention")
    return problems


def fit_context_parallel(model_dir: str, root: str, sizes: dict) -> None:
    """Five steps of ``CausalLM`` on the transformers model under ``ParallelStrategy(**sizes)`` (the strategy splits
    every micro-batch along the sequence); rank 0 writes the losses and the attention calls' query lengths."""
    import json

    import torch.distributed as dist
    from trainer_cases import fit

    calls = count_attention_calls()
    losses, _ = fit(model_dir, root, sizes, steps=5, native="never")
    if dist.get_rank() == 0:
        record = {"losses": losses, "query_lengths": sorted({length for length, _ in calls}), "calls": len(calls)}
        (Path(root) / "losses.json").write_text(json.dumps(record))
