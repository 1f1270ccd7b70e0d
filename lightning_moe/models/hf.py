"""The generic path: any transformers causal LM (or image-text-to-text model) trained like a native decoder.

Architectures without a native family (Qwen3-Next, Kimi-Linear, remote-code models, vision-language models)
train as the transformers model itself, as NeMo AutoModel does: :func:`build_hf_model` constructs it with its
parameters on the meta device, applies converters (LoRA, FP8) and the package's parallelism, materializes it
and streams the checkpoint into the (possibly sharded) parameters. :class:`HFModel` puts it behind the native
``Decoder`` interface, so ``CausalLM``'s loss normalization, optimizer and callbacks apply unchanged:
``model(input_ids, position_ids)`` gives logits, ``model(input_ids, position_ids, labels=labels)`` gives loss
*sums* over pre-shifted labels, computed with the fused chunked output layer from the output layer's input
(transformers' own loss is a mean over labels it shifts itself).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_moe.dtypes import FLOAT_DTYPES
from lightning_moe.io.files import HF_CONFIG, read_json
from lightning_moe.models.build import build_model
from lightning_moe.models.config import ModelConfig
from lightning_moe.models.converters import apply_converters
from lightning_moe.models.decoder import LossOutput
from lightning_moe.models.families import family_for_hf_config
from lightning_moe.models.hf_experts import force_balanced_routing, track_expert_load
from lightning_moe.models.hf_packing import PackedMaskCheck
from lightning_moe.models.hf_weights import load_hf_weights
from lightning_moe.models.hub import local_dir_or_hub_id, snapshot_dir
from lightning_moe.models.layers.loss import (
    IGNORE_INDEX,
    cross_entropy_sum,
    linear_cross_entropy,
    vocab_parallel_loss,
)

TASKS = ("causal-lm", "image-text-to-text")
# config keys of heads that transform logits after the output GEMM (softcapping, scaling): those models
# compute the loss from their own logits instead of the fused output layer
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_softcapping", "logits_scaling", "logit_scale",
                        "output_multiplier", "lm_head_multiplier")
# layer types whose mixing respects packed-sequence boundaries through the attention mask
MASKED_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# layers whose output at a token depends on a state carried from earlier tokens (linear attention, Mamba), by class
SEQUENCE_STATE_CLASSES = re.compile(r"(Mamba\d?Mixer|GatedDeltaNet|DeltaAttention|LightningAttention)$")
SEQUENCE_STATE_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "gated_deltanet", "lightning_attention")


@dataclass
class HFModelConfig:
    """A transformers checkpoint to train as is.

    Args:
        hf: a Hugging Face model directory or hub id (downloaded once; tests and air-gapped runs use directories).
        trust_remote_code: allow the model's own Python code (``auto_map`` in config.json) to run.
        revision: hub revision (branch, tag or commit) of a hub id.
        dtype: parameter dtype (``float32``, ``bfloat16``, ``float16``); default float32, the master weights
            of mixed-precision training.
        attn_implementation: transformers attention backend (``sdpa``, ``flash_attention_2``, ``eager``, ...);
            default: transformers' choice.
        native: ``auto`` trains architectures with a native family through the native decoder (as
            ``pretrained``; the options below then do not apply) and the rest through transformers;
            ``always`` requires a native family; ``never`` always uses transformers.
        loss_chunk_size: tokens per chunk of the fused output-layer cross entropy.
        force_balanced: benchmarks: token copies go round-robin to the experts of transformers' standardized
            experts modules, whatever the router chose (the native ``moe.force_balanced``); with a native family
            set it in the native recipe's ``moe`` instead.
        bias_update_rate: aux-loss-free balancing for routers with an ``e_score_correction_bias`` (DeepSeek-V3
            style: GLM-5, MiMo-V2, Laguna, Kimi-Linear, DeepSeek-V4): after each optimizer step the bias moves by
            ``rate * sign(mean load - load)`` from the expert load counted on all ranks (the native
            ``moe.bias_update_rate``); 0 leaves the bias as loaded.
        attention_backend: the native path only: the native decoder's attention kernel (``sdpa``, ``flex``,
            ``te``: its ``attention.backend``, sliding blocks' included), which a hub config does not choose;
            default: the family's (sdpa).
        mtp_enabled: the native path only: false keeps the checkpoint's multi-token-prediction layers (loaded,
            saved and exported back) without computing them: no MTP loss, no gradient on their weights.
        mtp_shared_depths: the native path only: MTP depths that all apply the checkpoint's one MTP layer, with
            its weights shared (Megatron-Core's ``mtp_use_repeated_layer`` with ``mtp_num_layers``); exports hold
            that one layer. Default: one depth per MTP layer of the checkpoint, each with its own weights.
    """

    hf: str
    trust_remote_code: bool = False
    revision: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = None
    native: Literal["auto", "always", "never"] = "auto"
    loss_chunk_size: int = 1024
    force_balanced: bool = False
    bias_update_rate: float = 0.0
    attention_backend: Literal["sdpa", "flex", "te"] | None = None
    mtp_enabled: bool = True
    mtp_shared_depths: int | None = None

    def __post_init__(self) -> None:
        if self.mtp_shared_depths is not None and self.mtp_shared_depths < 1:
            raise ValueError(f"model.mtp_shared_depths={self.mtp_shared_depths} must be >= 1 (or null)")
        if self.native not in ("auto", "always", "never"):
            raise ValueError(f"model.native={self.native!r} must be auto, always or never")
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r} must be one of {sorted(FLOAT_DTYPES)} (or null for float32)")
        if self.bias_update_rate < 0:
            raise ValueError(f"model.bias_update_rate={self.bias_update_rate} must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return FLOAT_DTYPES[self.dtype or "float32"]


# ---------------------------------------------------------------------------------------------- locating
def resolve_model_dir(cfg: HFModelConfig) -> Path:
    """The local directory of ``cfg.hf``: the path itself, or the hub snapshot (downloaded when missing)."""
    return model_dir(cfg.hf, "model.hf", cfg.revision, cfg.trust_remote_code)


def model_dir(name: str, key: str, revision: str | None = None, trust_remote_code: bool = False) -> Path:
    """The local directory of a model named by a path or a hub id (its snapshot, downloaded when missing);
    ``key`` names the setting in errors."""
    found = local_dir_or_hub_id(name, key)
    if isinstance(found, Path):
        return found
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
    if trust_remote_code:
        patterns.append("*.py")
    return snapshot_dir(found, key, revision, patterns)


def read_config_json(directory: Path) -> dict[str, Any]:
    return read_json(directory / HF_CONFIG)


def check_remote_code(cfg: HFModelConfig, config_json: dict[str, Any]) -> None:
    """Custom modeling code runs only when granted; architectures transformers implements itself never need it."""
    auto_map = config_json.get("auto_map")
    if not auto_map or cfg.trust_remote_code:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if config_json.get("model_type") in CONFIG_MAPPING_NAMES:
        return
    target = next(iter(auto_map.values())) if isinstance(auto_map, dict) else auto_map
    raise ValueError(
        f"model.hf={cfg.hf!r}: model_type {config_json.get('model_type')!r} needs the checkpoint's own code "
        f"({target}); set model.trust_remote_code: true to run it"
    )


def native_family(config_json: dict[str, Any]):
    """The native family of this architecture, or None."""
    try:
        return family_for_hf_config(config_json)
    except ValueError:
        return None


def native_checkpoint_dir(cfg: HFModelConfig) -> Path | None:
    """The directory ``cfg`` trains from through the native decoder (as ``pretrained``), or None when it trains
    as the transformers model: ``native: auto`` picks native for architectures with a native family."""
    if cfg.native == "never":
        return None
    directory = resolve_model_dir(cfg)
    config_json = read_config_json(directory)
    if native_family(config_json) is not None:
        if cfg.force_balanced:
            raise ValueError(f"model.force_balanced=true on {config_json['architectures'][0]}, which trains through "
                             f"its native family: set moe.force_balanced in a native model config, or native: never")
        if cfg.bias_update_rate:
            raise ValueError(f"model.bias_update_rate={cfg.bias_update_rate} on {config_json['architectures'][0]}, "
                             f"which trains through its native family: set moe.bias_update_rate in a native model "
                             f"config, or native: never")
        return directory
    if cfg.native == "always":
        raise ValueError(f"model.native=always but {(config_json.get('architectures') or ['?'])[0]} has no native "
                         f"family; use native: auto to train it through transformers")
    return None


def refuse_native_settings(cfg: HFModelConfig) -> None:
    """A model trained through transformers cannot take the native decoder's settings: name them."""
    if cfg.attention_backend is not None:
        raise ValueError(f"model.attention_backend={cfg.attention_backend!r} chooses the native decoder's kernel; "
                         "this model trains through transformers: use model.attn_implementation")
    for key, default in (("mtp_enabled", True), ("mtp_shared_depths", None)):
        if getattr(cfg, key) != default:
            raise ValueError(f"model.{key}={getattr(cfg, key)!r} applies to the native decoder's MTP layers; this "
                             "model trains through transformers, whose model has none: drop it")


def apply_native_settings(cfg: HFModelConfig, config: ModelConfig, where: str) -> None:
    """What ``cfg`` chooses for the native decoder, set on its checkpoint's ``config`` (``where``, the checkpoint,
    names it in errors): the attention kernel, MTP switched off, the one MTP layer shared over more depths.
    Applying it twice changes nothing."""
    if cfg.attention_backend is not None:
        for attention in (config.attention, config.sliding_attention):
            if attention is not None:
                attention.backend = cfg.attention_backend
    mtp = config.mtp
    if (not cfg.mtp_enabled or cfg.mtp_shared_depths is not None) and mtp is None:
        key = "mtp_enabled" if not cfg.mtp_enabled else "mtp_shared_depths"
        raise ValueError(f"model.{key}: {where} has no MTP layers (transformers saves checkpoints without them)")
    if cfg.mtp_shared_depths is not None:
        if mtp.stored_layers != 1:
            raise ValueError(f"model.mtp_shared_depths={cfg.mtp_shared_depths}: {where} holds {mtp.stored_layers} "
                             "MTP layers; sharing applies one layer at every depth")
        mtp.num_layers, mtp.shared = cfg.mtp_shared_depths, True
    if not cfg.mtp_enabled:
        mtp.enabled = False


# ---------------------------------------------------------------------------------------------- construction
@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters are created on the meta device, buffers for real: non-persistent buffers (rotary frequencies)
    are computed at construction and are not in checkpoints, so they must survive materialization."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        # an already-meta parameter is registered as is, so tied weights stay one Parameter
        if param is not None and param.device.type != "meta":
            kind, extra = type(param), dict(param.__dict__)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name].__dict__.update(extra)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def construct_hf_model(cfg: HFModelConfig, directory: Path, task: str = "causal-lm") -> nn.Module:
    """The transformers model of ``directory`` with meta parameters (no weights read)."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {TASKS}")
    import transformers

    config_json = read_config_json(directory)
    check_remote_code(cfg, config_json)
    if config_json.get("quantization_config"):
        method = config_json["quantization_config"].get("quant_method")
        raise ValueError(f"model.hf={cfg.hf!r}: quantized ({method}) checkpoints are not trained on the generic path; "
                         f"use a dequantized (bf16/fp32) copy")
    config = transformers.AutoConfig.from_pretrained(directory, trust_remote_code=cfg.trust_remote_code)
    auto = transformers.AutoModelForCausalLM if task == "causal-lm" else transformers.AutoModelForImageTextToText
    kwargs: dict[str, Any] = {"dtype": cfg.torch_dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    with parameters_on_meta():
        try:
            return auto.from_config(config, **kwargs)
        except ValueError as err:
            if "Unrecognized configuration class" in str(err):
                raise ValueError(f"model.hf={cfg.hf!r}: {type(config).__name__} has no {task} model in "
                                 f"transformers {transformers.__version__}") from None
            raise


# ---------------------------------------------------------------------------------------------- the wrapper
def _layer_units(hf_model: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks (decoder layers, vision blocks): the classes transformers never splits across
    devices (``_no_split_modules``), outermost first found; else the entries of the longest ModuleList."""
    classes = set(getattr(hf_model, "_no_split_modules", None) or [])
    units: dict[str, nn.Module] = {}
    for name, module in hf_model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(f"{u}.") for u in units):
            units[name] = module
    if not units:
        lists = [(n, m) for n, m in hf_model.named_modules() if isinstance(m, nn.ModuleList)]
        if lists:
            name, longest = max(lists, key=lambda item: len(item[1]))
            units = {f"{name}.{key}": m for key, m in longest.named_children()}  # a pruned list keeps its numbers
    return units


