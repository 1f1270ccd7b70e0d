"""Worker side of the expert-parallel tests over transformers MoE architectures (``test_hf_ep_architectures.py``):
one launch runs every architecture at every layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from expert_parallel_cases import expert_parallel_gradients
from tiny_hf_models import batch
from trainer_cases import fit

from lightning_moe.models.hf import HFModelConfig, build_hf_model
from lightning_moe.models.hf_experts import CORRECTION_BIAS, correction_bias_routers, update_correction_biases
from lightning_moe.parallel import ParallelDims, parallelize

BIAS_UPDATE_RATE = 1e-2


def correction_biases(hf_model) -> dict[str, torch.Tensor]:
    """Every router's correction bias, full (an FSDP-sharded parameter gathered)."""
    out = {}
    for name, router, _ in correction_bias_routers(hf_model):
        bias = getattr(router, CORRECTION_BIAS).detach()
        out[name] = (bias.full_tensor() if hasattr(bias, "full_tensor") else bias).clone()
    return out


def fit_with_bias_updates(model_dir: str, root: str, sizes: dict | None, bias: bool) -> dict:
    """Five Trainer steps (aux-loss-free bias updates where the router has a correction bias): the losses,
    the final biases, and on the launched ranks whether every rank holds the same biases."""
    options = {"bias_update_rate": BIAS_UPDATE_RATE} if bias else {}
    # one row per micro-batch: 4 ranks hold one each, and a one-process run averages the router load-balancing
    # loss (Qwen3-MoE, Qwen3-Next) over the same rows
    losses, module = fit(model_dir, root, sizes, steps=5, micro_batch_size=1, native="never", hf_options=options)
    biases = correction_biases(module.model.hf)
    record = {"losses": losses, "biases": {k: v.tolist() for k, v in biases.items()}}
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, record["biases"])
        record["same_on_every_rank"] = all(b == every[0] for b in every)
        record["split"] = sorted(n for n, p in module.model.hf.named_parameters()
                                 if type(p).__name__ == "DTensor" and "ep" in (p.device_mesh.mesh_dim_names or ()))
    return record


def opposite_halves(module, args):
    """Routing skewed one way on even ranks and the other way on odd ones: each token's two copies to experts
    0 and 1, or 2 and 3, so each rank's own load is lopsided while the global load is even."""
    hidden_states, top_k_index, top_k_weights = args
    offset = 2 * (dist.get_rank() % 2)
    chosen = torch.arange(top_k_index.shape[1], device=top_k_index.device) + offset
    return hidden_states, chosen.expand_as(top_k_index).to(top_k_index.dtype), top_k_weights


def bias_update_from_global_load(model_dir: str, layout: dict) -> dict[str, list]:
    """One training forward under ``layout`` with :func:`opposite_halves` routing, then one bias update: the
    biases (full) afterwards, which move only if a rank used its own load instead of the global one."""
    dims = ParallelDims(**layout, world_size=dist.get_world_size())
    dims.build_meshes("cpu")
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never", bias_update_rate=0.5),
                           parallelize=lambda m: parallelize(m, dims))
    for _, _, experts in correction_bias_routers(model.hf):
        experts.register_forward_pre_hook(opposite_halves, prepend=True)  # before the load is counted
    data = {key: value.chunk(dims.dp_size)[dims.dp_rank] for key, value in batch(rows=4).items()}
    model.train()
    model(data["input_ids"], labels=data["labels"])
    update_correction_biases(model)
    return {k: v.tolist() for k, v in correction_biases(model.hf).items()}


def every_architecture(root: str, architectures: dict[str, bool], layout: dict) -> None:
    """For each architecture (``root/<name>``; value: whether its router has a correction bias), at ``layout``:
    the first backward's loss and full gradients (``root/<name>_grads.pt``), five Trainer steps and, with a
    correction bias, one update from rank-skewed routing (``root/<name>_fit.json``)."""
    for name, bias in architectures.items():
        model_dir = str(Path(root) / name)
        expert_parallel_gradients(model_dir, str(Path(root) / f"{name}_grads.pt"), layout, skewed=False)
        record = fit_with_bias_updates(model_dir, str(Path(root) / f"{name}_run"), layout, bias)
        if bias:
            record["skewed_update"] = bias_update_from_global_load(model_dir, layout)
        if dist.get_rank() == 0:
            (Path(root) / f"{name}_fit.json").write_text(json.dumps(record))


def pipelines_match(root: str, references: dict) -> None:
    """pp=2 Trainer runs of the ``references`` models (``hf:<directory>``) on the generic path's pipeline stages,
    compared with their one-process runs (``parallel/pipeline_cases.py``'s fit and comparison)."""
    import pipeline_cases

    problems = []
    for model, reference in references.items():
        run = pipeline_cases.fit(model, {"pp": 2}, Path(root) / f"pp2_{Path(model).name}")
        problems += pipeline_cases.compare(Path(model).name, reference, run)
    assert not problems, "\n".join(problems)
