"""``lightning-moe generate``: continue prompts with a trained model, through transformers' own ``generate``.

    lightning-moe generate --ckpt RUN_CKPT | --hf DIR  --prompt TEXT | --prompts FILE.jsonl
        [--chat] [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--json OUT]
        [--tokenizer DIR] [--device DEVICE] [--dtype DTYPE]

``--ckpt`` takes any checkpoint ``fit`` writes (``.ckpt`` file or distributed directory; native, LoRA or
``model: {hf: ...}`` runs): the model is loaded as ``CausalLM.load_from_checkpoint`` loads it and sampled in its
in-memory Hugging Face form, with the tokenizer the run trained with (its checkpoints carry it) and generation
settings made from it. ``--hf`` takes a Hugging Face directory (an export). A prompt is encoded as the tokenizer
encodes text, unless ``--chat`` (or a JSONL row with ``messages``) renders it with the chat template and its
generation prompt. ``--prompts`` rows: ``{"prompt": TEXT}`` or ``{"messages": [{"role": ..., "content": ...}]}``.
Temperature 0 (the default) decodes greedily. ``--json OUT`` writes one JSON line per prompt: its ``index``,
``prompt``, the generated ``text`` and ``token_ids`` (the new tokens only, up to and including the end token).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_moe.data.prompts import encode_prompt, read_prompts
from lightning_moe.data.tokenizer import generation_defaults, load_tokenizer
from lightning_moe.dtypes import FLOAT_DTYPES
from lightning_moe.io.atomic import atomic_write_text
from lightning_moe.io.run import read_run_checkpoint
from lightning_moe.models.generation import SamplingSettings, new_tokens
from lightning_moe.modules.restore import run_module_class
from lightning_moe.workflows.run_files import GENERATION_CONFIG, run_files


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-moe generate", description=__doc__.split("\n\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--ckpt", help="a checkpoint fit wrote (.ckpt file or distributed checkpoint directory)")
    model.add_argument("--hf", help="a Hugging Face model directory (an export)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt")
    prompts.add_argument("--prompts", help='a JSONL file of {"prompt": ...} or {"messages": [...]} rows')
    parser.add_argument("--chat", action="store_true", help="render prompts with the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampling")
    parser.add_argument("--json", dest="json_out", help="write one JSON record per prompt to this file")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the run's or the model directory's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: %(default)s")
    parser.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None, help="default: as the weights are stored")
    return parser


def load_for_generation(ckpt: str | None, hf: str | None, tokenizer: str | None, device: str) -> tuple[Any, Any, Any]:
    """(transformers model in eval mode, tokenizer, base ``GenerationConfig``) of a run checkpoint or HF dir."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if hf is not None:
        folder = Path(hf).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"--hf: directory {hf!r} does not exist")
        model = AutoModelForCausalLM.from_pretrained(folder).eval().to(device)
        return model, *_tokenizer_and_config(folder, tokenizer, GenerationConfig, "--hf")
    checkpoint = read_run_checkpoint(ckpt)
    module = run_module_class(checkpoint).load_from_checkpoint(ckpt, map_location=device)
    model = module.transformers_model()
    module.model = None  # the native copy is not needed once the transformers form holds the weights
    with run_files(checkpoint, module) as folder:
        return model, *_tokenizer_and_config(folder, tokenizer, GenerationConfig, "--ckpt")


def _tokenizer_and_config(folder: Path | None, tokenizer: str | None, config_class, flag: str) -> tuple[Any, Any]:
    if tokenizer is None and (folder is None or not (folder / "tokenizer_config.json").is_file()):
        raise ValueError(f"{flag}: the model comes with no tokenizer (the run's data module had none); "
                         f"name one with --tokenizer")
    loaded = load_tokenizer(tokenizer or str(folder))
    if folder is not None and (folder / GENERATION_CONFIG).is_file():
        return loaded, config_class.from_pretrained(folder)
    return loaded, config_class(**generation_defaults(loaded))


def generate(model: Any, tokenizer: Any, base_config: Any, prompts: list[Any], settings: SamplingSettings,
             chat: bool = False) -> list[dict[str, Any]]:
    """One record per prompt: ``index``, ``prompt``, ``text`` and ``token_ids`` of the new tokens."""
    config = settings.generation_config(base_config)
    if settings.seed is not None:
        torch.manual_seed(settings.seed)
    device = next(model.parameters()).device
    records = []
    for index, prompt in enumerate(prompts):
        ids = torch.tensor([encode_prompt(tokenizer, prompt, chat)], device=device)
        tokens = new_tokens(model, ids, torch.ones_like(ids), config)[0]
        records.append({"index": index, "prompt": prompt, "text": tokenizer.decode(tokens, skip_special_tokens=True),
                        "token_ids": tokens})
    return records


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = SamplingSettings(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    model, tokenizer, base_config = load_for_generation(args.ckpt, args.hf, args.tokenizer, args.device)
    if args.dtype is not None:
        model = model.to(FLOAT_DTYPES[args.dtype])
    records = generate(model, tokenizer, base_config, prompts, settings, args.chat)
    for record in records:
        if len(records) > 1:
            print(f"--- prompt {record['index']}")
        print(record["text"], flush=True)
    if args.json_out:
        atomic_write_text(args.json_out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        print(f"wrote {len(records)} record(s) to {args.json_out}", file=sys.stderr)
    return 0
