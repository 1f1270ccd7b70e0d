"""What vision-language transformers models need beyond the generic path: where the vision tower, the projector
and the embeddings are (to freeze them), multimodal rotary positions of packed rows, and a check that a
processor belongs to the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# attribute names transformers' image-text-to-text models use
VISION_TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTORS = ("merger", "deepstack_merger_list", "multi_modal_projector", "mm_projector", "connector")


def _find(hf_model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Outermost modules whose attribute name is one of ``names``."""
    found = []
    for name, _ in hf_model.named_modules():
        if name.rpartition(".")[2] in names and not any(name.startswith(f"{f}.") for f in found):
            found.append(name)
    return found


def vision_parts(hf_model: nn.Module) -> dict[str, list[str]]:
    """Module names of the vision tower (projector excluded), the projector(s) and the input embeddings."""
    towers = _find(hf_model, VISION_TOWERS)
    if not towers:
        raise ValueError(f"{type(hf_model).__name__}: no vision tower found (looked for modules named "
                         f"{', '.join(VISION_TOWERS)})")
    projectors = _find(hf_model, PROJECTORS)
    embeddings = [n for n, m in hf_model.named_modules() if m is hf_model.get_input_embeddings()]
    return {"vision": towers, "projector": projectors, "embeddings": embeddings}


def freeze_vision_parts(hf_model: nn.Module, vision: bool, projector: bool, embeddings: bool) -> list[str]:
    """``requires_grad=False`` on the chosen parts; returns the frozen parameter names."""
    parts = vision_parts(hf_model)
    if projector and not parts["projector"]:
        raise ValueError(f"freeze_projector: {type(hf_model).__name__} has no projector module named one of "
                         f"{', '.join(PROJECTORS)}")
    chosen = {"vision": vision, "projector": projector, "embeddings": embeddings}
    frozen = []
    for name, param in hf_model.named_parameters():
        part = _part_of(name, parts)
        if part is not None and chosen[part]:
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def _part_of(name: str, parts: dict[str, list[str]]) -> str | None:
    for part in ("projector", "embeddings", "vision"):  # a projector inside the tower is the projector
        if any(name.startswith(f"{prefix}.") for prefix in parts[part]):
            return part
    return None


def multimodal_position_ids(hf_model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                            mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
    """Rotary positions of rows that may pack several samples (positions restart at 0 at each).

    Models with multimodal rotary embeddings (``get_rope_index``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) get each
    sample's (temporal, height, width) positions computed on its own, stacked under the text positions as the
    ``[4, batch, seq]`` tensor their text model reads (the first row builds the packed attention mask); other
    models get ``position_ids`` unchanged. Images are taken in order, as the batch concatenated them.
    """
    rope_index = getattr(hf_model.base_model, "get_rope_index", None)
    if rope_index is None:
        return position_ids
    grids = iter(image_grid_thw if image_grid_thw is not None else [])
    spatial = torch.zeros((3, *input_ids.shape), dtype=position_ids.dtype, device=input_ids.device)
    for row in range(input_ids.shape[0]):
        starts = torch.nonzero(position_ids[row] == 0).flatten().tolist() + [input_ids.shape[1]]
        if starts[0] != 0:
            starts.insert(0, 0)
        for start, end in zip(starts[:-1], starts[1:]):
            types = mm_token_type_ids[row, start:end]
            images = int(((types[1:] == 1) & (types[:-1] != 1)).sum() + (types[0] == 1)) if end > start else 0
            grid = torch.stack([next(grids) for _ in range(images)]) if images else None
            positions, _ = rope_index(input_ids[row : row + 1, start:end], mm_token_type_ids=types[None],
                                      image_grid_thw=grid)
            spatial[:, row, start:end] = positions[:, 0]
    return torch.cat([position_ids[None], spatial])


def check_processor_matches(config: Any, processor: Any, model_name: str) -> None:
    """Raise when a processor (``data.vision_text.VisionTextProcessor``) would feed the model tokens or patches it
    does not understand: another image token, a larger vocabulary, other patch sizes."""
    text = config.get_text_config()
    where = f"processor {processor.source!r} does not match model {model_name!r}"
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is not None and image_token_id != processor.image_token_id:
        raise ValueError(f"{where}: its image token {processor.image_token!r} is id {processor.image_token_id}, the "
                         f"model's image_token_id is {image_token_id}")
    if len(processor.tokenizer) > text.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {len(processor.tokenizer)} tokens, the model's vocabulary "
                         f"{text.vocab_size}")
    vision = getattr(config, "vision_config", None)
    for key, model_key in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                           ("temporal_patch_size", "temporal_patch_size")):
        ours, theirs = getattr(processor.image_processor, key, None), getattr(vision, model_key, None)
        if ours is not None and theirs is not None and ours != theirs:
            raise ValueError(f"{where}: image processor {key}={ours}, the vision tower's {model_key}={theirs}")
