"""``lightning-moe convert import|export|export-lora|verify``: checkpoint conversion from the command line.

User errors (missing files, unknown architectures, mismatched tensors) print one line and exit 1;
outputs are written to a temporary directory and renamed, so a failed run leaves nothing behind.
"""

from __future__ import annotations

import argparse
import sys

from lightning_moe.dtypes import FLOAT_DTYPES

# each command imports what it runs inside its function: the CLI and every tool start without loading the rest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-moe convert", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)

    imp = sub.add_parser("import", help="Hugging Face directory -> native checkpoint")
    imp.add_argument("--hf-path", required=True,
                     help="Hugging Face model directory (config.json + safetensors), or a hub id (downloaded)")
    imp.add_argument("--hf-revision", default=None, help="hub revision (commit, branch or tag) of a hub id")
    imp.add_argument("--ep", type=int, default=1, help="on N launched ranks (torchrun): expert parallelism of the "
                     "layout; each rank reads its experts and tensors only and writes a distributed checkpoint")
    imp.add_argument("--out", required=True, help="output directory")
    imp.add_argument("--max-shard-size", type=int, default=5 * 2**30, help="bytes per safetensors shard")
    imp.add_argument("--dequantize-dtype", choices=sorted(FLOAT_DTYPES), default="bfloat16",
                     help="dtype of quantized hub weights (FP8 blocks, MXFP4) after import")
    imp.add_argument("--overwrite", action="store_true")

    exp = sub.add_parser("export", help="native checkpoint or training run -> Hugging Face directory")
    exp.add_argument("--ckpt", required=True, help="an imported checkpoint directory, or a run's Lightning checkpoint "
                     "(.ckpt file or distributed directory: native, LoRA (exported merged) or model: {hf: ...})")
    exp.add_argument("--out", required=True, help="output directory")
    exp.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None, help="cast floating tensors (default: keep)")
    exp.add_argument("--quantize", choices=["fp8-block", "mxfp4", "fp8-mxfp4"], default=None,
                     help="write the hub's quantized layout (DeepSeek-V3 / MiMo-V2.5 block FP8, GPT-OSS MXFP4 "
                          "experts, MiMo-V2.6 FP8 with MXFP4 experts)")
    exp.add_argument("--max-shard-size", type=int, default=5 * 2**30, help="bytes per safetensors shard")
    exp.add_argument("--distributed-save", action="store_true", help="on N launched ranks (torchrun): every rank "
                     "writes the files of its experts and tensors, rank 0 the index")
    exp.add_argument("--ep", type=int, default=1, help="with --distributed-save: expert parallelism of the layout")
    exp.add_argument("--overwrite", action="store_true")

    lora = sub.add_parser("export-lora", help="LoRA run checkpoint -> Hugging Face PEFT adapter and/or merged model")
    lora.add_argument("--ckpt", required=True,
                      help="Lightning checkpoint of a run with `peft` settings (.ckpt file or distributed directory)")
    lora.add_argument("--adapter-out", default=None, help="output directory of the PEFT adapter")
    lora.add_argument("--merged-out", default=None, help="output directory of the merged Hugging Face model")
    lora.add_argument("--dtype", choices=sorted(FLOAT_DTYPES), default=None, help="cast floating tensors (default: keep)")
    lora.add_argument("--overwrite", action="store_true")

    ver = sub.add_parser("verify", help="compare two Hugging Face directories tensor by tensor")
    ver.add_argument("--reference", required=True)
    ver.add_argument("--candidate", required=True)
    return parser


def hub_directory(path: str, revision: str | None) -> str:
    """``--hf-path`` as a local directory: itself, or the snapshot of a hub id at ``revision`` (fetched once by
    the first rank of each node when launched on several)."""
    from pathlib import Path

    if Path(path).expanduser().is_dir():
        if revision is not None:
            raise ValueError(f"--hf-revision {revision} applies to a hub id; {path} is a local directory")
        return path
    from lightning_moe.checkpoint.distributed_convert import join_ranks, launched_ranks
    from lightning_moe.models.hf import HFModelConfig, resolve_model_dir

    def snapshot() -> str:
        try:
            return str(resolve_model_dir(HFModelConfig(hf=path, revision=revision)))
        except FileNotFoundError as err:
            raise FileNotFoundError(str(err).replace("model.hf", "--hf-path", 1)) from None

    ranks, _, local_rank = launched_ranks()
    if ranks == 1:
        return snapshot()
    import torch.distributed as dist

    join_ranks()
    if local_rank == 0:
        snapshot()  # one download per node
    dist.barrier()
    return snapshot()  # the snapshot just fetched


