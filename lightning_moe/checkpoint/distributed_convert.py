"""Checkpoint conversion on N ranks, for checkpoints too large for one process:
``torchrun --nproc-per-node N -m lightning_moe.cli convert import|export ... --ep E`` (or ``srun`` under Slurm,
``jsrun`` under LSF: Lightning's cluster environments find the ranks).

Layout: the ranks split the model as expert-parallel training lays it out (``ParallelDims`` with ``ep``, FSDP
over the rest): the experts of each MoE layer go in contiguous blocks to the ``ep`` expert-parallel ranks, and
each block is split again over the ``world / ep`` ranks that FSDP-shard it, so every rank owns the same number of
experts of every layer. Every other tensor is owned whole by one rank, dealt out by size. A rank reads only
what it owns (safetensors reads are lazy, per tensor or per row range) and holds only that.

``import`` writes a distributed checkpoint (``torch.distributed.checkpoint``): every rank writes its own file,
expert stacks as DTensors sharded in that layout and each other tensor from its owner, with
``model_config.json``, the hub's config.json and tokenizer files beside it. ``open_checkpoint`` opens it as a
native checkpoint: training starts from it, ``export`` reads it.

``export --distributed-save``: every rank converts what it owns (its experts' rows read from the distributed
checkpoint's shards through DCP, or from a safetensors checkpoint's byte ranges), writes its own safetensors
files, and once all have, rank 0 writes the one index and config.json; the result holds the tensors of the
one-process export, bit for bit.

Ranks talk over gloo: conversion moves tensors between files, on CPU, whatever the devices.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_moe.checkpoint.convert import (
    copy_aux_files,
    export_hf_config,
    write_hub_tensors,
)
from lightning_moe.checkpoint.source import (
    HF_CONFIG,
    NATIVE_CONFIG,
    ORIGINAL_HF_CONFIG,
    DistributedNativeCheckpoint,
    HFCheckpoint,
    NativeCheckpoint,
    expected_tensors,
    open_checkpoint,
)
from lightning_moe.io.atomic import atomic_directory
from lightning_moe.io.distributed import STATE_DICT
from lightning_moe.io.safetensors_io import ShardedWriter, final_shard_names, name_shards
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.families import TensorMap, family_by_name
from lightning_moe.models.hf_form import cast_floating
from lightning_moe.parallel.dims import ParallelDims


def cluster_environment():
    """The launcher of this process as Lightning detects it (torchrun, ``srun`` under Slurm, LSF's ``jsrun``), or
    None: then ``WORLD_SIZE``/``RANK`` (set by any other launcher), else one process."""
    from lightning.fabric.plugins.environments import (
        LSFEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    return next((env() for env in (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment) if env.detect()), None)


def launched_ranks() -> tuple[int, int, int]:
    """(world size, global rank, local rank) the launcher gave this process; (1, 0, 0) when none did."""
    env = cluster_environment()
    if env is not None:
        return env.world_size(), env.global_rank(), env.local_rank()
    return (int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
            int(os.environ.get("LOCAL_RANK", "0")))


def join_ranks() -> None:
    """The gloo process group of the launched ranks (kept when one exists)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    from lightning.fabric.plugins.environments import TorchElasticEnvironment

    env = cluster_environment()
    if env is None or isinstance(env, TorchElasticEnvironment):
        dist.init_process_group("gloo")  # the launcher set MASTER_ADDR, RANK, WORLD_SIZE (env://)
    else:  # Slurm, LSF: the address and port Lightning derives from the job
        dist.init_process_group("gloo", init_method=f"tcp://{env.main_address}:{env.main_port}",
                                world_size=env.world_size(), rank=env.global_rank())


@dataclass
class ConversionLayout:
    """Which experts and tensors rank ``rank`` of ``world_size`` owns, for expert parallelism ``ep``."""

    world_size: int
    rank: int
    ep: int = 1
    dims: ParallelDims = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self.dims = ParallelDims(dp_shard=-1, ep=self.ep, world_size=self.world_size)
        except ValueError as err:
            raise ValueError(f"--ep {self.ep} on {self.world_size} ranks: {err}") from None

    @classmethod
    def of_process_group(cls, ep: int) -> ConversionLayout:
        import torch.distributed as dist

        return cls(dist.get_world_size(), dist.get_rank(), ep)

    @property
    def chunks(self) -> int:
        return self.ep * self.dims.ep_shard

    def chunk_of(self, rank: int) -> int:
        """Expert block of ``rank``: its expert-parallel index (the fastest-varying rank index of the expert mesh
        ``(ep_shard, ep)``), then its FSDP index within that block."""
        return (rank % self.ep) * self.dims.ep_shard + rank // self.ep

    def rows(self, count: int) -> tuple[int, int]:
        """This rank's experts ``start:stop`` of ``count``: ``torch.chunk``'s split, as DTensor's Shard(0)."""
        size = math.ceil(count / self.chunks)
        start = min(count, self.chunk_of(self.rank) * size)
        return start, min(count, start + size)

    def sharded(self, local: torch.Tensor, shape: torch.Size):
        """``local`` (this rank's rows) as the DTensor of the whole ``shape``, rows in expert-block order."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        order = sorted(range(self.world_size), key=self.chunk_of)
        mesh = DeviceMesh("cpu", torch.tensor(order), mesh_dim_names=("experts",))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    def owners(self, sizes: list[int]) -> list[int]:
        """A rank for each whole tensor of ``sizes`` (elements): the least loaded so far, lowest rank on ties."""
        load = [0] * self.world_size
        owners = []
        for size in sizes:
            owner = min(range(self.world_size), key=lambda r: (load[r], r))
            load[owner] += size
            owners.append(owner)
        return owners


def split_maps(maps: list[TensorMap], config: ModelConfig, layout: ConversionLayout) -> tuple[list[TensorMap], list[TensorMap]]:
    """(expert stacks, whole tensors this rank owns) among ``maps``; every rank computes the same split."""
    expected = expected_tensors(config)
    stacks = [m for m in maps if m.stacks_experts]
    whole = [m for m in maps if not m.stacks_experts]
    owners = layout.owners([sum(expected[n].numel() for n in m.natives) for m in whole])
    return stacks, [m for m, owner in zip(whole, owners) if owner == layout.rank]


def check_output(out: Path, overwrite: bool) -> None:
    """Every rank's own check, before any collective (so no rank waits for one that stopped here)."""
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"output {out} already exists and is not empty (pass --overwrite to replace it)")


