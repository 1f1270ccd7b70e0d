"""The runner of a pipeline: one rank's stages, the schedule of an optimizer step and evaluation in stage order.

Lightning still accumulates ``trainer.accumulate_grad_batches`` micro-batches per optimizer step; under a
pipeline each micro-batch is only kept (:meth:`PipelineRunner.add`), and the step's last one runs the schedule
over all of them (forward and backward of every stage). The schedule backpropagates the raw objective sums
(``scale_grads=False``); the training module then divides by the global label count as without a pipeline.
Loss sums of all stages are summed over the pipeline ranks, so every rank logs and scales by the same figures.
Evaluation runs the stages in order, sending the activations point to point (no schedule: no backward). The
strategy keeps the runner (``ParallelStrategy.pipeline``).
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from lightning_moe.dtypes import WIRE_DTYPES
from lightning_moe.models.batch_layout import BatchLayout
from lightning_moe.parallel.pipeline import (
    SCHEDULES,
    SINGLE_STAGE,
    SPLIT_BACKWARD,
    PipelinedDecoder,
    describe_split,
    stage_indices,
)
from lightning_moe.parallel.splits import check_micro_batches


class PipelineRunner:
    """Stages of one rank, their schedule (built at the first step, when the micro-batch count is known) and the
    micro-batches of the step being collected."""

    def __init__(self, model: PipelinedDecoder, dims, schedule: str, vp: int, specs, device: torch.device) -> None:
        self.model, self.dims, self.schedule_name, self.vp, self.specs = model, dims, schedule, vp, specs
        self.device = device
        self.group = dims.mesh("pp").get_group()
        self.num_stages = dims.pp * vp
        self.local = stage_indices(dims.pp_rank, dims.pp, vp, schedule)
        self.split = describe_split(specs, dims.pp, schedule, vp)
        self.schedule = None
        self.micro_batches = 0
        self.pending: list[dict[str, torch.Tensor]] = []
        self.shape: tuple[int, ...] | None = None
        # per step, summed over the pipeline ranks: seconds inside the stages' forward/backward, seconds of the
        # whole schedule (the bubble is the rest)
        self.busy_and_total: list[tuple[float, float]] = []
        self._timings_reduced = False
        self._busy = 0.0
        self._ran = False  # the schedule ran since the last optimizer step
        self.tied_group = None  # first and last stage's ranks, whose embedding copies are kept equal

    # ------------------------------------------------------------------ keys every rank reduces
    def sum_names(self, training: bool = True) -> list[str]:
        return self.model.sum_names(training)

    def _reduce_sums(self, names: list[str]) -> dict[str, torch.Tensor]:
        """This rank's stages' sums of the step, summed over the pipeline ranks (float64)."""
        totals = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for stage in self.model.stages:
            for sums in stage.sums:
                for key, value in sums.items():
                    if key in names:  # evaluation reports the main loss only
                        totals[names.index(key)] += value.double()
            stage.sums.clear()
        dist.all_reduce(totals, group=self.group)
        return dict(zip(names, totals))

    # ------------------------------------------------------------------ schedule
    def _build_schedule(self, micro_batches: int) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [PipelineStage(stage, index, self.num_stages, self.device, group=self.group)
                  for index, stage in zip(self.local, self.model.stages)]
        cls = get_schedule_class(SCHEDULES[self.schedule_name])
        try:
            self.schedule = cls(stages[0] if self.schedule_name in SINGLE_STAGE else stages,
                                n_microbatches=micro_batches, loss_fn=_objective, scale_grads=False)
        except ValueError as error:
            raise ValueError(
                f"pp_schedule={self.schedule_name!r} with pp={self.dims.pp}, vp={self.vp} cannot run "
                f"{micro_batches} micro-batches per step ({error}); set global_batch_size so that each "
                f"data-parallel rank gets a number of micro-batches that fits (e.g. a multiple of pp={self.dims.pp}, "
                f"at least pp*vp={self.num_stages})"
            ) from None
        self.micro_batches = micro_batches
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._busy += time.perf_counter() - start

        return timed

    # ------------------------------------------------------------------ training
    def add(self, batch: dict[str, torch.Tensor], micro_batches: int) -> dict[str, torch.Tensor] | None:
        """Keep a micro-batch; with the step's last one, run the schedule and return the step's sums."""
        shape = tuple(batch["input_ids"].shape)
        if self.shape is None:
            self.shape = shape
        elif shape != self.shape:
            raise ValueError(
                f"pipeline parallelism needs micro-batches of one shape (the stages' buffers are sized at the "
                f"first step): got {shape} after {self.shape}; pack rows or pad them to a fixed length "
                f"(seq_length / packed_sequence_size / pad_seq_to_mult)"
            )
        self.pending.append(batch)
        if len(self.pending) < micro_batches:
            return None
        if self.schedule is None:
            check_micro_batches(micro_batches, self.dims.pp)
            self._build_schedule(micro_batches)
            for stage in self.model.stages:
                stage.metadata_pass_pending = True
        elif micro_batches != self.micro_batches:
            raise ValueError(f"the pipeline schedule was built for {self.micro_batches} micro-batches per step, "
                             f"this step has {micro_batches}")
        batches, self.pending = self.pending, []
        layouts = [b.get("layout") for b in batches]
        for stage in self.model.stages:  # each stage's forwards take them in micro-batch order
            stage.layouts = deque(layouts if all(isinstance(x, BatchLayout) for x in layouts) else [])
        whole = {key: torch.cat([b[key] for b in batches]) for key in ("input_ids", "labels", "position_ids")
                 if batches[0].get(key) is not None}
        kwargs = {"token_ids": whole["input_ids"], "labels": whole["labels"]}
        if "position_ids" in whole:
            kwargs["position_ids"] = whole["position_ids"]
        first = any(self.specs[i].embedding for i in self.local)
        last = any(self.specs[i].output for i in self.local)
        for param in self.model.parameters():
            param.grad = None
        self._busy, start = 0.0, time.perf_counter()
        self.schedule.step(*((whole["input_ids"],) if first else ()), target=whole["labels"] if last else None,
                           return_outputs=False, **kwargs)
        if self.tied_group is not None:
            weight = self.model.embed.weight
            if hasattr(weight.grad, "placements") and weight.grad.placements != weight.placements:
                # under tensor parallelism the embedding's backward leaves a replicated gradient of the split weight
                weight.grad = weight.grad.redistribute(placements=weight.placements)
            grad = weight.grad
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.tied_group)
        # this rank's seconds, summed over the pipeline ranks at the end (reduce_timings): no step waits for them
        self.busy_and_total.append((self._busy, time.perf_counter() - start))
        self._ran = True
        sums = self._reduce_sums(self.sum_names())
        sums["tokens"] = torch.full((), float(whole["input_ids"].numel()), dtype=torch.float64, device=self.device)
        return sums

    def reduce_timings(self) -> None:
        """Sum each step's seconds over the pipeline ranks, once, at the end of training (every rank calls it)."""
        if self.busy_and_total and not self._timings_reduced:
            timing = torch.tensor(self.busy_and_total, dtype=torch.float64, device=self.device)
            dist.all_reduce(timing, group=self.group)
            self.busy_and_total = [tuple(row) for row in timing.tolist()]
            self._timings_reduced = True

    def bubble_fraction(self) -> float | None:
        """Measured share of the schedule's time the ranks spent outside their stages' forward and backward
        (waiting), over the steps after the first (which also infers shapes); None before two steps."""
        steps = self.busy_and_total[1:]
        if not steps:
            return None
        return 1.0 - sum(busy for busy, _ in steps) / sum(total for _, total in steps)

    def theoretical_bubble_fraction(self) -> float | None:
        """``(p-1)/(v*m+p-1)``: GPipe, 1F1B (v=1) and the interleaved schedules with equal stages; None for the
        zero-bubble schedules or before the micro-batch count is known."""
        if self.schedule_name in SPLIT_BACKWARD or not self.micro_batches:
            return None
        p, v, m = self.dims.pp, self.vp, self.micro_batches
        return (p - 1) / (v * m + p - 1)

    def summary(self) -> dict:
        """What the run card records about the pipeline."""
        return {"schedule": self.schedule_name, "pp": self.dims.pp, "vp": self.vp, "micro_batches": self.micro_batches,
                "split": self.split, "bubble_fraction": self.bubble_fraction(),
                "bubble_fraction_theoretical": self.theoretical_bubble_fraction()}

    def uncounted_parameters(self) -> list:
        """This rank's copies of weights the first stage's rank counts in the gradient norm (tied embeddings)."""
        if self.tied_group is None or any(self.specs[i].embedding for i in self.local):
            return []
        return list(self.model.embed.parameters())

    def checked(self, closure):
        """Lightning's closure of an optimizer step (its window's last micro-batch), then the check that the
        window ended where the schedule ran, before the gradients are read."""
        def run():
            result = closure()
            self.check_step_complete()
            return result

        return run

    def check_step_complete(self) -> None:
        """Lightning's accumulation window must end where the schedule ran: not the case after resuming a
        checkpoint written with another accumulation count at a batch count the new one does not divide."""
        ran, self._ran = self._ran, False
        if self.pending or not ran:
            raise RuntimeError(
                f"an optimizer step came after {len(self.pending)} of the pipeline's {self.micro_batches or '?'} "
                f"micro-batches: Lightning's accumulation window does not line up with the pipeline schedule "
                f"(resumed from a checkpoint written with another gradient-accumulation count, at a batch count "
                f"that is not a multiple of this run's?); resume from a checkpoint whose batch count is a multiple "
                f"of the micro-batches per step"
            )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward of every stage in order, activations sent point to point; the loss sums of the batch."""
        kwargs = {"token_ids": batch["input_ids"], "labels": batch["labels"]}
        if batch.get("position_ids") is not None:
            kwargs["position_ids"] = batch["position_ids"]
        owner = {i: r for r in range(self.dims.pp) for i in stage_indices(r, self.dims.pp, self.vp, self.schedule_name)}
        me, sends, kept = self.dims.pp_rank, [], None
        for index, stage in sorted(zip(self.local, self.model.stages), key=lambda pair: pair[0]):
            if index == 0:
                inputs = (batch["input_ids"],)
            elif owner[index - 1] == me:  # consecutive stages on one rank (V schedules)
                inputs = kept
            else:
                inputs = self._receive(owner[index - 1])
            out = stage(*inputs, **kwargs)
            if index < self.num_stages - 1:
                if owner[index + 1] == me:
                    kept = out
                else:
                    sends += self._send(out, owner[index + 1])
        for work in sends:
            work.wait()
        return self._reduce_sums(self.sum_names(training=False))

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank)

    def _send(self, tensors: tuple[torch.Tensor, ...], pp_rank: int) -> list:
        peer = self._peer(pp_rank)
        header = torch.tensor([len(tensors), WIRE_DTYPES.index(tensors[0].dtype), *tensors[0].shape], device=self.device)
        works = [dist.isend(header, peer, group=self.group)]
        works += [dist.isend(t.contiguous(), peer, group=self.group) for t in tensors]
        return works

    def _receive(self, pp_rank: int) -> tuple[torch.Tensor, ...]:
        peer = self._peer(pp_rank)
        header = torch.zeros(5, dtype=torch.int64, device=self.device)
        dist.recv(header, peer, group=self.group)
        count, dtype, *shape = header.tolist()
        tensors = tuple(torch.empty(shape, dtype=WIRE_DTYPES[dtype], device=self.device) for _ in range(count))
        for t in tensors:
            dist.recv(t, peer, group=self.group)
        return tensors


def _objective(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # the last stage's forward already returns the micro-batch's objective (loss sums, not means)
    return output