def distributed(ep: int, action: str, distributed_save: bool = True) -> bool:
    """Whether this process is one of N launched ranks of a distributed conversion (joining them if so)."""
    from lightning_moe.checkpoint.distributed_convert import join_ranks, launched_ranks

    ranks = launched_ranks()[0]
    if ranks == 1:
        if ep > 1 or (action == "export" and distributed_save):
            flag = "--distributed-save" if action == "export" and distributed_save else f"--ep {ep}"
            raise ValueError(f"{flag} converts on several ranks: launch with torchrun --nproc-per-node N "
                             f"(this process is the only rank)")
        return False
    if action == "export" and not distributed_save:
        raise ValueError(f"export on {ranks} launched ranks writes with --distributed-save (or run one process)")
    join_ranks()
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from lightning_moe.checkpoint import convert

    try:
        if args.action == "import":
            hf_dir = hub_directory(args.hf_path, args.hf_revision)
            if distributed(args.ep, "import"):
                from lightning_moe.checkpoint import distributed_convert as dc

                out = dc.import_hf_checkpoint_distributed(
                    hf_dir, args.out, dc.ConversionLayout.of_process_group(args.ep), overwrite=args.overwrite,
                    dequantize_dtype=FLOAT_DTYPES[args.dequantize_dtype])
            else:
                out = convert.import_hf_checkpoint(
                    hf_dir, args.out, max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                    dequantize_dtype=FLOAT_DTYPES[args.dequantize_dtype],
                )
            print(f"imported {args.hf_path} -> {out}")
        elif args.action == "export":
            from lightning_moe.io.run import is_run_checkpoint
            from lightning_moe.workflows.run_export import export_run

            if distributed(args.ep, "export", args.distributed_save):
                from lightning_moe.checkpoint import distributed_convert as dc

                if is_run_checkpoint(args.ckpt):
                    raise ValueError(f"--distributed-save exports an imported checkpoint (native or distributed) or a "
                                     f"Hugging Face directory; {args.ckpt} is a training run's checkpoint: export it "
                                     f"in one process")
                out = dc.export_hf_checkpoint_distributed(
                    args.ckpt, args.out, dc.ConversionLayout.of_process_group(args.ep), dtype=FLOAT_DTYPES.get(args.dtype),
                    max_shard_bytes=args.max_shard_size, overwrite=args.overwrite, quantize=args.quantize)
            elif is_run_checkpoint(args.ckpt):
                out = export_run(args.ckpt, args.out, dtype=FLOAT_DTYPES.get(args.dtype), quantize=args.quantize,
                                 max_shard_bytes=args.max_shard_size, overwrite=args.overwrite)
            else:
                out = convert.export_hf_checkpoint(
                    args.ckpt, args.out, dtype=FLOAT_DTYPES.get(args.dtype), max_shard_bytes=args.max_shard_size,
                    overwrite=args.overwrite, quantize=args.quantize,
                )
            print(f"exported {args.ckpt} -> {out}")
        elif args.action == "export-lora":
            from lightning_moe.workflows.run_export import export_lora_run

            for out in export_lora_run(args.ckpt, adapter_out=args.adapter_out, merged_out=args.merged_out,
                                       dtype=FLOAT_DTYPES.get(args.dtype), overwrite=args.overwrite):
                print(f"exported {args.ckpt} -> {out}")
        else:
            report = convert.verify_hf_checkpoints(args.reference, args.candidate)
            print(report.summary())
            return 0 if report.ok else 1
    except (FileNotFoundError, FileExistsError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
