"""``import lightning_moe.data`` stays light (no datasets / transformers / pyarrow) and registers the
data modules for LightningCLI's short class names."""

from __future__ import annotations

import subprocess
import sys

from distributed_harness import HANG_GUARD_S


def test_import_does_not_load_heavy_libraries():
    # lightning itself may import transformers (through its optional integrations): count only what we add
    code = ("import sys; heavy = ('datasets', 'transformers', 'pyarrow'); import lightning; "
            "before = {m for m in heavy if m in sys.modules}; import lightning_moe.data; "
            "print(sorted(m for m in heavy if m in sys.modules and m not in before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S, check=True)
    assert out.stdout.strip() == "[]"


def test_lightning_cli_finds_data_modules_by_short_name():
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    import lightning_moe.data  # noqa: F401

    cli = LightningCLI(
        LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, run=False,
        args=["--model=lightning.pytorch.demos.boring_classes.BoringModel", "--data=MockDataModule",
              "--data.seq_length=16", "--data.micro_batch_size=2", "--data.vocab_size=50",
              "--trainer.logger=false", "--trainer.enable_checkpointing=false"],
    )
    assert type(cli.datamodule).__name__ == "MockDataModule"
    assert cli.datamodule.seq_length == 16