def sequence_state_layers(hf_model: nn.Module) -> list[str]:
    """Class names of ``hf_model``'s sequence-state layers, and its config's ``layer_types`` of that kind."""
    classes = {type(m).__name__ for m in hf_model.modules() if SEQUENCE_STATE_CLASSES.search(type(m).__name__)}
    types = getattr(hf_model.config.get_text_config(), "layer_types", None) or []
    return sorted(classes) + sorted({f"layer type {t!r}" for t in types if t in SEQUENCE_STATE_LAYER_TYPES})


def packing_limitation(hf_model: nn.Module) -> str | None:
    """Why packed rows would leak across sequences in this model, or None when its mixing respects them.

    Attention honours packed rows through the mask transformers builds from restarting position ids;
    recurrent mixers (linear attention, Mamba, short convolutions) carry state across the boundary: the
    sequence boundaries (``cu_seq_lens_q``) reach only transformers' optional hub kernels for them, its torch
    implementations ignore them."""
    config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    others = sorted(set(getattr(config, "layer_types", None) or []) - MASKED_ATTENTION_TYPES)
    if others:
        classes = [name for name in sequence_state_layers(hf_model) if not name.startswith("layer type")]
        named = f" ({', '.join(classes)})" if classes else ""
        return f"its {', '.join(others)} layers{named} carry state across sequence boundaries"
    if any(isinstance(m, nn.Conv1d) for m in hf_model.modules()):
        return "its recurrent/convolutional mixers carry state across sequence boundaries"
    return None


