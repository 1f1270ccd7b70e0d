"""``VisionLM`` on a tiny random Qwen2.5-VL: the packed loss equals transformers' own forward on each sample,
a few training steps on the shipped MedPix sample leave the frozen vision tower bitwise unchanged and move the
language model, the export reloads in transformers, and a processor that does not belong to the model is
refused before any weight is read."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from tiny_vlm import SAMPLE, save_tiny_vlm, vlm_config

from lightning_moe import HFModelConfig, MedPixDataModule, VisionLM
from lightning_moe.models.hf import build_hf_model
from lightning_moe.models.hf_vision import check_processor_matches, freeze_vision_parts, vision_parts
from lightning_moe.modules.optim import OptimizerConfig


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("qwen2_5_vl"))


def medpix(vlm_dir, **options):
    return MedPixDataModule(processor=str(vlm_dir), dataset=str(SAMPLE / "train.jsonl"), **options)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_packed_loss_equals_transformers_on_each_sample(family, vlm_dir, tmp_path):
    import transformers as t

    if family == "qwen3_vl":
        vlm_dir = save_tiny_vlm(tmp_path, family="qwen3_vl")
    module = VisionLM(model=HFModelConfig(hf=str(vlm_dir)))
    module.model = build_hf_model(module.model_config, task="image-text-to-text")
    data = medpix(vlm_dir, packing="ffd", packed_sequence_size=256, micro_batch_size=1)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert len(batch["image_grid_thw"]) >= 3, "want a row packing several samples"
    out, _ = module._loss_output(batch)

    reference = t.AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    expected, grids = torch.zeros(()), iter(batch["image_grid_thw"])
    positions = batch["position_ids"][0]
    starts = (positions == 0).nonzero().flatten().tolist() + [positions.shape[0]]
    patches = 0
    for start, end in zip(starts[:-1], starts[1:]):
        labels = batch["labels"][:, start:end]
        if not (labels != -100).any():
            continue  # end padding
        grid = next(grids)[None]
        pixels = batch["pixel_values"][patches : patches + int(grid.prod())]
        patches += int(grid.prod())
        logits = reference(input_ids=batch["input_ids"][:, start:end], pixel_values=pixels, image_grid_thw=grid,
                           mm_token_type_ids=batch["mm_token_type_ids"][:, start:end], use_cache=False).logits
        expected = expected + torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100,
                                                                reduction="sum")
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-5, atol=1e-4)
    assert int(out.num_label_tokens) == int(batch["num_label_tokens"])


def test_few_steps_with_vision_frozen_then_export_reloads(vlm_dir, tmp_path):
    import transformers as t

    from lightning_moe.checkpoint.convert import export_model

    module = VisionLM(model=HFModelConfig(hf=str(vlm_dir)), optimizer=OptimizerConfig(lr=1e-2), freeze_vision=True)
    start = t.Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32).state_dict()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)
    trainer.fit(module, datamodule=medpix(vlm_dir, packing="ffd", packed_sequence_size=256, micro_batch_size=2))
    assert module.step_stats.step == 3 and module.step_stats.label_tokens > 0

    hf = module.model.hf
    parts = vision_parts(hf)
    assert parts == {"vision": ["model.visual"], "projector": ["model.visual.merger"],
                     "embeddings": ["model.language_model.embed_tokens"]}
    trained = hf.state_dict()
    frozen = [n for n, p in hf.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith("model.visual.") and ".merger." not in n for n in frozen)
    assert all(torch.equal(trained[n], start[n]) for n in frozen), "a frozen vision weight moved"
    for name in ("model.language_model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
                 "model.language_model.embed_tokens.weight", "model.visual.merger.mlp.0.weight"):
        assert not torch.equal(trained[name], start[name]), f"{name} did not train"

    export_model(module.model, tmp_path / "export")
    reloaded = t.Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "export", dtype=torch.float32)
    state = reloaded.state_dict()
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[k], trained[k]) for k in state)


def test_freezing_options_pick_their_parts(vlm_dir):
    model = build_hf_model(HFModelConfig(hf=str(vlm_dir)), task="image-text-to-text")
    frozen = freeze_vision_parts(model.hf, vision=False, projector=True, embeddings=True)
    assert frozen == ["model.visual.merger.ln_q.weight", "model.visual.merger.mlp.0.weight",
                      "model.visual.merger.mlp.0.bias", "model.visual.merger.mlp.2.weight",
                      "model.visual.merger.mlp.2.bias", "model.language_model.embed_tokens.weight"]
    assert all(p.requires_grad for n, p in model.hf.named_parameters() if n not in frozen)


def test_processor_that_does_not_match_the_model_is_refused(vlm_dir, tmp_path):

    data = medpix(vlm_dir)
    processor = data.processor
    tokenizer = processor.tokenizer
    other_token = vlm_config(tokenizer, image_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"))
    with pytest.raises(ValueError, match=r"does not match model 'm': its image token '<\|image_pad\|>' is id 4098, "
                                         r"the model's image_token_id is 4099"):
        check_processor_matches(other_token, processor, "m")
    small_vocab = vlm_config(tokenizer)
    small_vocab.text_config.vocab_size = 4000
    with pytest.raises(ValueError, match="the tokenizer has 4100 tokens, the model's vocabulary 4000"):
        check_processor_matches(small_vocab, processor, "m")
    other_patch = vlm_config(tokenizer)
    other_patch.vision_config.patch_size = 16
    with pytest.raises(ValueError, match="image processor patch_size=14, the vision tower's patch_size=16"):
        check_processor_matches(other_patch, processor, "m")

    # through the Trainer: the run stops at setup, naming both
    mismatched = tmp_path / "mismatched"
    save_tiny_vlm(mismatched, image_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="does not match model"):
        trainer.fit(VisionLM(model=HFModelConfig(hf=str(mismatched))), datamodule=medpix(vlm_dir))
    with pytest.raises(ValueError, match="native=always but Qwen2_5_VLForConditionalGeneration has no native family"):
        VisionLM(model=HFModelConfig(hf=str(vlm_dir), native="always"))._route_hf()


def test_text_only_checkpoint_is_refused(tmp_path):
    from tiny_hf import save_tiny

    llama = save_tiny("llama", tmp_path / "llama")
    with pytest.raises(ValueError, match="is a text-only architecture; VisionLM trains image-text-to-text checkpoints"):
        VisionLM(model=HFModelConfig(hf=str(llama)))._route_hf()


def test_run_checkpoint_exports_the_image_text_to_text_model(tmp_path):
    """Qwen3.5's model type has a causal-LM class (text only) and an image-text-to-text class: the export of a
    VisionLM run rebuilds the run's class and writes the trained vision tower too."""
    import transformers as t
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_moe.convert_command import main

    vlm_dir = save_tiny_vlm(tmp_path / "qwen3_5", family="qwen3_5")
    module = VisionLM(model=HFModelConfig(hf=str(vlm_dir)), optimizer=OptimizerConfig(lr=1e-2), freeze_vision=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)])
    trainer.fit(module, datamodule=medpix(vlm_dir, packing="none", packed_sequence_size=256, micro_batch_size=1))
    checkpoint = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    assert main(["export", "--ckpt", str(checkpoint), "--out", str(tmp_path / "export")]) == 0
    exported = t.AutoModelForImageTextToText.from_pretrained(tmp_path / "export", dtype=torch.float32).state_dict()
    trained = module.model.hf.state_dict()
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in exported)
    start = t.AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).state_dict()
    assert not torch.equal(exported["model.visual.blocks.0.attn.qkv.weight"], start["model.visual.blocks.0.attn.qkv.weight"])
    # the run loaded back for inference: the trained weights, and forward gives the trained model's logits
    loaded = VisionLM.load_from_checkpoint(checkpoint)
    assert not loaded.training and loaded.hf_task == "image-text-to-text"
    assert all(torch.equal(v, trained[k]) for k, v in loaded.model.hf.state_dict().items())
    batch = next(iter(trainer.datamodule.train_dataloader()))
    module.eval()
    with torch.no_grad():
        logits = loaded(batch)
        assert logits.shape[:2] == batch["input_ids"].shape
        torch.testing.assert_close(logits, module(batch), rtol=0, atol=1e-5)
