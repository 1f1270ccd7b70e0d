"""After ``fit``, through the real command line: the trained model loads back (file and distributed checkpoints) with
the logits of its export in transformers, ``generate`` and ``predict`` give transformers' greedy continuation of the
export, seeds decide the run, ``--ckpt_path last`` resumes across versions exactly, a redirected run prints progress
lines, ``validate`` / ``test`` work on SFT data, exports are readable by others and carry the tokenizer, and user
errors are short messages.

A few tiny runs of the quickstart recipe (shrunk) are shared by the tests of this file (module-scoped fixtures); two
processes at a time, so the imports of one overlap the steps of the other.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 1800  # only against a hung child: every run ends by itself
# the quickstart recipe shrunk: a small MoE, 256-token rows, 2 micro-batches per step, a constant learning rate after
# warmup (so a run's length does not change its first steps), the package's strategy (FSDP2 over one process)
OVERLAY = {
    "trainer": {"enable_checkpointing": True, "log_every_n_steps": 5, "enable_model_summary": False,
                "strategy": {"class_path": "lightning_moe.ParallelStrategy", "init_args": {"dp_shard": -1}}},
    "model": {"init_args": {
        "model": {"hidden_size": 64, "attention": {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
                  "moe": {"num_experts": 4, "top_k": 2, "intermediate_size": 64}},
        "scheduler": {"warmup_iters": 2, "decay_style": "constant"}}},
    "data": {"init_args": {"packed_sequence_size": 256}},
}
PROMPTS = [{"prompt": "The capital of France is"}, {"messages": [{"role": "user", "content": "Name a colour."}]}]
NEW_TOKENS = 6


def cli(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.Popen:
    """``python -m lightning_moe.cli ARGS``, stdout and stderr to pipes (not a terminal, as in a batch job)."""
    child = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "lightning_moe.cli", *args], cwd=cwd, env=child, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(process: subprocess.Popen, ok: bool = True) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=HANG_GUARD_S)
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if ok:
        assert result.returncode == 0, f"{' '.join(map(str, process.args))}\n{out[-3000:]}\n{err[-5000:]}"
    return result


def fit(root: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    # each run packs into its own cache: runs started together never write one cache entry at once
    return cli("fit", "--config", "configs/quickstart.yaml", "--config", str(root.parent / "overlay.yaml"),
               "--trainer.default_root_dir", str(root), "--data.init_args.cache_dir", str(root / "cache"), *args,
               env=env)


def card(version: Path) -> dict:
    return json.loads((version / "run_card.json").read_text())


def the_checkpoint(version: Path) -> Path:
    (found,) = list((version / "checkpoints").glob("*.ckpt"))
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Seed 1: 4 steps (distributed checkpoint), then ``--ckpt_path last`` to 6; 20 straight steps; seed 2: 2 steps
    (single-file checkpoint). Their output, run directories and checkpoints."""
    base = tmp_path_factory.mktemp("after_fit")
    (base / "overlay.yaml").write_text(yaml.safe_dump(OVERLAY))
    resumed, straight, seed2 = base / "resumed", base / "straight", base / "seed2"
    four = fit(resumed, "--seed_everything", "1", "--trainer.max_steps", "4")
    twenty = fit(straight, "--seed_everything", "1", "--trainer.max_steps", "20")
    four = finish(four)
    six = fit(resumed, "--seed_everything", "1", "--trainer.max_steps", "6", "--ckpt_path", "last")
    twenty, six = finish(twenty), finish(six)
    two = finish(fit(seed2, "--seed_everything", "2", "--trainer.max_steps", "2",
                     "--trainer.strategy.init_args.save_distributed_checkpoint", "false"))
    return {"base": base, "four": four, "six": six, "twenty": twenty, "two": two,
            "resumed": resumed / "lightning_logs", "straight": straight / "lightning_logs",
            "seed2": seed2 / "lightning_logs"}


