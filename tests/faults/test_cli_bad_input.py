"""Bad input through the command line: a non-zero exit (or an error out of ``main``, which the console script turns
into one) with a message naming the key, file, row or tensor, before any step; nothing deleted or half written.

Most cases call ``lightning_moe.cli.main`` in this process (what ``lightning-moe`` runs); one runs the real
console script to show the exit status and the message on stderr.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import warnings

import pytest
import torch
from harness import EXECUTABLE, RECIPE, REPO, child_env

from lightning_moe.cli import main
from lightning_moe.io.training import check_complete

TOKENIZER = str(REPO / "data" / "tokenizer")
TULU = REPO / "data" / "tulu3_sample.jsonl"
PRETRAIN_PREFIX = str(REPO / "data" / "pretrain_sample_text_document")


def fit(tmp_path, data: dict | None = None, *args: str) -> None:
    """``lightning-moe fit`` of the tiny MoE benchmark twin (vocabulary 256), one step, with other data."""
    overlay = {"trainer": {"max_steps": 1, "enable_progress_bar": False, "enable_model_summary": False,
                           "logger": False, "default_root_dir": str(tmp_path / "run")}}
    if data is not None:
        overlay["data"] = data
    path = tmp_path / "overlay.yaml"
    path.write_text(json.dumps(overlay))
    main(["fit", "--config", str(RECIPE), "--config", str(path), *args])


def test_vocabulary_smaller_than_the_tokenizer_fails_before_the_first_step_and_counts_drops(tmp_path):
    # 128-token rows: some Tulu-3 samples are longer and dropped; the counts are printed and in the run card
    data = {"class_path": "lightning_moe.data.SFTDataModule",
            "init_args": {"tokenizer": TOKENIZER, "dataset": str(TULU), "preset": "tulu3", "packed_sequence_size": 128,
                          "cache_dir": str(tmp_path / "cache"), "micro_batch_size": 1, "global_batch_size": 1}}
    with warnings.catch_warnings(record=True) as caught, pytest.raises(
            ValueError, match=r"model\.vocab_size is 256, but tokenizer .*tokenizer has 4096 tokens"):
        warnings.simplefilter("always")
        fit(tmp_path, data)
    card = json.loads((tmp_path / "run" / "run_card.json").read_text())
    dropped = card["data_counts"]["num_dropped_overlong"]
    assert dropped > 0 and card["steps"] == 0
    assert card["data_counts"]["num_samples"] + dropped == card["data_counts"]["num_input_samples"]
    assert any(f"{dropped} over-long samples dropped" in str(w.message) for w in caught)


def test_vocabulary_smaller_than_the_indexed_data_names_the_file(tmp_path):
    data = {"class_path": "lightning_moe.data.PretrainDataModule",
            "init_args": {"blend": PRETRAIN_PREFIX, "split": "1,0,0", "seq_length": 32, "micro_batch_size": 1,
                          "global_batch_size": 1, "cache_dir": str(tmp_path / "cache")}}
    with pytest.raises(ValueError, match=r"model\.vocab_size is 256, but .*pretrain_sample_text_document\.bin holds "
                                         r"token id 4095"):
        fit(tmp_path, data)
    assert list((tmp_path / "cache").glob("max-token-id-*.json"))  # the scan is remembered


def test_unknown_role_names_the_row_or_is_mapped(tmp_path, capsys):
    rows = [json.loads(line) for line in TULU.read_text().splitlines()[:6]]
    rows[3]["messages"][1]["role"] = "bot"
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "packed"
    args = ["data", "pack", "--dataset", str(path), "--tokenizer", TOKENIZER, "--preset", "tulu3",
            "--packed-sequence-size", "2048", "--output", str(out)]
    assert main(args) == 1
    assert re.search(r"chats\.jsonl row 3: column 'messages' message 1 has role 'bot'.*role_map",
                     capsys.readouterr().err)
    assert not out.exists()
    assert main([*args, "--role-map", "bot=assistant"]) == 0
    assert json.loads((out / "metadata.json").read_text())["num_samples"] == 6


def test_pack_refuses_a_non_empty_output_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "packed"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["data", "pack", "--dataset", str(TULU), "--tokenizer", TOKENIZER, "--preset", "tulu3",
            "--packed-sequence-size", "2048", "--output", str(out)]
    assert main(args) == 1
    assert f"--output {out} already exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


@pytest.mark.parametrize(("text", "message"), [
    ("", r"empty\.jsonl: empty, no JSON lines"),
    ('{"id": "a", "messages": []}\n{"id": "b", "messages": [}\n', r"empty\.jsonl line 2: not valid JSON"),
    ('{"id": "a"}\n[1, 2]\n', r"empty\.jsonl line 2: a JSON list, not an object"),
    (b'{"id": "a"}\n{"id": "\xff"}\n', r"empty\.jsonl line 2: not UTF-8 text"),
])
def test_empty_or_malformed_jsonl_names_file_and_line(tmp_path, capsys, text, message):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "packed"
    assert main(["data", "pack", "--dataset", str(path), "--tokenizer", TOKENIZER, "--preset", "tulu3",
                 "--packed-sequence-size", "256", "--output", str(out)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not out.exists()


def test_non_finite_learning_rate_is_refused_at_configuration(tmp_path):
    """The real console script: exit status 2 from the configuration, the key on stderr, no run directory."""
    result = subprocess.run([str(EXECUTABLE), "fit", "--config", str(RECIPE), "--model.init_args.optimizer.lr", ".inf",
                             "--trainer.default_root_dir", str(tmp_path / "run")],
                            capture_output=True, text=True, env=child_env(tmp_path), cwd=tmp_path)
    assert result.returncode != 0
    assert "optimizer.lr = inf is not a finite number" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_wrong_or_incomplete_checkpoints_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nowhere\.ckpt does not exist") as error:
        fit(tmp_path, None, "--ckpt_path", str(tmp_path / "nowhere.ckpt"))
    # refused while the command line is read, not once the model is built and the trainer restores
    assert not {"_fit_impl", "load_checkpoint"} & {entry.name for entry in error.traceback}

    import torch.distributed.checkpoint as dcp

    good = tmp_path / "good.ckpt"
    dcp.save({"state_dict": {"w": torch.arange(1000.0)}}, checkpoint_id=good, no_dist=True)
    torch.save({"global_step": 3}, good / "meta.pt")
    check_complete(good)
    shard = next(good.glob("*.distcp"))

    def broken(name: str, damage) -> str:
        copy = tmp_path / name
        shutil.copytree(good, copy)
        damage(copy)
        return str(copy)

    cases = {
        broken("shard.ckpt", lambda c: (c / shard.name).write_bytes((c / shard.name).read_bytes()[:100])):
            rf"shard .*shard\.ckpt/{shard.name} is truncated \(100 bytes",
        broken("noshard.ckpt", lambda c: (c / shard.name).unlink()): rf"shard .*noshard\.ckpt/{shard.name} is missing",
        broken("noindex.ckpt", lambda c: (c / ".metadata").unlink()): r"noindex\.ckpt/\.metadata is missing",
        broken("badindex.ckpt", lambda c: (c / ".metadata").write_bytes(b"\x80\x04junk")):
            r"badindex\.ckpt/\.metadata is truncated or corrupt",
        broken("nometa.ckpt", lambda c: (c / "meta.pt").unlink()): r"nometa\.ckpt/meta\.pt \(trainer state\) is missing",
        broken("badmeta.ckpt", lambda c: (c / "meta.pt").write_bytes((c / "meta.pt").read_bytes()[:50])):
            r"badmeta\.ckpt/meta\.pt is truncated or corrupt",
    }
    single = tmp_path / "single.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, single)
    single.write_bytes(single.read_bytes()[:-200])
    cases[str(single)] = r"checkpoint file .*single\.ckpt is truncated or corrupt"
    for path, message in cases.items():
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            check_complete(path)
    # the same check guards resuming through the CLI (and conversions of DCP directories)
    with pytest.raises(ValueError, match=rf"shard .*shard\.ckpt/{shard.name} is truncated"):
        fit(tmp_path, None, "--ckpt_path", str(tmp_path / "shard.ckpt"))


def test_corrupt_run_card_names_the_file(tmp_path, capsys):
    (tmp_path / "run_card.json").write_text('{"status": "completed", "series": {"st')
    assert main(["report", str(tmp_path)]) != 0
    assert f"{tmp_path / 'run_card.json'}: not a run card, the JSON is truncated or corrupt" in capsys.readouterr().err


def test_signal_handlers_are_given_back_after_a_run(tmp_path):
    """In a notebook or any caller that lives on, SIGTERM must end the process again once a run is over, whether
    it completed or failed (Lightning's own teardown would put back what it found: the preemption handler)."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    fit(tmp_path, None)
    assert {s: signal.getsignal(s) for s in before} == before
    with pytest.raises(RuntimeError, match="failing on purpose after step 1"):
        fit(tmp_path, None, "--trainer.max_steps", "3", "--trainer.callbacks+=fault_hooks.FailAfterFirstStep")
    assert {s: signal.getsignal(s) for s in before} == before
