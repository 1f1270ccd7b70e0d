"""Worker side of the generic path's expert-parallel tests (transformers' standardized experts split over ep)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from tiny_hf_models import batch
from trainer_cases import fit

from lightning_moe.models.hf import HFModelConfig, build_hf_model
from lightning_moe.models.hf_experts import standardized_experts
from lightning_moe.parallel import ParallelDims, parallelize


def route_to_first_two_experts(module, args):
    """Skewed routing: every token copy to experts 0 and 1 (both on ep rank 0 of 4 experts over 2 ranks)."""
    hidden_states, top_k_index, top_k_weights = args
    return hidden_states, top_k_index.remainder(2), top_k_weights


def skew(hf_model) -> None:
    for _, experts in standardized_experts(hf_model):
        experts.register_forward_pre_hook(route_to_first_two_experts)


def fit_expert_parallel(model_dir: str, root: str, sizes: dict) -> None:
    """Five Trainer steps under ``sizes``; the losses and the parameters sharded over ep."""
    losses, module = fit(model_dir, root, sizes, steps=5, native="never")
    split = sorted(n for n, p in module.model.hf.named_parameters()
                   if type(p).__name__ == "DTensor" and "ep" in (p.device_mesh.mesh_dim_names or ()))
    if dist.get_rank() == 0:
        (Path(root) / "losses.json").write_text(json.dumps({"losses": losses, "split": split}))


def expert_parallel_gradients(model_dir: str, out: str, sizes: dict, skewed: bool) -> None:
    """One loss and backward of a fixed batch under ``sizes`` (each data-parallel rank its share of the rows):
    the summed loss, every full gradient (FSDP's mean over the data-parallel ranks undone), and each rank's
    local expert gradient norms (zero on a rank whose experts received no token)."""
    dims = ParallelDims(**sizes, world_size=dist.get_world_size())
    dims.build_meshes("cpu")
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never"), parallelize=lambda m: parallelize(m, dims))
    if skewed:
        skew(model.hf)
    data = {key: value.chunk(dims.dp_size)[dims.dp_rank] for key, value in batch(rows=4).items()}
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    local = {n: float(p.grad.to_local().norm()) for n, p in model.hf.named_parameters() if "experts" in n}
    # every trained parameter (frozen ones, e.g. Laguna's correction bias, have no gradient; nor have those the
    # loss does not reach, e.g. sparse-attention indexers that only select keys)
    grads = {n: None if p.grad is None else (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
             * dims.dp_size for n, p in model.hf.named_parameters() if p.requires_grad}
    total = loss.detach().clone()
    dist.all_reduce(total, group=dims.mesh("dp").get_group())
    norms = [None] * dist.get_world_size()
    dist.all_gather_object(norms, local)
    if dist.get_rank() == 0:
        torch.save({"loss": total, "grads": grads, "local_expert_grad_norms": norms}, out)


def gradients_at_layouts(model_dir: str, root: str, layouts: list[dict]) -> None:
    """:func:`expert_parallel_gradients` at each layout in turn, in one launch (``root/grads_{i}.pt``)."""
    for i, sizes in enumerate(layouts):
        expert_parallel_gradients(model_dir, str(Path(root) / f"grads_{i}.pt"), sizes, skewed=False)


# ---------------------------------------------------------------------------------------------- test side
def one_process_gradients(model_dir: str, skewed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_hf_model(HFModelConfig(hf=model_dir, native="never"))
    if skewed:
        skew(model.hf)
    data = batch(rows=4)
    loss = model(data["input_ids"], labels=data["labels"]).loss_sum
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.hf.named_parameters() if p.requires_grad}


def assert_same_gradients(path, model_dir: str, skewed: bool) -> dict:
    split = torch.load(path, weights_only=True)
    loss, grads = one_process_gradients(model_dir, skewed)
    torch.testing.assert_close(split["loss"], loss, rtol=1e-6, atol=1e-5)
    assert split["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        if grad is None:
            assert split["grads"][name] is None, name
            continue
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-5, atol=1e-5, msg=name)
    return split
