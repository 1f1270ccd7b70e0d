"""Output layer fused with cross entropy, chunked over tokens.

Full-vocabulary fp32 logits for a whole batch are the largest activation of a small-hidden, large-vocab
model. Here logits exist for one chunk of tokens at a time; their gradient is computed in the same pass
(cross entropy is the last op), so backward is a scale and no logits are kept or recomputed. Tokens
without a label are skipped entirely.

Labels are already shifted (``labels[t]`` is the target of position ``t``); -100 means no loss.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_moe.models.layers.upcast import upcast, upcast_dtype

IGNORE_INDEX = -100


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when it is on (bf16-mixed), else the input's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                vocab_group=None, vocab_start: int = 0, grad_enabled: bool = True, repeatable: bool = False):
        # ``needs_input_grad`` only says whether inputs require grad, also under no_grad (evaluation): the
        # caller's grad mode, which forward cannot see, decides whether gradients are worth computing
        need_hidden_grad = grad_enabled and ctx.needs_input_grad[0]
        need_weight_grad = grad_enabled and ctx.needs_input_grad[1]
        dtype = _compute_dtype(hidden)
        acc = upcast_dtype(dtype)  # fp32 softmax and sums, float64 for a float64 model
        loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.zeros_like(hidden) if need_hidden_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight_grad else None
        # cast once, not once per chunk and matmul as autocast would
        with torch.autocast(hidden.device.type, enabled=False):
            weight_c, hidden_c = weight.to(dtype), hidden.to(dtype)
            # one set of chunk buffers reused by every chunk: a fresh [chunk, vocab] tensor per chunk costs
            # more in page faults than the elementwise work done on it (CPU)
            rows_max = min(chunk_size, hidden.shape[0])
            logits_buf = hidden.new_empty(rows_max, weight.shape[0], dtype=dtype)
            fp32_buf = logits_buf if dtype == acc else torch.empty_like(logits_buf, dtype=acc)
            weight_grad_buf = None
            if need_weight_grad and dtype != acc:
                weight_grad_buf = torch.empty(weight.shape, dtype=dtype, device=weight.device)
            for start in range(0, hidden.shape[0], chunk_size):
                h = hidden_c[start : start + chunk_size]
                y = labels[start : start + chunk_size]
                logits = torch.mm(h, weight_c.t(), out=logits_buf[: h.shape[0]])
                log_probs = fp32_buf[: h.shape[0]]
                if log_probs is not logits:
                    log_probs.copy_(logits)
                rows = torch.arange(y.shape[0], device=y.device)
                if vocab_group is None:
                    cols, hit = y, 1.0
                    torch.log_softmax(log_probs, dim=-1, out=log_probs)
                    loss_sum -= log_probs[rows, cols].sum()
                else:
                    lse, target, cols, hit = _vocab_parallel_statistics(log_probs, y, vocab_group, vocab_start)
                    loss_sum += (lse - target).sum()
                    log_probs.sub_(lse[:, None])
                if not (need_hidden_grad or need_weight_grad):
                    continue
                # softmax minus one-hot, in the matmul dtype (the exponential is taken in fp32, in place)
                grad_logits = log_probs.exp_()
                grad_logits[rows, cols] -= hit
                if grad_logits is not logits:
                    grad_logits = logits.copy_(grad_logits)
                if need_hidden_grad:
                    rows_grad = grad_hidden[start : start + chunk_size]
                    if rows_grad.dtype == dtype:
                        torch.mm(grad_logits, weight_c, out=rows_grad)
                    else:  # bf16-mixed: fp32 hidden states, bf16 matmul
                        rows_grad.copy_(grad_logits @ weight_c)
                if need_weight_grad:
                    if weight_grad_buf is None:
                        # accumulate in place (the out= form, which FLOP counters see, unlike addmm_)
                        torch.addmm(grad_weight, grad_logits.t(), h, out=grad_weight)
                    else:
                        _add_upcast_(grad_weight, torch.mm(grad_logits.t(), h, out=weight_grad_buf))
        # the gradients are results, not inputs: kept on ctx and handed over once, so backward can scale them in
        # place (a second [vocab, hidden] copy at the moment activation memory peaks is what it saves)
        ctx.gradients = (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.repeatable = repeatable
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.gradients is None:
            raise RuntimeError("backward through the fused output layer and loss a second time: its gradients "
                               "were handed over by the first backward (retain_graph is not supported here)")
        grad_hidden, grad_weight = ctx.gradients
        if ctx.repeatable:
            # backward in two passes (input gradients, then weight gradients: zero-bubble pipeline schedules):
            # the gradients stay on ctx, each pass gets scaled copies
            grad_hidden, grad_weight = (None if g is None else g * grad_loss.to(g.dtype) for g in ctx.gradients)
            return grad_hidden, grad_weight, None, None, None, None, None, None
        ctx.gradients = None
        for grad in (grad_hidden, grad_weight):
            if grad is not None:
                grad.mul_(grad_loss.to(grad.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _add_upcast_(accumulator: torch.Tensor, update: torch.Tensor, rows_per_block: int = 2048) -> None:
    """``accumulator += update`` for an fp32 accumulator and a low-precision update. On CPU a mixed-dtype add
    runs a scalar casting loop (several times slower than the GEMM that made ``update``); blocks of rows upcast
    first stay in cache and take the vectorized path."""
    if accumulator.device.type != "cpu":
        accumulator += update
        return
    for start in range(0, accumulator.shape[0], rows_per_block):
        accumulator[start : start + rows_per_block] += update[start : start + rows_per_block].to(accumulator.dtype)


def _vocab_parallel_statistics(logits: torch.Tensor, labels: torch.Tensor, vocab_group, vocab_start: int):
    """Log-sum-exp and target logit of each row, the column of its target in ``logits`` and whether this rank owns
    it (1/0 in the logits' dtype), when the columns are this rank's slice of a vocabulary split over
    ``vocab_group`` (tensor parallelism, as in Megatron): max and sum of exponentials are all-reduced, and the
    target logit comes from the rank that owns it. Every row keeps its place (no ``nonzero``: no host sync)."""
    import torch.distributed as dist

    local = labels - vocab_start
    owned = (local >= 0) & (local < logits.shape[1])
    row_max = logits.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=vocab_group)
    cols = local.clamp(0, logits.shape[1] - 1)
    target = logits.gather(1, cols[:, None]).squeeze(1)
    sums = torch.stack([torch.exp(logits - row_max[:, None]).sum(dim=-1), torch.where(owned, target, 0.0)])
    dist.all_reduce(sums, group=vocab_group)
    return row_max + torch.log(sums[0]), sums[1], cols, owned.to(logits.dtype)


def labelled_rows(labels: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` entries of 1-d ``labels`` that carry a label, in order, without reading the device
    (``nonzero`` would: its size depends on the values): each labelled entry is scattered to its rank among them,
    the others to a spare slot past the end."""
    keep = labels != IGNORE_INDEX
    rank = torch.cumsum(keep, dim=0) - 1
    slots = torch.where(keep, rank, count)
    index = torch.empty(count + 1, dtype=torch.long, device=labels.device)
    index.scatter_(0, slots, torch.arange(labels.numel(), device=labels.device))
    return index[:count]


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024,
    vocab_group=None, vocab_start: int = 0, repeatable_backward: bool = False, label_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropy losses of ``hidden @ weight.T`` against ``labels``, and the label count.

    ``hidden`` [..., H], ``weight`` [V, H], ``labels`` [...] with -100 for no loss. Returns fp32
    ``(loss_sum, num_label_tokens)``; divide by the *global* label count to get the mean.

    Vocabulary-parallel (tensor parallelism): ``weight`` holds rows ``vocab_start ...`` of a vocabulary split
    over ``vocab_group`` and every rank passes the same ``hidden`` and ``labels``. The loss is the
    full-vocabulary loss on every rank; the gradient of ``hidden`` is this rank's share, to be summed over
    the group by the caller.

    ``repeatable_backward``: the backward may run more than once over the same graph (costs a copy of the
    gradients). ``label_count``: how many of ``labels`` carry a label, known on the host (the batch's layout);
    without it the labelled rows are found by ``nonzero``, a host sync on a GPU.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if label_count is None:
        keep = torch.nonzero(labels != IGNORE_INDEX, as_tuple=True)[0]
        label_count = keep.numel()
    elif label_count < labels.numel():
        keep = labelled_rows(labels, label_count)
    if label_count == 0:
        # keep the graph connected so every rank runs the same backward
        return upcast(hidden.sum() + weight.sum()) * 0.0, torch.zeros((), dtype=torch.long, device=hidden.device)
    if label_count < labels.numel():
        hidden, labels = hidden.index_select(0, keep), labels.index_select(0, keep)
    loss_sum = _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size, vocab_group, vocab_start,
                                         torch.is_grad_enabled(), repeatable_backward)
    # a fill kernel, not torch.tensor(): a host-to-device copy would wait for the device
    return loss_sum, torch.full((), label_count, dtype=torch.long, device=hidden.device)


class OutputLayer:
    """How the decoder meets its output weight: logits, or the loss fused with the output GEMM. Tensor
    parallelism gives the decoder a vocabulary-parallel version of the same two methods
    (``lightning_moe/parallel/tensor.py``). ``repeatable_backward``: see :func:`linear_cross_entropy`."""

    repeatable_backward = False

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, weight)

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
             label_count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_cross_entropy(hidden, weight, labels, chunk_size, repeatable_backward=self.repeatable_backward,
                                    label_count=label_count)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain (unfused) summed cross entropy over already-computed logits, in fp32 (float64 for float64)."""
    return torch.nn.functional.cross_entropy(
        upcast(logits.reshape(-1, logits.shape[-1])), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def vocab_parallel_loss(hidden: torch.Tensor, weight, labels: torch.Tensor,
                        chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused cross entropy of replicated ``hidden`` against an output weight split by vocabulary rows (a DTensor):
    local logits, all-reduced softmax statistics; each rank's ``hidden`` gradient covers its rows only, so the
    backward sums them over the tensor-parallel ranks."""
    mesh = weight.device_mesh
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return linear_cross_entropy(hidden, weight.to_local(), labels, chunk_size, vocab_group=mesh.get_group(),
                                vocab_start=offset[0])
