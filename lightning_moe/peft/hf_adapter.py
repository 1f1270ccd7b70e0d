"""Adapters in Hugging Face PEFT layout: ``adapter_config.json`` + ``adapter_model.safetensors``.

The layout is the one peft itself produces for the transformers model of the same base, found by injecting
the same adapters into that model built on the meta device: linear adapters keep their shape under the hub
module name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); expert adapters become peft
``target_parameters`` adapters on transformers' fused ``experts.gate_up_proj`` / ``experts.down_proj``, whose
``lora_A`` is ``[E * r, in]`` (expert-major) and ``lora_B`` ``[out, r * E]`` (expert-minor).
``peft.PeftModel.from_pretrained`` on the transformers model then computes what the native model computes.

Adapters of layers transformers does not have (the MTP layers: transformers drops them on load) have no PEFT
counterpart; they travel next to the adapter, under their native names, in ``mtp_adapter_model.safetensors``,
which peft ignores and :func:`load_hf_adapter` reads back, so a run can start again from the whole adapter.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from lightning_moe.io.atomic import atomic_directory
from lightning_moe.io.files import copy_aux_files
from lightning_moe.models.families import family_by_name
from lightning_moe.models.families.base import TensorMap
from lightning_moe.models.hf_weights import HubNames
from lightning_moe.models.layers.moe import GroupedExperts
from lightning_moe.models.weights import copy_tensors_into
from lightning_moe.peft.experts import ExpertLora, fused_input_projection
from lightning_moe.peft.lora import ADAPTER_NAME, is_adapter_parameter, lora_modules
from lightning_moe.peft.merge import full_tensor

# transformers and peft are imported inside the functions that use them: they take seconds to import
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MTP_ADAPTER_WEIGHTS = "mtp_adapter_model.safetensors"
MTP_PREFIX = "mtp."
KEY_PREFIX = "base_model.model."
# our expert adapter -> the transformers experts parameter it lives on
HF_EXPERT_PARAMETERS = {"gate_up": "gate_up_proj", "up": "up_proj", "down": "down_proj"}
_DEFAULT_TO_HF = {f.name: f.default for f in dataclasses.fields(TensorMap)}["to_hf"]


@dataclass
class AdapterLayout:
    """How the native adapters map onto the transformers model: tensor maps, peft config, scaling."""

    maps: list[TensorMap]
    peft_config: Any  # peft.LoraConfig for the transformers model
    scaling: float


def hf_meta_model(hf_config: dict[str, Any]) -> nn.Module:
    """The transformers model of ``hf_config``, on the meta device."""
    import transformers

    settings = {k: v for k, v in hf_config.items() if k not in ("model_type", "transformers_version")}
    config = transformers.AutoConfig.for_model(hf_config["model_type"], **settings)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _rank_and_scaling(owners: dict[str, nn.Module]) -> tuple[int, float]:
    settings = set()
    for module in owners.values():
        if isinstance(module, GroupedExperts):
            adapter: ExpertLora = module.adapter
            settings.add((next(iter(adapter.lora_A.values())).shape[1], adapter.scaling))
        else:
            settings.add((module.r[ADAPTER_NAME], module.scaling[ADAPTER_NAME]))
    if len(settings) != 1:
        raise ValueError(f"adapters with different rank/scaling {sorted(settings)} have no single PEFT config")
    return settings.pop()


def _hf_module(weight_map: dict[str, TensorMap], hub_names: HubNames, native_module: str) -> str:
    m = weight_map.get(f"{native_module}.weight")
    renames = m is not None and len(m.hf) == 1 and not getattr(m, "joint", ()) and m.to_hf is _DEFAULT_TO_HF
    if not renames:
        raise ValueError(
            f"adapter on {native_module}: the family maps its weight to the hub "
            f"{'not at all' if m is None else 'with a transformation'}, so the adapter has no PEFT counterpart"
        )
    return hub_names(m.hf[0]).removesuffix(".weight")


def _hf_expert_parameter(weight_map: dict[str, TensorMap], hub_names: HubNames, hf_params: list[str], native: str,
                         which: str) -> str:
    stacked = weight_map.get(f"{native}.down_proj")
    layer = re.match(r"^(.*?\.layers\.\d+)\.", hub_names(stacked.hf[0])) if stacked is not None else None
    if layer is None:
        raise ValueError(f"expert adapter on {native}: the family has no per-layer hub tensors for these experts")
    suffix = f".experts.{HF_EXPERT_PARAMETERS[which]}"
    found = [p for p in hf_params if p.startswith(layer.group(1) + ".") and p.endswith(suffix)]
    if len(found) != 1:
        raise ValueError(
            f"expert adapter on {native}: the transformers model has {len(found)} parameters "
            f"'{layer.group(1)}.*{suffix}' (needs exactly one fused experts tensor)"
        )
    return found[0]


def _compact(chosen: list[str], universe: list[str]) -> list[str]:
    """The shortest name suffixes that select exactly ``chosen`` among ``universe`` (peft's list matching)."""
    depth = 1
    while depth <= max(n.count(".") + 1 for n in chosen):
        short = sorted({".".join(n.split(".")[-depth:]) for n in chosen})
        picked = {u for u in universe if any(u == s or u.endswith(f".{s}") for s in short)}
        if picked == set(chosen):
            return short
        depth += 1
    return sorted(chosen)


def adapter_layout(model: nn.Module, hf_config: dict[str, Any] | None = None, *, trained: Sequence[str] = (),
                   modules_to_save: Sequence[str] = ()) -> AdapterLayout:
    """Match every native adapter to its tensors in the PEFT layout of the transformers model.

    ``trained``: native names of tensors other than adapters that the run changed (the router bias of
    aux-loss-free balancing); the transformers modules holding them are saved whole, as peft's
    ``modules_to_save``, next to ``modules_to_save`` given by name (an adapter read back)."""
    import peft

    owners = lora_modules(model)
    if not owners:
        raise ValueError("the model has no LoRA adapters (apply_lora was not called)")
    # MTP adapters are written beside the PEFT adapter (mtp_adapter_tensors)
    owners = {name: module for name, module in owners.items() if not name.startswith(MTP_PREFIX)}
    if not owners:
        raise ValueError("every adapter is on an mtp.* layer, which the transformers model does not have; "
                         "a PEFT adapter needs adapters on the main model")
    config = model.config
    family = family_by_name(config.family)
    hf_config = hf_config or family.to_hf_config(config)
    weight_map = {m.native: m for m in family.weight_map(config)}
    hf_model = hf_meta_model(hf_config)
    _check_peft_accepts(owners, hf_model)
    hf_params = [n for n, _ in hf_model.named_parameters()]
    hub_names = HubNames.of(hf_model)
    rank, scaling = _rank_and_scaling(owners)

    linear_to_hf: dict[str, str] = {}
    expert_to_hf: dict[tuple[str, str], str] = {}
    for name, module in owners.items():
        if isinstance(module, GroupedExperts):
            for which in (fused_input_projection(module), "down"):
                expert_to_hf[(name, which)] = _hf_expert_parameter(weight_map, hub_names, hf_params, name, which)
        else:
            linear_to_hf[name] = _hf_module(weight_map, hub_names, name)
    module_names = [n for n, _ in hf_model.named_modules()]
    saved = sorted(set(modules_to_save) | {_hf_owner(weight_map, hub_names, name) for name in trained
                                           if not name.startswith(MTP_PREFIX)})
    peft_config = peft.LoraConfig(
        r=rank,
        lora_alpha=scaling * rank,
        # peft's adapters on parameters do not support dropout; it is a training-time setting anyway
        lora_dropout=0.0,
        target_modules=_compact(sorted(linear_to_hf.values()), module_names) if linear_to_hf else None,
        target_parameters=_compact(sorted(expert_to_hf.values()), hf_params) if expert_to_hf else None,
        modules_to_save=saved or None,
        base_model_name_or_path=hf_config.get("_name_or_path") or None,
        task_type="CAUSAL_LM",
        inference_mode=True,
    )
    # peft edits the config while injecting (transformers 5 MoE retargeting); the file keeps what was asked.
    # Modules saved whole are laid out below: the injected model shows where the adapters go.
    peft.inject_adapter_in_model(dataclasses.replace(copy.deepcopy(peft_config), modules_to_save=None), hf_model)
    placed = _peft_keys(hf_model)

    maps = []
    for native, hf_module in linear_to_hf.items():
        for ab in ("lora_A", "lora_B"):
            maps.append(TensorMap.rename(f"{native}.{ab}.{ADAPTER_NAME}.weight", _take(placed, native, hf_module, None, ab)))
    for (native, which), hf_param in expert_to_hf.items():
        module_path, _, param = hf_param.rpartition(".")
        a_key = _take(placed, native, module_path, param, "lora_A")
        b_key = _take(placed, native, module_path, param, "lora_B")
        maps += [_expert_a_map(f"{native}.adapter.lora_A.{which}", a_key, rank),
                 _expert_b_map(f"{native}.adapter.lora_B.{which}", b_key, rank)]
    if placed:
        raise ValueError(f"peft adapts {sorted(placed)[:3]} of the transformers model, which no native adapter "
                         f"matches: this base cannot hold these adapters in PEFT layout")
    _check_shapes(model, maps, hf_model)
    for module in saved:
        maps += _saved_module_maps(weight_map, hub_names, hf_model, module, set(owners))
    return AdapterLayout(maps, peft_config, scaling)


def _hf_owner(weight_map: dict[str, TensorMap], hub_names: HubNames, native: str) -> str:
    """The transformers module holding native tensor ``native`` (renamed to the hub as it is)."""
    m = weight_map.get(native)
    if m is None or len(m.hf) != 1 or m.to_hf is not _DEFAULT_TO_HF:
        raise ValueError(f"the run changed {native}, which the family maps to the hub "
                         f"{'not at all' if m is None else 'with a transformation'}: a PEFT adapter cannot hold it")
    return hub_names(m.hf[0]).rpartition(".")[0]


def _saved_module_maps(weight_map: dict[str, TensorMap], hub_names: HubNames, hf_model: nn.Module, module: str,
                       adapted: set[str]) -> list[TensorMap]:
    """Every tensor of transformers module ``module`` (peft saves a ``modules_to_save`` module whole), renamed
    from its native tensor."""
    wanted = {f"{module}.{name}" for name in hf_model.get_submodule(module).state_dict()}
    maps = []
    for m in weight_map.values():
        if len(m.hf) == 1 and m.to_hf is _DEFAULT_TO_HF and hub_names(m.hf[0]) in wanted:
            if m.native.rpartition(".")[0] in adapted:
                raise ValueError(f"{m.native}: a module saved whole ({module}) cannot hold an adapter too")
            wanted.discard(hub_names(m.hf[0]))
            maps.append(TensorMap.rename(m.native, f"{KEY_PREFIX}{hub_names(m.hf[0])}"))
    if wanted:
        raise ValueError(f"{module} is saved whole in the PEFT adapter, but no native tensor renames to "
                         f"{sorted(wanted)[:3]}")
    return maps


def _check_peft_accepts(owners: dict[str, nn.Module], hf_model: nn.Module) -> None:
    """peft refuses LoRA on the Mamba mixers' out_proj of transformers' Mamba models (their fused kernels read
    ``out_proj.weight`` directly, so an adapter there would be skipped): such adapters have no PEFT form."""
    import peft
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba  # peft's own rule, kept in step

    probe = peft.LoraConfig(r=1)
    refused = []
    for name in owners:
        try:
            _check_lora_target_modules_mamba(probe, hf_model, name.rpartition(".")[2])
        except ValueError:
            refused.append(name)
    if refused:
        raise ValueError(
            f"adapters on {', '.join(refused[:3])}{' ...' if len(refused) > 3 else ''}: peft refuses LoRA on the "
            f"Mamba mixers' out_proj of {hf_model.config.model_type} models (their fused kernels bypass it), so no "
            f"PEFT adapter can hold them; export the merged model (--merged-out), or train with "
            f"peft.exclude_modules: [mamba.out_proj]"
        )


def _take(placed: dict[str, tuple[str, str | None, str]], native: str, hf_module: str, param: str | None,
          ab: str) -> str:
    wanted = (hf_module, param, ab)
    for key, where in placed.items():
        if where == wanted:
            del placed[key]
            return key
    target = hf_module if param is None else f"{hf_module}.{param}"
    raise ValueError(
        f"adapter on {native}: peft does not adapt {target} of the transformers model from this config (peft on "
        f"transformers 5 reads targets named like expert projections of fused-MoE models as expert targets); "
        f"leave it out with peft.exclude_modules or export the merged model instead"
    )


def _peft_keys(hf_model: nn.Module) -> dict[str, tuple[str, str | None, str]]:
    """Key in adapter_model.safetensors -> (unwrapped module, targeted parameter or None, lora_A|lora_B)."""
    from peft.tuners.lora import LoraLayer

    keys = {}
    for name, module in hf_model.named_modules():
        if isinstance(module, LoraLayer):
            unwrapped = re.sub(r"(\.base_layer)+$", "", name)
            param = getattr(module, "parameter_name", None)
            for ab in ("lora_A", "lora_B"):
                keys[f"{KEY_PREFIX}{name}.{ab}.weight"] = (unwrapped, param, ab)
    return keys


def _check_shapes(model: nn.Module, maps: list[TensorMap], hf_model: nn.Module) -> None:
    """Our adapters, laid out for peft, must have the shapes peft gave the transformers model's adapters."""
    ours = dict(model.named_parameters())
    theirs = {f"{KEY_PREFIX}{n}".replace(f".{ADAPTER_NAME}.", "."): p for n, p in hf_model.named_parameters()}
    for m in maps:
        native = ours[m.native]
        shape = tuple(m.to_hf(torch.empty(native.shape, device="meta"))[0].shape)
        if shape != tuple(theirs[m.hf[0]].shape):
            raise ValueError(f"adapter {m.native}: PEFT layout shape {shape}, peft expects "
                             f"{tuple(theirs[m.hf[0]].shape)} for {m.hf[0]}")


def _expert_a_map(native: str, key: str, rank: int) -> TensorMap:
    # ours [E, r, in] <-> peft [E * r, in]: expert-major rows
    return TensorMap(
        native, (key,),
        to_native=lambda ts: ts[0].reshape(-1, rank, ts[0].shape[-1]),
        to_hf=lambda t: [t.reshape(-1, t.shape[-1])],
    )


def _expert_b_map(native: str, key: str, rank: int) -> TensorMap:
    # ours [E, out, r] <-> peft [out, r * E]: column k * E + e holds rank k of expert e
    return TensorMap(
        native, (key,),
        to_native=lambda ts: ts[0].reshape(ts[0].shape[0], rank, -1).permute(2, 0, 1).contiguous(),
        to_hf=lambda t: [t.permute(1, 2, 0).reshape(t.shape[1], -1).contiguous()],
    )


def export_hf_adapter(model: nn.Module, out: str | Path, *, hf_config: dict[str, Any] | None = None,
                      trained: Sequence[str] = (), dtype: torch.dtype | None = None, base_model: str | None = None,
                      aux_dir: Path | None = None, overwrite: bool = False) -> Path:
    """Write the model's adapters as a Hugging Face PEFT adapter directory; ``trained`` names the other tensors
    the run changed (their transformers modules are saved whole, see :func:`adapter_layout`). ``base_model``
    (a hub id or directory) is what ``AutoPeftModelForCausalLM`` loads the adapter onto; ``aux_dir``'s tokenizer
    and generation files are copied beside it."""
    layout = adapter_layout(model, hf_config, trained=trained)
    if base_model is not None:
        layout.peft_config.base_model_name_or_path = base_model
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}

    def value(name: str) -> torch.Tensor:
        tensor = full_tensor(params[name].detach())
        return (tensor if dtype is None else tensor.to(dtype)).cpu()

    tensors = {m.hf[0]: m.to_hf(value(m.native))[0].contiguous() for m in layout.maps}
    mtp_tensors = mtp_adapter_names(model) + [name for name in trained if name.startswith(MTP_PREFIX)]
    mtp = {name: value(name).contiguous() for name in mtp_tensors}
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        if mtp:
            save_file(mtp, str(tmp / MTP_ADAPTER_WEIGHTS), metadata={"format": "pt"})
        layout.peft_config.save_pretrained(str(tmp))
        if aux_dir is not None:
            copy_aux_files(aux_dir, tmp)
    return Path(out)


