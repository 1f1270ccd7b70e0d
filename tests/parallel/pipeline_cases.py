"""Worker side of the pipeline tests: ``CausalLM`` under ``ParallelStrategy(pp=...)`` in a real ``Trainer``,
compared with the same module trained by one process (the reference, run by the test itself)."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from parallel_cases import full, tiny_config

from lightning_moe import ParallelStrategy
from lightning_moe.data import MockDataModule
from lightning_moe.models.hf import HFModelConfig
from lightning_moe.modules.causal_lm import CausalLM
from lightning_moe.modules.optim import OptimizerConfig, SchedulerConfig
from lightning_moe.parallel import ParallelDims
from lightning_moe.parallel.dims import SIZE_NAMES
from lightning_moe.peft import LoraConfig
from lightning_moe.precision import Float8Config

GLOBAL_ROWS, MICRO_ROWS, SEQ, STEPS = 8, 2, 16, 6
# model names of the cases beyond parallel_cases.tiny_config's: (architecture, training module options)
VARIANTS = {"llama_lora": ("llama", {"peft": LoraConfig(r=4)}),
            "llama_fp8": ("llama", {"fp8": Float8Config(recipe="tensorwise", min_dim=16)}),
            # a reference of its own: compiled by inductor on one process too (its kernels, not eager's numbers)
            "llama_inductor": ("llama", {})}
LOSS_TOLERANCE, GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-4, 1e-5


class Recorder(Callback):
    """Per optimizer step (step, loss, gradient norm), and each validation loss."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, float]] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = pl_module.step_stats
        if stats is not None and (not self.steps or self.steps[-1][0] != stats.step):
            self.steps.append((stats.step, stats.loss, stats.grad_norm))

    def on_validation_end(self, trainer, pl_module):
        if "val/loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val/loss"]))


class GradProbe(CausalLM):
    """Keeps the first step's gradients as the optimizer sees them (normalized, before clipping), whole."""

    first_grads: dict | None = None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.first_grads is None:
            self.first_grads = {n: full(p.grad).clone() for n, p in self.model.named_parameters() if p.grad is not None}
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


def fit(model: str, sizes: dict, root: Path, steps: int = STEPS, devices: int | None = None,
        ckpt_path: str | None = None, checkpoint_every: int | None = None, module_class=GradProbe,
        strategy_class=ParallelStrategy) -> dict:
    """Train ``model`` with ``sizes`` (a strategy's init args; None: Lightning's default strategy); returns the
    step records, validation losses and the first step's gradients (whole, every stage's)."""
    devices = devices or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    mesh_sizes = {k: v for k, v in (sizes or {}).items() if k in ("pp", *SIZE_NAMES)}
    dp = ParallelDims(**mesh_sizes, world_size=devices).dp_size
    recorder = Recorder()
    callbacks = [recorder]
    if checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1))
    strategy = strategy_class(**sizes) if sizes is not None else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=bool(checkpoint_every), enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, val_check_interval=2 * (GLOBAL_ROWS // MICRO_ROWS) // dp, num_sanity_val_steps=0,
        gradient_clip_val=0.5, callbacks=callbacks,
    )
    architecture, options = VARIANTS.get(model, (model, {}))
    if model.startswith("lora+"):
        architecture, options = model.removeprefix("lora+"), {"peft": LoraConfig(r=4)}
    module = module_class(model=model_config(architecture), optimizer=OptimizerConfig(lr=3e-3),
                          scheduler=SchedulerConfig(warmup_iters=2), seed=11, **options)
    data = MockDataModule(seq_length=SEQ, micro_batch_size=MICRO_ROWS, global_batch_size=GLOBAL_ROWS,
                          vocab_size=64, num_val_samples=2 * MICRO_ROWS)  # every layout validates all 4
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    converted = sum(type(m).__name__.startswith(("Float8", "MX")) or hasattr(m, "base_layer")
                    for m in module.model.modules())
    grads = module.first_grads or {}
    if dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, grads)
        grads = {name: grad for rank_grads in gathered for name, grad in rank_grads.items()}
    return {"steps": recorder.steps, "val": recorder.val, "grads": grads, "converted_layers": converted}


