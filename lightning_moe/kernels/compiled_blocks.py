"""``torch.compile``'d blocks on CPU, run only where their first use matched the eager block.

Inductor generates C++ for the CPU's vector ISA, and that code has been wrong on some CPUs (see ``flex.py``
for one such kernel). A compiled block's first call per (block kind, compile backend, device type, dtype, input shapes,
grad mode) runs the block eagerly and compiled on the same inputs and compares the outputs and, when training,
the gradients of the inputs and of the block's parameters (``torch.autograd.grad``: nothing accumulates into
``.grad``; blocks sharded by FSDP compare outputs only, since a backward inside FSDP's forward reshards). A mismatch or a build failure keeps every block on that device type and dtype eager for the rest of
the process, with one warning. GPU blocks are not checked: Triton code does not depend on the CPU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_flatten, tree_map

from lightning_moe.kernels.checks import is_broken, is_checked, normalized_error, run_check

KERNEL = "compiled block"
FALLBACK = "the eager block"


def block_kind(block: nn.Module) -> str:
    """Blocks of one kind share compiled code: the class and, for decoder blocks, what their op is."""
    op = getattr(block, "op", None)
    if isinstance(op, nn.Module):
        return f"{type(block).__name__}[{getattr(block, 'symbol', '')}:{type(op).__name__}]"
    return type(block).__name__


def guard_compiled_block(block: nn.Module, eager_forward, compiled_forward, backend):
    """``block``'s forward: ``compiled_forward`` (compiled by ``backend``, a name or a backend function) where it
    was checked against ``eager_forward`` on this machine."""
    kind = block_kind(block)
    # one backend's passed check says nothing of another's code (aot_eager generates none, inductor C++)
    backend_name = f"backend={getattr(backend, '__name__', backend)}"

    @functools.wraps(eager_forward)
    def forward(*args, **kwargs):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if _is_float_tensor(t)]
        if not tensors or tensors[0].device.type != "cpu" or torch.compiler.is_compiling():
            return compiled_forward(*args, **kwargs)
        device, dtype = tensors[0].device, tensors[0].dtype
        if is_broken(KERNEL, device, dtype):
            return eager_forward(*args, **kwargs)
        # a backward inside FSDP's forward would run FSDP's end-of-backward callback, which reshards every unit
        # (this block's parameters too) under the real call: blocks with FSDP units are checked forward only
        grad = torch.is_grad_enabled() and not _holds_fsdp_units(block)
        # the arguments' cached state (a layout's masks, filled by the first block of a forward) changes the
        # compiled code: blocks after the first run another variant, checked on its own
        signature = (kind, backend_name, *(f"{tuple(t.shape)}" for t in tensors), *_cached_state(args, kwargs),
                     "forward+backward" if grad else "forward")
        if is_checked(KERNEL, device, dtype, signature) or run_check(
            KERNEL, device, dtype, signature, FALLBACK,
            lambda: _errors(block, eager_forward, compiled_forward, args, kwargs, grad),
        ):
            return compiled_forward(*args, **kwargs)
        return eager_forward(*args, **kwargs)

    return forward


def _holds_fsdp_units(block: nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in block.modules())


def _is_float_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _errors(block, eager_forward, compiled_forward, args, kwargs, grad) -> dict[str, float]:
    # identity saved-tensor hooks: an activation checkpoint around the caller must not capture these graphs
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        args, kwargs = tree_map(
            lambda t: t.detach().requires_grad_(t.requires_grad) if _is_float_tensor(t) else t, (args, kwargs))
        # compiled first, as the block's real first call would run (with emulated AVX2, a compiled checkpointed
        # block's backward failed in inductor's C++ after an eager run of the same block had filled the caches)
        # each run starts from the arguments' and the modules' cached state as the call found it: what a wrong
        # compiled run cached must not reach the eager run, and the real call then runs the variant checked here
        state = _snapshot(args, kwargs) + _module_caches(block)
        got = [t for t in tree_flatten(compiled_forward(*args, **kwargs))[0] if _is_float_tensor(t)]
        _restore(state)
        expected = [t for t in tree_flatten(eager_forward(*args, **kwargs))[0] if _is_float_tensor(t)]
        _restore(state)
        if len(got) != len(expected):
            raise RuntimeError(f"compiled block returned {len(got)} tensors, the eager block {len(expected)}")
        errors = {"out": max(normalized_error(g, e) for g, e in zip(got, expected))}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if _is_float_tensor(t) and t.requires_grad]
        params = [p for p in block.parameters() if p.requires_grad]
        differentiable = [i for i, t in enumerate(expected) if t.requires_grad]
        if grad and differentiable and inputs + params:
            gen = torch.Generator(device=expected[0].device).manual_seed(0)
            weights = [torch.randn(expected[i].shape, generator=gen, device=expected[i].device)
                       for i in differentiable]

            def gradients(outputs):
                objective = sum((outputs[i].float() * w).sum() for i, w in zip(differentiable, weights))
                return torch.autograd.grad(objective, inputs + params, allow_unused=True)

            expected_grads, got_grads = gradients(expected), gradients(got)
            pairs = list(zip(got_grads, expected_grads))
            errors["grad_inputs"] = max((_grad_error(g, e) for g, e in pairs[: len(inputs)]), default=0.0)
            errors["grad_params"] = max((_grad_error(g, e) for g, e in pairs[len(inputs):]), default=0.0)
    return errors


def _stateful(args, kwargs) -> list:
    plain = (torch.Tensor, nn.Module, int, float, bool, str, type(None))
    return [v for v in tree_flatten((args, kwargs))[0] if not isinstance(v, plain) and hasattr(v, "__dict__")]


def _cached_state(args, kwargs) -> list[str]:
    """What each non-tensor argument holds: its attributes, and the keys of its dict attributes (caches)."""
    return [f"{type(obj).__name__}({', '.join(f'{k}={sorted(map(str, v)) if isinstance(v, dict) else type(v).__name__}' for k, v in vars(obj).items())})"
            for obj in _stateful(args, kwargs)]


def _snapshot(args, kwargs) -> list[tuple[object, dict]]:
    return [(obj, {k: dict(v) if isinstance(v, dict) else v for k, v in vars(obj).items()})
            for obj in _stateful(args, kwargs)]


_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _module_caches(block: nn.Module) -> list[tuple[object, dict]]:
    """The dict attributes the block's modules keep beyond nn.Module's own (rotary frequencies per device...):
    a compiled run fills them as a side effect."""
    snapshot = []
    for module in block.modules():
        caches = {k: dict(v) for k, v in vars(module).items() if isinstance(v, dict) and k not in _MODULE_INTERNALS}
        if caches:
            snapshot.append((module, caches))
    return snapshot


def _restore(snapshot) -> None:
    for obj, state in snapshot:
        current = vars(obj)
        if not isinstance(obj, nn.Module):  # a module's snapshot holds only its caches
            for key in set(current) - set(state):
                del current[key]
        for key, value in state.items():
            if isinstance(value, dict) and isinstance(current.get(key), dict):
                current[key].clear()  # the same dict object: compiled code guards on it
                current[key].update(value)
            else:
                current[key] = value


def _grad_error(got, expected) -> float:
    if got is None or expected is None:
        return 0.0 if got is None and expected is None else float("inf")
    return normalized_error(got, expected)
