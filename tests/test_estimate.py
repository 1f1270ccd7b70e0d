"""``lightning-moe estimate``: the fake-tensor probe against a real forward, the estimate against a real run's
memory, and the command's verdicts and errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import estimate_cases
import pytest
import torch
from distributed_harness import run_distributed_test
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_moe.estimate.command import main as estimate_main
from lightning_moe.estimate.memory import COMPONENTS, build_fake_decoder, estimate_memory
from lightning_moe.estimate.probe import saved_activations
from lightning_moe.estimate.recipe import apply_overrides, load_recipe
from lightning_moe.models.decoder import Decoder
from lightning_moe.parallel.activation_checkpoint import repeated_blocks

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_estimate.py"


def real_saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """The same count as the probe, on real tensors: storages saved for backward, each once, no parameters."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    seen: dict[StorageWeakRef, int] = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params:
            seen[ref] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, None, labels=ids)
    return sum(seen.values())


@pytest.mark.parametrize("twin", ["moe_benchmark", "mla_moe_benchmark", "nemotron_h_benchmark"])
def test_the_fake_probe_saves_what_a_real_forward_saves(twin):
    layout = load_recipe(ROOT / "configs" / "tiny" / f"{twin}.yaml", [])
    config = layout.model
    mode, fake = build_fake_decoder(layout, torch.float32)
    tokens = layout.micro_batch_size * layout.seq_length
    per_expert = tokens * config.moe.top_k // config.moe.num_experts
    probed = saved_activations(mode, fake, repeated_blocks(fake), layout.micro_batch_size, layout.seq_length,
                               per_expert)
    torch.manual_seed(0)
    real = Decoder(config)  # the twins route balanced (force_balanced), as the probe assumes
    real.init_weights(0)
    ids = torch.randint(0, config.vocab_size, (layout.micro_batch_size, layout.seq_length))
    # exact but for data-dependent rows the probe takes as full (MTP targets past a row's end have no label)
    assert probed.total == pytest.approx(real_saved_bytes(real, ids), rel=1e-3)
    assert all(v > 0 for v in probed.per_block.values()) and probed.outside > 0


def test_overrides_set_nested_keys_as_yaml():
    config = apply_overrides({"trainer": {"devices": 1}}, ["--trainer.devices", "8", "--model.init_args.seed=3",
                                                           "--trainer.strategy.init_args.ep", "[1, 2]"])
    assert config == {"trainer": {"devices": 8, "strategy": {"init_args": {"ep": [1, 2]}}},
                      "model": {"init_args": {"seed": 3}}}
    with pytest.raises(ValueError, match="--trainer.devices has no value"):
        apply_overrides({}, ["--trainer.devices"])


def test_sharding_divides_parameters_and_states_by_the_layout():
    recipe = ROOT / "configs" / "tiny" / "moe_benchmark.yaml"
    one = estimate_memory(load_recipe(recipe, []))[0].components
    layout = load_recipe(recipe, ["--trainer.devices", "4", "--trainer.strategy.init_args.ep", "2"])
    four = estimate_memory(layout)[0].components
    # every tensor is sharded 4 ways (dense over dp_shard=4, experts over ep=2 x ep_shard=2)
    for name in ("parameters", "gradients", "optimizer states"):
        assert four[name] == pytest.approx(one[name] / 4)
    assert one["FSDP working set"] == 0 and four["FSDP working set"] > 0
    model = Decoder(layout.model)
    assert one["parameters"] == sum(p.numel() * 2 for p in model.parameters())  # bf16-true


def test_the_command_says_whether_it_fits_and_writes_components_that_add_up(tmp_path, capsys):
    recipe = str(ROOT / "configs" / "tiny" / "nemotron_h_benchmark.yaml")
    out = tmp_path / "estimate.json"
    assert estimate_main(["--config", recipe, "--device-memory", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "fits" in printed and "every rank" in printed
    report = json.loads(out.read_text())
    (rank,) = report["ranks"]
    assert set(rank["components"]) == set(COMPONENTS)
    assert sum(rank["components"].values()) == pytest.approx(rank["total"])
    assert estimate_main(["--config", recipe, "--device-memory", "0.001"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


def test_bad_recipes_and_layouts_are_named(tmp_path, capsys):
    assert estimate_main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such recipe file" in capsys.readouterr().err
    recipe = str(ROOT / "configs" / "tiny" / "moe_benchmark.yaml")
    assert estimate_main(["--config", recipe, "--trainer.devices", "3", "--trainer.strategy.init_args.ep", "2"]) == 2
    assert "ep=2" in capsys.readouterr().err


def test_the_estimate_matches_a_real_runs_memory():
    """The benchmark's dense case at a smaller width: the estimate within 15 % of the measured peak RSS increase
    of a real fit (``benchmarks/bench_estimate.py`` runs five cases at full width)."""
    narrower = ["--model.init_args.model.hidden_size", "512", "--model.init_args.model.mlp.intermediate_size", "2048",
                "--data.init_args.seq_length", "512"]
    script = (
        "import sys, json; sys.path.insert(0, 'benchmarks'); import bench_estimate as b; "
        f"r, o = b.CASES['dense']; o = o + {narrower!r}; "
        "print(json.dumps([b.estimate(r, o)['total'], b.measure(r, o)]))"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"), check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    estimated, measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert estimated == pytest.approx(measured, rel=0.15)


def test_pipeline_ranks_hold_the_strategys_split():
    recipe = ROOT / "configs" / "tiny" / "mla_moe_benchmark.yaml"
    whole = estimate_memory(load_recipe(recipe, []))[0]
    ranks = estimate_memory(load_recipe(recipe, ["--trainer.devices", "2", "--trainer.strategy.init_args.pp", "2"]))
    assert [r.kind for r in ranks] == ["first stage (embedding)", "last stage 1 (output layer)"]
    # no FSDP within a stage: the stages' parameters add up to the whole model's
    assert sum(r.components["parameters"] for r in ranks) == pytest.approx(whole.components["parameters"])
    assert ranks[0].components["loss buffers"] == 0 and ranks[1].components["loss buffers"] > 0
    with pytest.raises(ValueError, match="pp_layout"):
        estimate_memory(load_recipe(recipe, ["--trainer.devices", "2", "--trainer.strategy.init_args.pp", "2",
                                             "--trainer.strategy.init_args.pp_layout", "Et|t*9L"]))


def test_the_estimate_is_what_each_rank_holds_after_parallelization():
    """Per-rank parameter, gradient and optimizer bytes of the estimate equal the local shards each of 2 gloo ranks
    holds after ``parallelize`` and one step: TP of Nemotron-H (latent MoE), TP of MLA + MoE, TP x EP, FSDP2."""
    run_distributed_test(estimate_cases.check_estimates, 2)