class RankZeroDirectory:
    """A staging directory made by rank 0 and shared with every rank (:func:`atomic_directory` on rank 0: the
    output appears whole when every rank has written into it, and not at all when rank 0 fails)."""

    def __init__(self, out: Path, overwrite: bool) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        self._context = atomic_directory(out, overwrite=overwrite) if self.rank == 0 else None
        box = [self._context.__enter__() if self._context is not None else None]
        dist.broadcast_object_list(box, src=0)
        self.path: Path = box[0]

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, error, traceback) -> bool:
        import torch.distributed as dist

        if error is None:
            dist.barrier()  # every rank has written its files
        if self._context is not None:
            self._context.__exit__(exc_type, error, traceback)
        return False


def import_hf_checkpoint_distributed(hf_dir: str | Path, out: str | Path, layout: ConversionLayout, *,
                                     overwrite: bool = False, dequantize_dtype: torch.dtype = torch.bfloat16) -> Path:
    """Hugging Face directory -> distributed native checkpoint, on all ranks of the process group."""
    import torch.distributed.checkpoint as dcp


    out = Path(out)
    check_output(out, overwrite)
    source = HFCheckpoint(hf_dir, dequantize_dtype)  # config and tensor headers only
    expected = expected_tensors(source.config)
    stacks, owned = split_maps(source.maps, source.config, layout)
    state: dict[str, Any] = {}
    for m in stacks:
        start, stop = layout.rows(len(m.hf))
        rows = [source.reader.get(name) for name in m.hf[start:stop]]
        shape = expected[m.native].shape
        local = torch.stack(rows) if rows else torch.empty((0, *shape[1:]), dtype=source.reader.dtype(m.hf[0]))
        state[m.native] = layout.sharded(local, shape)
    for m in owned:
        state.update(zip(m.natives, m.natives_from_hf([source.reader.get(name) for name in m.hf])))
    with RankZeroDirectory(out, overwrite) as staging:
        dcp.save({STATE_DICT: state}, storage_writer=dcp.FileSystemWriter(staging))
        if layout.rank == 0:
            source.config.save(staging / NATIVE_CONFIG)
            (staging / ORIGINAL_HF_CONFIG).write_text(json.dumps(source.hf_config, indent=2) + "\n")
            copy_aux_files(source.directory, staging)
    return out


