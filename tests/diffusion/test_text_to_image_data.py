"""The shipped Naruto sample has the hub dataset's schema; bad rows are errors naming the row; the latent cache
holds exactly what the encoders give online."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_qwen_image import RESOLUTION, SAMPLE

from lightning_moe.data.commands import main
from lightning_moe.data.latent_cache import LatentCacheDataset
from lightning_moe.data.text_to_image import TextToImageDataModule, collate_images


def test_sample_has_the_naruto_blip_captions_schema():
    import datasets

    ds = datasets.load_dataset("parquet", data_files={"train": str(SAMPLE)}, split="train")
    assert ds.features == datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    sizes = {ds[i]["image"].size for i in range(len(ds))}
    assert len(ds) == 24 and len(sizes) > 1 and all(isinstance(t, str) and t for t in ds["text"])


def _broken_copy(tmp_path, row: int, image: bytes | None = None, text: str | None = "keep"):
    """The sample with row ``row``'s image bytes or caption replaced."""
    import datasets

    ds = datasets.load_dataset("parquet", data_files={"train": str(SAMPLE)}, split="train")
    ds = ds.cast_column("image", datasets.Image(decode=False))
    rows = ds.to_list()
    if image is not None:
        rows[row]["image"] = {"bytes": image, "path": None}
    if text != "keep":
        rows[row]["text"] = text
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    path = tmp_path / "broken.parquet"
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(path))
    return path


def test_corrupt_image_and_missing_caption_name_the_row(tmp_path, capsys):
    corrupt = _broken_copy(tmp_path, 3, image=b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(ValueError, match=r"broken.parquet row 3: column 'image': the image could not be decoded"):
        TextToImageDataModule(dataset=str(corrupt), resolution=RESOLUTION).setup()
    # the cache command stops on the same row, before loading any model, and writes nothing
    out = tmp_path / "cache"
    assert main(["cache-latents", "--dataset", str(corrupt), "--model", str(tmp_path / "no_model"),
                 "--output", str(out), "--resolution", str(RESOLUTION)]) == 1
    assert "row 3: column 'image'" in capsys.readouterr().err and not out.exists()

    uncaptioned = _broken_copy(tmp_path, 5, text=None)
    with pytest.raises(ValueError, match=r"row 5: column 'text' must be a non-empty caption string, got None"):
        TextToImageDataModule(dataset=str(uncaptioned), resolution=RESOLUTION).setup()
    skipping = TextToImageDataModule(dataset=str(uncaptioned), resolution=RESOLUTION, bad_rows="skip")
    skipping.setup()
    assert len(skipping.train_data) == 23 and 5 not in skipping.train_data.kept

    with pytest.raises(ValueError, match=r"train.parquet: column 'caption' missing \(found: image, text\)"):
        TextToImageDataModule(dataset=str(SAMPLE), resolution=RESOLUTION, caption_column="caption").setup()


def test_images_are_resized_and_centre_cropped():
    from PIL import Image

    from lightning_moe.data.image_caption import square_pixels

    wide = np.zeros((20, 40, 3), dtype=np.uint8)
    wide[:, 10:30] = 255  # the middle half is white: exactly what the centre crop keeps
    pixels = square_pixels(Image.fromarray(wide), 16)
    assert pixels.shape == (3, 16, 16) and pixels.dtype == np.float32
    assert np.allclose(pixels[:, :, 1:-1], 1.0, atol=1e-2) and pixels.min() >= -1.0


def test_cache_holds_what_the_encoders_give_online(tiny_pipeline, tiny_cache):
    from lightning_moe.models.diffusion import DiffusionModelConfig, load_family

    cache = LatentCacheDataset(tiny_cache)
    assert cache.metadata["num_rows"] == 24 and cache.metadata["resolution"] == RESOLUTION
    assert isinstance(cache.latents, np.memmap)
    online = TextToImageDataModule(dataset=str(SAMPLE), resolution=RESOLUTION)
    online.setup()
    encoders = load_family(DiffusionModelConfig(path=str(tiny_pipeline), encoder_dtype="float32")).encoders()
    batch = collate_images([online.train_data[i] for i in (0, 7, 13)])
    latents = encoders.encode_images(batch["pixel_values"])
    embeds, mask = encoders.encode_prompts(batch["captions"])
    for row, i in enumerate((0, 7, 13)):
        item = cache[i]
        assert item["index"] == i
        torch.testing.assert_close(item["latents"], latents[row], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(item["prompt_embeds"], embeds[row, : int(mask[row].sum())], rtol=1e-5, atol=1e-5)
    empty, empty_mask = encoders.encode_prompts([""])
    torch.testing.assert_close(cache.empty_prompt_embeds, empty[0, : int(empty_mask[0].sum())])
    with pytest.raises(ValueError, match="holds 32px latents but resolution=64"):
        TextToImageDataModule(cache_dir=str(tiny_cache), resolution=64).setup()
    # atomic: an existing cache is not overwritten without --overwrite
    assert main(["cache-latents", "--dataset", str(SAMPLE), "--model", str(tiny_pipeline), "--output",
                 str(tiny_cache), "--resolution", str(RESOLUTION)]) == 1
