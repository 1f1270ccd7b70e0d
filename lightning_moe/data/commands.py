"""``lightning-moe data ...``: offline packing, indexed-dataset building, sample files.

    lightning-moe data pack --dataset FILE_OR_HUB_ID --tokenizer DIR --preset tulu3 \\
        --packed-sequence-size 4096 [--pad-seq-to-mult 8] [--role-map gpt=assistant] --output DIR [--overwrite]
    lightning-moe data index --input FILE.jsonl --tokenizer DIR --output-prefix PREFIX [--json-key text]
    lightning-moe data samples --output DIR
    lightning-moe data cache-latents --dataset FILE_OR_HUB_ID --model PIPELINE --output DIR [--resolution 1024]

Errors print one line to stderr and return a non-zero status; outputs appear only when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from lightning_moe.data.formats import FORMATS, PRESETS
from lightning_moe.data.packing import PACKERS


# each command imports what it runs inside its function: the CLI and every tool start without loading the rest
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightning-moe data", description="Data preparation.")
    sub = p.add_subparsers(dest="command", required=True)

    pack = sub.add_parser("pack", help="tokenize and pack SFT rows into parquet + metadata JSON")
    pack.add_argument("--dataset", required=True, help="jsonl/json/parquet file, save_to_disk folder or hub id")
    pack.add_argument("--tokenizer", required=True, help="tokenizer directory or hub id")
    pack.add_argument("--output", required=True, help="output folder (packed.parquet + metadata.json)")
    pack.add_argument("--overwrite", action="store_true", help="replace an existing non-empty output folder")
    pack.add_argument("--split", default="train", help="split, with optional slice: train[:100000]")
    pack.add_argument("--revision", default=None, help="hub revision of the dataset")
    pack.add_argument("--tokenizer-revision", default=None, help="hub revision of the tokenizer")
    pack.add_argument("--dataset-name", default=None, help="hub configuration name")
    pack.add_argument("--preset", choices=sorted(PRESETS), default=None)
    pack.add_argument("--format", choices=FORMATS, default=None)
    pack.add_argument("--messages-column", default=None)
    pack.add_argument("--last-turn-only", action="store_true", default=None)
    pack.add_argument("--prompt-template", default=None, help="e.g. 'Problem: {problem} Solution:'")
    pack.add_argument("--completion-column", default=None)
    pack.add_argument("--separator", default=None)
    pack.add_argument("--use-chat-template", action="store_true", default=None)
    pack.add_argument("--role-map", action="append", default=None, metavar="FROM=TO",
                      help="rename a chat role to system/user/assistant/tool (repeatable); other roles are errors")
    pack.add_argument("--packed-sequence-size", type=int, required=True)
    pack.add_argument("--pad-seq-to-mult", type=int, default=1)
    pack.add_argument("--packing", choices=sorted(PACKERS), default="ffd")
    pack.add_argument("--overlong", choices=("drop", "truncate"), default="drop")
    pack.add_argument("--skip-invalid-rows", action="store_true")
    pack.add_argument("--num-proc", type=int, default=None, help="tokenization worker processes")

    index = sub.add_parser("index", help="tokenize a JSONL text file into Megatron .bin/.idx files")
    index.add_argument("--input", required=True, help="JSON-lines file, one document per row")
    index.add_argument("--tokenizer", required=True, help="tokenizer directory or hub id")
    index.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    index.add_argument("--json-key", default="text")
    index.add_argument("--append-eod", action="store_true", help="append the eos token to every document")

    cache = sub.add_parser("cache-latents", help="encode image/caption rows once with a diffusion pipeline's frozen "
                                                 "VAE and text encoder into a memory-mapped latent cache")
    cache.add_argument("--dataset", required=True, help="parquet/jsonl/json file, save_to_disk folder or hub id")
    cache.add_argument("--model", required=True, help="diffusers pipeline folder or hub id (Qwen/Qwen-Image)")
    cache.add_argument("--family", default="auto", help="the pipeline's family (auto: from model_index.json)")
    cache.add_argument("--output", required=True, help="cache folder (TextToImageDataModule cache_dir)")
    cache.add_argument("--resolution", type=int, default=1024, help="square side of the encoded images")
    cache.add_argument("--split", default="train")
    cache.add_argument("--revision", default=None, help="hub revision of the dataset")
    cache.add_argument("--image-column", default="image")
    cache.add_argument("--caption-column", default="text")
    cache.add_argument("--bad-rows", choices=("error", "skip"), default="error")
    cache.add_argument("--batch-size", type=int, default=8, help="rows encoded at once")
    cache.add_argument("--device", default="cpu", help="where the encoders run (cuda, cuda:1, cpu)")
    cache.add_argument("--encoder-dtype", default="bfloat16")
    cache.add_argument("--max-sequence-length", type=int, default=1024)
    cache.add_argument("--overwrite", action="store_true")

    samples = sub.add_parser("samples", help="write synthetic sample files and a small tokenizer")
    samples.add_argument("--output", required=True)
    samples.add_argument("--seed", type=int, default=0)
    samples.add_argument("--vocab-size", type=int, default=4096)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "pack":
            result = _pack(args)
        elif args.command == "index":
            result = _index(args)
        elif args.command == "cache-latents":
            result = _cache_latents(args)
        else:
            from lightning_moe.data.samples import write_sample_files

            result = write_sample_files(args.output, seed=args.seed, vocab_size=args.vocab_size)
    except (ValueError, FileNotFoundError, OSError, NotImplementedError) as e:
        print(f"lightning-moe data {args.command}: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, sort_keys=True, default=str))
    return 0


def _pack(args: argparse.Namespace) -> dict:
    from lightning_moe.data.sft import build_packed_sft, make_sample_format
    from lightning_moe.data.tokenizer import load_tokenizer

    output = args.output
    if os.path.exists(output) and not args.overwrite and (not os.path.isdir(output) or os.listdir(output)):
        raise FileExistsError(f"--output {output} already exists and is not empty; pass --overwrite to replace it")
    role_map = None
    if args.role_map:
        pairs = [entry.partition("=") for entry in args.role_map]
        if any(not source or not target for source, _, target in pairs):
            raise ValueError(f"--role-map takes FROM=TO, got {args.role_map}")
        role_map = {source: target for source, _, target in pairs}
    fmt = make_sample_format(
        args.preset, args.format, messages_column=args.messages_column, last_turn_only=args.last_turn_only,
        prompt_template=args.prompt_template, completion_column=args.completion_column, separator=args.separator,
        use_chat_template=args.use_chat_template, role_map=role_map,
    )
    tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_revision)
    meta = build_packed_sft(
        args.output, args.dataset, tokenizer, fmt, args.packed_sequence_size, args.pad_seq_to_mult, args.packing,
        args.overlong, args.split, args.revision, args.dataset_name, args.num_proc, None, args.skip_invalid_rows,
    )
    keys = ("num_packs", "num_samples", "packing_efficiency", "packing_factor", "max_samples_per_pack",
            "num_dropped_overlong", "num_truncated", "num_skipped_invalid")
    return {"output": args.output, **{k: meta[k] for k in keys}}


def _index(args: argparse.Namespace) -> dict:
    from lightning_moe.data.indexed import build_indexed_dataset_from_jsonl
    from lightning_moe.data.tokenizer import load_tokenizer

    if not os.path.isfile(args.input):  # before the (slow) tokenizer load
        raise FileNotFoundError(f"input file {args.input} does not exist")
    tokenizer = load_tokenizer(args.tokenizer)
    stats = build_indexed_dataset_from_jsonl(args.input, tokenizer, args.output_prefix, json_key=args.json_key,
                                             append_eod=args.append_eod)
    return {"output_prefix": args.output_prefix, **stats}


def _cache_latents(args: argparse.Namespace) -> dict:
    from lightning_moe.data.text_to_image import build_latent_cache

    return build_latent_cache(
        args.dataset, args.model, args.output, resolution=args.resolution, split=args.split, revision=args.revision,
        image_column=args.image_column, caption_column=args.caption_column, bad_rows=args.bad_rows,
        batch_size=args.batch_size, device=args.device, family=args.family, encoder_dtype=args.encoder_dtype,
        max_sequence_length=args.max_sequence_length, overwrite=args.overwrite,
    )


if __name__ == "__main__":
    sys.exit(main())
