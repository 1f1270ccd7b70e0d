"""``ParallelStrategy``: Lightning's ``ModelParallelStrategy`` with the package's named meshes and parallelisms.

Lightning's strategy builds a fixed 2-D ``(data_parallel, tensor_parallel)`` mesh and leaves parallelization
to the module. This one takes the sizes of every dimension, validates them against the world size (in
``setup_environment``), the model (in ``parallelize``, called by the module's ``configure_model``) and the
data module's row length (in ``setup``), all before the first step, and provides what the training module
and data modules ask of a strategy: ``parallelize``, ``shard_batch``, ``loss_reduction_group``,
``clip_grad_norm``, ``data_parallel_rank`` / ``data_parallel_size`` and ``parallel_sizes``. Under a pipeline it
runs the steps itself (its ``training_step`` / ``validation_step`` / ``test_step`` hand the micro-batches to the
stages' runner), so the module has one step path.
With gradient accumulation under HSDP, the all-reduce across replicas runs once per optimizer step
(``block_backward_sync``).

Distributed checkpoints are Lightning's (DCP directories); parameters and optimizer states are DTensors
with global shapes, so a checkpoint saved on one mesh resumes on another. Every checkpoint is written under a
temporary name and renamed when complete, and checked for completeness before it is read
(``checkpoint.training``); a run whose model has no DTensors (one process) resumes as well.

YAML::

    trainer:
      strategy:
        class_path: lightning_moe.ParallelStrategy
        init_args: {dp_shard: -1, tp: 2, cp: 1, ep: 1, activation_checkpointing: selective,
                    activation_checkpointing_every: 2, param_dtype: bfloat16}
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_moe.dtypes import dtype_option
from lightning_moe.io.pipelined import (
    flattened_optimizer_state,
    has_flattened_optimizer_state,
    load_flattened,
)
from lightning_moe.io.training import (
    check_complete,
    clear_staging,
    load_unsharded,
    publish,
    staging_path,
)
from lightning_moe.parallel.activation_checkpoint import check_mode
from lightning_moe.parallel.compile import check_compile
from lightning_moe.parallel.context import shard_batch
from lightning_moe.parallel.dims import ParallelDims, check_pp, check_sizes
from lightning_moe.parallel.fsdp import deferred_all_reduce
from lightning_moe.parallel.grad_norm import clip_grad_norm_
from lightning_moe.parallel.options import ParallelOptions
from lightning_moe.parallel.parallelize import parallelize
from lightning_moe.parallel.pipeline import check_schedule, default_schedule
from lightning_moe.parallel.pipeline_stages import check_splittable, split_into_stages
from lightning_moe.parallel.splits import check_micro_batches
from lightning_moe.parallel.tensor import DEFER_FLAG, deferred_partial_sums


class ParallelStrategy(ModelParallelStrategy):
    """FSDP2/HSDP, tensor + sequence, expert and context parallelism on one set of named meshes.

    Args:
        dp_replicate: HSDP replicas (each holds a full FSDP-sharded copy of the model).
        dp_shard: ranks that shard the model with FSDP inside a replica; -1 = what the other sizes leave.
        cp: context-parallel ranks (each row's sequence split over them).
        tp: tensor-parallel ranks (heads, MLP channels and vocabulary split; sequence parallel in between).
        ep: expert-parallel ranks, carved out of ``dp_shard * cp`` (experts split over them).
        activation_checkpointing: ``none`` | ``full`` | ``selective`` (every ``activation_checkpointing_every``-th block).
        compile: ``torch.compile`` every block (after tensor/expert/context parallelism and activation
            checkpointing, before FSDP), with ``compile_backend``.
        param_dtype: FSDP mixed precision: dtype of the unsharded parameters in forward/backward
            (``bfloat16``); null keeps the stored dtype.
        reduce_dtype: dtype of gradient reduction (``float32``).
        cpu_offload: keep sharded parameters, gradients and optimizer states in CPU memory.
        reshard_after_forward: free unsharded block parameters after forward (re-gather in backward).
        save_distributed_checkpoint: DCP directories (True) or one consolidated file (False).
        pp: pipeline-parallel ranks (outermost mesh dimension; each holds different blocks).
        vp: virtual pipeline stages per pipeline rank (interleaving).
        pp_schedule: a ``torch.distributed.pipelining`` schedule: ``1f1b`` (default), ``interleaved_1f1b``
            (default with ``vp > 1``), ``gpipe``, ``looped_bfs``, ``interleaved_zb``, ``zbv``, ``dualpipev``.
        pp_layout: which blocks each virtual stage holds (``"Et*3|t*4|t*4|t*3mL"``, see
            ``parallel.pipeline.parse_layout``); default: balanced by FLOPs and parameters.
    """

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        cp: int = 1,
        tp: int = 1,
        ep: int = 1,
        activation_checkpointing: str = "none",
        activation_checkpointing_every: int = 1,
        compile: bool = False,
        compile_backend: str = "inductor",
        param_dtype: str | None = None,
        reduce_dtype: str | None = "float32",
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        pp: int = 1,
        vp: int = 1,
        pp_schedule: str | None = None,
        pp_layout: str | list[str] | None = None,
    ) -> None:
        check_sizes(dp_replicate, dp_shard, cp, tp, ep)
        check_pp(pp)

        pp_schedule = pp_schedule or default_schedule(vp)
        check_schedule(pp_schedule, pp, vp)
        check_mode(activation_checkpointing, activation_checkpointing_every)
        if compile:
            check_compile(compile_backend)
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self._sizes = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp, "ep": ep}
        self.parallel_options = ParallelOptions(
            activation_checkpointing=activation_checkpointing,
            activation_checkpointing_every=activation_checkpointing_every,
            compile=compile,
            compile_backend=compile_backend,
            param_dtype=dtype_option(param_dtype, "param_dtype"),
            reduce_dtype=dtype_option(reduce_dtype, "reduce_dtype"),
            cpu_offload=cpu_offload,
            reshard_after_forward=reshard_after_forward,
            vp=vp,
            pp_schedule=pp_schedule,
            pp_layout=pp_layout,
        )
        self._parallel_dims: ParallelDims | None = None
        # the runner of this rank's pipeline stages, set when the model is built (parallel/pipeline_runner.py)
        self.pipeline = None

    # ------------------------------------------------------------------ meshes
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._parallel_dims = ParallelDims(**self._sizes, world_size=self.world_size)
        self._parallel_dims.build_meshes(self.root_device.type)
        self._device_mesh = self._parallel_dims.world_mesh
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._device_mesh

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("ParallelStrategy: the meshes exist once the Trainer has set up the processes")
        return self._parallel_dims

    @property
    def parallel_sizes(self) -> dict[str, int]:
        """Resolved sizes (``dp_shard=-1`` filled in once the world size is known), for the run card."""
        if self._parallel_dims is not None:
            return self.parallel_dims.sizes
        return {k: v for k, v in self._sizes.items() if k != "pp" or v > 1}

    @property
    def pipeline_parallel(self) -> bool:
        return self._sizes["pp"] > 1

    @property
    def stage_group(self):
        """Ranks that hold the same pipeline stages (None without a pipeline: all ranks)."""
        if not self.pipeline_parallel:
            return None
        return self.parallel_dims.mesh("stage").get_group()

    @property
    def data_parallel_rank(self) -> int:
        return self.parallel_dims.dp_rank

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # tensor-, context- and expert-parallel peers read the same samples
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @property
    def loss_reduction_group(self):
        """Ranks whose tokens form one global batch: data-parallel x context-parallel (None on one process)."""
        if self.world_size == 1:
            return None
        return self.parallel_dims.mesh("dp_cp").get_group()

    # ------------------------------------------------------------------ model and batches
    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (meta device, after converters) split over the meshes; under a pipeline, first split into
        stages, each parallelized, whose runner this strategy keeps (:attr:`pipeline`)."""
        if self.pipeline_parallel:
            check_splittable(model, self._sizes["pp"])
            model, self.pipeline = split_into_stages(model, self.parallel_dims, self.parallel_options,
                                                     self.root_device)
            return model
        return parallelize(model, self.parallel_dims, self.parallel_options)

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under a pipeline the runner keeps each micro-batch, and the step's last one runs the schedule (every
        forward and backward), whose loss sums the module takes (``add_sums``). Lightning's backward gets a zero
        unconnected to the model (it refuses None on several ranks)."""
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        with self.precision_plugin.train_step_context():
            sums = self.pipeline.add(self.shard_batch(args[0]), module.trainer.accumulate_grad_batches)
            if sums is not None:
                module.add_sums(sums)
            return torch.zeros((), device=self.pipeline.device, requires_grad=True)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._pipelined_evaluation(self.precision_plugin.val_step_context(), args[0])

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._pipelined_evaluation(self.precision_plugin.test_step_context(), args[0])

    def _pipelined_evaluation(self, context, batch: dict) -> None:
        """The stages run in order (no schedule, no backward); the module takes the batch's loss sums."""
        with context:
            self.lightning_module.add_sums(self.pipeline.evaluate(self.shard_batch(batch)), evaluation=True)

    @property
    def averaged_micro_batches(self) -> int:
        """How many micro-batches a step's gradients are the mean of: Lightning divides each one's objective by
        the accumulation count before its backward, a pipeline schedule backpropagates their sums."""
        return 1 if self.pipeline is not None else self.lightning_module.trainer.accumulate_grad_batches

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            closure = self.pipeline.checked(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.pipeline is not None:
            self.pipeline.reduce_timings()  # on every rank (a collective), for the run card

    def shard_batch(self, batch: dict) -> dict:
        """This rank's share of a batch: the context-parallel sequence split (identity when ``cp == 1``)."""
        dims = self.parallel_dims
        dims.check_seq_length(batch["input_ids"].shape[1], "batch sequence length")
        if dims.cp == 1:
            return batch

        return shard_batch(batch, dims.mesh("cp"))

    def clip_grad_norm(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients of parameters on any mix of meshes by their total norm; returns that norm."""
        # under a pipeline each rank holds some stages' parameters: their norms are combined over the stages
        group = self.parallel_dims.mesh("pp").get_group() if self.pipeline_parallel else None
        uncounted = self.pipeline.uncounted_parameters() if self.pipeline is not None else ()
        return clip_grad_norm_(parameters, max_norm, norm_type, stage_group=group, uncounted=uncounted)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning runs every micro-batch but the last of an accumulation window inside this: under HSDP the
        all-reduce of gradients across replicas waits for the last one (see ``fsdp.deferred_all_reduce``), and
        tensor parallelism without FSDP sums replicated parameters' partial gradients only then
        (``tensor.deferred_partial_sums``). Plain FSDP has no all-reduce to defer."""
        dims, module = self._parallel_dims, self.lightning_module
        model = getattr(module, "model", None)
        if model is not None and hasattr(model, DEFER_FLAG):
            with deferred_partial_sums(model):
                yield
            return
        if dims is None or dims.dp_replicate == 1 or module is None:
            yield
            return

        with deferred_all_reduce(module):
            yield

    def setup(self, trainer) -> None:
        data = getattr(trainer, "datamodule", None)
        if data is not None:
            self.parallel_dims.check_data_module(data)
            if self.pipeline_parallel and isinstance(getattr(data, "micro_batch_size", None), int):
                dims = self.parallel_dims
                rows = data.micro_batch_size * dims.dp_size
                check_micro_batches((getattr(data, "global_batch_size", None) or rows) // rows, dims.pp)
        super().setup(trainer)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Lightning's save, written under ``.partial/`` and moved to ``filepath`` once complete on every rank
        (see ``checkpoint.training``): a kill mid-save leaves the previous checkpoint of that name intact."""
        final = Path(self.broadcast(str(filepath)))
        staged = staging_path(final)
        if self.is_global_zero:
            clear_staging(final)
        self.barrier("ParallelStrategy.save_checkpoint: staging cleared")
        super().save_checkpoint(checkpoint, staged, storage_options)
        self.barrier("ParallelStrategy.save_checkpoint: written")
        if self.is_global_zero:
            publish(staged, final)
        self.barrier("ParallelStrategy.save_checkpoint: published")

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """A pipelined run's optimizer states are saved keyed by parameter name (``io/pipelined.py``)."""
        if not (self.pipeline_parallel and self._save_distributed_checkpoint):
            return super().optimizer_state(optimizer)

        return flattened_optimizer_state(self.model, getattr(optimizer, "_optimizer", optimizer))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load after a completeness check naming any missing or truncated file; a model without
        DTensor parameters (one process, no FSDP or TP) loads too."""
        from torch.distributed.tensor import DTensor


        path = Path(self.broadcast(str(checkpoint_path)))
        check_complete(path)
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]

        if has_flattened_optimizer_state(path):  # written by a pipelined run
            return load_flattened(path, self.model, optimizers, strict=self.lightning_module.strict_loading,
                                  weights_only=weights_only)
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            return super().load_checkpoint(path, weights_only=weights_only)
        return load_unsharded(path, self.model, optimizers, strict=self.lightning_module.strict_loading,
                              weights_only=weights_only)
