"""CausalLM: global-batch token loss, pretrained starts, resume, scheduler."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from tiny_hf import build_tiny

from lightning_moe.data import MockDataModule, SFTDataModule
from lightning_moe.models.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig
from lightning_moe.modules.causal_lm import CausalLM, build_decoder
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig, lr_factor

TOKENIZER = "data/tokenizer"


def tiny_moe(vocab: int = 4160) -> ModelConfig:
    return ModelConfig(
        family="qwen3_moe", vocab_size=vocab, hidden_size=64, pattern="*E*-",
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
        mlp=MLPConfig(96), moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32, aux_loss_coeff=0.01),
    )


def trainer(tmp_path, max_steps, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                    limit_val_batches=0)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


class GradientProbe(CausalLM):
    """Records the gradients the optimizer would see (after normalization, before clipping)."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.seen_grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def test_step_loss_is_sum_over_label_tokens_of_the_global_batch(tmp_path):
    """Packed SFT micro-batches carry different label counts: the step gradient must be that of
    sum(token losses) / sum(label tokens), not a mean of per-micro-batch means."""
    def data():
        return SFTDataModule(tokenizer=TOKENIZER, dataset="data/tulu3_sample.jsonl", preset="tulu3",
                             packed_sequence_size=256, micro_batch_size=1, global_batch_size=4,
                             cache_dir=str(tmp_path / "cache"))

    module = GradientProbe(model=tiny_moe(), optimizer=OptimizerConfig(lr=0.0))
    t = trainer(tmp_path, max_steps=1)
    t.fit(module, datamodule=data())
    assert t.accumulate_grad_batches == 4

    # reference: the same initial weights, the same four micro-batches, one plain backward
    model = build_decoder(tiny_moe(), seed=module.seed)
    dm = data()
    dm.trainer = trainer(tmp_path, max_steps=1)
    dm.setup("fit")
    batches = [b for _, b in zip(range(4), dm.train_dataloader())]
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    assert len(set(counts)) > 1, "the test needs micro-batches with different label counts"
    total, aux = 0.0, 0.0
    for b in batches:
        out = model(b["input_ids"], b["position_ids"], labels=b["labels"])
        total = total + out.loss_sum
        aux = aux + out.aux_loss * out.num_label_tokens
    ((total + aux) / sum(counts)).backward()
    for name, param in model.named_parameters():
        assert torch.allclose(module.seen_grads[name], param.grad, rtol=1e-4, atol=1e-7), name
    assert math.isclose(module.step_stats.loss, total.item() / sum(counts), rel_tol=1e-5)
    assert module.step_stats.label_tokens == sum(counts)


def test_mtp_loss_scale_weighs_the_mean_over_depths(tmp_path):
    """Megatron's mtp_loss_scaling_factor (DeepSeek-V3's lambda): with D depths each weighs scale / D."""
    from lightning_moe.models.config import MTPConfig

    class BatchProbe(GradientProbe):
        def training_step(self, batch, batch_idx):
            self.batch = batch
            return super().training_step(batch, batch_idx)

    config = tiny_moe(vocab=256)
    config.mtp = MTPConfig(num_layers=2, pattern="*-", loss_scale=0.3)
    module = BatchProbe(model=config, optimizer=OptimizerConfig(lr=0.0))
    trainer(tmp_path, max_steps=1).fit(module, datamodule=MockDataModule(seq_length=16, micro_batch_size=2,
                                                                          vocab_size=256, num_val_samples=0))
    model = build_decoder(config, seed=module.seed)
    batch = module.batch
    out = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
    assert len(out.mtp_loss_sums) == 2
    objective = out.loss_sum + 0.3 / 2 * sum(out.mtp_loss_sums) + out.aux_loss * out.num_label_tokens
    (objective / out.num_label_tokens).backward()
    for name, param in model.named_parameters():
        assert torch.allclose(module.seen_grads[name], param.grad, rtol=1e-4, atol=1e-7), name


