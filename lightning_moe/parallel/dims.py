"""Parallel sizes, their validation, and the device meshes built from them.

Pipeline stages take the outermost dimension ``pp`` (each pipeline rank holds different blocks; see
``parallel/pipeline.py``); inside one pipeline rank, dense parameters live on the mesh ``(dp_replicate, dp_shard, cp, tp)`` (row-major over ranks, so
tensor-parallel peers are neighbours). Experts live on a second mesh over the same ranks,
``(pp, dp_replicate, ep_shard, ep)``: expert parallelism is carved out of the ``dp_shard * cp * tp`` ranks
(Megatron-Core's parallel folding, torchtitan's rule), and the remaining ``ep_shard = dp_shard * cp * tp / ep``
ranks shard the experts with FSDP. Routed experts are never split by tensor parallelism: under TP each rank
routes its own sequence shard, so tensor-parallel peers hold different tokens for the experts, just as
data- and context-parallel peers do. Both layouts enumerate ranks the same way, so the ``ep`` peers of a
rank are ranks that hold different tokens.

Named sub-meshes (``dims.mesh(name)``):
    ``dp``            dp_replicate x dp_shard: ranks that see different batches (the sampler's rank)
    ``dp_shard_cp``   dp_shard x cp: what FSDP shards dense parameters over
    ``dp_cp``         dp_replicate x dp_shard x cp: the loss is normalized over these ranks
    ``fsdp``          the dense FSDP mesh: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP
    ``cp``, ``tp``, ``dp_replicate``, ``dp_shard``
    ``cp_tp``         cp x tp: where Mamba-2 / linear-attention mixers trade tokens for heads
    ``ep``            ranks that exchange tokens for their experts
    ``expert_fsdp``   what FSDP shards experts over: ``ep_shard``, or ``(dp_replicate, ep_shard)``
    ``pp``            the ranks that hold the stages of one pipeline (same data, different blocks)
    ``stage``         the ranks that hold the same stages (all but ``pp``; only when ``pp > 1``)
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

from lightning_moe.models.blocks import model_kinds
from lightning_moe.models.splits import check_head_split, divisors
from lightning_moe.row_length import row_length

SIZE_NAMES = ("dp_replicate", "dp_shard", "cp", "tp", "ep")
MESH_SIZE_NAMES = ("pp", *SIZE_NAMES)  # every size ParallelDims takes


@dataclass
class ParallelDims:
    """Sizes of each parallel dimension for ``world_size`` ranks; ``dp_shard=-1`` takes what is left."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    world_size: int = 1
    _meshes: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_sizes(self.dp_replicate, self.dp_shard, self.cp, self.tp, self.ep)
        check_pp(self.pp)
        others = self.pp * self.dp_replicate * self.cp * self.tp
        # the pipeline size is named in the messages only when there is a pipeline
        pp_name, pp_value = ("pp*", f"{self.pp}*") if self.pp > 1 else ("", "")
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"{pp_name}dp_replicate*cp*tp = {pp_value}{self.dp_replicate}*{self.cp}*{self.tp} = {others} does "
                    f"not divide the world size {self.world_size}; use sizes whose product divides {self.world_size}"
                )
            self.dp_shard = self.world_size // others
        total = others * self.dp_shard
        if total != self.world_size:
            raise ValueError(
                f"{pp_name}dp_replicate*dp_shard*cp*tp = {pp_value}{self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp} = {total} != world size {self.world_size} (devices x nodes); set dp_shard=-1 to use the "
                f"rest, or sizes that multiply to {self.world_size}"
            )
        if self.expert_region % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp_shard*cp*tp = {self.dp_shard}*{self.cp}*{self.tp} = "
                f"{self.expert_region} (experts are spread over the data-parallel shard, context-parallel and "
                f"tensor-parallel ranks); use ep in {divisors(self.expert_region)}"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def dp_size(self) -> int:
        """Ranks that see different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp_size(self) -> int:
        """Ranks that hold different tokens of the global batch: the loss-normalization group."""
        return self.dp_size * self.cp

    @property
    def expert_region(self) -> int:
        """Ranks that hold different tokens for the experts inside a replica: ``dp_shard * cp * tp``."""
        return self.dp_shard * self.cp * self.tp

    @property
    def ep_shard(self) -> int:
        return self.expert_region // self.ep

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_cp_size > 1

    @property
    def sizes(self) -> dict[str, int]:
        """The sizes by name (``pp`` only when pipelining)."""
        sizes = {name: getattr(self, name) for name in SIZE_NAMES}
        return {"pp": self.pp, **sizes} if self.pp > 1 else sizes

    def sequence_multiple(self) -> int:
        """Row lengths must be a multiple of this: 2*cp load-balanced chunks, each rank's cp share split over tp."""
        return math.lcm(2 * self.cp if self.cp > 1 else 1, self.cp * self.tp)

    # ------------------------------------------------------------------ checks against a model and data
    def check_model(self, config) -> None:
        """Raise a one-line message when the model cannot be split with these sizes: each block kind's own
        checks (``models/blocks.py``), then the vocabulary and the experts."""
        kinds = model_kinds(config)
        if self.tp > 1 and config.te_modules:
            # TE's layers split themselves (their tp_group and sequence_parallel arguments), which torch's
            # tensor-parallel styles do not drive: they would run whole on every rank
            raise ValueError(f"tp={self.tp}: model.te_modules: true is not split by tensor parallelism "
                             f"(Transformer Engine's layers shard through their own tp_group); use "
                             f"te_modules: false with tp > 1, or tp=1")
        # Mamba-2 / Gated DeltaNet / KDA trade tokens for heads over the tp, cp x tp and cp ranks
        trades = [("tp", self.tp), ("cp*tp", self.cp * self.tp if self.cp > 1 and self.tp > 1 else 1), ("cp", self.cp)]
        for name, size in trades:
            for kind in kinds:
                if size > 1 and kind.traded_heads is not None:
                    key, count, unit = kind.traded_heads(config)
                    check_head_split(count, size, name, key, unit)
        if self.tp > 1:
            for kind in kinds:
                if kind.check_tensor_split is not None:
                    kind.check_tensor_split(config, self.tp)
            if config.vocab_size % self.tp:
                raise ValueError(
                    f"tp={self.tp} does not divide vocab_size={config.vocab_size}; pad the vocabulary or use tp in "
                    f"{divisors(config.vocab_size)}"
                )
        if self.cp > 1:
            for kind in kinds:
                if kind.check_context_split is not None:
                    kind.check_context_split(config, self.cp)
        if self.ep > 1:
            if not any(kind.experts for kind in kinds):
                raise ValueError(f"ep={self.ep} but the model has no MoE layers; use ep=1")
            experts = config.moe.num_experts
            if experts % self.ep:
                usable = [d for d in divisors(experts) if self.expert_region % d == 0]
                raise ValueError(f"ep={self.ep} does not divide moe.num_experts={experts}; use ep in {usable}")

    def check_seq_length(self, seq_length: int, where: str = "sequence length") -> None:
        multiple = self.sequence_multiple()
        if seq_length % multiple:
            reasons = []
            if self.cp > 1:
                reasons.append(f"2*cp={2 * self.cp} load-balanced chunks")
            if self.tp > 1:
                reasons.append(f"cp*tp={self.cp * self.tp} sequence-parallel shards")
            raise ValueError(
                f"{where} {seq_length} is not a multiple of {multiple} ({', '.join(reasons)}); pad rows to a "
                f"multiple of {multiple}, e.g. {seq_length + multiple - seq_length % multiple}"
            )

    def check_data_module(self, data) -> None:
        """A data module's rows (``lightning_moe/row_length.py``) must split into the context- and
        sequence-parallel shards."""
        rows = row_length(data)
        if rows is None:
            return
        multiple = self.sequence_multiple()
        if rows.multiple is not None:
            if rows.multiple % multiple:
                raise ValueError(
                    f"{type(data).__name__}.pad_seq_to_mult={rows.multiple}: unpacked rows must be padded to "
                    f"a multiple of {multiple} with cp={self.cp}, tp={self.tp}; set pad_seq_to_mult to a multiple "
                    f"of {multiple}"
                )
            return
        self.check_seq_length(rows.tokens, f"{type(data).__name__}.{rows.key}")

    # ------------------------------------------------------------------ meshes
    def build_meshes(self, device_type: str) -> None:
        """Create the process groups (collective over all ranks; call once, on every rank)."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        meshes = {name: world[name] for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp")}
        meshes["dp"] = world["dp_replicate", "dp_shard"]._flatten("dp")
        meshes["dp_shard_cp"] = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        meshes["dp_cp"] = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        meshes["cp_tp"] = world["cp", "tp"]._flatten("cp_tp")
        if self.pp > 1:
            meshes["stage"] = world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
        meshes["fsdp"] = meshes["dp_shard_cp"]
        if self.dp_replicate > 1:
            with warnings.catch_warnings():
                # newer torch prefers unflattened views (torch >= 2.9 only); this slice works on every version
                warnings.filterwarnings("ignore", message="Slicing a flattened dim")
                meshes["fsdp"] = world["dp_replicate", "dp_shard_cp"]
        meshes["world"] = world
        if self.ep > 1:
            experts = init_device_mesh(
                device_type,
                (self.pp, self.dp_replicate, self.ep_shard, self.ep),
                mesh_dim_names=("pp", "dp_replicate", "ep_shard", "ep"),
            )
            meshes["ep"] = experts["ep"]
            meshes["expert_fsdp"] = experts["dp_replicate", "ep_shard"] if self.dp_replicate > 1 else experts["ep_shard"]
        self._meshes = meshes

    def mesh(self, name: str):
        if not self._meshes:
            raise RuntimeError("ParallelDims.build_meshes() has not been called (it needs torch.distributed)")
        if name not in self._meshes:
            raise KeyError(f"no mesh named {name!r}; available: {sorted(self._meshes)}")
        return self._meshes[name]

    @property
    def world_mesh(self):
        return self.mesh("world")

    @property
    def dp_rank(self) -> int:
        return self.mesh("dp").get_local_rank() if self._meshes else 0

    @property
    def pp_rank(self) -> int:
        return self.mesh("pp").get_local_rank() if self._meshes else 0


def check_pp(pp: int) -> None:
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pp={pp!r} must be a positive integer (pipeline stages)")


def check_sizes(dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int) -> None:
    """Sizes that are wrong whatever the world size."""
    for name, value in zip(SIZE_NAMES, (dp_replicate, dp_shard, cp, tp, ep)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be an integer")
        if value < 1 and not (name == "dp_shard" and value == -1):
            allowed = "a positive integer, or -1 for the remaining ranks" if name == "dp_shard" else "a positive integer"
            raise ValueError(f"{name}={value} must be {allowed}")
