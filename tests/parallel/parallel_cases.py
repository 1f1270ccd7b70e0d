"""Worker side of the distributed tests: tiny models trained under a parallel layout and, in the same
process, on one rank with the whole global batch (the reference). Losses, gradient norms and the gradients
of the first step must match; each rank checks its own view.

The training loop follows the training module's contract: each rank backpropagates its local loss *sum*,
the label count is all-reduced over data-parallel x context-parallel ranks, and gradients are multiplied by
``dp_cp_size / global_label_tokens`` before clipping.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lightning_moe.checkpoint.load import copy_tensors_into
from lightning_moe.models.config import (
    AttentionConfig,
    LinearAttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
)
from lightning_moe.models.decoder import Decoder
from lightning_moe.parallel import ParallelDims, parallelize
from lightning_moe.parallel.context import load_balanced_indices, shard_batch
from lightning_moe.parallel.fsdp import deferred_all_reduce
from lightning_moe.parallel.grad_norm import clip_grad_norm_
from lightning_moe.parallel.options import ParallelOptions

ROWS, SEQ, STEPS = 4, 16, 5
MAX_NORM = 0.5
LOSS_TOLERANCE = 1e-5
# fp32 sums in another order (sharded reductions, all-reduces): differences of a few ulps of each gradient
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7


def tiny_config(name: str) -> ModelConfig:
    """``llama``: dense GQA. ``qwen3_moe``: qk-norm, a dense block then an MoE block. ``qwen3_moe_skewed``:
    the same with a selection bias that sends every token to experts 0 and 1. ``gpt_oss_like``: tied
    embeddings, attention biases and sinks, a sliding window on the first layer, squared-ReLU MLPs with bias.
    ``qwen3_moe_balanced``: the same with round-robin routing (the benchmarks'), ``qwen3_moe_balanced_aux`` with a
    load-balancing loss too. ``deepseek_like``: MLA,
    group-limited sigmoid routing with a shared expert, one MTP depth; ``mla_moe``: the same without MTP (context parallelism does not split MTP heads); ``deepseek_shared_mtp``: one MTP layer
    applied at 2 depths (Megatron's repeated MTP layer)."""
    if name in ("deepseek_like", "mla_moe", "deepseek_shared_mtp"):
        mtp = {"deepseek_like": MTPConfig(num_layers=1, pattern="*E", loss_scale=0.3),
               "deepseek_shared_mtp": MTPConfig(num_layers=2, pattern="*E", loss_scale=0.3, shared=True)}.get(name)
        return ModelConfig(
            family="deepseek_v3", vocab_size=64, hidden_size=32, pattern="*-*E",
            attention=AttentionConfig(type="mla", num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                      qk_rope_head_dim=4, v_head_dim=8),
            mlp=MLPConfig(64),
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, score_func="sigmoid", n_group=2,
                          topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, num_shared_experts=1),
            mtp=mtp, init_std=0.05,
        )
    if name == "gpt_oss_like":
        return ModelConfig(
            family="llama", vocab_size=64, hidden_size=32, pattern="*-*-", tie_embeddings=True,
            attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, out_bias=True,
                                      sinks=True, sliding_window=6, sliding_window_layers=[True, False]),
            mlp=MLPConfig(64, activation="relu2", bias=True), init_std=0.05,
        )
    if name in ("hybrid", "hybrid_4_groups", "hybrid_latent"):
        # hybrid_4_groups: B/C groups for cp x tp = 4 ranks; hybrid_latent: Nemotron's latent MoE with the
        # aux-loss-free selection bias
        return ModelConfig(
            family="nemotron_h", vocab_size=64, hidden_size=32, pattern="M*ME",
            attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8),
            mamba=MambaConfig(num_heads=8, head_dim=4, state_size=8, n_groups=4 if name.endswith("groups") else 2,
                              chunk_size=4),
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, activation="relu2", score_func="sigmoid",
                          num_shared_experts=1, latent_size=16 if name == "hybrid_latent" else None,
                          score_correction_bias=name == "hybrid_latent"),
            mlp=None, init_std=0.05,
        )
    if name in ("gdn_hybrid", "kda_hybrid"):
        # Qwen3-Next-like (Gated DeltaNet with 2 key heads for 4 value heads, gated attention, 1 + w norms, a gated
        # shared expert) and Kimi-Linear-like (KDA) hybrids; chunks of 4 (GDN) pass states across chunks
        gdn = name == "gdn_hybrid"
        return ModelConfig(
            family="qwen3_next" if gdn else "kimi_linear", vocab_size=64, hidden_size=32,
            pattern="GE*-GE" if gdn else "KE*-KE",
            attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, output_gate=gdn),
            linear_attention=LinearAttentionConfig(num_k_heads=2 if gdn else 4, num_v_heads=4,
                                                   head_k_dim=8 if gdn else 16, head_v_dim=6 if gdn else 16,
                                                   chunk_size=4 if gdn else 16),
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, num_shared_experts=1,
                          shared_intermediate_size=16, shared_expert_gate=gdn),
            mlp=MLPConfig(32), norm_offset=gdn, init_std=0.05 if gdn else 0.02,
        )
    if name == "mimo_like":
        # MiMo-V2: full attention then sliding blocks with more kv heads, sinks and another rope theta, value heads
        # narrower than query/key heads, scaled values, a sigmoid router with selection bias, an MTP depth that slides
        window = dict(head_dim=8, v_head_dim=4, value_scale=0.7,
                      rope=RopeConfig(theta=1e4, partial_rotary_factor=0.5))
        return ModelConfig(
            family="mimo_v2", vocab_size=64, hidden_size=32, pattern="*-*E*E",
            attention=AttentionConfig(num_heads=4, num_kv_heads=2, sliding_window=6,
                                      sliding_window_layers=[False, True, True, True],
                                      **{**window, "rope": RopeConfig(theta=1e6, partial_rotary_factor=0.5)}),
            sliding_attention=AttentionConfig(num_heads=4, num_kv_heads=4, sinks=True, **window),
            mlp=MLPConfig(64),
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, score_func="sigmoid", norm_topk_prob=True,
                          score_correction_bias=True),
            mtp=MTPConfig(num_layers=1, pattern="*-"), init_std=0.05,
        )
    if name == "llama_wide":  # every tensor-parallel shard of every GEMM a whole number of 32-element MX blocks
        return ModelConfig(
            family="llama", vocab_size=64, hidden_size=64, pattern="*-*-",
            attention=AttentionConfig(num_heads=4, num_kv_heads=4, head_dim=16), mlp=MLPConfig(128), init_std=0.05,
        )
    if name == "llama":
        return ModelConfig(
            family="llama", vocab_size=64, hidden_size=32, pattern="*-*-",
            attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8), mlp=MLPConfig(64), init_std=0.05,
        )
    if name in ("qwen3_moe", "qwen3_moe_skewed", "qwen3_moe_balanced", "qwen3_moe_balanced_aux"):
        return ModelConfig(
            family="qwen3_moe", vocab_size=64, hidden_size=32, pattern="*-*E",
            attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True), mlp=MLPConfig(64),
            moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, norm_topk_prob=True,
                          score_correction_bias=name.endswith("skewed"), force_balanced="balanced" in name,
                          aux_loss_coeff=0.01 if name.endswith("aux") else 0.0),
            init_std=0.05,
        )
    raise ValueError(name)


