"""`lightning-moe fit` of the LoRA twins with checkpointing, then `lightning-moe convert export-lora`: the PEFT
adapter loads in `peft.PeftModel` over the transformers base, and its logits equal the merged export's and those
of the model the run trained, however the recipe named the base (`model.hf` with native on, `pretrained` of a
Hugging Face directory or of an imported checkpoint), from distributed and single-file checkpoints.

Runs are in-process through the package's own entry point (`lightning_moe.cli.main`), one fit per case, shared by
the tests of this module. fp32 throughout, so the three computations agree to float rounding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from tiny_hf import save_nemotron_h_twin, save_tiny, tiny_config
from trained_logits import probe_tokens

from lightning_moe.cli import main as cli_main
from lightning_moe.io.run import read_run_checkpoint

pytestmark = pytest.mark.slow  # three short CLI runs (about a minute on two loaded cores)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TOL = 1e-4


def qwen3_moe_base(path: Path) -> Path:
    """A Qwen3-MoE directory with experts in every layer, as the hub's Qwen3-MoE checkpoints (peft on
    transformers 5 takes adapters on a dense layer's gate/up/down for expert targets; export says so)."""
    import transformers

    config = tiny_config("qwen3_moe")
    config.mlp_only_layers = []
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def fit(root: Path, recipe: str, vocab_size: int, *overrides: str) -> Path:
    """Train 3 steps of a twin with checkpointing on; returns the run's last checkpoint (file or directory)."""
    probe = {"class_path": "trained_logits.SaveTrainedOutputs",
             "init_args": {"path": str(root / "trained.pt"), "vocab_size": vocab_size}}
    cli_main(["fit", "--config", str(CONFIGS / "tiny" / recipe), "--trainer.max_steps=3",
              "--trainer.enable_checkpointing=true", "--trainer.enable_progress_bar=false",
              f"--trainer.default_root_dir={root}", f"--trainer.callbacks+={json.dumps(probe)}",
              "--model.init_args.optimizer.lr=1e-2", *overrides])  # adapters that move in 3 steps
    # the twins' own ModelCheckpoint settings decide the name (epoch=0-step=3.ckpt, last.ckpt)
    checkpoints = [p for p in sorted(root.rglob("*.ckpt")) if read_run_checkpoint(p)["global_step"] == 3]
    assert checkpoints, f"no step-3 checkpoint under {root}"
    return checkpoints[0]


CASES = {
    # the LoRA benchmark twin names its base as every LoRA recipe does; ParallelStrategy: a distributed checkpoint
    "dense model.hf": ("dense_lora_benchmark.yaml", "llama", ["--trainer.precision=32-true"]),
    # stacked-expert adapters over an imported checkpoint; no strategy: a single .ckpt file
    "qwen3_moe imported": ("lora_moe.yaml", "qwen3_moe", []),
    # the same twin trained as the transformers model itself (model.native: never): peft's own layer names
    "dense transformers path": ("dense_lora_benchmark.yaml", "llama", ["--trainer.precision=32-true",
                                                                      "--model.init_args.model.native=never"]),
    # experts and MTP adapters over a Hugging Face directory named by `pretrained`; peft refuses adapters on the
    # Mamba mixers' out_proj (test_mamba_out_proj_adapters_export_merged_only)
    "nemotron_h pretrained": ("nemotron_h_lora.yaml", "nemotron_h",
                              ["--model.init_args.peft.exclude_modules=[mamba.out_proj]",
                               "--trainer.strategy.init_args.param_dtype=null",
                               "--trainer.strategy.init_args.reduce_dtype=null"]),
}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    """(case, transformers base directory, run directory) after fit -> export-lora (adapter and merged)."""
    recipe, family, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(family)
    if family == "nemotron_h":
        base, vocab = save_nemotron_h_twin(root / "base"), 4160
        overrides = [*overrides, "--model.init_args.model=null", f"--model.init_args.pretrained={base}",
                     f"--data.init_args.cache_dir={root / 'cache'}"]
    elif family == "qwen3_moe":
        base, vocab = qwen3_moe_base(root / "base"), 160
    else:
        base, vocab = save_tiny(family, root / "base"), 160
    if request.param in ("dense model.hf", "dense transformers path"):
        overrides = [*overrides, f"--model.init_args.model.hf={base}", "--data.init_args.vocab_size=160"]
    if request.param == "qwen3_moe imported":
        assert cli_main(["convert", "import", "--hf-path", str(base), "--out", str(root / "imported")]) == 0
        overrides = [*overrides, f"--model.init_args.pretrained={root / 'imported'}"]
    ckpt = fit(root / "run", recipe, vocab, *overrides)
    assert ckpt.is_dir() == (recipe != "lora_moe.yaml")  # distributed (ParallelStrategy) or one file
    assert cli_main(["convert", "export-lora", "--ckpt", str(ckpt), "--adapter-out", str(root / "adapter"),
                     "--merged-out", str(root / "merged")]) == 0
    return request.param, base, root, ckpt, vocab