def export_transformers_adapter(hf_model: nn.Module, out: str | Path, *, dtype: torch.dtype | None = None,
                                base_model: str | None = None, aux_dir: Path | None = None,
                                overwrite: bool = False) -> Path:
    """The adapters of a transformers causal LM trained with LoRA (the transformers path, ``model: {hf: ...}``
    without a native decoder) as a PEFT adapter directory. The names are transformers' own, so the layout is
    peft's for the same targets; injecting the written config into the model's meta twin must give exactly
    these adapters. ``base_model`` and ``aux_dir``: as for :func:`export_hf_adapter`."""
    import peft

    owners = lora_modules(hf_model)
    if not owners:
        raise ValueError("the model has no LoRA adapters (apply_lora was not called)")
    _check_peft_accepts(owners, hf_model)
    rank, scaling = _rank_and_scaling(owners)
    plain = [n for n, _ in hf_model.named_modules() if ".lora_" not in n and ".base_layer" not in n]
    peft_config = peft.LoraConfig(
        r=rank, lora_alpha=scaling * rank, lora_dropout=0.0, target_modules=_compact(sorted(owners), plain),
        base_model_name_or_path=base_model or getattr(hf_model.config, "_name_or_path", None) or None,
        task_type="CAUSAL_LM",
        inference_mode=True,
    )
    twin = hf_meta_model(hf_model.config.to_dict())
    way_out = "export the merged model (--merged-out, or `lightning-moe convert export --ckpt`)"
    try:
        peft.inject_adapter_in_model(copy.deepcopy(peft_config), twin)
    except ValueError as err:  # e.g. transformers 5 fused experts: peft retargets expert-named projections
        raise ValueError(f"peft cannot lay these adapters out on {type(hf_model).__name__} ({err}); {way_out}") from err
    tensors = {}
    for name, layer in owners.items():
        for ab in ("lora_A", "lora_B"):
            tensor = full_tensor(getattr(layer, ab)[ADAPTER_NAME].weight.detach())
            tensors[f"{KEY_PREFIX}{name}.{ab}.weight"] = (tensor if dtype is None else tensor.to(dtype)).cpu().contiguous()
    placed = set(_peft_keys(twin))
    if placed != set(tensors):
        raise ValueError(f"peft places this config's adapters on {sorted(placed ^ set(tensors))[:3]} (and not all of "
                         f"the model's): the adapters have no PEFT layout; {way_out}")
    with atomic_directory(out, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        peft_config.save_pretrained(str(tmp))
        if aux_dir is not None:
            copy_aux_files(aux_dir, tmp)
    return Path(out)


def mtp_adapter_names(model: nn.Module) -> list[str]:
    """Native names of the adapter tensors on mtp.* layers (written to ``mtp_adapter_model.safetensors`` with the
    other MTP tensors the run changed)."""
    return [name for name, _ in model.named_parameters()
            if name.startswith(MTP_PREFIX) and is_adapter_parameter(name)]


def _read_mtp_adapters(model: nn.Module, directory: Path) -> list[tuple[str, torch.Tensor]]:
    wanted, path = mtp_adapter_names(model), directory / MTP_ADAPTER_WEIGHTS
    if not wanted:
        if path.is_file():
            raise ValueError(f"{path}: the adapter has MTP adapters but the model has none on mtp.* layers "
                             f"(set peft.include_mtp: true, on a model with MTP layers)")
        return []
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: missing {MTP_ADAPTER_WEIGHTS}; the model has {len(wanted)} adapter "
                                f"tensors on mtp.* layers (train without peft.include_mtp to leave them out)")
    params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        missing = set(wanted) - keys
        unknown = {k for k in keys - set(wanted) if is_adapter_parameter(k) or k not in params}
        if missing or unknown:
            raise ValueError(f"{path}: MTP tensors {sorted(missing | unknown)[:3]} are in only one of the file and "
                             f"the model (other MTP targets or depths)")
        loaded = [(name, f.get_tensor(name)) for name in sorted(keys)]
    for name, tensor in loaded:
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(tensor.shape)}, the model's adapter needs "
                             f"{tuple(params[name].shape)} (another rank or base model)")
    return loaded