def local_natives(source, stacks: list[TensorMap], owned: list[TensorMap], layout: ConversionLayout
                  ) -> dict[str, torch.Tensor]:
    """This rank's part of ``source``: the rows of its experts of each stack, and its whole tensors."""
    expected = expected_tensors(source.config)
    if isinstance(source, DistributedNativeCheckpoint):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        stored = dcp.FileSystemReader(source.directory).read_metadata().state_dict_metadata
        dtypes = {name: stored[f"{STATE_DICT}.{name}"].properties.dtype for name in source.names}
        request: dict[str, Any] = {}
        for m in stacks:
            start, stop = layout.rows(len(m.hf))
            shape = expected[m.native].shape
            request[m.native] = layout.sharded(torch.empty((stop - start, *shape[1:]), dtype=dtypes[m.native]), shape)
        for m in owned:
            request.update((name, torch.empty(expected[name].shape, dtype=dtypes[name])) for name in m.natives)
        wrapped = {STATE_DICT: request}
        dcp.load(wrapped, checkpoint_id=source.directory, planner=DefaultLoadPlanner(allow_partial_load=True))
        return {name: (t.to_local() if hasattr(t, "to_local") else t) for name, t in wrapped[STATE_DICT].items()}
    tensors: dict[str, torch.Tensor] = {}
    for m in stacks:
        start, stop = layout.rows(len(m.hf))
        if isinstance(source, NativeCheckpoint):
            tensors[m.native] = source.reader.get_rows(m.native, start, stop)
        else:  # a Hugging Face directory: the experts' own hub tensors
            rows = [source.reader.get(name) for name in m.hf[start:stop]]
            tensors[m.native] = torch.stack(rows) if rows else torch.empty((0, *expected[m.native].shape[1:]))
    for m in owned:
        tensors.update((name, source.get_native(name)) for name in m.natives)
    return tensors


def export_hf_checkpoint_distributed(ckpt: str | Path, out: str | Path, layout: ConversionLayout, *,
                                     dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
                                     overwrite: bool = False, quantize: str | None = None) -> Path:
    """Native (distributed or not) or Hugging Face checkpoint -> Hugging Face directory, every rank writing its
    own safetensors files, rank 0 the index."""
    import torch.distributed as dist

    out = Path(out)
    check_output(out, overwrite)
    source = open_checkpoint(ckpt)
    family = family_by_name(source.config.family)
    hf = export_hf_config(family, source.config, source.hf_config, dtype, quantize)
    maps = family.weight_map(source.config)
    stacks, owned = split_maps(maps, source.config, layout)
    tensors = local_natives(source, stacks, owned, layout)
    with RankZeroDirectory(out, overwrite) as staging:
        writer = ShardedWriter(staging, max_shard_bytes, temp_prefix=f"rank{layout.rank:05d}-")
        mine = {id(m) for m in stacks + owned}
        for m in maps:  # in the one-process export's order
            if id(m) not in mine:
                continue
            if m.stacks_experts:
                start, stop = layout.rows(len(m.hf))
                names, parts = m.hf[start:stop], list(cast_floating([tensors.pop(m.native)], dtype)[0].unbind(0))
            else:
                names = m.hf
                parts = m.hf_from_natives(cast_floating([tensors.pop(name) for name in m.natives], dtype))
            write_hub_tensors(writer, family, names, parts, hf, quantize)
        shards = writer.close()
        everyone: list[Any] = [None] * layout.world_size
        dist.all_gather_object(everyone, (shards, writer.total_bytes))
        before = sum(len(s) for s, _ in everyone[:layout.rank])
        names = final_shard_names(sum(len(s) for s, _ in everyone))
        for (temp, _), name in zip(shards, names[before:]):
            os.replace(staging / temp, staging / name)  # each rank names its own files
        if layout.rank == 0:
            name_shards(staging, [shard for s, _ in everyone for shard in s], sum(b for _, b in everyone),
                        rename=False)
            (staging / HF_CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
            copy_aux_files(source.directory, staging)
    return out
