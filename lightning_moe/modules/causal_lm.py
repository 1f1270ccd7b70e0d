"""``CausalLM``: pretraining, SFT and LoRA of a native decoder under Lightning.

The loss of an optimizer step is the sum of token losses divided by the label tokens of the *whole global
batch* (all micro-batches and data-parallel ranks), Megatron's per-token loss. Each micro-batch backpropagates
its raw loss sum; once the step's micro-batches are done, the global label count is all-reduced once and
every gradient is rescaled before clipping. This is exact for packed SFT, where micro-batches and ranks
carry very different numbers of label tokens.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
import torch.distributed as dist

from lightning_moe.checkpoint.load import copy_tensors_into
from lightning_moe.checkpoint.source import open_checkpoint
from lightning_moe.data.tokenizer import load_tokenizer, tokenizer_files
from lightning_moe.models.build import build_model, to_empty
from lightning_moe.models.config import (
    AttentionConfig,
    MambaConfig,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    RopeConfig,
)
from lightning_moe.models.converters import apply_converters
from lightning_moe.models.decoder import Decoder, LossOutput
from lightning_moe.models.generation import new_tokens
from lightning_moe.models.hf import (
    HFModel,
    HFModelConfig,
    apply_native_settings,
    build_hf_model,
    hf_converters,
    model_dir,
    native_checkpoint_dir,
    refuse_native_settings,
)
from lightning_moe.models.hf_experts import update_correction_biases
from lightning_moe.models.hf_form import native_as_transformers
from lightning_moe.models.layers.moe import MoE, update_expert_bias
from lightning_moe.modules.clipping import clip_gradients
from lightning_moe.modules.optim import (
    OptimizerConfig,
    SchedulerConfig,
    build_adamw,
    build_scheduler,
    check_finite,
)
from lightning_moe.modules.rng import gather_rng_states, restore_rng_states
from lightning_moe.modules.step_metrics import (
    UNLOGGED,
    StepMetrics,
    logging_step,
    step_stats_of,
)
from lightning_moe.modules.step_stats import StepStats
from lightning_moe.parallel.grad_norm import scale_gradients
from lightning_moe.peft import (
    LoraConfig,
    keep_checkpoints_adapter_only,
    load_hf_adapter,
    merged_state_dict,
)
from lightning_moe.precision import Float8Config
from lightning_moe.precision.fp8 import precompute_fsdp_float8_scales
from lightning_moe.seeds import seed_in_force

DEFAULT_SEED = 0  # of the weights, without a recipe seed or seed_everything
TOKENIZER_KEY = "tokenizer_files"  # the run's tokenizer files in its checkpoints

# evaluation losses are all-reduced over the loss group before they are logged (_log_eval): Lightning's advice to
# log them with sync_dist does not apply
warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('(val|test)/(loss|ppl)'")


def build_decoder(config: ModelConfig, *, seed: int = 0, source=None, parallelize=None,
                  device: torch.device | str = "cpu", fp8: Float8Config | None = None,
                  peft: LoraConfig | None = None, freeze: list[str] | None = None) -> Decoder:
    """``build_model`` of a ``Decoder``: converters (FP8, LoRA, freezing), ``parallelize``, initialization from
    ``seed``, the weights of ``source`` (a checkpoint; each rank only its shards) when given; then the starting
    adapter, if any."""
    def construct() -> Decoder:
        with torch.device("meta"):
            return Decoder(config)

    model = build_model(
        construct, materialize=to_empty, device=device, seed=seed,
        convert=lambda m: apply_converters(m, fp8, peft, freeze), parallelize=parallelize,
        initialize=lambda m: m.init_weights(seed),
        load=None if source is None else lambda m: copy_tensors_into(
            m, ((name, t) for name, t in source.iter_native() if name not in m.held_elsewhere)),
    )
    if peft is not None and peft.adapter_path is not None:
        if model.held_elsewhere:
            raise ValueError("peft.adapter_path with pp > 1: starting adapters are read into unpipelined models only")
        load_hf_adapter(model, Path(peft.adapter_path).expanduser(), hf_config=getattr(source, "hf_config", None))
    return model


class CausalLM(L.LightningModule):
    """A causal language model trained on ``{input_ids, labels (pre-shifted), position_ids}`` batches.

    Args:
        model: the architecture; optional when ``pretrained`` is given (its config is used). An
            :class:`HFModelConfig` (``{hf: <dir or hub id>, ...}``) trains a Hugging Face checkpoint: natively
            when its architecture has a native family (``native: auto``), else as the transformers model itself.
        pretrained: a Hugging Face model directory or hub id (as ``model.hf``; local paths are looked at first), or
            a checkpoint written by ``lightning-moe convert import``. A missing path, or one whose tensors do not
            match ``model``, is an error, never a random start.
        optimizer: AdamW settings.
        scheduler: warmup + decay settings.
        mtp_loss_scale: weight of the multi-token-prediction loss, the mean over its depths (default:
            ``model.mtp.loss_scale``); Megatron's ``mtp_loss_scaling_factor``, DeepSeek-V3's lambda.
        seed: seed of the weight initialization (every rank uses the same one); default: the ``seed_everything``
            seed, else 0.
        fp8: FP8 / MXFP8 training of linear layers (and MXFP8 expert GEMMs); emulated where no hardware runs it.
        peft: LoRA adapters; only they train, and checkpoints hold only them (plus buffers).
        freeze: regular expressions of parameter names to keep frozen (full fine-tuning).
    """

    hf_task = "causal-lm"  # which transformers auto class builds an HFModelConfig model

    def __init__(
        self,
        model: ModelConfig | HFModelConfig | None = None,
        pretrained: str | None = None,
        optimizer: OptimizerConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        mtp_loss_scale: float | None = None,
        seed: int | None = None,
        fp8: Float8Config | None = None,
        peft: LoraConfig | None = None,
        freeze: list[str] | None = None,
    ) -> None:
        super().__init__()
        if model is None and pretrained is None:
            raise ValueError("CausalLM needs `model` (a ModelConfig) or `pretrained` (a checkpoint directory)")
        if isinstance(model, HFModelConfig) and pretrained is not None:
            raise ValueError("model.hf already names the checkpoint to start from; drop `pretrained`")
        self.save_hyperparameters()
        self.model_config = model
        self.pretrained = pretrained
        self.optimizer_config = optimizer or OptimizerConfig()
        self.scheduler_config = scheduler or SchedulerConfig()
        if mtp_loss_scale is not None:
            check_finite("model", mtp_loss_scale=mtp_loss_scale)
        self.mtp_loss_scale = mtp_loss_scale
        self.own_seed = seed
        self.seed = seed_in_force(seed, DEFAULT_SEED)  # settled again in setup, once every rank is up
        self.fp8, self.peft, self.freeze = fp8, peft, freeze
        if peft is not None:
            # LoRA checkpoints hold no frozen weights: they come from ``pretrained`` on resume
            keep_checkpoints_adapter_only(self)
        self.model: Decoder | HFModel | None = None
        self._step_stats: StepStats | None = None
        self._source = None
        self._native_settings: HFModelConfig | None = None  # an HFModelConfig routed to the native path
        self._step_sums: dict[str, torch.Tensor] = {}
        self.step_metrics = StepMetrics()  # each step's loss, norms and counts, read back every log_every_n_steps
        self._eval_sums: dict[str, torch.Tensor] = {}
        self._tokenizer_cache: dict[str, bytes] | None = None
        self._generator: torch.nn.Module | None = None  # the transformers form that predict_step samples from

    # ------------------------------------------------------------------ model construction
    def _checkpoint(self):
        if self._source is None and self.pretrained is not None:
            self._source = open_checkpoint(model_dir(self.pretrained, "pretrained"))
        return self._source

    def _route_hf(self) -> None:
        """An ``HFModelConfig`` whose architecture has a native family becomes ``pretrained`` (native path);
        any other stays and is built through transformers."""
        if not isinstance(self.model_config, HFModelConfig):
            return

        directory = native_checkpoint_dir(self.model_config)
        if directory is not None:
            self._native_settings = self.model_config
            self.model_config, self.pretrained = None, str(directory)
        else:
            refuse_native_settings(self.model_config)

    def resolved_config(self) -> ModelConfig:
        """The native model's config: ``model``, or the checkpoint's, with this module's ``mtp_loss_scale``."""
        self._route_hf()
        source = self._checkpoint()
        config = self.model_config
        if config is None:
            config = source.config
            if self._native_settings is not None:
                apply_native_settings(self._native_settings, config, f"the checkpoint {self.pretrained}")
        if self.mtp_loss_scale is not None and config.mtp is not None:
            config = dataclasses.replace(config, mtp=dataclasses.replace(config.mtp, loss_scale=self.mtp_loss_scale))
        return config

    def setup(self, stage: str) -> None:
        self.seed = seed_in_force(self.own_seed, DEFAULT_SEED, self.trainer)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self._trainer is None:  # Lightning's load_from_checkpoint: the model for inference, on one process
            self.model = self.build_inference_model()
            return
        strategy = self.trainer.strategy
        self._route_hf()
        if isinstance(self.model_config, HFModelConfig):
            self.model = self._build_hf(strategy)
        else:
            self.model = build_decoder(
                self.resolved_config(), seed=self.seed, source=self._checkpoint(),
                parallelize=getattr(strategy, "parallelize", None), device=strategy.root_device,
                fp8=self.fp8, peft=self.peft, freeze=self.freeze,
            )

    def on_fit_start(self) -> None:
        # token ids past the embedding end in an IndexError deep in the first step; name them now
        vocab_size = getattr(getattr(self.model, "config", None), "vocab_size", None)
        data = self.trainer.datamodule
        if vocab_size is not None and hasattr(data, "check_vocabulary"):
            data.check_vocabulary(int(vocab_size))

    def _check_hf_adapters(self) -> None:
        if self.peft is not None and self.peft.adapter_path is not None:
            raise ValueError("peft.adapter_path: starting adapters are read into native models only; "
                             "drop it for a model trained through transformers (model.hf)")

    def _build_hf(self, strategy) -> HFModel:
        self._check_hf_adapters()
        return build_hf_model(
            self.model_config, task=self.hf_task, convert=hf_converters(self.fp8, self.peft, self.freeze),
            parallelize=getattr(strategy, "parallelize", None), device=strategy.root_device, seed=self.seed,
        )

    # ------------------------------------------------------------------ distributed bookkeeping
    def _loss_group(self):
        """Ranks whose label tokens share one normalization: data-parallel x context-parallel."""
        strategy = self.trainer.strategy
        if hasattr(strategy, "loss_reduction_group"):
            return strategy.loss_reduction_group
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self._loss_group()
        if group is not None:
            dist.all_reduce(tensor, group=group)
        return tensor

    def _reduction_size(self) -> int:
        group = self._loss_group()
        return dist.get_world_size(group) if group is not None else 1

    # ------------------------------------------------------------------ steps
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, position_ids)

    def _loss_output(self, batch: dict[str, torch.Tensor]) -> tuple[LossOutput, int]:
        """The loss sums of this rank's part of the batch, and how many tokens that part holds."""
        shard = getattr(self.trainer.strategy, "shard_batch", None)
        if shard is not None:
            batch = shard(batch)
        layout = {"batch_layout": batch["layout"]} if isinstance(self.model, Decoder) and "layout" in batch else {}
        out = self.model(batch["input_ids"], batch.get("position_ids"), labels=batch["labels"], **layout)
        return out, batch["input_ids"].numel()

    def _mtp_scale(self) -> float:
        """The weight of the MTP loss (``mtp_loss_scale``, or the model's ``mtp.loss_scale``)."""
        if self.mtp_loss_scale is not None:
            return self.mtp_loss_scale
        mtp = self.model.config.mtp
        return mtp.loss_scale if mtp is not None else 0.0

    @staticmethod
    def _accumulate(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        sums[name] = sums[name] + value if name in sums else value

    def add_sums(self, sums: dict[str, torch.Tensor], evaluation: bool = False) -> None:
        """Loss sums of this step's (or this evaluation's) micro-batches that join the module's: also those a
        pipeline schedule computed (``ParallelStrategy`` runs it in its step hooks)."""
        for name, value in sums.items():
            self._accumulate(self._eval_sums if evaluation else self._step_sums, name, value)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        out, tokens = self._loss_output(batch)
        sums = self._step_sums
        self._accumulate(sums, "loss_sum", out.loss_sum)
        self._accumulate(sums, "label_tokens", out.num_label_tokens)
        # a fill kernel, not torch.tensor(): a host-to-device copy would wait for the forward to finish
        self._accumulate(sums, "tokens", torch.full((), tokens, dtype=torch.float64, device=out.loss_sum.device))
        objective = out.loss_sum
        if out.aux_loss is not None:
            # a mean-type loss: weight it by this micro-batch's share of label tokens
            objective = objective + out.aux_loss * out.num_label_tokens
            self._accumulate(sums, "aux_loss", out.aux_loss * out.num_label_tokens)
        # each of D depths weighs scale / D: the scale applies to the mean over depths, as in Megatron
        weight = self._mtp_scale() / len(out.mtp_loss_sums) if out.mtp_loss_sums else 0.0
        for depth, (mtp_sum, mtp_count) in enumerate(zip(out.mtp_loss_sums, out.mtp_label_tokens), start=1):
            objective = objective + weight * mtp_sum
            self._accumulate(sums, f"mtp_{depth}_loss_sum", mtp_sum)
            self._accumulate(sums, f"mtp_{depth}_tokens", mtp_count)
        return objective

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        names = sorted(self._step_sums)
        totals = self._all_reduce(torch.stack([self._step_sums[n] for n in names]))
        step = dict(zip(names, totals))  # device values: read back every log_every_n_steps (step_metrics.py)
        self._step_sums = {}
        label_tokens = step["label_tokens"].clamp(min=1.0)
        # undo the mean over reducing ranks and over the micro-batches Lightning's backward averaged (the
        # strategy's figure: a pipeline schedule backpropagates their sums), divide by the global label count
        averaged = getattr(self.trainer.strategy, "averaged_micro_batches", self.trainer.accumulate_grad_batches)
        factor = torch.full_like(label_tokens, self._reduction_size() * averaged) / label_tokens
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        scale_gradients(grads, factor)
        metrics = self.step_metrics
        metrics.set("loss", step["loss_sum"] / label_tokens)
        metrics.set("tokens", step["tokens"])
        metrics.set("label_tokens", step["label_tokens"])
        if "aux_loss" in step:
            metrics.set("aux_loss", step["aux_loss"] / label_tokens)
        depth = 1
        while f"mtp_{depth}_loss_sum" in step:
            metrics.set(f"mtp_{depth}_loss", step[f"mtp_{depth}_loss_sum"] / step[f"mtp_{depth}_tokens"].clamp(min=1.0))
            depth += 1
        metrics.set("lr", optimizer.param_groups[0]["lr"])
        metrics.set("skipped", float(not grads))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_gradients(self, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        skipped = bool(self.step_metrics.current.get("skipped", False))
        if skipped:
            # a step skipped for non-finite gradients moves no expert bias either (the decision is the same on
            # every rank); the routing counts of its forwards are dropped
            for moe in self.model.modules():
                if isinstance(moe, MoE):
                    moe.tokens_per_expert.zero_()
            update_correction_biases(self.model, apply=False)
        else:
            # aux-loss-free balancing: expert biases move right after the weights do. Token counts are summed over
            # all ranks that hold the same layers: tensor-parallel ranks route different sequence shards, and the
            # update only uses the sign
            group = getattr(self.trainer.strategy, "stage_group", None)
            update_expert_bias(self.model, group)
            update_correction_biases(self.model, group)  # model.hf routers
            if self.fp8 is not None and self.fp8.fsdp_float8_all_gather:
                precompute_fsdp_float8_scales(self.model)
        for moe in self.model.modules():
            if isinstance(moe, MoE):
                getattr(moe.dispatcher, "end_step", lambda: None)()
        step = self.trainer.global_step + 1  # Lightning counts the step once this hook returns
        self.step_metrics.end_step(step)
        if logging_step(self.trainer, step):
            self._read_metrics(log=True)

    @property
    def step_stats(self) -> StepStats | None:
        """The figures of the last step, on the host. Reading it reads back the steps not read yet (a host sync
        on a GPU); the package's callbacks take them at logging steps instead (``on_steps_read``)."""
        if self.step_metrics.pending:
            self._read_metrics(log=False)
        return self._step_stats

    @step_stats.setter
    def step_stats(self, value: StepStats | None) -> None:
        self._step_stats = value

    def on_train_end(self) -> None:
        self._read_metrics(log=False)  # the steps since the last logging step, for the callbacks' records

    def _read_metrics(self, log: bool) -> None:
        """The kept steps' values on the host: logged (the last step's), and handed to the callbacks that take
        them (``on_steps_read``) as :class:`StepStats`."""
        read = self.step_metrics.read()
        if not read:
            return
        stats = [step_stats_of(step, values) for step, values in read]
        self._step_stats = stats[-1]
        if log:
            for name, value in read[-1][1].items():
                if name not in UNLOGGED:
                    # a host tensor: Lightning's logging and progress bar then read host memory only
                    self.log(f"train/{name}", torch.tensor(value, dtype=torch.get_default_dtype()),
                             prog_bar=name == "loss", rank_zero_only=True)
        for callback in self.trainer.callbacks:
            if hasattr(callback, "on_steps_read"):
                callback.on_steps_read(self.trainer, self, stats)

    # ------------------------------------------------------------------ evaluation
    def _eval_step(self, batch: dict[str, torch.Tensor]) -> None:
        out, _ = self._loss_output(batch)
        self.add_sums({"loss_sum": out.loss_sum, "label_tokens": out.num_label_tokens}, evaluation=True)

    def _log_eval(self, prefix: str) -> None:
        if not self._eval_sums:
            return
        totals = self._all_reduce(torch.stack([self._eval_sums["loss_sum"], self._eval_sums["label_tokens"]]))
        self._eval_sums = {}
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        self.log(f"{prefix}/loss", loss, prog_bar=prefix == "val", rank_zero_only=True)
        self.log(f"{prefix}/ppl", float(np.exp(min(loss, 50.0))), rank_zero_only=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self):
        optimizer = build_adamw(self.model, self.optimizer_config)
        scheduler = build_scheduler(
            optimizer, self.scheduler_config, self.optimizer_config.lr, int(self.trainer.max_steps or 0)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ resume
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if isinstance(self.model, HFModel):  # which transformers auto class rebuilds the model at export
            checkpoint["hf_task"] = self.hf_task
        checkpoint["rng_states"] = gather_rng_states()
        files = self._tokenizer_files()
        if files:  # exports and `generate` of the checkpoint find the run's tokenizer here
            checkpoint[TOKENIZER_KEY] = files

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("rng_states"):
            restore_rng_states(checkpoint["rng_states"], self.global_rank)

    def _tokenizer_files(self) -> dict[str, bytes] | None:
        """The files of the data module's tokenizer (or processor), read once."""
        if self._tokenizer_cache is None:
            data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
            tokenizer = getattr(data, "processor", None) or getattr(data, "tokenizer", None)
            if not hasattr(tokenizer, "save_pretrained") and getattr(data, "tokenizer_path", None):
                tokenizer = load_tokenizer(data.tokenizer_path)  # data that reads its tokenizer for one id (EOD)
            self._tokenizer_cache = tokenizer_files(tokenizer) if hasattr(tokenizer, "save_pretrained") else {}
        return self._tokenizer_cache

    # ------------------------------------------------------------------ after fit: inference and generation
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, map_location: Any = None, strict: bool | None = None,
                             **kwargs: Any) -> CausalLM:
        """The module of a checkpoint ``fit`` wrote (a ``.ckpt`` file or a distributed checkpoint directory) with
        its model built for inference on one process, in eval mode: ``module(input_ids)`` gives logits
        ``[batch, seq, vocab]``. ``map_location``: the device (default CPU); ``kwargs`` override hyperparameters,
        as in Lightning."""
        from lightning_moe.modules.load_back import load_run_module

        return load_run_module(cls, checkpoint_path, device=map_location, strict=strict is not False, overrides=kwargs)

    def build_inference_model(self) -> Decoder | HFModel:
        """The run's model as ``configure_model`` builds it, on one process on the CPU, for a checkpoint's weights:
        no sharding, no FP8 (checkpoints hold the high-precision weights), no starting adapter (the checkpoint
        holds the trained one). A LoRA run's frozen base comes from ``pretrained`` / ``model.hf``, since its
        checkpoints hold only the adapters."""
        self._route_hf()
        if isinstance(self.model_config, HFModelConfig):
            return build_hf_model(self.model_config, task=self.hf_task, convert=hf_converters(peft=self.peft),
                                  seed=self.seed)
        peft = dataclasses.replace(self.peft, adapter_path=None) if self.peft is not None else None
        return build_decoder(self.resolved_config(), seed=self.seed, source=self._checkpoint() if peft else None,
                             peft=peft)

    def transformers_model(self) -> torch.nn.Module:
        """The model as a transformers ``PreTrainedModel`` in memory, for transformers' ``generate``: the
        transformers model itself on the generic path; for the native decoder the model an export's config.json
        builds, with the same weights (adapters merged in) under the hub's names. Collective when sharded."""
        if isinstance(self.model, HFModel):
            return self.model.hf
        source = self._checkpoint() if self.pretrained is not None else None
        return native_as_transformers(self.model.config, merged_state_dict(self.model),
                                      hf_config=getattr(source, "hf_config", None), device=self.device)

    def on_predict_start(self) -> None:
        self._generator = self.transformers_model()  # on every rank: gathering a sharded model is a collective

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        """The new tokens of each prompt of a :class:`~lightning_moe.data.PromptsDataModule` batch, by transformers'
        ``generate`` with the batch's generation config (:class:`~lightning_moe.callbacks.PredictionWriter` decodes
        and writes them)."""
        if "generation_config" not in batch:
            raise ValueError("predict continues prompts: give it a PromptsDataModule (--data PromptsDataModule "
                             "--data.prompts FILE.jsonl --data.tokenizer DIR)")
        tokens = new_tokens(self._generator, batch["input_ids"], batch["attention_mask"], batch["generation_config"])
        return {"index": batch["index"].tolist(), "token_ids": tokens}


# hyperparameters hold these dataclasses: let weights-only checkpoint loading rebuild them
torch.serialization.add_safe_globals(
    [ModelConfig, AttentionConfig, RopeConfig, MLPConfig, MoEConfig, MambaConfig, MTPConfig,
     OptimizerConfig, SchedulerConfig, Float8Config, LoraConfig]
)
