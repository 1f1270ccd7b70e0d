"""A cache of encoded text-to-image rows: VAE latents and text-encoder states, memory-mapped at training time.

Written once (``lightning-moe data cache-latents``) by the frozen VAE and text encoder of the model that will be
trained, so training runs neither. Layout of the cache folder (complete or absent: built under a temporary name,
then renamed):

- ``latents.npy``: float32 ``[N, C, h, w]``, normalized as the transformer takes them;
- ``prompt_embeds.npy``: float32 ``[T, D]``, every row's valid text states one after another;
- ``prompt_offsets.npy``: int64 ``[N + 1]``, where each row's states start (and the last ends);
- ``empty_prompt_embeds.npy``: float32 ``[L, D]``, the empty caption (classifier-free-guidance dropout);
- ``row_indices.npy``: int64 ``[N]``, each entry's row number in the source;
- ``metadata.json``: the encoders, source, resolution and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_moe.io.atomic import atomic_directory

METADATA = "metadata.json"
FORMAT_VERSION = 1


def _valid_states(embeds: torch.Tensor, mask: torch.Tensor) -> list[np.ndarray]:
    """Per row: its text states where the mask is set (padding dropped)."""
    return [e[m.bool()].float().cpu().numpy() for e, m in zip(embeds, mask)]


@torch.no_grad()
def write_latent_cache(output: str | Path, rows: Any, encoder: Any, kept: list[int], *, batch_size: int = 8,
                       source_fingerprint: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Encode the rows ``kept`` of ``rows`` (:class:`~lightning_moe.data.image_caption.ImageCaptionRows`) with
    ``encoder`` (``encode_images``, ``encode_prompts``, ``describe``) into the folder ``output``; returns its
    metadata."""
    with atomic_directory(output, overwrite=overwrite) as tmp:
        latents_file = None
        offsets = [0]
        with open(tmp / "prompt_embeds.bin", "wb") as states_file:
            for start in range(0, len(kept), batch_size):
                chunk = kept[start:start + batch_size]
                pixels = torch.from_numpy(np.stack([rows.pixels(i) for i in chunk]))
                latents = encoder.encode_images(pixels).float().cpu().numpy()
                if latents_file is None:
                    latents_file = np.lib.format.open_memmap(tmp / "latents.npy", mode="w+", dtype=np.float32,
                                                             shape=(len(kept), *latents.shape[1:]))
                latents_file[start:start + len(chunk)] = latents
                embeds, mask = encoder.encode_prompts([rows.caption(i) for i in chunk])
                for states in _valid_states(embeds, mask):
                    states_file.write(np.ascontiguousarray(states, dtype=np.float32).tobytes())
                    offsets.append(offsets[-1] + len(states))
                    text_dim = states.shape[1]
        latents_file.flush()
        del latents_file
        flat = np.fromfile(tmp / "prompt_embeds.bin", dtype=np.float32).reshape(offsets[-1], text_dim)
        np.save(tmp / "prompt_embeds.npy", flat)
        (tmp / "prompt_embeds.bin").unlink()
        np.save(tmp / "prompt_offsets.npy", np.asarray(offsets, dtype=np.int64))
        empty, empty_mask = encoder.encode_prompts([""])
        np.save(tmp / "empty_prompt_embeds.npy", _valid_states(empty, empty_mask)[0])
        np.save(tmp / "row_indices.npy", np.asarray(kept, dtype=np.int64))
        metadata = {
            "format_version": FORMAT_VERSION,
            "encoders": encoder.describe(),
            "source": rows.name,
            "source_fingerprint": source_fingerprint,
            "resolution": rows.resolution,
            "num_rows": len(kept),
            "latent_shape": list(np.load(tmp / "latents.npy", mmap_mode="r").shape[1:]),
            "text_dim": int(text_dim),
            "text_tokens": int(offsets[-1]),
        }
        (tmp / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    return metadata


class LatentCacheDataset(Dataset):
    """The entries of a cache folder, memory-mapped: ``{latents, prompt_embeds, index}`` per item."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        meta_file = self.folder / METADATA
        if not meta_file.is_file():
            raise FileNotFoundError(f"{self.folder} is not a latent cache ({METADATA} missing); write one with "
                                    f"`lightning-moe data cache-latents`")
        self.metadata = json.loads(meta_file.read_text())
        if self.metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_file}: format_version {self.metadata.get('format_version')}, expected "
                             f"{FORMAT_VERSION}; write the cache again")
        self.latents = np.load(self.folder / "latents.npy", mmap_mode="r")
        self.prompt_embeds = np.load(self.folder / "prompt_embeds.npy", mmap_mode="r")
        self.offsets = np.load(self.folder / "prompt_offsets.npy")
        self.row_indices = np.load(self.folder / "row_indices.npy")
        self.empty_prompt_embeds = torch.from_numpy(np.load(self.folder / "empty_prompt_embeds.npy"))
        if not len(self.latents) == len(self.row_indices) == len(self.offsets) - 1:
            raise ValueError(f"{self.folder}: latents, row indices and prompt offsets disagree on the row count "
                             f"({len(self.latents)}, {len(self.row_indices)}, {len(self.offsets) - 1})")

    def __len__(self) -> int:
        return len(self.latents)

    def __getitem__(self, i: int) -> dict[str, Any]:
        start, end = self.offsets[i], self.offsets[i + 1]
        return {"latents": torch.from_numpy(np.array(self.latents[i])),
                "prompt_embeds": torch.from_numpy(np.array(self.prompt_embeds[start:end])),
                "index": int(self.row_indices[i])}


def pad_prompts(states: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of text states ``[L_i, D]`` -> ``[B, max L, D]`` zero-padded, and the ``[B, max L]`` mask."""
    longest = max(len(s) for s in states)
    embeds = states[0].new_zeros(len(states), longest, states[0].shape[-1])
    mask = torch.zeros(len(states), longest, dtype=torch.long, device=states[0].device)
    for row, s in enumerate(states):
        embeds[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return embeds, mask