def test_peft_adapter_merged_export_and_trained_model_agree(exported):
    import peft
    import transformers

    case, base, root, _, vocab = exported
    ids = probe_tokens(vocab)
    trained = torch.load(root / "run" / "trained.pt")["logits"]
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        before = hf(ids).logits
        adapted = peft.PeftModel.from_pretrained(hf, root / "adapter").eval()(ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32)(ids).logits
    assert (adapted - trained).abs().max() <= TOL, case
    assert (merged - trained).abs().max() <= TOL, case
    assert (before - trained).abs().max() > 1e-3, case  # the adapters trained: not the base's logits
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    if not case.startswith("dense"):  # adapters on the fused experts of the transformers model
        assert config["target_parameters"], case
    # aux-loss-free balancing moved Nemotron-H's router bias: the routers travel whole (peft's modules_to_save)
    assert bool(config["modules_to_save"]) == (case == "nemotron_h pretrained"), case
    # the adapter names its base; a Hugging Face base is what AutoPeftModelForCausalLM loads it onto
    imported = case == "qwen3_moe imported"
    assert config["base_model_name_or_path"] == str((root / "imported" if imported else base).resolve()), case
    if not imported:
        with torch.no_grad():
            auto = peft.AutoPeftModelForCausalLM.from_pretrained(root / "adapter", dtype=torch.float32).eval()
            assert (auto(ids).logits - adapted).abs().max() <= TOL, case
    # the tokenizer of a run that trained with one (the SFT data of the Nemotron-H twin) travels with both exports
    for export in (root / "adapter", root / "merged"):
        assert (export / "tokenizer.json").is_file() == (case == "nemotron_h pretrained"), (case, export)


def test_mtp_adapters_travel_with_the_adapter_and_the_merged_export(exported):
    """transformers has no MTP layers: their adapters are written next to the PEFT adapter, a new run starting
    from that adapter has the trained MTP adapters, and the merged export's MTP layers compute the trained MTP
    loss."""
    from safetensors import safe_open

    from lightning_moe.checkpoint.load import load_pretrained
    from lightning_moe.checkpoint.source import open_checkpoint
    from lightning_moe.modules.causal_lm import build_decoder
    from lightning_moe.peft import LoraConfig

    case, base, root, ckpt, vocab = exported
    if case != "nemotron_h pretrained":
        assert not (root / "adapter" / "mtp_adapter_model.safetensors").exists()
        return
    stored = read_run_checkpoint(ckpt)["state_dict"]
    mtp_keys = [k for k in stored if k.startswith("model.mtp.")]  # adapters and buffers (the router bias)
    adapters = {k.removeprefix("model.") for k in mtp_keys if ".lora_" in k}
    assert any(".experts.adapter." in k for k in adapters) and any(".lora_B.default." in k for k in adapters)
    with safe_open(str(root / "adapter" / "mtp_adapter_model.safetensors"), framework="pt") as f:
        assert adapters <= set(f.keys())

    # a run starting from the exported adapter has every MTP tensor the run trained
    recipe = yaml.safe_load((CONFIGS / "tiny" / "nemotron_h_lora.yaml").read_text())
    lora = LoraConfig(**{**recipe["model"]["init_args"]["peft"], "exclude_modules": ["mamba.out_proj"],
                         "adapter_path": str(root / "adapter")})
    source = open_checkpoint(base)
    resumed = build_decoder(source.config, seed=1, source=source, peft=lora).state_dict()
    for key in mtp_keys:
        assert torch.equal(resumed[key.removeprefix("model.")], stored[key]), key

    ids = probe_tokens(vocab)
    trained = torch.load(root / "run" / "trained.pt")["mtp_loss_sums"]
    with torch.no_grad():
        merged = load_pretrained(root / "merged").eval()(ids, labels=torch.roll(ids, -1, dims=1)).mtp_loss_sums
    assert len(merged) == len(trained) == 1
    assert abs(merged[0] - trained[0]) <= 1e-3 * abs(trained[0])


def test_mamba_out_proj_adapters_export_merged_only(tmp_path):
    """peft refuses LoRA on the Mamba mixers' out_proj of Nemotron-H (its kernels bypass the module), so a PEFT
    adapter holding them is refused before anything is written, naming the way out; the merged export has them."""
    from lightning_moe.checkpoint.source import open_checkpoint
    from lightning_moe.modules.causal_lm import build_decoder
    from lightning_moe.peft import LoraConfig, export_hf_adapter

    source = open_checkpoint(save_nemotron_h_twin(tmp_path / "base"))
    model = build_decoder(source.config, source=source, peft=LoraConfig(r=2))
    with pytest.raises(ValueError, match=r"adapters on layers\.0\.mamba\.out_proj, layers\.3\.mamba\.out_proj: "
                                         r"peft refuses LoRA .* peft\.exclude_modules: \[mamba\.out_proj\]"):
        export_hf_adapter(model, tmp_path / "adapter", hf_config=source.hf_config)
    assert not (tmp_path / "adapter").exists()
