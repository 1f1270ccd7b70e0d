"""Image + text conversations -> the package's batches, with a model's tokenizer and image processor.

A sample is one user turn [image, question] and one assistant turn [answer]. The chat template renders the
prompt (up to the assistant header) and the whole conversation; the prompt's image placeholder becomes as
many image tokens as the image processor makes patches after merging (``prod(image_grid_thw) / merge_size**2``,
the rule of the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors), and the loss covers the answer tokens through
the end-of-turn token, not what the template adds after it.

The tokenizer and the image processor are loaded separately (``AutoTokenizer``, ``AutoImageProcessor``):
transformers' composite processors of these models also load a video processor, which needs torchvision;
image processors have PIL/numpy backends.

Samples carry ``input_ids``, ``labels`` (shifted), ``mm_token_type_ids`` (1 on image tokens), ``pixel_values``
[patches, channels * patch volume] and ``image_grid_thw`` [images, 3]. Several samples packed into one row
keep their own position ids (restarting at 0); a batch concatenates the rows' images in row order.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_moe.data.collate import Collator
from lightning_moe.data.formats import RowError, shift_labels
from lightning_moe.data.tokenizer import load_tokenizer, pad_token_id

QWEN_IMAGE_TOKEN = "<|image_pad|>"
TEXT_KEYS = ("input_ids", "labels", "position_ids")


class ImageError(RowError):
    """The row's image is missing or cannot be decoded."""


@dataclass
class VisionTextProcessor:
    """A tokenizer with a chat template, an image processor, and the placeholder token images expand into."""

    tokenizer: Any
    image_processor: Any
    image_token: str
    image_token_id: int
    merge_size: int
    source: str

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)


def _chat_template_file(directory: str) -> str | None:
    for name in ("chat_template.jinja", "chat_template.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


def load_vision_processor(path: str, revision: str | None = None, trust_remote_code: bool = False,
                          image_token: str | None = None) -> VisionTextProcessor:
    """The tokenizer and image processor of a model directory (or hub id)."""
    from transformers import AutoImageProcessor

    tokenizer = load_tokenizer(path, revision, trust_remote_code)
    try:
        image_processor = AutoImageProcessor.from_pretrained(
            path, revision=None if os.path.isdir(path) else revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"processor {path!r}: no image processor could be loaded ({err})") from err
    if tokenizer.chat_template is None and os.path.isdir(path):
        tokenizer.chat_template = _chat_template_file(path)
    if tokenizer.chat_template is None:
        raise ValueError(f"processor {path!r}: the tokenizer has no chat template (nor chat_template.json/.jinja)")
    merge_size = getattr(image_processor, "merge_size", None)
    if merge_size is None:
        raise ValueError(f"processor {path!r}: {type(image_processor).__name__} does not merge patches into "
                         f"image_grid_thw tokens; supported: Qwen2-VL / Qwen2.5-VL / Qwen3-VL class image processors")
    image_token = image_token or getattr(tokenizer, "image_token", None) or QWEN_IMAGE_TOKEN
    token_id = tokenizer.convert_tokens_to_ids(image_token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"processor {path!r}: the tokenizer has no image token {image_token!r}; set image_token to "
                         f"the placeholder the model's chat template emits")
    return VisionTextProcessor(tokenizer, image_processor, image_token, int(token_id), int(merge_size), path)


def decode_image(value: Any, base_dir: str | None, column: str):
    """An RGB PIL image from what an image column holds: a PIL image, ``{"bytes", "path"}`` (``datasets``'
    undecoded ``Image``), raw bytes, or a path (relative to ``base_dir``)."""
    from PIL import Image, UnidentifiedImageError

    if value is None:
        raise ImageError(f"column '{column}' is missing or null")
    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, dict):
            data, path = value.get("bytes"), value.get("path")
        else:
            data, path = (value, None) if isinstance(value, (bytes, bytearray)) else (None, value)
        if data is None and not isinstance(path, str):
            raise ImageError(f"column '{column}' holds neither image bytes nor a path ({type(value).__name__})")
        if data is None:
            path = path if os.path.isabs(path) or base_dir is None else os.path.join(base_dir, path)
            if not os.path.isfile(path):
                raise ImageError(f"column '{column}': image file {path} does not exist")
        try:
            image = Image.open(io.BytesIO(data) if data is not None else path)
            image.load()
        except (UnidentifiedImageError, OSError, SyntaxError) as err:
            raise ImageError(f"column '{column}': the image could not be decoded ({err})") from None
    return image.convert("RGB")


def _end_of_answer(tokenizer: Any, answer_ids: Sequence[int]) -> int:
    """Tokens of the assistant part that carry loss: through its last special token (the end of turn)."""
    special = set(tokenizer.all_special_ids)
    ends = [i for i, t in enumerate(answer_ids) if t in special]
    return ends[-1] + 1 if ends else len(answer_ids)


def encode_image_question_answer(processor: VisionTextProcessor, image: Any, question: str, answer: str,
                                 system_prompt: str | None = None) -> dict[str, Any]:
    """One sample; raises :class:`RowError` when the template cannot express it."""
    tok = processor.tokenizer
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages += [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    prompt = tok.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(messages, tokenize=False)
    if not full.startswith(prompt):
        raise RowError("the chat template does not render the prompt as a prefix of the conversation")
    if prompt.count(processor.image_token) != 1:
        raise RowError(f"the chat template put {prompt.count(processor.image_token)} image placeholders "
                       f"{processor.image_token!r} in the prompt, expected 1")
    vision = processor.image_processor(images=[image], return_tensors="pt")
    grid = vision["image_grid_thw"]
    num_tokens = int(grid.prod()) // processor.merge_size**2
    prompt_ids = tok(prompt.replace(processor.image_token, processor.image_token * num_tokens),
                     add_special_tokens=False)["input_ids"]
    answer_ids = tok(full[len(prompt):], add_special_tokens=False)["input_ids"]
    end = _end_of_answer(tok, answer_ids)
    ids = list(prompt_ids) + list(answer_ids)
    mask = [0] * len(prompt_ids) + [1] * end + [0] * (len(answer_ids) - end)
    ids_array = np.asarray(ids, dtype=np.int64)
    return {
        "input_ids": ids_array,
        "labels": np.asarray(shift_labels(ids, mask), dtype=np.int64),
        "mm_token_type_ids": (ids_array == processor.image_token_id).astype(np.int64),
        "pixel_values": vision["pixel_values"],
        "image_grid_thw": grid,
    }


def pack_samples(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Samples side by side in one row; each keeps its own position ids (restarting at 0)."""
    return {
        "input_ids": np.concatenate([s["input_ids"] for s in samples]),
        "labels": np.concatenate([s["labels"] for s in samples]),
        "position_ids": np.concatenate([np.arange(len(s["input_ids"])) for s in samples]),
        "mm_token_type_ids": np.concatenate([s["mm_token_type_ids"] for s in samples]),
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
    }


class VisionCollator(Collator):
    """Rows -> a batch: text keys padded as :class:`Collator` pads them, ``mm_token_type_ids`` padded with 0,
    images of all rows concatenated in row order."""

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().__call__([{k: r[k] for k in TEXT_KEYS} for r in rows])
        types = torch.zeros_like(batch["input_ids"])
        for i, row in enumerate(rows):
            types[i, : len(row["mm_token_type_ids"])] = torch.from_numpy(row["mm_token_type_ids"])
        batch["mm_token_type_ids"] = types
        batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
        batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows])
        return batch
