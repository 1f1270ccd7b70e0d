"""Prompts to continue: ``lightning-moe generate``'s input, and ``PromptsDataModule`` for ``predict``.

A prompt is a text, encoded as the tokenizer encodes text (its own special tokens, e.g. a BOS), or a chat
(``messages``, or a text with ``chat=True`` as one user turn), rendered by the chat template with its
generation prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_moe.data.distributed import data_parallel_rank_and_size
from lightning_moe.data.sources import iter_jsonl
from lightning_moe.data.tokenizer import generation_defaults, load_tokenizer, pad_token_id
from lightning_moe.models.generation import SamplingSettings

Prompt = str | list[dict[str, Any]]


def read_prompts(path: str | Path) -> list[Prompt]:
    """The prompts of a JSONL file: ``{"prompt": TEXT}`` or ``{"messages": [...]}`` rows (errors name the line)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts: list[Prompt] = []
    for number, row in iter_jsonl(str(path)):
        if isinstance(row.get("messages"), list):
            prompts.append(row["messages"])
        elif isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        else:
            raise ValueError(f"{path} line {number}: a prompt row needs a 'prompt' string or a 'messages' list, "
                             f"it has {sorted(row)}")
    return prompts


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of a prompt (see the module docstring)."""
    if isinstance(prompt, str) and not chat:
        ids = tokenizer(prompt)["input_ids"]
    else:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat prompts need a tokenizer with a chat_template")
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        ids = ids["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    return list(ids)


class PromptsDataModule(L.LightningDataModule):
    """Prompts for ``lightning-moe predict`` / ``Trainer.predict``: each rank continues its share of them
    (``CausalLM.predict_step``), and :class:`~lightning_moe.callbacks.PredictionWriter` writes the results.

    Args:
        prompts: a JSONL file of ``{"prompt": TEXT}`` or ``{"messages": [...]}`` rows.
        tokenizer: tokenizer directory or hub id (the one the model trained with).
        chat: render text prompts with the chat template as a user turn.
        max_new_tokens, temperature, top_p, seed: :class:`~lightning_moe.models.generation.SamplingSettings`.
        micro_batch_size: prompts per batch (left-padded to the longest).
    """

    def __init__(self, prompts: str, tokenizer: str, chat: bool = False, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 micro_batch_size: int = 1) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.prompts_path, self.tokenizer_path, self.chat = prompts, tokenizer, chat
        self.settings = SamplingSettings(max_new_tokens, temperature, top_p, seed)
        self.micro_batch_size = micro_batch_size
        self._tokenizer: Any = None
        self.prompts: list[Prompt] = []

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
        return self._tokenizer

    def setup(self, stage: str | None = None) -> None:
        if stage not in (None, "predict"):
            raise ValueError(f"PromptsDataModule holds prompts to continue (predict), it has no data to {stage} on")
        self.prompts = read_prompts(self.prompts_path)
        if self.settings.seed is not None:  # each rank samples its own prompts with its own stream
            torch.manual_seed(self.settings.seed + (self.trainer.global_rank if self.trainer is not None else 0))

    def predict_dataloader(self) -> DataLoader:
        from transformers import GenerationConfig

        config = self.settings.generation_config(GenerationConfig(**generation_defaults(self.tokenizer)))
        rows = [(i, encode_prompt(self.tokenizer, p, self.chat)) for i, p in enumerate(self.prompts)]
        rank, size = data_parallel_rank_and_size(self.trainer)
        # every prompt once: ranks past the end repeat the first ones, the writer keeps one record per index
        sampler = DistributedSampler(rows, num_replicas=size, rank=rank, shuffle=False, drop_last=False)
        pad = pad_token_id(self.tokenizer)

        def collate(batch: list[tuple[int, list[int]]]) -> dict[str, Any]:
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, ids) in enumerate(batch):  # left-padded: generation continues at the right end
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                mask[row, width - len(ids):] = 1
            return {"input_ids": input_ids, "attention_mask": mask, "index": torch.tensor([i for i, _ in batch]),
                    "generation_config": config}

        return DataLoader(rows, batch_size=self.micro_batch_size, sampler=sampler, collate_fn=collate)
