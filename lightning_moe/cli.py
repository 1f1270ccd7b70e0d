"""``lightning-moe``: training through LightningCLI, plus the convert / data / estimate / plan / report / slurm
tools.

    lightning-moe fit --config recipe.yaml [--trainer.max_steps 100 ...] [--ckpt_path last]
    lightning-moe validate|test --config recipe.yaml --ckpt_path CKPT|last
    lightning-moe predict --config recipe.yaml --ckpt_path CKPT|last --data PromptsDataModule \
        --data.prompts FILE.jsonl --data.tokenizer DIR          # writes <default_root_dir>/predictions.jsonl
    lightning-moe generate --ckpt RUN_CKPT | --hf DIR --prompt TEXT | --prompts FILE.jsonl [--chat] [--json OUT]
    lightning-moe convert import --hf-path DIR --out DIR
    lightning-moe convert export --ckpt DIR --out DIR [--dtype bfloat16]
    lightning-moe convert export-lora --ckpt RUN.ckpt [--adapter-out DIR] [--merged-out DIR]
    lightning-moe convert verify --reference DIR --candidate DIR
    lightning-moe data pack|index|cache-latents ...
    lightning-moe estimate --config recipe.yaml [--device-memory GIB] [--trainer.devices 8 ...]
    lightning-moe plan --config recipe.yaml [--gpu h100|h200|b200|gb200|FILE.yaml] [--gpus N --top K] [--json OUT]
    lightning-moe report RUN_DIR
    lightning-moe slurm --config recipe.yaml [--nodes N --gpus-per-node G ...] [--dry-run | --submit]

A mistake in the command line, the recipe, the data or a checkpoint is printed as a short message naming the
key, file or row, with exit status 1 (2 for the command line and recipe); LIGHTNING_MOE_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings

# each command imports what it runs inside its function: the CLI and every tool start without loading the rest
TRAINING_COMMANDS = ("fit", "validate", "test", "predict")
DEBUG_ENV = "LIGHTNING_MOE_DEBUG"  # set (not 0): user errors keep their traceback
# tool name -> module with ``main(argv) -> int``
TOOLS = {
    "convert": "lightning_moe.convert_command",
    "data": "lightning_moe.data.commands",
    "estimate": "lightning_moe.estimate.command",
    "generate": "lightning_moe.workflows.generate",
    "plan": "lightning_moe.plan.command",
    "report": "lightning_moe.callbacks.report",
    "slurm": "lightning_moe.slurm",
}


def default_callbacks() -> list:
    """Throughput, peak memory, NaN/inf health, preemption handling, the run card, validation intervals in
    optimizer steps and the writer of ``predict`` results: every run gets them."""
    from lightning_moe.callbacks import (
        HealthCheck,
        PeakMemory,
        PredictionWriter,
        Preemption,
        RunCard,
        Throughput,
        ValidationInSteps,
    )

    # Preemption last: it ends the run at a step's end, after the others have seen that step
    return [Throughput(), PeakMemory(), HealthCheck(), RunCard(), ValidationInSteps(), PredictionWriter(),
            Preemption()]


def replace_lightning_defaults(callbacks: list, terminal: bool = True) -> list:
    """Lightning's default rich progress bar and model summary (exactly those classes, with their settings)
    become the package's: a bar in optimizer steps in a terminal, plain progress lines otherwise (a log file),
    and a summary with model FLOPs. Other choices stay."""
    from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar

    from lightning_moe.callbacks import ModelSummary, Preemption, StepLines, StepProgressBar

    replaced, lines = [], None
    for callback in callbacks:
        if type(callback) is RichProgressBar and not terminal:
            lines = StepLines()
            continue
        if type(callback) is RichProgressBar:
            callback = StepProgressBar(refresh_rate=callback.refresh_rate, leave=callback._leave,
                                       theme=callback.theme, console_kwargs=callback._console_kwargs)
        elif type(callback) is RichModelSummary:
            callback = ModelSummary(max_depth=callback._max_depth, **callback._summarize_kwargs)
        replaced.append(callback)
    if lines is not None:  # after the callbacks whose logged values it prints, before the one that ends a run
        at = next((i for i, c in enumerate(replaced) if isinstance(c, Preemption)), len(replaced))
        replaced.insert(at, lines)
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


def run_training_cli(argv: list[str] | None, raise_config_errors: bool = False) -> None:
    """LightningCLI's fit / validate / test / predict; ``raise_config_errors``: a configuration error raises
    jsonargparse's ``ArgumentError`` instead of printing the usage and exiting."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import CSVLogger

    from lightning_moe.io.training import check_resume_path
    from lightning_moe.workflows.resume import RESUME_NAMES, resolve_resume_path

    class CLI(LightningCLI):
        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            # a wrong or incomplete --ckpt_path is named now, before LightningCLI reads the hyperparameters of a
            # checkpoint file, and long before the model is built and the trainer restores it
            subcommand = self.config.get("subcommand")
            if subcommand:
                check_resume_path(self.config[subcommand].get("ckpt_path"))

        def before_instantiate_classes(self) -> None:
            if self.subcommand != "fit":  # a checkpoint's callback states only matter to a fit that resumes
                warnings.filterwarnings("ignore", message=r"Be aware that when using `ckpt_path`, callbacks used")

        def instantiate_trainer(self, **kwargs):
            trainer = super().instantiate_trainer(**kwargs)
            trainer.callbacks[:] = replace_lightning_defaults(add_missing_callbacks(list(trainer.callbacks)),
                                                              terminal=sys.stdout.isatty())
            settings = self.config[self.subcommand]["trainer"]
            if trainer.fast_dev_run:
                # a trial run writes nothing: Lightning's stand-in logger stays, and its ModelCheckpoint, which skips
                # fast_dev_run's saves, would still write last.ckpt at the end of training
                trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, ModelCheckpoint)]
            elif settings.get("logger") in (None, True):
                trainer.loggers = default_loggers(trainer.default_root_dir)
            return trainer

        def after_instantiate_classes(self) -> None:
            # `last` / `hpc`: the newest complete checkpoint of the run directory, whichever version wrote it
            settings = self.config_init[self.subcommand]
            if settings.get("ckpt_path") in RESUME_NAMES:
                settings["ckpt_path"] = resolve_resume_path(settings["ckpt_path"], self.trainer)
            for logger in self.trainer.loggers:
                if isinstance(logger, CSVLogger):
                    # its folder now, while empty: made after the config is saved there, it warns of old files
                    _ = logger.experiment

    # make the package's modules and data modules known to jsonargparse by their short names
    importlib.import_module("lightning_moe.modules")
    importlib.import_module("lightning_moe.data")
    # how a data module says it has no validation data (an empty list of loaders), which Lightning warns about
    warnings.filterwarnings("ignore", message=r"Total length of `.*` across ranks is zero")
    CLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"exit_on_error": False} if raise_config_errors else None,
        args=argv,
    )


