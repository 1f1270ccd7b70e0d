"""Blocks compiled with ``torch.compile`` (``ParallelStrategy(compile=True)``) train like the eager model: the
same loss and gradients, with and without activation checkpointing inside the compiled blocks, for dense and MoE
blocks (fp32 experts run their grouped GEMM eagerly), under the same parameter names; and under a Trainer."""

from __future__ import annotations

import shutil

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from parallel_cases import initial_state, tiny_config
from torch._dynamo.utils import counters

from lightning_moe import ParallelStrategy
from lightning_moe.data import MockDataModule
from lightning_moe.kernels import kernel_checks
from lightning_moe.models.decoder import Decoder
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig
from lightning_moe.parallel.compile import apply_compile


def packed_batch(vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    positions = torch.cat([torch.arange(10), torch.arange(6)]).expand(2, 16)  # two sequences per row
    labels = torch.randint(0, vocab, (2, 16), generator=gen)
    labels[1, :4] = -100
    return ids, positions, labels


def loss_and_grads(model: Decoder, batch) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(*batch[:2], labels=batch[2])
    loss = out.loss_sum / out.num_label_tokens + (out.aux_loss if out.aux_loss is not None else 0)
    loss.backward()
    return loss.item(), {name: p.grad.float() for name, p in model.named_parameters()}


def compiled_blocks_served() -> bool:
    """The compiled blocks passed their first-use check against the eager blocks, so they, not the eager
    fallback, computed the losses compared here."""
    checks = [c for c in kernel_checks() if c["kernel"] == "compiled block"]
    return bool(checks) and all(c["used"] == "compiled" for c in checks)


def compiled_twin(name: str, dtype: torch.dtype, backend: str, checkpoint: str) -> tuple[Decoder, Decoder]:
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = Decoder(tiny_config(name)), Decoder(tiny_config(name))
    for model in (eager, compiled):
        model.load_state_dict(initial_state(name))
        model.to(dtype)
    blocks = apply_compile(compiled, backend, checkpoint, 2)
    assert blocks == [f"layers.{i}" for i in range(4)]
    return eager, compiled


@pytest.mark.parametrize(("name", "dtype", "checkpoint"), [
    ("llama", torch.float32, "none"), ("llama", torch.float32, "full"), ("llama", torch.float32, "selective"),
    ("qwen3_moe", torch.float32, "full"), ("qwen3_moe", torch.bfloat16, "selective"),
])
def test_compiled_blocks_give_the_eager_loss_and_gradients(name, dtype, checkpoint):
    eager, compiled = compiled_twin(name, dtype, "aot_eager", checkpoint)
    batch = packed_batch()
    for _ in range(2):  # the second pass runs the cached graphs
        loss, grads = loss_and_grads(eager, batch)
        compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
        assert compiled_loss == pytest.approx(loss, rel=1e-6, abs=1e-6)
        for key, grad in grads.items():
            assert torch.allclose(compiled_grads[key], grad, rtol=1e-5, atol=1e-6), key
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert compiled_blocks_served()
    assert list(compiled.state_dict()) == list(eager.state_dict())


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="inductor's CPU code generation needs a C++ compiler")
def test_inductor_compiled_blocks_give_the_eager_loss_and_gradients():
    eager, compiled = compiled_twin("llama", torch.float32, "inductor", "full")
    batch = packed_batch()
    loss, grads = loss_and_grads(eager, batch)
    compiled_loss, compiled_grads = loss_and_grads(compiled, batch)
    assert compiled_loss == pytest.approx(loss, rel=1e-5)
    for key, grad in grads.items():
        assert torch.allclose(compiled_grads[key], grad, rtol=1e-4, atol=1e-6), key
    if not compiled_blocks_served():  # e.g. with AVX2 code (torch 2.13): see lightning_moe/kernels
        pytest.skip(f"inductor's code failed its first-use check on this machine, the eager blocks ran: "
                    f"{[c for c in kernel_checks() if c['status'] != 'ok'][0]}")


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(pl_module.step_stats.loss)


def test_strategy_compiles_the_blocks_of_a_training_run(tmp_path):
    def fit(strategy) -> list[float]:
        torch.manual_seed(0)
        recorder = LossRecorder()
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path, callbacks=[recorder])
        module = CausalLM(model=tiny_config("qwen3_moe"), optimizer=OptimizerConfig(lr=3e-3))
        trainer.fit(module, datamodule=MockDataModule(seq_length=16, micro_batch_size=2, vocab_size=64,
                                                      num_val_samples=0))
        return recorder.losses, module

    torch._dynamo.reset()
    counters.clear()
    expected, _ = fit("auto")
    losses, module = fit(ParallelStrategy(compile=True, compile_backend="aot_eager",
                                          activation_checkpointing="full"))
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was compiled"
    assert "checkpointed_forward" in module.model.layers["0"].forward.__wrapped__.__qualname__
    assert compiled_blocks_served()
    assert losses == pytest.approx(expected, rel=1e-5)
