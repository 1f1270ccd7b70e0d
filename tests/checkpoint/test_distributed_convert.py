"""``convert import`` and ``convert export --distributed-save`` on 4 gloo ranks with EP 2 (one launch for a
Nemotron-H with two MTP depths and a DeepSeek-V3 with its MTP layer): every rank reads only its experts and
tensors, the distributed checkpoint holds the one-process import's tensors bit for bit, the export equals the
one-process export and the hub checkpoint bit for bit (MTP included), every rank writes its own files, and each
rank's peak memory stays below the whole checkpoint's size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed_convert_cases import (
    EP,
    EXPERTS,
    convert_on_every_rank,
    deepseek_v3_hub,
    nemotron_h_hub,
    peak_rss_since_reset,
    start_peak_rss,
    warmup_hub,
)
from distributed_harness import run_distributed_test

from lightning_moe.checkpoint.convert import export_hf_checkpoint, import_hf_checkpoint, verify_hf_checkpoints
from lightning_moe.checkpoint.distributed_convert import ConversionLayout, DistributedNativeCheckpoint
from lightning_moe.checkpoint.source import NativeCheckpoint, open_checkpoint
from lightning_moe.io.safetensors_io import SafetensorsDir

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # one 4-rank launch, about two minutes on 2 loaded cores
WORLD = 4
MODELS = {"nemotron_h": nemotron_h_hub, "deepseek_v3": deepseek_v3_hub}


def checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, list[dict], dict[str, int]]:
    """The hub checkpoints, their one-process conversion (its import's peak memory measured as the ranks'), and
    the ranks' reports of their one launch."""
    work = tmp_path_factory.mktemp("distributed_convert")
    import_hf_checkpoint(warmup_hub(work / "warmup-hub"), work / "warmup-native")
    one_process_peaks = {}
    for name, build in MODELS.items():
        build(work / f"{name}-hub")
        before = start_peak_rss()
        import_hf_checkpoint(work / f"{name}-hub", work / f"{name}-native")  # the one-process conversion
        one_process_peaks[name] = peak_rss_since_reset() - before
        export_hf_checkpoint(work / f"{name}-native", work / f"{name}-one-process")
    run_distributed_test(convert_on_every_rank, WORLD, work, ["warmup", *MODELS])
    return work, [json.loads((work / f"rank{r}.json").read_text()) for r in range(WORLD)], one_process_peaks


@pytest.mark.parametrize("name", list(MODELS))
def test_distributed_import_holds_the_one_process_import(converted, name):
    work, _, _ = converted
    ours = open_checkpoint(work / f"{name}-dcp")
    assert isinstance(ours, DistributedNativeCheckpoint)
    assert sorted((work / f"{name}-dcp").glob("__*_0.distcp")) == [work / f"{name}-dcp" / f"__{r}_0.distcp"
                                                                   for r in range(WORLD)]  # a file per rank
    reference = NativeCheckpoint(work / f"{name}-native")
    assert ours.config == reference.config and ours.names == reference.names
    for native, tensor in reference.iter_native():
        theirs = ours.get_native(native)
        assert theirs.dtype == tensor.dtype and torch.equal(theirs.view(torch.uint8), tensor.view(torch.uint8)), native
    assert any(n.startswith("mtp.") for n in ours.names)


@pytest.mark.parametrize("name", list(MODELS))
def test_distributed_export_is_the_one_process_export_and_the_hub_checkpoint(converted, name):
    work, _, _ = converted
    export = work / f"{name}-export"
    for reference in (work / f"{name}-one-process", work / f"{name}-hub"):
        for candidate in (export, work / f"{name}-export-native"):
            report = verify_hf_checkpoints(reference, candidate)
            assert report.ok, report.summary()
    hub_names = SafetensorsDir(work / f"{name}-hub").keys()
    assert report.tensors == len(hub_names)
    mtp = [n for n in hub_names if n.startswith("mtp.") or n.startswith("model.layers.3.")]
    assert len(mtp) > 10 and set(mtp) <= set(SafetensorsDir(export).keys())
    index = json.loads((export / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= WORLD and files == sorted(p.name for p in export.glob("*.safetensors"))
    assert files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert json.loads((export / "config.json").read_text()) == json.loads(
        (work / f"{name}-one-process" / "config.json").read_text())
    # the distributed checkpoint also exports in one process (it opens as a native checkpoint)
    export_hf_checkpoint(work / f"{name}-dcp", work / f"{name}-dcp-one-process")
    assert verify_hf_checkpoints(work / f"{name}-hub", work / f"{name}-dcp-one-process").ok


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_reads_only_its_experts_and_tensors(converted, name):
    work, ranks, _ = converted
    hub = SafetensorsDir(work / f"{name}-hub")
    expert_names = [n for n in hub.keys() if ".experts." in n and ".shared_experts." not in n]
    read = [{r.split(":", 1)[1] for r in rank[f"{name}-import"]["reads"]} for rank in ranks]
    assert set().union(*read) == set(hub.keys())  # together the ranks read the checkpoint, each tensor once
    assert sum(len(r) for r in read) == len(hub.keys())
    for rank, names in enumerate(read):
        layout = ConversionLayout(WORLD, rank, EP)
        start, stop = layout.rows(EXPERTS)
        experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names & set(expert_names)}
        assert experts == set(range(start, stop)), (rank, experts)  # its block of EXPERTS / WORLD experts
    # exporting a safetensors checkpoint, a rank reads the rows of its experts of each stack and its other tensors
    native = SafetensorsDir(work / f"{name}-native")
    stacks = [n for n in native.keys() if ".experts." in n and ".shared_experts." not in n]
    read = [rank[f"{name}-export-native"]["reads"] for rank in ranks]
    whole = sorted(r.split(":", 1)[1] for names in read for r in names if "[" not in r)
    assert whole == sorted(set(native.keys()) - set(stacks))  # each other tensor read once, by its owner
    for rank, names in enumerate(read):
        start, stop = ConversionLayout(WORLD, rank, EP).rows(EXPERTS)
        assert {r.split(":", 1)[1] for r in names if ".experts." in r and ".shared_experts." not in r} == {
            f"{n}[{start}:{stop}]" for n in stacks}


@pytest.mark.parametrize("name", list(MODELS))
def test_each_rank_peak_memory_is_below_the_checkpoint_size(converted, name):
    work, ranks, one_process = converted
    size = checkpoint_bytes(work / f"{name}-hub")
    assert size > 40 * 2**20  # large enough that a rank's share stands out from allocator noise
    assert one_process[name] > 0.9 * size  # the measure sees a conversion that holds the whole checkpoint
    for step in ("import", "export", "export-native"):
        peaks = [rank[f"{name}-{step}"]["peak_bytes"] for rank in ranks]
        assert max(peaks) < size, (step, peaks, size)
