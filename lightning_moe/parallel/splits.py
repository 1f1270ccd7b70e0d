"""Whether a step has the micro-batches its pipeline stages need."""

from __future__ import annotations


def check_micro_batches(micro_batches: int, pp: int) -> None:
    """Refuse, before the first step, a micro-batch count the pipeline cannot fill."""
    if micro_batches < pp:
        raise ValueError(
            f"pp={pp} pipeline stages need at least {pp} micro-batches per step, got {micro_batches} "
            f"(global_batch_size / (micro_batch_size x data-parallel size)); raise global_batch_size to at least "
            f"{pp} x micro_batch_size x data-parallel size"
        )