def run_command(args: list[str], from_command_line: bool = False) -> int:
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    command = args[0]
    if command in TOOLS:
        return importlib.import_module(TOOLS[command]).main(args[1:])
    # from the command line LightningCLI reads sys.argv itself (given both, it warns)
    run_training_cli(None if from_command_line else args, raise_config_errors=from_command_line)
    return 0


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types a mistake in the command line, recipe, data or a checkpoint raises (the package's
    errors name the key, file, row or tensor; Lightning's MisconfigurationException its setting)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return ValueError, OSError, MisconfigurationException


def short_message(command: str, error: BaseException, what: str = "error") -> str:
    return (f"lightning-moe {command}: {what}: {condensed(str(error))}\n"
            f"(a traceback: run again with {DEBUG_ENV}=1)")


# the scaffolding of jsonargparse's messages, around the lines that say what is wrong
CONFIG_ERROR_SCAFFOLD = re.compile(r"Does not validate against any of the Union subtypes|Subtypes: |Errors:|"
                                   r"- Expected a <class 'NoneType'>|Given value type: |Given value: |"
                                   r"- Problem with given class_path|Parser key ")


def condensed(text: str) -> str:
    """jsonargparse's message of a bad setting in a few lines: the key it names, what is wrong (the nested
    alternatives it tried and the values it was given left out), and the nested key as the command line gave it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not any(CONFIG_ERROR_SCAFFOLD.search(line) for line in lines):
        return text
    keys = [line for line in lines if line.startswith("Parser key ")][:1]
    causes = list(dict.fromkeys(line.lstrip("- ") for line in lines if not CONFIG_ERROR_SCAFFOLD.search(line)))
    nested = [line.removeprefix("Given value: ") for line in lines if line.startswith("Given value: NestedArg")]
    return "\n  ".join(keys + causes[:4] + nested[-1:]) if causes else text


def main(argv: list[str] | None = None) -> int:
    """``lightning-moe``. From the command line (``argv`` None) a user error is a short message on stderr and
    exit status 1; called with ``argv`` from Python, errors are raised."""
    if argv is not None:
        return run_command(list(argv))
    args = sys.argv[1:]
    try:
        return run_command(args, from_command_line=True)
    except argparse.ArgumentError as error:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(short_message(args[0] if args else "", error, "error in the configuration"), file=sys.stderr)
        return 2
    except user_errors() as error:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(short_message(args[0] if args else "", error), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
