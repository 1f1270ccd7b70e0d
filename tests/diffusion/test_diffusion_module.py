"""DiffusionModule on a tiny random Qwen-Image pipeline: the flow-matching loss falls on a fixed batch, online and
cached encoding train alike, the run card counts images, and the exports load in diffusers and reproduce the
trained model's prediction."""

from __future__ import annotations

import json

import pytest
import torch
from diffusion_cases import fit
from tiny_qwen_image import RESOLUTION, SAMPLE

from lightning_moe import DiffusionModule
from lightning_moe.data.text_to_image import TextToImageDataModule, collate_images
from lightning_moe.models.diffusion import DiffusionModelConfig, FlowMatchingConfig
from lightning_moe.peft import LoraConfig


def _fixed_input(config, generator_seed: int = 7):
    g = torch.Generator().manual_seed(generator_seed)
    latent_hw = (RESOLUTION // 8, RESOLUTION // 8)
    tokens = (latent_hw[0] // 2) * (latent_hw[1] // 2)
    return dict(packed=torch.randn(2, tokens, config.in_channels, generator=g), sigmas=torch.tensor([0.3, 0.8]),
                prompt_embeds=torch.randn(2, 9, config.joint_attention_dim, generator=g),
                prompt_mask=torch.tensor([[1] * 9, [1] * 6 + [0] * 3]), latent_hw=latent_hw)


def _predict(transformer, inputs):
    from lightning_moe.models.diffusion.qwen_image import QwenImageFamily

    with torch.no_grad():
        return QwenImageFamily.predict(transformer, inputs["packed"], inputs["sigmas"], inputs["prompt_embeds"],
                                       inputs["prompt_mask"], inputs["latent_hw"])


def test_flow_matching_loss_falls_on_a_fixed_batch(tiny_pipeline):
    from lightning_moe.models.diffusion.transformer import build_diffusion_transformer

    module = DiffusionModule(DiffusionModelConfig(path=str(tiny_pipeline), encoder_dtype="float32"),
                             flow_matching=FlowMatchingConfig(condition_dropout=0.0))
    module.model = build_diffusion_transformer(module._load_family())
    data = TextToImageDataModule(dataset=str(SAMPLE), resolution=RESOLUTION)
    data.setup()
    inputs = module.flow_inputs(collate_images([data.train_data[i] for i in range(4)]))  # noise drawn once
    optimizer = torch.optim.AdamW(module.model.parameters(), lr=3e-3, fused=True)
    losses = []
    for _ in range(30):
        loss = module.loss(inputs).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_online_and_cached_encoding_train_alike_and_the_transformer_exports(tiny_pipeline, tiny_cache, tmp_path):
    from diffusers import QwenImageTransformer2DModel

    online, module, trainer = fit(str(tiny_pipeline), str(tmp_path / "online"), card=True)
    cached, _, _ = fit(str(tiny_pipeline), str(tmp_path / "cached"), cache=str(tiny_cache))
    assert len(online) == 3 and online == pytest.approx(cached, abs=1e-5)

    card = json.loads((tmp_path / "online" / "run_card.json").read_text())
    assert card["images_per_s_per_gpu"] > 0 and card["tflops_per_gpu"] > 0
    assert card["flops_method"].startswith("DiffusionModule.throughput_counts")
    # label tokens are the image patches: (32 / 8 / 2)^2 = 4 per image
    assert card["label_tokens_per_s_per_gpu"] == pytest.approx(4 * card["images_per_s_per_gpu"], rel=1e-6)
    assert "| Images/s/process |" in (tmp_path / "online" / "run_card.md").read_text()  # per process on the CPU

    exported = QwenImageTransformer2DModel.from_pretrained(tmp_path / "online" / "export")
    start = QwenImageTransformer2DModel.from_pretrained(tiny_pipeline / "transformer")
    inputs = _fixed_input(exported.config)
    trained = _predict(module.model.transformer, inputs)
    torch.testing.assert_close(_predict(exported, inputs), trained, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(_predict(start, inputs), trained, atol=1e-4)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_resumed_run_continues_loss_by_loss(tiny_pipeline, tiny_cache, tmp_path, lora):
    """3 steps straight = 2 steps, a distributed checkpoint (LoRA: adapters only), then the 3rd step resumed."""
    peft = LoraConfig(r=4, alpha=8.0, target_modules=["to_q", "to_k", "to_v", "to_add_out"]) if lora else None
    straight, _, _ = fit(str(tiny_pipeline), str(tmp_path / "straight"), cache=str(tiny_cache), peft=peft,
                         save_every=2)
    checkpoint = tmp_path / "straight" / "checkpoints" / "epoch=0-step=2.ckpt"
    resumed, _, _ = fit(str(tiny_pipeline), str(tmp_path / "resumed"), cache=str(tiny_cache), peft=peft,
                        resume=str(checkpoint))
    assert checkpoint.is_dir() and len(straight) == 3 and resumed == straight[2:]


def test_parameters_no_loss_reaches_are_the_ones_frozen(tiny_pipeline):
    from diffusers import QwenImageTransformer2DModel

    from lightning_moe.models.diffusion.qwen_image import QwenImageFamily

    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_pipeline / "transformer")
    inputs = _fixed_input(transformer.config)
    QwenImageFamily.predict(transformer, inputs["packed"], inputs["sigmas"], inputs["prompt_embeds"],
                            inputs["prompt_mask"], inputs["latent_hw"]).square().mean().backward()
    no_gradient = [n for n, p in transformer.named_parameters() if p.grad is None]
    assert no_gradient and no_gradient == QwenImageFamily.unused_parameters(transformer)


def test_compiled_blocks_with_activation_checkpointing_train_like_eager(tiny_pipeline, tiny_cache, tmp_path):
    from torch._dynamo.utils import counters

    eager, _, _ = fit(str(tiny_pipeline), str(tmp_path / "eager"), cache=str(tiny_cache), steps=2)
    counters.clear()
    compiled, module, _ = fit(str(tiny_pipeline), str(tmp_path / "compiled"), cache=str(tiny_cache), steps=2,
                              compile=True, compile_backend="aot_eager", activation_checkpointing="full")
    assert compiled == pytest.approx(eager, abs=1e-5)
    block = module.model.transformer.transformer_blocks[0]
    assert "forward" in vars(block)  # the block's forward was replaced by its compiled (checkpointed) one
    assert counters["stats"]["unique_graphs"] > 0  # and dynamo traced graphs for it


def test_lora_adapters_load_in_diffusers_and_reproduce_the_prediction(tiny_pipeline, tiny_cache, tmp_path):
    from diffusers import QwenImagePipeline

    lora = LoraConfig(r=4, alpha=8.0, target_modules=["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj",
                                                      "add_v_proj", "to_out.0", "to_add_out"])
    _, module, _ = fit(str(tiny_pipeline), str(tmp_path / "lora"), cache=str(tiny_cache), peft=lora)
    trainable = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)

    pipe = QwenImagePipeline.from_pretrained(tiny_pipeline)
    inputs = _fixed_input(pipe.transformer.config)
    base = _predict(pipe.transformer, inputs)
    pipe.load_lora_weights(tmp_path / "lora" / "export")
    trained = _predict(module.model.transformer, inputs)
    torch.testing.assert_close(_predict(pipe.transformer, inputs), trained, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(base, trained, atol=1e-4)  # the adapters moved away from the base model


def test_hunyuan_image_3_mismatched_caches_and_model_parallel_layouts_are_refused(tiny_pipeline, tmp_path, capsys):
    from lightning_moe.data.commands import main
    from lightning_moe.models.diffusion.qwen_image import QwenImageFamily

    with pytest.raises(NotImplementedError, match=r"HunyuanImage-3.0 .* no implementation in the installed diffusers"):
        DiffusionModelConfig(path="tencent/HunyuanImage-3.0", family="hunyuan_image_3")
    assert main(["cache-latents", "--dataset", str(SAMPLE), "--model", "tencent/HunyuanImage-3.0", "--family",
                 "hunyuan_image_3", "--output", str(tmp_path / "cache")]) == 1
    assert "no implementation in the installed diffusers" in capsys.readouterr().err
    # Qwen-Image's own sizes (16 latent channels, 3584-wide text states) against a cache of the tiny pipeline
    with pytest.raises(ValueError, match=r"cache X: latents with 4 channels and text states of width 32, but the "
                                         r"transformer takes 16 latent channels .* encoded for another model"):
        QwenImageFamily.check_inputs({"in_channels": 64, "joint_attention_dim": 3584}, 4, 32, "cache X")
    from lightning_moe.models.diffusion.transformer import build_diffusion_transformer
    from lightning_moe.parallel.diffusion import DIFFUSERS
    from lightning_moe.parallel.dims import ParallelDims
    from lightning_moe.parallel.options import ParallelOptions

    model = build_diffusion_transformer(DiffusionModule(DiffusionModelConfig(path=str(tiny_pipeline)))._load_family())
    assert sorted(model.layers) == ["transformer.transformer_blocks.0", "transformer.transformer_blocks.1"]
    with pytest.raises(ValueError, match="tp=2: QwenImageTransformer2DModel runs through diffusers, where it trains with data parallelism"):
        DIFFUSERS.check(model, ParallelDims(tp=2, world_size=2), ParallelOptions())
