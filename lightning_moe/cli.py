"""``lightning-moe``: training through LightningCLI, plus the convert / data / estimate / report / slurm tools.

    lightning-moe fit --config recipe.yaml [--trainer.max_steps 100 ...]
    lightning-moe convert import --hf-path DIR --out DIR
    lightning-moe convert export --ckpt DIR --out DIR [--dtype bfloat16]
    lightning-moe convert export-lora --ckpt RUN.ckpt [--adapter-out DIR] [--merged-out DIR]
    lightning-moe convert verify --reference DIR --candidate DIR
    lightning-moe data pack|index|cache-latents ...
    lightning-moe estimate --config recipe.yaml [--device-memory GIB] [--trainer.devices 8 ...]
    lightning-moe report RUN_DIR
    lightning-moe slurm --config recipe.yaml [--nodes N --gpus-per-node G ...] [--dry-run | --submit]
"""

from __future__ import annotations

import importlib
import sys

# each command imports what it runs inside its function: the CLI and every tool start without loading the rest
TRAINING_COMMANDS = ("fit", "validate", "test", "predict")
# tool name -> module with ``main(argv) -> int``
TOOLS = {
    "convert": "lightning_moe.checkpoint.commands",
    "data": "lightning_moe.data.commands",
    "estimate": "lightning_moe.estimate.command",
    "report": "lightning_moe.callbacks.report",
    "slurm": "lightning_moe.slurm",
}


def default_callbacks() -> list:
    """Throughput, peak memory, NaN/inf health, preemption handling and the run card: every training run gets
    them."""
    from lightning_moe.callbacks import HealthCheck, PeakMemory, Preemption, RunCard, Throughput

    # Preemption last: it ends the run at a step's end, after the others have seen that step
    return [Throughput(), PeakMemory(), HealthCheck(), RunCard(), Preemption()]


def replace_lightning_defaults(callbacks: list) -> list:
    """Lightning's default rich progress bar and model summary (exactly those classes, with their settings)
    become the package's: a bar in optimizer steps, a summary with model FLOPs. Other choices stay."""
    from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

    from lightning_moe.callbacks import ModelSummary, StepProgressBar

    replaced = []
    for callback in callbacks:
        if type(callback) is RichProgressBar:
            callback = StepProgressBar(refresh_rate=callback.refresh_rate, leave=callback._leave,
                                       theme=callback.theme, console_kwargs=callback._console_kwargs)
        elif type(callback) is RichModelSummary:
            callback = ModelSummary(max_depth=callback._max_depth, **callback._summarize_kwargs)
        replaced.append(callback)
    return replaced


def add_missing_callbacks(callbacks: list) -> list:
    """The default callbacks of a kind the configuration did not already list (a recipe's own settings, or its
    subclass of a default, win)."""
    return callbacks + [d for d in default_callbacks() if not any(isinstance(c, type(d)) for c in callbacks)]


def default_loggers(root_dir: str) -> list:
    """TensorBoard event files and a ``metrics.csv`` in the same ``lightning_logs/version_N`` folder: what a run
    logs when the recipe names no logger (W&B, MLflow and others are Lightning's loggers, set in ``trainer.logger``)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    tensorboard = TensorBoardLogger(root_dir, name="lightning_logs")
    return [tensorboard, CSVLogger(root_dir, name="lightning_logs", version=tensorboard.version)]


def run_training_cli(argv: list[str] | None) -> None:
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    from lightning_moe.checkpoint.training import check_resume_path

    class CLI(LightningCLI):
        def before_instantiate_classes(self) -> None:
            # a wrong or incomplete --ckpt_path is named now, not after the model is built
            check_resume_path(self.config[self.subcommand].get("ckpt_path"))

        def instantiate_trainer(self, **kwargs):
            trainer = super().instantiate_trainer(**kwargs)
            trainer.callbacks[:] = replace_lightning_defaults(add_missing_callbacks(list(trainer.callbacks)))
            if self.config[self.subcommand]["trainer"].get("logger") in (None, True):
                trainer.loggers = default_loggers(trainer.default_root_dir)
            return trainer

    # make the package's modules and data modules known to jsonargparse by their short names
    importlib.import_module("lightning_moe.modules")
    importlib.import_module("lightning_moe.data")
    CLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    command = args[0]
    if command in TOOLS:
        return importlib.import_module(TOOLS[command]).main(args[1:])
    # from the command line LightningCLI reads sys.argv itself (given both, it warns)
    run_training_cli(args if argv is not None else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
