"""``ParallelStrategy`` under a real ``Trainer`` with ``CausalLM``: a distributed checkpoint written with 2-way
FSDP resumes with 2-way tensor parallelism and continues with the same losses and gradient norms, and exports to a
Hugging Face directory; HSDP with gradient accumulation all-reduces across replicas once per step and trains like
one process."""

from __future__ import annotations

import pytest
import strategy_trainer_cases
import torch
from distributed_harness import run_distributed_test

from lightning_moe.convert_command import main as convert_main
from lightning_moe.io.run import PREFIX, read_run_checkpoint

pytestmark = pytest.mark.distributed


def test_fsdp_checkpoint_resumes_with_tensor_parallelism(tmp_path):
    run_distributed_test(strategy_trainer_cases.resume_on_another_mesh, 2, str(tmp_path), init_process_group=False)
    check_distributed_checkpoint_export(next((tmp_path / "fsdp" / "ckpt").glob("*step=4.ckpt")), tmp_path / "hf")


def check_distributed_checkpoint_export(checkpoint, out):
    """Each weight read from the FSDP shards equals torch's own conversion of the whole checkpoint (weights and
    optimizer states at once); the export of the run loads in transformers and gives the run's logits."""
    import transformers
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from lightning_moe.models.decoder import Decoder

    dcp_to_torch_save(checkpoint, out.parent / "whole.pt")
    whole = torch.load(out.parent / "whole.pt", weights_only=True)
    assert any(key.startswith("optimizer_") for key in whole)
    lazy = read_run_checkpoint(checkpoint)
    assert sorted(lazy["state_dict"]) == sorted(whole["state_dict"])
    for name, tensor in whole["state_dict"].items():
        assert torch.equal(lazy["state_dict"][name], tensor), name
        assert lazy["state_dict"][name].dtype == tensor.dtype, name

    assert convert_main(["export", "--ckpt", str(checkpoint), "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    native = Decoder(lazy["hyper_parameters"]["model"])
    native.load_state_dict({k.removeprefix(PREFIX): v for k, v in whole["state_dict"].items()})
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        assert (native(ids) - exported(ids).logits).abs().max() <= 1e-4


def test_gradient_accumulation_matches_one_process(tmp_path):
    run_distributed_test(strategy_trainer_cases.accumulation_matches_one_process, 2, str(tmp_path),
                         init_process_group=False)