@pytest.fixture(scope="module")
def exported(runs):
    """``convert export`` of the seed-2 run (a single-file checkpoint) and ``generate`` on its checkpoint."""
    base = runs["base"]
    ckpt = the_checkpoint(runs["seed2"] / "version_0")
    (base / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    export = cli("convert", "export", "--ckpt", str(ckpt), "--out", str(base / "export"))
    generated = cli("generate", "--ckpt", str(ckpt), "--prompts", str(base / "prompts.jsonl"), "--max-new-tokens",
                    str(NEW_TOKENS), "--json", str(base / "generated.jsonl"))
    finish(export), finish(generated)
    return {"ckpt": ckpt, "export": base / "export", "generated": base / "generated.jsonl"}


def test_seed_everything_decides_the_run_and_the_card_records_it(runs):
    straight = card(runs["straight"] / "version_0")
    four = card(runs["resumed"] / "version_0")
    seed2 = card(runs["seed2"] / "version_0")
    assert four["seeds"] == straight["seeds"] == {"seed_everything": 1, "model": 1, "data": 1}
    assert seed2["seeds"] == {"seed_everything": 2, "model": 2, "data": 2}
    assert four["series"]["loss"] == straight["series"]["loss"][:4]  # seed 1 twice: the same run
    # seed 2: other weights and batches. The same seed gives bitwise the same losses, so differences far above
    # fp32 rounding of a loss near ln(vocab) ~ 8 (1e-6) come from the seed
    differences = [abs(a - b) for a, b in zip(seed2["series"]["loss"], straight["series"]["loss"][:2], strict=True)]
    assert min(differences) > 1e-5, differences


def test_a_resume_from_last_continues_the_run_exactly(runs):
    first, second = runs["resumed"] / "version_0", runs["resumed"] / "version_1"
    assert the_checkpoint(first).is_dir()  # the distributed checkpoint of step 4, found in the older version
    assert "Restored all states from the checkpoint" in runs["six"].stdout + runs["six"].stderr
    resumed = card(first)["series"]["loss"] + card(second)["series"]["loss"]
    assert card(second)["series"]["step"] == [4, 5] and card(second)["steps"] == 6
    assert resumed == card(runs["straight"] / "version_0")["series"]["loss"][:6]


def test_a_redirected_run_prints_a_progress_line_every_log_interval(runs):
    out = runs["twenty"].stdout
    lines = [line for line in out.splitlines() if "] Step " in line]
    assert [line.split("] Step ")[1].split(" |")[0] for line in lines] == ["5/20", "10/20", "15/20", "20/20"]
    for field in ("loss ", "grad norm ", "lr ", "tokens/s/process ", "TFLOP/s/process ", "step time ", "time left ",
                  "memory "):
        assert field in lines[1], lines[1]
    assert "━" not in out  # no rich bar drawn into the log
    markdown = (runs["straight"] / "version_0" / "run_card.md").read_text()
    assert markdown.count("RSS") == 1 and "/GPU" not in markdown  # CPU: one memory row, rates per process
    noise = ("exists and is not empty", "Total length of", "Failed to load", "Tip:", "sync_dist", "LeafSpec")
    for text in (runs["twenty"].stdout + runs["twenty"].stderr, runs["six"].stdout + runs["six"].stderr):
        assert not [n for n in noise if n in text]


def test_load_from_checkpoint_gives_the_logits_of_the_export(runs, exported, tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_moe import CausalLM, load_pretrained
    from lightning_moe.workflows.run_export import export_run

    tokens = torch.randint(0, 4101, (2, 24), generator=torch.Generator().manual_seed(0))
    distributed = the_checkpoint(runs["resumed"] / "version_1")  # step 6
    for ckpt, export in ((exported["ckpt"], exported["export"]), (distributed, export_run(distributed, tmp_path))):
        module = CausalLM.load_from_checkpoint(ckpt)
        assert not module.training and module.device.type == "cpu"
        reference = AutoModelForCausalLM.from_pretrained(export).eval()
        with torch.no_grad():
            logits, expected = module(tokens), reference(tokens).logits
        assert logits.shape == (2, 24, 4160)
        # fp32 weights: the two implementations agree to rounding of logits of magnitude ~ a few units
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
        with torch.no_grad():
            assert torch.equal(load_pretrained(ckpt)(tokens), logits)


def test_generate_and_predict_continue_as_transformers_greedy_generate_on_the_export(runs, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    records = [json.loads(line) for line in exported["generated"].read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(exported["export"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported["export"])  # the run's tokenizer, carried by the export
    config = GenerationConfig.from_pretrained(exported["export"])
    assert set(config.eos_token_id) == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    for prompt, record in zip(PROMPTS, records, strict=True):
        if "prompt" in prompt:
            ids = tokenizer(prompt["prompt"], return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        end = next((i for i, t in enumerate(new) if t in config.eos_token_id), None)
        assert record["token_ids"] == (new if end is None else new[: end + 1])
        assert record["text"] == tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    # predict: the same prompts through the Trainer, batched (left-padded) on the run's checkpoint
    root = runs["seed2"].parent
    finish(cli("predict", "--config", "configs/quickstart.yaml", "--config", str(runs["base"] / "overlay.yaml"),
               "--trainer.default_root_dir", str(root), "--ckpt_path", str(exported["ckpt"]),
               "--data", "lightning_moe.data.PromptsDataModule", "--data.prompts", str(runs["base"] / "prompts.jsonl"),
               "--data.tokenizer", "data/tokenizer", "--data.max_new_tokens", str(NEW_TOKENS),
               "--data.micro_batch_size", "2"))
    predicted = [json.loads(line) for line in (root / "predictions.jsonl").read_text().splitlines()]
    assert [p["token_ids"] for p in predicted] == [r["token_ids"] for r in records]
    assert card(runs["seed2"] / "version_0")["status"] == "completed"  # predict left the fit's card alone


def test_exports_are_readable_by_others_and_carry_the_tokenizer(exported):
    files = sorted(p.name for p in exported["export"].iterdir())
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    umask = os.umask(0)
    os.umask(umask)
    for path in exported["export"].iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path


def test_validate_and_test_on_sft_data_leave_the_fit_card(runs):
    root = runs["resumed"].parent
    ckpt = the_checkpoint(runs["resumed"] / "version_1")
    common = ("--config", "configs/quickstart.yaml", "--config", str(runs["base"] / "overlay.yaml"),
              "--trainer.default_root_dir", str(root), "--data.init_args.val_dataset", "data/tulu3_sample.jsonl",
              "--data.init_args.val_split", "train[:40]", "--data.init_args.cache_dir", str(root / "cache"))
    # one after the other: two runs started together under one root can take the same logger version
    validate = finish(cli("validate", *common, "--ckpt_path", str(ckpt)))
    test = finish(cli("test", *common, "--ckpt_path", "last"))  # the test split defaults to the validation rows
    assert "val/loss" in validate.stdout and "test/loss" in test.stdout
    val_loss = float(validate.stdout.split("val/loss")[1].split()[1])
    test_loss = float(test.stdout.split("test/loss")[1].split()[1])
    assert val_loss == pytest.approx(test_loss, rel=1e-6)  # one checkpoint, the same rows
    assert card(runs["resumed"] / "version_1")["status"] == "completed"
    assert card(runs["resumed"] / "version_1")["steps"] == 6
    assert not list(root.glob("lightning_logs/version_[2-9]/run_card.json"))


def test_user_errors_are_short_messages_naming_the_key_or_file(runs, tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump(OVERLAY))
    root = tmp_path / "run"
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(the_checkpoint(runs["seed2"] / "version_0").read_bytes()[:100_000])
    cases = {
        ("--model.init_args.model.hiden_size", "64"): "hiden_size",
        ("--data.init_args.dataset", "data/tulu3_smaple.jsonl"): "data/tulu3_smaple.jsonl",
        ("--data.init_args.tokenizer", "data/tokeniser"): "directory 'data/tokeniser' does not exist",
        ("--ckpt_path", str(truncated)): f"{truncated} is truncated",
        ("--ckpt_path", "last"): f"no complete checkpoint to resume from (looked for {root}",
        ("--model.init_args.model", "null", "--model.init_args.pretrained", "org/not-downloaded"):
            "pretrained='org/not-downloaded' is not a local directory",
    }
    processes = {args: fit(root, *args) for args in cases}
    for args, process in processes.items():
        result = finish(process, ok=False)
        assert result.returncode in (1, 2), args
        assert cases[args] in result.stderr, (args, result.stderr[-3000:])
        message = result.stderr[result.stderr.index("lightning-moe fit: error"):]
        assert len(message.splitlines()) <= 5 and "Traceback" not in result.stderr, (args, result.stderr[-3000:])
        assert "huggingface.co" not in result.stderr
    assert not list(root.rglob("*.ckpt"))  # no run got as far as a checkpoint
    validate = finish(cli("validate", "--config", "configs/quickstart.yaml", "--config", str(overlay), "--ckpt_path",
                          str(the_checkpoint(runs["seed2"] / "version_0")), "--trainer.default_root_dir", str(root),
                          "--data.init_args.cache_dir", str(root / "cache")), ok=False)
    assert "SFTDataModule has no validation data; set data.init_args.val_dataset" in validate.stderr
    debug = finish(fit(root, "--data.init_args.tokenizer", "data/tokeniser", env={"LIGHTNING_MOE_DEBUG": "1"}),
                   ok=False)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "data/tokeniser" in debug.stderr


def test_fast_dev_run_writes_nothing(tmp_path):
    from lightning_moe.cli import main

    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(yaml.safe_dump(OVERLAY))
    checkpoints = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                   "init_args": {"every_n_train_steps": 1, "save_last": True}}
    main(["fit", "--config", "configs/quickstart.yaml", "--config", str(overlay), "--trainer.fast_dev_run", "2",
          "--trainer.default_root_dir", str(tmp_path / "run"), f"--trainer.callbacks+={json.dumps(checkpoints)}"])
    assert not (tmp_path / "run").exists() or not list((tmp_path / "run").rglob("*"))


def test_a_recipe_seed_wins_over_seed_everything():
    import lightning as L

    from lightning_moe import CausalLM, ModelConfig, SFTDataModule

    config = ModelConfig(vocab_size=64, hidden_size=16, pattern="*-")
    data = {"tokenizer": "data/tokenizer", "dataset": "data/tulu3_sample.jsonl"}
    assert (CausalLM(model=config).seed, SFTDataModule(**data).seed) == (0, 1234)  # no seed anywhere: the defaults
    L.seed_everything(2)
    assert (CausalLM(model=config).seed, SFTDataModule(**data).seed) == (2, 2)
    assert (CausalLM(model=config, seed=7).seed, SFTDataModule(**data, seed=5).seed) == (7, 5)
