"""Text-to-image fine-tuning data: image + caption rows, encoded online by the training module or read from a
latent cache.

Online (``dataset``): batches are ``{pixel_values [B, 3, R, R] in [-1, 1], captions: list[str], index [B]}`` and
the module runs its frozen VAE and text encoder on them. Cached (``cache_dir``, written by ``lightning-moe data
cache-latents``): batches are ``{latents [B, C, h, w], prompt_embeds [B, L, D], prompt_mask [B, L], index [B]}``
read from memory-mapped files. ``index`` is the row's number in the source in both cases, so the module draws the
same noise and timestep for a row either way (and on any data-parallel layout).

Rows are checked once at setup (every image decoded, every caption read): a bad row stops the run naming it
(``bad_rows: error``) or is left out and counted (``bad_rows: skip``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_moe.data.base import BaseDataModule
from lightning_moe.data.formats import RowError
from lightning_moe.data.image_caption import ImageCaptionRows
from lightning_moe.data.latent_cache import LatentCacheDataset, pad_prompts, write_latent_cache
from lightning_moe.data.sources import load_source
from lightning_moe.models.diffusion import DiffusionModelConfig, load_family


class ImageCaptionDataset(Dataset):
    """The usable rows ``kept`` of ``rows``: ``{pixel_values, caption, index}`` per item."""

    def __init__(self, rows: ImageCaptionRows, kept: list[int]) -> None:
        self.rows, self.kept = rows, kept

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int) -> dict[str, Any]:
        index = self.kept[i]
        try:
            pixels, caption = self.rows.pixels(index), self.rows.caption(index)
        except RowError as err:  # the file changed since setup checked it
            raise ValueError(f"{self.rows.name} row {index}: {err}") from None
        return {"pixel_values": torch.from_numpy(pixels), "caption": caption, "index": index}


def collate_images(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "captions": [it["caption"] for it in items],
            "index": torch.tensor([it["index"] for it in items])}


def collate_latents(items: list[dict[str, Any]]) -> dict[str, Any]:
    embeds, mask = pad_prompts([it["prompt_embeds"] for it in items])
    return {"latents": torch.stack([it["latents"] for it in items]), "prompt_embeds": embeds, "prompt_mask": mask,
            "index": torch.tensor([it["index"] for it in items])}


class TextToImageDataModule(BaseDataModule):
    """Image + caption rows for diffusion fine-tuning (:class:`lightning_moe.DiffusionModule`).

    Args:
        dataset: rows with an image and a caption column: a ``.parquet``/``.jsonl``/``.json`` file, a
            ``save_to_disk`` folder or a hub id (``lambdalabs/naruto-blip-captions``). Encoded online.
        cache_dir: a folder written by ``lightning-moe data cache-latents`` instead (``dataset`` then unset).
        split: split of ``dataset`` (with optional slice, ``train[:100]``).
        revision: hub revision of ``dataset``.
        resolution: square side of the training images (multiple of 16); checked against the cache's.
        image_column, caption_column: the columns (the Naruto dataset's ``image`` and ``text``).
        bad_rows: ``error`` (default: stop at the first bad row, naming it) or ``skip`` (leave out and count).
        micro_batch_size, global_batch_size, seed, num_workers: as for every data module.
    """

    def __init__(
        self, dataset: str | None = None, cache_dir: str | None = None, split: str = "train",
        revision: str | None = None, resolution: int = 1024, image_column: str = "image",
        caption_column: str = "text", bad_rows: Literal["error", "skip"] = "error", micro_batch_size: int = 1,
        global_batch_size: int | None = None, seed: int | None = None, num_workers: int = 0,
    ) -> None:
        super().__init__(micro_batch_size, global_batch_size, seed, num_workers)
        if (dataset is None) == (cache_dir is None):
            raise ValueError("TextToImageDataModule needs exactly one of dataset (encoded online) and cache_dir "
                             "(a latent cache)")
        if bad_rows not in ("error", "skip"):
            raise ValueError(f"bad_rows={bad_rows!r} must be error or skip")
        self.dataset, self.cache_dir, self.split, self.revision = dataset, cache_dir, split, revision
        self.resolution, self.image_column, self.caption_column = resolution, image_column, caption_column
        self.bad_rows = bad_rows
        self.train_data: Dataset | None = None

    @property
    def cached(self) -> bool:
        return self.cache_dir is not None

    def load_rows(self) -> tuple[ImageCaptionRows, list[int], str]:
        """The source's rows, the usable row numbers and the source's fingerprint."""
        src = load_source(self.dataset, self.split, self.revision)
        base_dir = os.path.dirname(os.path.abspath(self.dataset)) if os.path.isfile(self.dataset) else None
        rows = ImageCaptionRows(src, self.resolution, self.image_column, self.caption_column, base_dir)
        return rows, rows.check(self.bad_rows), src.fingerprint

    def setup(self, stage: str | None = None) -> None:
        if self.train_data is not None:
            return
        if self.cached:
            data = LatentCacheDataset(self.cache_dir)
            if data.metadata["resolution"] != self.resolution:
                raise ValueError(f"cache_dir {self.cache_dir} holds {data.metadata['resolution']}px latents but "
                                 f"resolution={self.resolution}; set resolution: {data.metadata['resolution']}")
            self.train_data = data
        else:
            rows, kept, _ = self.load_rows()
            self.train_data = ImageCaptionDataset(rows, kept)

    @property
    def cache_metadata(self) -> dict[str, Any] | None:
        return self.train_data.metadata if isinstance(self.train_data, LatentCacheDataset) else None

    @property
    def empty_prompt_embeds(self) -> torch.Tensor | None:
        """The cache's text states of the empty caption (for classifier-free-guidance dropout)."""
        return self.train_data.empty_prompt_embeds if isinstance(self.train_data, LatentCacheDataset) else None

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._train_loader(self.train_data, collate_latents if self.cached else collate_images)


def build_latent_cache(dataset: str, model: str, output: str | Path, *, resolution: int = 1024, split: str = "train",
                       revision: str | None = None, image_column: str = "image", caption_column: str = "text",
                       bad_rows: str = "error", batch_size: int = 8, device: str = "cpu", family: str = "auto",
                       encoder_dtype: str = "bfloat16", max_sequence_length: int = 1024,
                       overwrite: bool = False) -> dict[str, Any]:
    """Check every row of ``dataset``, then encode the usable ones with the frozen encoders of the pipeline
    ``model`` into the cache folder ``output`` (what ``lightning-moe data cache-latents`` runs)."""
    config = DiffusionModelConfig(path=model, family=family, encoder_dtype=encoder_dtype,
                                  max_sequence_length=max_sequence_length)  # refuses unimplemented families
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if Path(output).exists() and not overwrite and any(Path(output).iterdir()):
        raise FileExistsError(f"output {output} already exists and is not empty (pass --overwrite to replace it)")
    data = TextToImageDataModule(dataset=dataset, split=split, revision=revision, resolution=resolution,
                                 image_column=image_column, caption_column=caption_column, bad_rows=bad_rows)
    rows, kept, fingerprint = data.load_rows()  # every row checked before the (slow) encoder load
    encoders = load_family(config).encoders(device)
    meta = write_latent_cache(output, rows, encoders, kept, batch_size=batch_size, source_fingerprint=fingerprint,
                              overwrite=overwrite)
    return {"output": str(output), "skipped_rows": len(rows) - len(kept), **meta}
