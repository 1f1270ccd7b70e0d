"""The hardware the planner predicts for: one row per GPU with its sources, plus a user's own as YAML.

Peak dense FLOP/s are the MFU table's (``callbacks/peak_flops.py``: datasheet figures without sparsity), usable
memory the estimate's (``estimate/command.py``: what ``torch.cuda`` reports as total). Bandwidths are per GPU
and per direction:

- H100 SXM5: HBM3 3.35 TB/s; NVLink 4 900 GB/s bidirectional (450 GB/s each way), 8 GPUs per NVLink domain
  (HGX H100); one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s). NVIDIA H100 Tensor Core GPU datasheet; DGX H100
  user guide.
- H200 SXM: HBM3e 4.8 TB/s; NVLink and network as H100 (HGX H200). NVIDIA H200 datasheet.
- B200 (HGX B200): HBM3e 8 TB/s; NVLink 5 1.8 TB/s bidirectional (900 GB/s each way), 8 GPUs per domain;
  400 Gb/s ConnectX-7 per GPU. NVIDIA DGX B200 datasheet.
- GB200 NVL72: HBM3e 8 TB/s; NVLink 5 900 GB/s each way across all 72 GPUs of the rack (one NVLink domain);
  400 Gb/s per GPU across racks. NVIDIA GB200 NVL72 datasheet.

``cpu`` is this machine, one training process on its CPU (the CPU twins of the recipes): peak FLOP/s and
memory bandwidth measured here and cached (``callbacks/peak_flops.py``: a square bf16 matmul, the rate MFU on CPU
divides by, and a large tensor copy), memory the machine's RAM. One process has no links, so its NVLink and
network bandwidths are infinite (collectives cost nothing) and its domain is one rank. Its constants are its own:
``gemm`` is 1 (the peak *is* a large GEMM's measured rate) and ``gemm_knee`` is fitted by
``benchmarks/plan_vs_cpu.py`` on one CPU twin (the other held out); at these toy widths the knee stands for
the per-operation overhead of small GEMMs and the training loop as much as for the GEMMs' shape.

A user's GPU is a YAML file given as ``--gpu FILE.yaml``::

    name: MyGPU
    peak_flops: {bf16: 989.0e12, fp8: 1979.0e12}   # dense FLOP/s; mxfp8 optional
    memory_gib: 79.2          # usable
    hbm_bytes_per_s: 3.35e12
    nvlink_bytes_per_s: 450.0e9   # per GPU, each way
    network_bytes_per_s: 50.0e9   # per GPU, each way
    nvlink_domain: 8          # GPUs one NVLink domain joins
    constants: hopper         # efficiency constants of a fitted family (hopper, blackwell), or a mapping

The step-time model's efficiency constants are fitted per hardware family on published rows
(``benchmarks/plan_vs_published.py`` prints the fit); H200 takes H100's (same SM and tensor cores) and B200
GB200's.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import yaml

from lightning_moe.callbacks.peak_flops import PEAK_FLOPS, cpu_memory_bandwidth, cpu_peak_flops
from lightning_moe.estimate.command import DEVICE_MEMORY_GIB


@dataclass(frozen=True)
class Constants:
    """The step-time model's efficiency constants (``plan/step_time.py`` says where each enters).

    Fitted per hardware family: ``gemm`` (the fraction of peak a large GEMM reaches), ``gemm_knee`` (the
    smallest GEMM side, in elements, at which a GEMM reaches half of that: tokens per expert for grouped expert
    GEMMs), ``link`` (the fraction of a link's bandwidth a collective reaches). Fixed, stated rather than fitted:
    ``attention`` and ``scan`` (attention scores and chunked linear-attention / SSD scans, relative to ``gemm``),
    ``overlap`` (the fraction of compute that FSDP's prefetch can hide its collectives behind), ``elementwise``
    (passes over a block's hidden states per token, forward + backward, at memory bandwidth)."""

    gemm: float = 0.6
    gemm_knee: float = 256.0
    link: float = 0.7
    attention: float = 0.6
    scan: float = 0.25
    overlap: float = 0.9
    elementwise: float = 40.0


FITTED = ("gemm", "gemm_knee", "link")

# fitted by benchmarks/plan_vs_published.py on its calibration rows (every other published row per GPU type, in
# file order): H100 on 8 rows, GB200 on 4; ``link`` reached the top of the grid (1.0) on both
FAMILIES: dict[str, Constants] = {
    "hopper": Constants(gemm=0.65, gemm_knee=128.0, link=1.0),
    "blackwell": Constants(gemm=0.85, gemm_knee=2048.0, link=1.0),
    # fitted by benchmarks/plan_vs_cpu.py on the dense CPU twin (configs/tiny/dense_cp_benchmark.yaml) on a
    # 2-thread AVX-512 server CPU (rounded), the MoE twin held out: it runs 1.5-1.8x the dense twin's time at about
    # its FLOPs, which the model's FLOPs-and-bytes terms do not see (per-operation overhead at toy widths)
    "cpu": Constants(gemm=1.0, gemm_knee=4500.0),
}


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dense FLOP/s by GEMM precision: bf16, fp8, mxfp8
    memory_gib: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    network_bytes_per_s: float
    nvlink_domain: int
    constants: Constants = field(default_factory=Constants)
    family: str = "custom"
    source: str = ""

    def peak(self, precision: str) -> float:
        """Dense FLOP/s of GEMMs in ``precision`` (bf16 where the GPU has no such tensor cores)."""
        return self.peak_flops.get(precision) or self.peak_flops["bf16"]


def _row(name: str, table_name: str, hbm: float, nvlink: float, network: float, domain: int, family: str,
         source: str) -> Hardware:
    return Hardware(name=name, peak_flops=dict(PEAK_FLOPS[table_name]), memory_gib=DEVICE_MEMORY_GIB[table_name],
                    hbm_bytes_per_s=hbm, nvlink_bytes_per_s=nvlink, network_bytes_per_s=network,
                    nvlink_domain=domain, constants=FAMILIES[family], family=family, source=source)


def builtin_hardware() -> dict[str, Hardware]:
    return {
        "h100": _row("H100", "H100", 3.35e12, 450e9, 50e9, 8, "hopper", "NVIDIA H100 SXM5 datasheet; DGX H100"),
        "h200": _row("H200", "H200", 4.8e12, 450e9, 50e9, 8, "hopper", "NVIDIA H200 SXM datasheet; HGX H200"),
        "b200": _row("B200", "B200", 8.0e12, 900e9, 50e9, 8, "blackwell", "NVIDIA DGX B200 datasheet"),
        "gb200": _row("GB200", "GB200", 8.0e12, 900e9, 50e9, 72, "blackwell", "NVIDIA GB200 NVL72 datasheet"),
    }


def cpu_hardware() -> Hardware:
    """This machine's CPU as one training process: its measured bf16 matmul peak and memory bandwidth (cached),
    its RAM, no links."""
    peak, peak_source = cpu_peak_flops(torch.bfloat16)
    bandwidth, bandwidth_source = cpu_memory_bandwidth()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Hardware(name=f"CPU ({torch.get_num_threads()} threads)", peak_flops={"bf16": peak}, memory_gib=ram,
                    hbm_bytes_per_s=bandwidth, nvlink_bytes_per_s=math.inf, network_bytes_per_s=math.inf,
                    nvlink_domain=1, constants=FAMILIES["cpu"], family="cpu",
                    source=f"{peak_source}; {bandwidth_source}")


REQUIRED = ("peak_flops", "memory_gib", "hbm_bytes_per_s", "nvlink_bytes_per_s", "network_bytes_per_s",
            "nvlink_domain")


def load_hardware_yaml(path: Path) -> Hardware:
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"--gpu {path}: not valid YAML ({error})") from error
    if not isinstance(spec, dict):
        raise ValueError(f"--gpu {path}: expected a mapping of {', '.join(REQUIRED)}")
    missing = [key for key in REQUIRED if key not in spec]
    if missing:
        raise ValueError(f"--gpu {path}: missing {', '.join(missing)}")
    peak = spec["peak_flops"]
    if not isinstance(peak, dict) or "bf16" not in peak:
        raise ValueError(f"--gpu {path}: peak_flops must be a mapping with at least bf16 (dense FLOP/s)")
    constants = spec.get("constants", "hopper")
    if isinstance(constants, str):
        if constants not in FAMILIES:
            raise ValueError(f"--gpu {path}: constants {constants!r} is not one of {sorted(FAMILIES)} or a mapping")
        family, constants = constants, FAMILIES[constants]
    elif isinstance(constants, dict):
        known = {f.name for f in fields(Constants)}
        unknown = sorted(set(constants) - known)
        if unknown:
            raise ValueError(f"--gpu {path}: unknown constants {unknown}; known: {sorted(known)}")
        family, constants = "custom", Constants(**{k: float(v) for k, v in constants.items()})
    else:
        raise ValueError(f"--gpu {path}: constants must be a family name or a mapping")
    return Hardware(name=str(spec.get("name", path.stem)), peak_flops={k: float(v) for k, v in peak.items()},
                    memory_gib=float(spec["memory_gib"]), hbm_bytes_per_s=float(spec["hbm_bytes_per_s"]),
                    nvlink_bytes_per_s=float(spec["nvlink_bytes_per_s"]),
                    network_bytes_per_s=float(spec["network_bytes_per_s"]), nvlink_domain=int(spec["nvlink_domain"]),
                    constants=constants, family=family, source=str(path))


def hardware_named(name: str) -> Hardware:
    """A built-in GPU by name (case-insensitive), or a YAML file describing one; a one-line error otherwise."""
    table = builtin_hardware()
    if name.lower() in table:
        return table[name.lower()]
    if name.lower() == "cpu":
        return cpu_hardware()
    path = Path(name)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ValueError(f"--gpu {name}: no such hardware file")
        return load_hardware_yaml(path)
    raise ValueError(f"--gpu {name!r}: unknown GPU; use one of {', '.join(table)}, cpu or a YAML file describing it "
                     f"({', '.join(REQUIRED)})")


def hardware_of_recipe(hardware_line: str | None) -> Hardware | None:
    """The built-in GPU a recipe's ``# Hardware:`` line names (longest name first: GB200 before B200)."""
    if not hardware_line:
        return None
    table = builtin_hardware()
    for key in sorted(table, key=len, reverse=True):
        if table[key].name in hardware_line:
            return table[key]
    return None