def load_hf_adapter(model: nn.Module, adapter_dir: str | Path, *, hf_config: dict[str, Any] | None = None) -> int:
    """Copy a Hugging Face PEFT adapter into the model's adapters (same targets, rank and alpha).
    Returns the number of tensors loaded."""
    directory = Path(adapter_dir)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory}: missing {name} (not a PEFT adapter directory)")
    saved = json.loads((directory / ADAPTER_CONFIG).read_text())
    layout = adapter_layout(model, hf_config, modules_to_save=saved.get("modules_to_save") or ())
    _check_config(saved, layout, directory)
    with safe_open(str(directory / ADAPTER_WEIGHTS), framework="pt") as f:
        keys = set(f.keys())
        expected = {m.hf[0]: m for m in layout.maps}
        unexpected = sorted(keys - set(expected))
        missing = sorted(set(expected) - keys)
        if unexpected or missing:
            raise ValueError(
                f"{directory / ADAPTER_WEIGHTS}: "
                + (f"tensor(s) {unexpected[:3]} have no adapter in this model; " if unexpected else "")
                + (f"adapter tensor(s) {missing[:3]} are missing; " if missing else "")
                + "the adapter was trained with other targets (check peft.target_modules / target_experts)"
            )
        params = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        loaded = []
        for key, m in expected.items():
            meta = torch.empty(f.get_slice(key).get_shape(), device="meta")
            shape, want = tuple(m.to_native([meta]).shape), tuple(params[m.native].shape)
            if shape != want:
                raise ValueError(
                    f"{directory / ADAPTER_WEIGHTS}: tensor {key} has shape {tuple(meta.shape)}, the model's "
                    f"adapter {m.native} needs {want}: the adapter belongs to a different base model or rank"
                )
            loaded.append((m.native, m.to_native([f.get_tensor(key)])))
    return copy_tensors_into(model, loaded + _read_mtp_adapters(model, directory))


def _check_config(saved: dict[str, Any], layout: AdapterLayout, directory: Path) -> None:
    where = directory / ADAPTER_CONFIG
    if saved.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type {saved.get('peft_type')!r}, only LORA adapters are supported")
    for key in ("use_dora", "use_rslora"):
        if saved.get(key):
            raise ValueError(f"{where}: {key}=true is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if saved.get(key):
            raise ValueError(f"{where}: per-module {key} is not supported")
    rank = layout.peft_config.r
    if saved.get("r") != rank or abs(saved.get("lora_alpha", 0) / saved["r"] - layout.scaling) > 1e-9:
        raise ValueError(
            f"{where}: r={saved.get('r')}, lora_alpha={saved.get('lora_alpha')}; the model's adapters have "
            f"r={rank}, alpha={layout.scaling * rank:g} (set peft.r / peft.alpha to match)"
        )