def initial_state(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    model = Decoder(tiny_config(name))
    model.init_weights()
    if name.endswith("skewed"):
        for moe in model.moe_layers():
            moe.router.score_correction_bias.copy_(torch.tensor([50.0, 50.0, -50.0, -50.0]))
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def global_batches(vocab_size: int, steps: int = STEPS, seed: int = 0, rows: int = ROWS) -> list[dict[str, torch.Tensor]]:
    """Packed rows: documents of 3-8 tokens (positions restart), no label on each document's last token,
    and a prompt without loss at the start of row 0."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        input_ids = torch.randint(0, vocab_size, (rows, SEQ), generator=gen)
        position_ids = torch.zeros_like(input_ids)
        labels = torch.full_like(input_ids, -100)
        for row in range(rows):
            start = 0
            while start < SEQ:
                length = min(int(torch.randint(3, 9, (1,), generator=gen)), SEQ - start)
                position_ids[row, start : start + length] = torch.arange(length)
                labels[row, start : start + length - 1] = input_ids[row, start + 1 : start + length]
                start += length
        labels[0, :3] = -100
        batches.append({"input_ids": input_ids, "labels": labels, "position_ids": position_ids})
    return batches


def local_batch(batch: dict[str, torch.Tensor], dims: ParallelDims) -> dict[str, torch.Tensor]:
    rows = batch["input_ids"].shape[0] // dims.dp_size
    start = dims.dp_rank * rows
    local = {key: value[start : start + rows] for key, value in batch.items()}
    return shard_batch(local, dims.mesh("cp")) if dims.cp > 1 else local


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_numel(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


@dataclass
class Run:
    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    # elements of parameters + gradients + optimizer states held by this rank after the first step
    state_elements: int = 0


def new_optimizer(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train(model: torch.nn.Module, batches, dims: ParallelDims | None = None, optimizer=None, first_step: int = 0,
          run: Run | None = None, micro_batches: int = 1) -> tuple[Run, torch.optim.Optimizer]:
    """``micro_batches``: each rank's rows of a step in that many backwards (gradients accumulated); under HSDP
    the all-reduce across replicas waits for the last one, as ``ParallelStrategy`` runs it."""
    optimizer = optimizer or new_optimizer(model)
    run = run or Run()
    group = dims.mesh("dp_cp").get_group() if dims is not None else None
    reduction_size = dims.dp_cp_size if dims is not None else 1
    for step in range(first_step, len(batches)):
        batch = local_batch(batches[step], dims) if dims is not None else batches[step]
        totals = torch.zeros(2)
        for index in range(micro_batches):
            micro = {key: value.chunk(micro_batches)[index] for key, value in batch.items()}
            last = index == micro_batches - 1
            with nullcontext() if last or dims is None or dims.dp_replicate == 1 else deferred_all_reduce(model):
                out = model(micro["input_ids"], micro["position_ids"], labels=micro["labels"])
                # the training module's objective: the MTP scale weighs the mean over depths
                mtp_weight = model.config.mtp.loss_scale / len(out.mtp_loss_sums) if out.mtp_loss_sums else 0.0
                (out.loss_sum + mtp_weight * sum(out.mtp_loss_sums, torch.zeros(()))).backward()
            totals += torch.stack([out.loss_sum.detach(), out.num_label_tokens.to(torch.float32)])
        if group is not None:
            dist.all_reduce(totals, group=group)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # as in the training module, FSDP's mean over dp x cp ranks is undone
        torch._foreach_mul_(grads, reduction_size / totals[1].item())
        if dims is not None:
            norm = clip_grad_norm_(model.parameters(), MAX_NORM)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        run.losses.append(totals[0].item() / totals[1].item())
        run.norms.append(float(norm))
        if step == 0:
            run.grads = {name: full(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        if step == 0:
            tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
            tensors += [t for state in optimizer.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0]
            run.state_elements = sum(local_numel(t) for t in tensors)
        optimizer.zero_grad()
    return run, optimizer


def parallel_model(name: str, dims: ParallelDims, state: dict[str, torch.Tensor] | None, **options) -> Decoder:
    """Built as the training module builds it: meta device, parallelize, materialize, initialize, load."""
    with torch.device("meta"):
        model = Decoder(tiny_config(name))
    parallelize(model, dims, ParallelOptions(**options))
    model.to_empty(device="cpu")
    torch.manual_seed(99)
    model.init_weights()
    if state is not None:
        copy_tensors_into(model, state.items())
    return model


def compare(case: str, reference: Run, run: Run) -> list[str]:
    problems = []
    for step, (expected, got) in enumerate(zip(reference.losses, run.losses)):
        if abs(expected - got) > LOSS_TOLERANCE:
            problems.append(f"{case}: step {step} loss {got:.8f} != single-process {expected:.8f}")
    if len(run.losses) != len(reference.losses):
        problems.append(f"{case}: {len(run.losses)} steps, expected {len(reference.losses)}")
    for step, (expected, got) in enumerate(zip(reference.norms, run.norms)):
        if abs(expected - got) > GRAD_RTOL * abs(expected):
            problems.append(f"{case}: step {step} gradient norm {got:.8f} != single-process {expected:.8f}")
    if set(run.grads) != set(reference.grads):
        problems.append(f"{case}: gradients of {sorted(set(run.grads) ^ set(reference.grads))} missing on one side")
    for name, expected in reference.grads.items():
        got = run.grads.get(name)
        if got is not None and not torch.allclose(got, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL):
            error = (got - expected).abs().max().item()
            problems.append(f"{case}: step-1 gradient of {name} differs by up to {error:.3g}")
    return problems


def build_dims(sizes: dict[str, int]) -> ParallelDims:
    dims = ParallelDims(**sizes, world_size=dist.get_world_size())
    dims.build_meshes("cpu")
    return dims


def compare_logits(case: str, reference: Decoder, model: Decoder, batch, dims: ParallelDims) -> list[str]:
    """The logits path (no labels, no gradients): this rank's rows and sequence positions of the
    single-process logits. Training continues afterwards, as after a validation loop."""
    with torch.no_grad():
        expected = reference(batch["input_ids"], batch["position_ids"])
        local = local_batch(batch, dims)
        got = model(local["input_ids"], local["position_ids"])
    rows = ROWS // dims.dp_size
    expected = expected[dims.dp_rank * rows : (dims.dp_rank + 1) * rows]
    if dims.cp > 1:
        expected = expected[:, load_balanced_indices(SEQ, dims.cp, dims.mesh("cp").get_local_rank())]
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=GRAD_RTOL, atol=1e-6):
        return [f"{case}: logits {tuple(got.shape)} differ from the single-process logits {tuple(expected.shape)}"]
    return []


def run_layout(case: str, model: str, sizes: dict[str, int], max_state_ratio: float | None = None,
               micro_batches: int = 1, lr: float = 1e-2, **options) -> list[str]:
    """Train ``model`` with ``sizes`` (each rank's rows of a step in ``micro_batches`` backwards) and compare
    with the single-process run on whole global batches (and the logits before), both with AdamW at ``lr``."""
    dims = build_dims(sizes)
    state = initial_state(model)
    batches = global_batches(tiny_config(model).vocab_size, rows=ROWS * micro_batches)
    reference = Decoder(tiny_config(model))
    reference.load_state_dict(state)
    parallel = parallel_model(model, dims, state, **options)
    problems = compare_logits(case, reference, parallel, global_batches(tiny_config(model).vocab_size)[0], dims)
    expected, _ = train(reference, batches, optimizer=new_optimizer(reference, lr))
    got, _ = train(parallel, batches, dims, new_optimizer(parallel, lr), micro_batches=micro_batches)
    problems += compare(case, expected, got)
    if model.endswith("skewed") and any(moe.tokens_per_expert[2:].sum() for moe in reference.moe_layers()):
        problems.append(f"{case}: the selection bias did not keep experts 2 and 3 (the second ep rank) idle")
    if max_state_ratio is not None:
        ratio = got.state_elements / expected.state_elements
        if ratio > max_state_ratio:
            problems.append(f"{case}: parameters+gradients+optimizer state per rank are {ratio:.3f} of the "
                            f"single-process run, more than {max_state_ratio}")
    return problems


def run_reshard(case: str, model: str, save_sizes: dict[str, int], load_sizes: dict[str, int],
                directory: str, save_after: int = 2) -> list[str]:
    """Train ``save_after`` steps on one layout, save a distributed checkpoint (model + optimizer), resume on
    another layout (different weights before loading) and finish: the losses continue the reference run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = initial_state(model)
    batches = global_batches(tiny_config(model).vocab_size)
    reference = Decoder(tiny_config(model))
    reference.load_state_dict(state)
    expected, _ = train(reference, batches)

    first_dims = build_dims(save_sizes)
    first = parallel_model(model, first_dims, state)
    run, optimizer = train(first, batches[:save_after], first_dims)
    dcp.save({"model": get_model_state_dict(first), "optim": get_optimizer_state_dict(first, optimizer)},
             checkpoint_id=directory)

    second_dims = build_dims(load_sizes)
    second = parallel_model(model, second_dims, None)
    second_optimizer = new_optimizer(second)
    loaded = {"model": get_model_state_dict(second), "optim": get_optimizer_state_dict(second, second_optimizer)}
    dcp.load(loaded, checkpoint_id=directory)
    set_model_state_dict(second, loaded["model"])
    set_optimizer_state_dict(second, second_optimizer, loaded["optim"])
    run, _ = train(second, batches, second_dims, second_optimizer, first_step=save_after, run=run)
    run.grads = expected.grads  # gradients of step 1 are checked by the other cases
    return compare(case, expected, run)


def run_forward(case: str, model: str, sizes: dict[str, int], backend: str, window: int | None = None) -> list[str]:
    """The loss of one packed batch with attention ``backend`` and ``window`` (forward only: flex has no CPU
    backward)."""
    config = tiny_config(model)
    config.attention.backend = backend
    config.attention.sliding_window = window
    dims = build_dims(sizes)
    state = initial_state(model)
    batch = global_batches(config.vocab_size, steps=1)[0]
    reference = Decoder(config)
    reference.load_state_dict(state)
    with torch.device("meta"):
        model_ = Decoder(config)
    parallelize(model_, dims)
    model_.to_empty(device="cpu")
    model_.init_weights()
    copy_tensors_into(model_, state.items())
    with torch.no_grad():
        expected = reference(batch["input_ids"], batch["position_ids"], labels=batch["labels"]).loss_sum
        local = local_batch(batch, dims)
        got = model_(local["input_ids"], local["position_ids"], labels=local["labels"]).loss_sum
        dist.all_reduce(got, group=dims.mesh("dp_cp").get_group())
    if abs(got.item() - expected.item()) > LOSS_TOLERANCE * abs(expected.item()):
        return [f"{case}: loss sum {got.item():.6f} != single-process {expected.item():.6f}"]
    return []


def check_cases(cases: list[tuple]) -> None:
    """Run every ``(function name, args, kwargs)`` case on this rank (``module.function`` names a function of
    another cases module); report all mismatches together."""
    import importlib

    problems = []
    for function, args, kwargs in cases:
        module, _, name = function.rpartition(".")
        problems += (getattr(importlib.import_module(module), name) if module else globals()[name])(*args, **kwargs)
    if problems:
        raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(problems))