def test_pretrained_start_matches_transformers_loss(tmp_path):
    hf = build_tiny("qwen3")
    hf.save_pretrained(tmp_path / "hf")
    dm = MockDataModule(seq_length=16, micro_batch_size=2, vocab_size=160, num_val_samples=0)
    module = CausalLM(pretrained=str(tmp_path / "hf"), optimizer=OptimizerConfig(lr=0.0))
    trainer(tmp_path, max_steps=1).fit(module, datamodule=dm)
    dm2 = MockDataModule(seq_length=16, micro_batch_size=2, vocab_size=160, num_val_samples=0)
    dm2.trainer = trainer(tmp_path, max_steps=1)
    batch = next(iter(dm2.train_dataloader()))
    with torch.no_grad():
        logits = hf(batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 160), batch["labels"].reshape(-1))
    assert math.isclose(module.step_stats.loss, expected.item(), rel_tol=1e-5)


def test_bad_pretrained_paths_fail_before_training(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer(tmp_path, max_steps=1).fit(
            CausalLM(pretrained=str(tmp_path / "missing")), datamodule=MockDataModule(seq_length=8, vocab_size=160)
        )
    build_tiny("llama").save_pretrained(tmp_path / "hf")
    wrong = tiny_moe(vocab=160)
    wrong.family, wrong.pattern, wrong.moe, wrong.mlp = "llama", "*-*-", None, MLPConfig(80)
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \(96, 64\), the model has \(80, 64\)"):
        trainer(tmp_path, max_steps=1).fit(
            CausalLM(model=wrong, pretrained=str(tmp_path / "hf")), datamodule=MockDataModule(seq_length=8, vocab_size=160)
        )


class LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = pl_module.step_stats
        if stats is not None and (not self.losses or self.losses[-1][0] != stats.step):
            self.losses.append((stats.step, stats.loss))


def test_resume_gives_identical_per_step_losses(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(steps, ckpt_path=None, checkpoints=False):
        recorder = LossRecorder()
        callbacks = [recorder]
        if checkpoints:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1))
        t = trainer(tmp_path, steps, callbacks=callbacks, enable_checkpointing=checkpoints)
        module = CausalLM(model=tiny_moe(vocab=256), optimizer=OptimizerConfig(lr=3e-3),
                          scheduler=SchedulerConfig(warmup_iters=3))
        dm = MockDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=256, num_val_samples=0)
        t.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return [loss for _, loss in recorder.losses]

    full = run(10, checkpoints=True)
    assert len(full) == 10
    ckpt = next((tmp_path / "ckpt").glob("*step=5.ckpt"))
    resumed = run(10, ckpt_path=str(ckpt))
    assert resumed == full[5:]


def test_weight_decay_skips_norms_and_biases_including_stacked_expert_biases():
    from lightning_moe.modules.optim import build_adamw

    config = tiny_moe(vocab=256)
    config.attention.qkv_bias, config.moe.expert_bias = True, True
    model = build_decoder(config)
    optimizer = build_adamw(model, OptimizerConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for group in optimizer.param_groups if group["weight_decay"] > 0 for p in group["params"]}
    assert "layers.1.moe.experts.up_proj" in decayed and "layers.0.attn.q_proj.weight" in decayed
    assert not any(name.endswith(("bias", "norm.weight")) for name in decayed), sorted(decayed)
    assert {"layers.1.moe.experts.up_bias", "layers.0.attn.q_proj.bias"} <= set(names.values()) - decayed


def test_warmup_cosine_schedule_follows_megatron():
    cfg = SchedulerConfig(warmup_iters=10, lr_decay_iters=110, min_lr=1e-5)
    lr = 1e-3
    assert lr_factor(0, cfg, lr, 0) * lr == pytest.approx(1e-4)
    assert lr_factor(9, cfg, lr, 0) * lr == pytest.approx(1e-3)
    # halfway through the decay the cosine is at its midpoint
    assert lr_factor(60, cfg, lr, 0) * lr == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))
    assert lr_factor(110, cfg, lr, 0) * lr == pytest.approx(1e-5)
    assert lr_factor(500, cfg, lr, 0) * lr == pytest.approx(1e-5)
    linear = SchedulerConfig(warmup_iters=0, lr_decay_iters=100, min_lr=0.0, decay_style="linear")
    assert lr_factor(25, linear, lr, 0) == pytest.approx(0.75)
