"""``lightning-moe report``: a PNG of the loss and throughput curves from a real run's card."""

from __future__ import annotations

import json
import subprocess
import sys

from PIL import Image
from tiny_lm import TinyLM, loader, make_trainer

from lightning_moe.callbacks import RunCard, Throughput
from lightning_moe.callbacks.report import main
from lightning_moe.cli import main as cli_main


def test_report_draws_the_run_card_series(tmp_path, capsys):
    trainer = make_trainer(tmp_path, [Throughput(), RunCard(print_card=False)], max_steps=3)
    trainer.fit(TinyLM(), loader())
    run_dir = tmp_path / "run" / "version_0"
    assert main([str(run_dir)]) == 0
    png = run_dir / "run_report.png"
    assert capsys.readouterr().out.strip() == str(png)
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 400 and image.height > 400

    # panels without values are left out: a card with losses only gives a shorter figure
    card = json.loads((run_dir / "run_card.json").read_text())
    for key in ("tokens_per_s_per_gpu", "tflops_per_gpu"):
        card["series"][key] = [None] * len(card["series"]["step"])
    losses_only = tmp_path / "losses_only"
    losses_only.mkdir()
    (losses_only / "run_card.json").write_text(json.dumps(card))
    assert main([str(losses_only), "--out", str(tmp_path / "loss.png")]) == 0
    with Image.open(tmp_path / "loss.png") as short, Image.open(png) as full:
        assert short.height < full.height / 2


def test_report_names_a_missing_card(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "run_card.json" in err and str(tmp_path) in err
    assert not list(tmp_path.iterdir())


def test_report_runs_as_a_module_and_from_the_cli(tmp_path, capsys):
    result = subprocess.run([sys.executable, "-m", "lightning_moe.callbacks.report", str(tmp_path / "none")],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "no run card" in result.stderr
    assert cli_main(["report", str(tmp_path / "none")]) == 1
    assert "no run card" in capsys.readouterr().err


def test_report_does_not_load_torch_or_lightning():
    code = ("import sys, lightning_moe.callbacks.report; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'matplotlib'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
