"""Which diffusion model a run trains: a diffusers pipeline folder (or hub id) and its family.

A family file (``qwen_image.py``) knows its pipeline's parts: the trained transformer class, how the frozen VAE and
text encoder turn images and captions into the transformer's inputs, and how the transformer is called. Families
without an implementation in the installed diffusers / transformers are refused here, before anything is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("qwen_image", "hunyuan_image_3")
# diffusers pipeline class (model_index.json ``_class_name``) or transformers architecture -> family
PIPELINE_FAMILIES = {"QwenImagePipeline": "qwen_image", "HunyuanImage3ForCausalMM": "hunyuan_image_3"}

HUNYUAN_IMAGE_3_MISSING = (
    "HunyuanImage-3.0 (tencent/HunyuanImage-3.0, HunyuanImage3ForCausalMM: one 80B-total / 13B-active MoE decoder "
    "over text and image tokens, 64 experts top-8 plus a shared expert) has no implementation in the installed "
    "diffusers {diffusers} or transformers {transformers}: diffusers' HunyuanImage pipelines are HunyuanImage-2.1 "
    "(a DiT, HunyuanImageTransformer2DModel), transformers' hunyuan_v1_moe is the text-only Hunyuan-A13B and its "
    "hunyuan_vl an image-to-text model. "
    "Training it needs the model's own code (the hub ships it as trust_remote_code files, NeMo AutoModel has a "
    "native port; neither is installed or reachable offline): the decoder with "
    "bidirectional attention inside the image span and 2-D rotary positions for image tokens, the timestep-token "
    "embedding, the UNet patch embedding of latents and the UNet final layer that predicts the velocity, and the "
    "mapping of its hub tensor names. model.family=hunyuan_image_3 is therefore "
    "refused (the recipe configs/hunyuan_image/ records the published run's sizes)"
)


def _versions() -> dict[str, str]:
    import importlib.metadata

    found = {}
    for name in ("diffusers", "transformers"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "(not installed)"
    return found


def refuse_unimplemented(family: str) -> None:
    if family == "hunyuan_image_3":
        raise NotImplementedError(HUNYUAN_IMAGE_3_MISSING.format(**_versions()))


@dataclass
class DiffusionModelConfig:
    """A diffusers pipeline to fine-tune.

    Args:
        path: a pipeline folder as the hub lays them out (``model_index.json``, ``transformer/``, ``vae/``,
            ``text_encoder/``, ``tokenizer/``, ``scheduler/``) or a hub id (``Qwen/Qwen-Image``).
        family: ``auto`` (from ``model_index.json``), ``qwen_image`` or ``hunyuan_image_3`` (refused: see above).
        revision: hub revision of ``path``.
        encoder_dtype: dtype of the frozen VAE and text encoder (``bfloat16``, ``float32``).
        max_sequence_length: caption tokens kept after the prompt template (Qwen-Image: at most 1024).
    """

    path: str
    family: str = "auto"
    revision: str | None = None
    encoder_dtype: str = "bfloat16"
    max_sequence_length: int = 1024

    def __post_init__(self) -> None:
        if self.family != "auto" and self.family not in FAMILIES:
            raise ValueError(f"model.family={self.family!r} is not one of auto, {', '.join(FAMILIES)}")
        refuse_unimplemented(self.family)
        if not isinstance(getattr(torch, self.encoder_dtype, None), torch.dtype):
            raise ValueError(f"model.encoder_dtype={self.encoder_dtype!r} is not a torch dtype (bfloat16, float32)")

    @property
    def torch_encoder_dtype(self) -> torch.dtype:
        return getattr(torch, self.encoder_dtype)


def resolve_pipeline_dir(cfg: DiffusionModelConfig) -> Path:
    """The local pipeline folder (a hub id is downloaded, or read from the local hub cache when offline)."""
    local = Path(cfg.path).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file() and not (local / "config.json").is_file():
            raise FileNotFoundError(f"model.path={cfg.path!r} has no model_index.json: not a diffusers pipeline folder")
        return local
    if local.is_absolute() or cfg.path.startswith("."):
        raise FileNotFoundError(f"model.path={cfg.path!r} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(cfg.path, revision=cfg.revision))
    except Exception as err:  # offline without a cached copy, unknown id, no access
        raise FileNotFoundError(f"model.path={cfg.path!r} is neither a local folder nor a reachable hub model: "
                                f"{err}") from err


def detect_family(directory: Path) -> str:
    for name in ("model_index.json", "config.json"):
        file = directory / name
        if file.is_file():
            data: dict[str, Any] = json.loads(file.read_text())
            keys = [data.get("_class_name"), *(data.get("architectures") or [])]
            for key in keys:
                if key in PIPELINE_FAMILIES:
                    return PIPELINE_FAMILIES[key]
            raise ValueError(f"{file}: {keys[0] or keys[1:]} is not a supported pipeline (supported: "
                             f"{', '.join(sorted(PIPELINE_FAMILIES))})")
    raise FileNotFoundError(f"{directory}: no model_index.json")


torch.serialization.add_safe_globals([DiffusionModelConfig])
