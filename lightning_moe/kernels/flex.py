"""Compiled ``flex_attention``, run only where its first use on this machine computed the right values.

Why the check exists (remove it when torch is fixed): with torch 2.13.0+cpu, inductor's C++ flex-attention
kernel for a document (block-diagonal causal) mask is wrong when generated for AVX2 (CPUs without AVX-512, or
``ATEN_CPU_CAPABILITY=avx2`` on one that has it): normalized max error ~1 against SDPA with the same mask in about
half of fresh runs at 24 tokens (the error depends on memory state: an out-of-bounds or uninitialized read),
while the AVX-512 code and eager ``flex_attention`` are right; at some shapes its generated C++ does not compile
(``'cur_qSplitSize8' was not declared in this scope``, reported on an AVX2-only EPYC). Packed rows then leak
across (or drop) their samples without an error. A check can pass by luck and the kernel fail later: the check
lowers the risk, it cannot remove it; on AVX2-only CPUs prefer ``attention: sdpa``. Minimal repro (no upstream issue found at the time of writing; run it with a compile cache of
its own, since inductor's FX graph cache key does not include the vector ISA and AVX-512 runs would later load
the AVX2 code)::

    ATEN_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python -c "
    import torch; from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    S = 24; docs = torch.cat([torch.full((n,), i) for i, n in enumerate([8, 12, 4])])[None]
    mask = lambda b, h, q, kv: (q >= kv) & (docs[b, q] == docs[b, kv])
    bm = create_block_mask(mask, 1, None, S, S, device='cpu')
    q, k, v = (torch.randn(1, 4, S, 16) for _ in range(3))
    dense = torch.tril(torch.ones(S, S, dtype=torch.bool)) & (docs[0][:, None] == docs[0][None])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=bm)
    print((out - ref).abs().max())  # ~2 in about half the runs with avx2, ~3e-7 with avx512
    "

The check (once per device type, dtype, shapes, mask kind and grad mode: each is its own compiled kernel)
runs the compiled kernel on the call's own inputs, forward and backward, and compares a sample of query rows
with an fp32 reference from the layout's dense mask (which does not go through the block mask). On a mismatch
or a build failure the caller is told to use SDPA with the dense mask instead (see ``attention.attend``).
"""

from __future__ import annotations

import torch

from lightning_moe.kernels.checks import is_broken, is_checked, normalized_error, run_check

KERNEL = "flex_attention"
FALLBACK = "sdpa with the same mask"
SAMPLED_ROWS = 32  # query rows compared with the reference: enough to cross every document boundary class

_compiled = None


def compiled_flex_attention():
    """torch's flex_attention, compiled once per process (run eagerly it materializes the full scores)."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def run_flex(q, k, v, block_mask, scale: float, lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compiled flex attention with GQA; ``lse``: also the rows' log-sum-exp (natural log)."""
    kernel = compiled_flex_attention()
    if not lse:
        return kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True), None
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def flex_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, window: int | None, scale: float,
                lse: bool) -> bool:
    """Whether the compiled kernel may serve this call; checks it first if this signature is new.

    ``layout``: a SequenceLayout (or context-parallel row) giving ``block_mask(window)`` and
    ``dense_mask(window, force=True)`` of the same rule."""
    if is_broken(KERNEL, q.device, q.dtype):
        return False
    if torch.compiler.is_compiling():
        return True  # traced into a compiled block: that block's own check compares it with the eager block
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    signature = (f"q {tuple(q.shape)}", f"k {tuple(k.shape)}", f"v {tuple(v.shape)}",
                 f"{type(layout).__name__}(packed={getattr(layout, 'packed', True)}, window={window})",
                 "lse" if lse else "no lse", "forward+backward" if grad else "forward")
    if is_checked(KERNEL, q.device, q.dtype, signature):
        return True
    return run_check(KERNEL, q.device, q.dtype, signature, FALLBACK,
                     lambda: _errors(q, k, v, layout, window, scale, lse, grad))


def _errors(q, k, v, layout, window, scale, lse, grad) -> dict[str, float]:
    # identity saved-tensor hooks: an activation checkpoint around the caller must not capture this graph
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.set_grad_enabled(grad):
        inputs = [t.detach().requires_grad_(grad and t.requires_grad) for t in (q, k, v)]
        out, out_lse = run_flex(*inputs, layout.block_mask(window), scale, lse)
        rows = torch.linspace(0, q.shape[2] - 1, min(q.shape[2], SAMPLED_ROWS), device=q.device).round().long()
        leaves = [t.detach().float().requires_grad_(x.requires_grad) for t, x in zip((q, k, v), inputs)]
        ref, ref_lse = _reference_rows(*leaves, layout.dense_mask(window, force=True), scale, rows)
        errors = {"out": normalized_error(out[:, :, rows], ref)}
        if lse:
            errors["lse"] = normalized_error(out_lse[:, :, rows], ref_lse)
        wants = [i for i, x in enumerate(inputs) if x.requires_grad]
        if wants:
            gen = torch.Generator(device=q.device).manual_seed(0)
            weights = torch.randn(ref.shape, generator=gen, device=q.device)
            lse_weights = torch.randn(ref_lse.shape, generator=gen, device=q.device)

            def objective(o, o_lse):
                return (o.float() * weights).sum() + ((o_lse.float() * lse_weights).sum() if lse else 0)

            got = torch.autograd.grad(objective(out[:, :, rows], out_lse[:, :, rows] if lse else None),
                                      [inputs[i] for i in wants])
            expected = torch.autograd.grad(objective(ref, ref_lse), [leaves[i] for i in wants])
            for i, g, e in zip(wants, got, expected):
                if i == 0:  # only the sampled query rows have a gradient
                    g, e = g[:, :, rows], e[:, :, rows]
                errors[f"grad_{'qkv'[i]}"] = normalized_error(g, e)
    return errors


def _reference_rows(q, k, v, mask, scale, rows):
    """fp32 attention output and log-sum-exp of query ``rows`` only (cost: rows x keys)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q[:, :, rows], k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, :, rows], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)