def labels_after_first_sequence(position_ids: torch.Tensor, labels: torch.Tensor) -> bool:
    """Whether a row has label tokens in a second (or later) packed sequence; end padding carries no labels."""
    restarts = position_ids == 0
    restarts[..., 0] = False
    later = restarts.cumsum(-1) > 0
    return bool(((labels != IGNORE_INDEX) & later).any())


def fused_output_layer(hf_model: nn.Module) -> bool:
    """Whether logits are exactly ``output_layer(hidden)`` for a bias-free linear output layer."""
    head = hf_model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return False
    configs = [hf_model.config]
    if hasattr(hf_model.config, "get_text_config"):
        configs.append(hf_model.config.get_text_config())
    return not any(getattr(c, key, None) not in (None, 1, 1.0) for c in configs for key in LOGIT_TRANSFORM_KEYS)


class HFModel(nn.Module):
    """A transformers model behind the native ``Decoder`` interface (see the module docstring).

    ``layers`` names the repeated blocks that FSDP shards and activation checkpointing wraps one by one.
    """

    mtp = None  # no multi-token-prediction heads: parallelism helpers look for them
    # checkpoint tensors of the model that other pipeline ranks hold (a pipelined model's, parallel/pipeline_stages.py)
    held_elsewhere: frozenset[str] = frozenset()

    def __init__(self, hf_model: nn.Module, loss_chunk_size: int = 1024) -> None:
        super().__init__()
        self.hf = hf_model
        self.loss_chunk_size = loss_chunk_size
        self.fused_loss = fused_output_layer(hf_model)
        self.packing_limitation = packing_limitation(hf_model)
        # packed rows kept apart by the model's own masks (models refused above are not checked again)
        self.packed_masks = PackedMaskCheck(hf_model, enabled=self.packing_limitation is None)
        # found before parallelism: FSDP renames the classes it wraps
        self._unit_names = list(_layer_units(hf_model))
        self.hf_class = type(hf_model)  # what the FLOP count builds a fake copy of
        self.model_dir: Path | None = None

    @property
    def config(self):
        return self.hf.config

    @property
    def layers(self) -> dict[str, nn.Module]:
        return {f"hf.{name}": self.hf.get_submodule(name) for name in self._unit_names}

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor | LossOutput:
        """``inputs``: further model inputs (``pixel_values``, ``image_grid_thw``, ...)."""
        if labels is not None and position_ids is not None and self.packing_limitation is not None:
            text_positions = position_ids[0] if position_ids.ndim == 3 else position_ids
            if labels_after_first_sequence(text_positions, labels):
                raise ValueError(
                    f"{type(self.hf).__name__} cannot train on packed rows: {self.packing_limitation}; "
                    f"use one sample per row (data packing: none)"
                )
        kwargs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False, **inputs}
        check = self.packed_masks.around(list(self.layers.values()), position_ids)
        if labels is None:
            with check:
                return self.hf(**kwargs).logits
        if not self.fused_loss:
            with check:
                out = self.hf(**kwargs)
            loss_sum = cross_entropy_sum(out.logits, labels)
            count = (labels != IGNORE_INDEX).sum()
        else:
            head = self.hf.get_output_embeddings()
            with output_layer_inputs(head) as hidden, check:
                out = self.hf(**kwargs)
            if type(head.weight).__name__ == "DTensor":  # vocabulary split over tensor-parallel ranks
                loss_sum, count = vocab_parallel_loss(hidden[-1], head.weight, labels, self.loss_chunk_size)
            else:
                loss_sum, count = linear_cross_entropy(hidden[-1], head.weight, labels, self.loss_chunk_size)
        return LossOutput(loss_sum=loss_sum, num_label_tokens=count, aux_loss=self._aux_loss(out))

    def _aux_loss(self, out: Any) -> torch.Tensor | None:
        """The router load-balancing loss the model's own head adds (with its coefficient), when configured."""
        aux = getattr(out, "aux_loss", None)
        if aux is None:
            return None
        coef = getattr(self.hf, "router_aux_loss_coef", None)
        if coef is None:
            coef = getattr(self.hf.config.get_text_config(), "router_aux_loss_coef", 0.0)
        return coef * aux