def model_config(name: str):
    """``hf:<directory>``: that transformers model on the generic path (``native: never``); ``hfnative:<directory>``:
    its native family's decoder from that checkpoint; else ``parallel_cases.tiny_config``'s native model (a
    ``lora+`` prefix, see :func:`fit`, adds LoRA adapters)."""
    if name.startswith("hf:"):
        return HFModelConfig(hf=name[3:], native="never")
    if name.startswith("hfnative:"):
        return HFModelConfig(hf=name.removeprefix("hfnative:"))
    return tiny_config(name)


def run_name(model: str) -> str:
    """A directory name for ``model``'s runs (the kind and the model directory's name for checkpoint models)."""
    kind, _, directory = model.partition(":")
    return f"{kind}_{Path(directory).name}" if directory else model


def save_hf_models(directory: Path, *families: str) -> dict[str, str]:
    """Tiny random transformers models (``tests/tiny_hf.py``'s, and ``qwen3_sliding``: Qwen3 whose second layer
    attends through a sliding window of 4, so the second stage must pick the mask of its own layer) saved under
    ``directory``: family -> model name."""
    import transformers
    from tiny_hf import COMMON, random_model, save_tiny

    names = {}
    for family in families:
        path = directory / f"hf_{family}"
        if family == "qwen3_sliding":
            config = transformers.Qwen3Config(**COMMON, intermediate_size=96, head_dim=32, use_sliding_window=True,
                                              sliding_window=4, max_window_layers=1)
            assert config.layer_types == ["full_attention", "sliding_attention"], config.layer_types
            random_model(config).save_pretrained(path)
        else:
            save_tiny(family, path)
        names[family] = f"hf:{path}"
    return names


def compare(case: str, reference: dict, run: dict, grads: bool = True) -> list[str]:
    problems = []
    if [s for s, _, _ in run["steps"]] != [s for s, _, _ in reference["steps"]]:
        problems.append(f"{case}: steps {[s for s, _, _ in run['steps']]} != {[s for s, _, _ in reference['steps']]}")
    for (step, loss, norm), (_, expected, expected_norm) in zip(run["steps"], reference["steps"]):
        if abs(loss - expected) > LOSS_TOLERANCE:
            problems.append(f"{case}: step {step} loss {loss:.8f} != one process {expected:.8f}")
        if abs(norm - expected_norm) > GRAD_RTOL * expected_norm:
            problems.append(f"{case}: step {step} gradient norm {norm:.8f} != one process {expected_norm:.8f}")
    if len(run["val"]) != len(reference["val"]) or any(
            abs(a - b) > LOSS_TOLERANCE for a, b in zip(run["val"], reference["val"])):
        problems.append(f"{case}: validation losses {run['val']} != one process {reference['val']}")
    if grads:
        if set(run["grads"]) != set(reference["grads"]):
            problems.append(f"{case}: gradients of {sorted(set(run['grads']) ^ set(reference['grads']))} missing")
        for name, expected in reference["grads"].items():
            got = run["grads"].get(name)
            if got is not None and not torch.allclose(got, expected, rtol=GRAD_RTOL, atol=GRAD_ATOL):
                problems.append(f"{case}: step-1 gradient of {name} differs by {(got - expected).abs().max():.3g}")
    return problems


class SwappedBlocks(GradProbe):
    """A broken pipeline: the first stage runs its blocks in reverse order."""

    def configure_model(self):
        super().configure_model()
        stage = self.model.stages[0]
        if stage.spec.index == 0:
            stage.layers = torch.nn.ModuleDict(reversed(list(stage.layers.items())))


class DroppedMicroBatch(GradProbe):
    """A broken pipeline: the last micro-batch of every step loses its labels (contributes nothing). The batch is
    changed on arrival: under a pipeline the strategy, not ``training_step``, runs the step."""

    training_batches = 0

    def on_after_batch_transfer(self, batch, dataloader_idx):
        if self.trainer.training:
            self.training_batches += 1
            if self.training_batches % self.trainer.accumulate_grad_batches == 0:
                # new labels: the batch's host layout, which describes the collated ones, goes
                batch = {**{k: v for k, v in batch.items() if k != "layout"},
                         "labels": torch.full_like(batch["labels"], -100)}
        return batch


class IgnoredActivations(GradProbe):
    """A broken generic-path pipeline: stages past the first run their layers on zeros, not on the hidden states
    they received."""

    def configure_model(self):
        from lightning_moe.parallel import pipeline_hf

        super().configure_model()
        self._replace_input = pipeline_hf._replace_input
        pipeline_hf._replace_input = lambda hidden: (lambda module, args, kwargs: None)

    def teardown(self, stage):
        from lightning_moe.parallel import pipeline_hf

        if hasattr(self, "_replace_input"):
            pipeline_hf._replace_input = self._replace_input
        super().teardown(stage)


class LocalTokensAhead(GradProbe):
    """A broken pipeline under context parallelism: the first stage shifts its own chunks for the tokens ahead that
    MTP reads, not the whole row (wrong at every chunk boundary)."""

    def configure_model(self):
        from lightning_moe.models.layers.mtp import shift_left
        from lightning_moe.parallel import pipeline

        super().configure_model()
        self._ids_ahead = pipeline.ids_ahead
        pipeline.ids_ahead = lambda ids, layout, depths: [shift_left(ids, d, 0) for d in range(1, depths + 1)]

    def teardown(self, stage):
        from lightning_moe.parallel import pipeline

        if hasattr(self, "_ids_ahead"):
            pipeline.ids_ahead = self._ids_ahead
        super().teardown(stage)


BROKEN = {"swapped_blocks": SwappedBlocks, "dropped_micro_batch": DroppedMicroBatch,
          "ignored_activations": IgnoredActivations, "local_tokens_ahead": LocalTokensAhead}


def check_resume(directory: Path, reference: dict) -> list[str]:
    """A ``pp=2`` run of the dense model checkpointed every 3 steps trains like one process; resumed from its
    step-3 checkpoint with ``pp=2``, with ``pp=2, vp=2`` (other stages) and with ``pp=1`` (2-way FSDP), steps 4-6
    repeat its losses; an FSDP2 run's step-6 checkpoint continues with ``pp=2`` as with FSDP2."""
    full = fit("llama", {"pp": 2}, directory / "pp2", checkpoint_every=3)
    problems = compare("dense_1f1b (checkpointed)", reference, full)
    checkpoint = next((directory / "pp2" / "ckpt").glob("*step=3.ckpt"))
    for case, sizes in (("resumed_pp2", {"pp": 2}), ("resumed_pp2_vp2", {"pp": 2, "vp": 2}),
                        ("resumed_pp1_fsdp2", {"dp_shard": 2})):
        resumed = fit("llama", sizes, directory / case, ckpt_path=str(checkpoint))
        if [s for s, _, _ in resumed["steps"]] != [4, 5, 6]:
            problems.append(f"{case}: resumed steps {[s for s, _, _ in resumed['steps']]}, expected [4, 5, 6]")
        for (step, loss, norm), (_, expected, expected_norm) in zip(resumed["steps"], full["steps"][3:]):
            if abs(loss - expected) > LOSS_TOLERANCE or abs(norm - expected_norm) > GRAD_RTOL * expected_norm:
                problems.append(f"{case}: step {step} loss {loss:.8f} / norm {norm:.6f} != uninterrupted "
                                f"{expected:.8f} / {expected_norm:.6f}")
    # the other way: a checkpoint of an unpipelined run from scratch (FSDP2, itself equal to one process) continues
    # under pp=2 as under FSDP2
    sharded = fit("llama", {"dp_shard": 2}, directory / "fsdp2", checkpoint_every=STEPS)
    problems += compare("fsdp2 from scratch", reference, sharded)
    unpipelined = next((directory / "fsdp2" / "ckpt").glob(f"*step={STEPS}.ckpt"))
    onward = [fit("llama", sizes, directory / f"onward_{i}", steps=STEPS + 1, ckpt_path=str(unpipelined))["steps"]
              for i, sizes in enumerate(({"dp_shard": 2}, {"pp": 2}))]
    if len(onward[1]) != 1 or abs(onward[1][0][1] - onward[0][0][1]) > LOSS_TOLERANCE:
        problems.append(f"an FSDP2 checkpoint continued with pp=2: {onward[1]} != with FSDP2 {onward[0]}")
    return problems