@contextlib.contextmanager
def output_layer_inputs(head: nn.Linear) -> Iterator[list[torch.Tensor]]:
    """While active, ``head`` records its input and returns a placeholder of the logits' shape that costs no
    memory: the loss GEMM happens in the fused cross entropy instead."""
    seen: list[torch.Tensor] = []
    previous = head.__dict__.get("forward")  # tensor-parallel styles install their own forward

    def record(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden)
        placeholder = torch.zeros((), dtype=torch.float32, device=hidden.device)
        return placeholder.expand(*hidden.shape[:-1], head.out_features)

    head.forward = record
    try:
        yield seen
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
    if not seen:
        raise RuntimeError(f"{type(head).__name__} output layer was not called by the model's forward")


# ---------------------------------------------------------------------------------------------- build
def hf_converters(fp8=None, peft=None, freeze: list[str] | None = None) -> Callable[[HFModel], None] | None:
    """The package's converters (``Float8Config``, ``LoraConfig``, freeze patterns) as one function applied to the
    meta-device transformers model; module and parameter names are transformers' own
    (``model.layers.0.self_attn.q_proj``, ``model.embed_tokens.weight``)."""
    if fp8 is None and peft is None and not freeze:
        return None

    def convert(model: HFModel) -> None:
        apply_converters(model.hf, fp8, peft, freeze)

    return convert


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """``model.to_empty(device)`` that keeps tied parameters tied (an output layer sharing the input embedding):
    plain ``to_empty`` gives each module its own new tensor, and the checkpoint fills only the embedding's."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # new storage, same Parameter objects
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def materialize_with_buffers(model: nn.Module, device: torch.device | str) -> None:
    """:func:`materialize` a model built under :func:`parameters_on_meta`, keeping the buffers it computed."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    materialize(model, device)
    for name, value in buffers.items():
        path, _, leaf = name.rpartition(".")
        owner = model.get_submodule(path) if path else model
        owner._buffers[leaf] = value.to(device)