def check_pipelines(directory: str, references: dict, cases: list[tuple[str, str, dict]],
                    broken: list[tuple[str, str, dict]] = (), resume: bool = False,
                    checkpointed: tuple[str, ...] = ()) -> None:
    """Every ``(case, model, sizes)`` trains like one process; every ``broken`` one (a name of :data:`BROKEN`)
    does not (two steps are enough to see it); with ``resume``, :func:`check_resume` too. The cases named in
    ``checkpointed`` save their last step's checkpoint (under ``<directory>/<case>/ckpt``)."""
    problems = check_resume(Path(directory), references["llama"]) if resume else []
    for case, model, sizes in cases:
        if sizes.get("compile"):  # this case's compiled code and first-use verdicts only
            from lightning_moe.kernels.checks import reset_kernel_checks

            torch._dynamo.reset()
            reset_kernel_checks()
        run = fit(model, sizes, Path(directory) / case, checkpoint_every=STEPS if case in checkpointed else None)
        problems += compare(case, references[model], run)
        if (VARIANTS.get(model, (None, {}))[1] or model.startswith("lora+")) and not run["converted_layers"]:
            problems.append(f"{case}: no FP8 or LoRA layer in this rank's stages")
        if sizes.get("compile"):
            problems += compiled_blocks_problems(case)
    for case, model, sizes in broken:
        reference = {**references[model], "steps": references[model]["steps"][:2]}
        run = fit(model, sizes, Path(directory) / case, steps=2, module_class=BROKEN[case])
        if not any("loss" in problem for problem in compare(case, reference, run, grads=False)):
            problems.append(f"{case}: a broken pipeline trained like one process (the comparison cannot fail)")
    problems += check_too_few_micro_batches(Path(directory) / "too_few")
    if problems:
        raise AssertionError(f"rank {dist.get_rank()}:\n" + "\n".join(problems))


def compiled_blocks_problems(case: str) -> list[str]:
    """The compiled blocks passed their first-use check against eager and served the run (no eager fallback)."""
    from lightning_moe.kernels.checks import kernel_checks

    checks = [c for c in kernel_checks() if c["kernel"] == "compiled block"]
    if not checks or any(c["used"] != "compiled" for c in checks):
        return [f"{case}: the compiled blocks did not serve the run: {checks}"]
    return []


def check_too_few_micro_batches(root: Path) -> list[str]:
    """One micro-batch per step (the default global batch: micro-batch x data-parallel ranks) cannot fill 2 stages:
    refused before the first step, saying what fits."""
    devices = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=ParallelStrategy(pp=2), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root)
    module = GradProbe(model=tiny_config("llama"))
    data = MockDataModule(seq_length=SEQ, micro_batch_size=MICRO_ROWS, vocab_size=64, num_val_samples=0)
    try:
        trainer.fit(module, datamodule=data)
    except ValueError as error:
        if "need at least 2 micro-batches per step, got 1" in str(error) and module.step_stats is None:
            return []
        return [f"too few micro-batches: unexpected error {error}"]
    return ["too few micro-batches: one micro-batch per step trained with pp=2"]