def build_hf_model(
    cfg: HFModelConfig,
    *,
    task: str = "causal-lm",
    convert: Callable[[HFModel], None] | None = None,
    parallelize: Callable[[nn.Module], Any] | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> HFModel:
    """``build_model`` of the transformers model of ``cfg``: ``convert`` (LoRA/FP8, on meta), ``parallelize``
    (sharding; a pipeline's split returns the parts this rank's stages hold, ``parallel/pipeline_hf.py``), the
    checkpoint's weights, each rank only its shards; adapters start from ``seed``."""
    directory = resolve_model_dir(cfg)

    def construct() -> HFModel:
        model = HFModel(construct_hf_model(cfg, directory, task), cfg.loss_chunk_size)
        if cfg.force_balanced:
            force_balanced_routing(model.hf)
        if cfg.bias_update_rate:  # counts the routing that runs, so after the balanced-routing hook
            track_expert_load(model.hf, cfg.bias_update_rate)
        return model

    def load(model: HFModel) -> None:
        load_hf_weights(model.hf, directory, elsewhere=model.held_elsewhere)

    model = build_model(construct, materialize=materialize_with_buffers, device=device, seed=seed, convert=convert,
                        parallelize=parallelize, load=load)
    model.model_dir = directory
    return model


torch.serialization.add_safe_globals([HFModelConfig])
