"""Hugging Face ``transformers`` checkpoints to and from our models (needs ``safetensors``, not transformers).

Supported architectures (``model_type`` in ``config.json``):

============  =========================  ===================================================
model_type    architecture               our model
============  =========================  ===================================================
``llama``     ``LlamaForCausalLM``       :class:`~.llama.Llama`
``mixtral``   ``MixtralForCausalLM``     :class:`~.moe.MoE` (softmax, top-k renormalized)
``qwen2_moe`` ``Qwen2MoeForCausalLM``    :class:`~.moe.MoE` (+ gated shared expert, q/k/v biases,
                                         dense ``mlp_only_layers``)
``qwen3_moe`` ``Qwen3MoeForCausalLM``    :class:`~.qwen3_moe.Qwen3MoE` (adapter: hf_qwen3_moe.py)
``deepseek_v3`` ``DeepseekV3ForCausalLM`` :class:`~.deepseek_v3.DeepSeekV3` (adapter: hf_deepseek_v3.py)
============  =========================  ===================================================

Weights are renamed one-to-one (the tables are in llama.py's and moe.py's notes); per-expert
``experts.{e}.gate_proj/up_proj/down_proj`` (or Mixtral's ``w1/w3/w2``) weights are transposed and
stacked into the grouped ``w1_EDF`` / ``w3_EDF`` / ``w2_EFD``, and the fused ``experts.gate_up_proj`` /
``experts.down_proj`` layout that transformers 5 uses in memory is accepted too. Saving writes the
per-expert layout, which every transformers version reads.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import defaultdict
from pathlib import Path, PurePath
from typing import Any, Callable, Optional, Union, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from lightning_vescale.models.hf_deepseek_v3 import DEEPSEEK_V3_ADAPTER
from lightning_vescale.models.hf_qwen3_moe import QWEN3_MOE_ADAPTER
from lightning_vescale.models.llama import Llama, LlamaConfig, RopeScaling
from lightning_vescale.models.moe import GroupedExperts, MoE, MoEConfig
from lightning_vescale.quant.hf_fp8 import fold_fp8_state, fp8_format
from lightning_vescale.quant.tensor import QuantizedTensor, is_quantized, set_quantized_parameter
from lightning_vescale.state_dict.dtype_kinds import dtype_kind_mismatches
from lightning_vescale.state_dict.report import listing, mismatch_report

__all__ = ["SUPPORTED_MODEL_TYPES", "from_pretrained", "hf_parameter_names", "read_pretrained_config", "save_pretrained"]

# Families with an adapter module of their own (models/hf_<model_type>.py; see hf_adapter.py).
_ADAPTERS = {adapter.model_type: adapter for adapter in (QWEN3_MOE_ADAPTER, DEEPSEEK_V3_ADAPTER)}
SUPPORTED_MODEL_TYPES = ("llama", "mixtral", "qwen2_moe", *_ADAPTERS)
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                  **{t: adapter.architecture for t, adapter in _ADAPTERS.items()}}
_TYPE_OF_ARCHITECTURE = {arch: model_type for model_type, arch in _ARCHITECTURES.items()}

ModelConfig = Union[LlamaConfig, MoEConfig]

# (ours, Hugging Face) module names inside layer i ("layers.{i}." / "model.layers.{i}.").
_LAYER_MODULES = (
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("feed_forward.w1", "mlp.gate_proj"),
    ("feed_forward.w3", "mlp.up_proj"),
    ("feed_forward.w2", "mlp.down_proj"),
    ("feed_forward.router", "mlp.gate"),
    ("feed_forward.shared_experts.w1", "mlp.shared_expert.gate_proj"),
    ("feed_forward.shared_experts.w3", "mlp.shared_expert.up_proj"),
    ("feed_forward.shared_experts.w2", "mlp.shared_expert.down_proj"),
    ("feed_forward.shared_gate", "mlp.shared_expert_gate"),
)
_HF_TO_OURS_MODULE = {hf: ours for ours, hf in _LAYER_MODULES}
_OURS_TO_HF_MODULE = dict(_LAYER_MODULES)
# Grouped expert parameter -> per-expert projection name (Qwen / Llama style, Mixtral style).
_EXPERT_PROJ = {"w1_EDF": ("gate_proj", "w1"), "w3_EDF": ("up_proj", "w3"), "w2_EFD": ("down_proj", "w2")}
_EXPERT_PARAM_OF_PROJ = {name: param for param, names in _EXPERT_PROJ.items() for name in names}


# ----------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------


def from_pretrained(
    path: Union[str, Path],
    *,
    model_type: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    device: Union[str, torch.device] = "cpu",
    quantized_weights: Optional[str] = None,
) -> tuple[nn.Module, ModelConfig]:
    """Load a local transformers checkpoint directory into a :class:`Llama` or :class:`MoE`.

    The directory needs ``config.json`` and either ``model.safetensors`` or a sharded
    ``model.safetensors.index.json`` with its shards. The model is built on the meta device,
    materialized on ``device`` and filled from the checkpoint (no random initialization).

    Args:
        path: the checkpoint directory.
        model_type: one of :data:`SUPPORTED_MODEL_TYPES` (``"llama"``, ``"mixtral"``, ``"qwen2_moe"``,
            ``"qwen3_moe"``, ``"deepseek_v3"``) or the architecture name (e.g. ``"LlamaForCausalLM"``);
            default: ``config.json``'s ``model_type``.
        dtype: dtype of the returned model's parameters and buffers.
        device: where the model is materialized.
        quantized_weights: for an FP8 block checkpoint (``quantization_config`` with ``weight_block_size``, each
            quantized weight stored as ``float8_e4m3fn`` codes plus ``weight_scale_inv``, as DeepSeek-V3 and
            Qwen3-FP8 ship them): ``"dequantize"`` loads plain weights in ``dtype``; ``"keep"`` makes each quantized
            weight a frozen :class:`~lightning_vescale.quant.QuantizedTensor` holding the checkpoint's codes and
            scales (nothing is re-quantized; the model runs by dequantizing them, and ``fully_shard`` shards them
            as codes + scales). A quantized checkpoint without this argument raises.

    Returns:
        ``(model, config)``.

    .. note::
        Raises ``FileNotFoundError`` when the directory, ``config.json`` or the safetensors files are
        missing, and ``ValueError`` for an unsupported ``model_type`` or configuration (the message
        names the field), or when checkpoint tensors are missing, unexpected, of the wrong shape or of
        another dtype kind (integers or bool where float weights belong; all of them are listed, with both
        shapes or dtypes). These checks read only the files' headers, on the meta device, so nothing is
        allocated for a checkpoint that does not fit. Also ``ValueError`` for a damaged safetensors file
        (its header does not fit its bytes) and for an index whose shard names leave the directory.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r} (found: {sorted(p.name for p in path.iterdir())})")
    hf_config = json.loads(config_file.read_text())
    model_type = _resolve_model_type(model_type or hf_config.get("model_type"), config_file)
    fp8 = fp8_format(hf_config, quantized_weights, config_file)
    adapter = _ADAPTERS.get(model_type)
    config = adapter.config_from_hf(hf_config) if adapter else _CONFIG_FROM_HF[model_type](hf_config)
    files = _safetensors_files(path)

    # Names, shapes and dtype kinds are checked on the meta device, from the files' headers only, so a
    # config.json that does not fit the weights fails with the mismatch before anything is allocated.
    with torch.device("meta"):
        build: Callable[[Any], Union[Llama, MoE]] = (
            adapter.model_class if adapter else Llama if isinstance(config, LlamaConfig) else MoE
        )
        model = build(config)
    headers = _read_headers(files)
    if fp8 is not None:
        assert quantized_weights is not None  # fp8_format refuses a quantized checkpoint without a mode
        headers = fold_fp8_state(headers, fp8, quantized_weights, dtype, path)
    _check_state(model, *_our_state(headers, config, adapter), path)
    model.to_empty(device=device)
    model.init_buffers()
    tensors = _read_tensors(files)
    if fp8 is not None:
        assert quantized_weights is not None
        tensors = fold_fp8_state(tensors, fp8, quantized_weights, dtype, path)
    state, origin, _ = _our_state(tensors, config, adapter)
    quantized = {name: t for name, t in state.items() if is_quantized(t)}
    model.load_state_dict({n: t for n, t in state.items() if n not in quantized}, strict=False)
    model.to(dtype)
    for name, t in quantized.items():
        set_quantized_parameter(model, name, cast(QuantizedTensor, t.to(device=device, dtype=dtype)))  # dispatch keeps the subclass
    return model, config


def _resolve_model_type(model_type: Optional[str], config_file: Path) -> str:
    if model_type is not None:
        model_type = _TYPE_OF_ARCHITECTURE.get(model_type, model_type)
    if model_type is None:
        raise ValueError(
            f"{config_file} has no 'model_type'; pass model_type= one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
            f"({', '.join(_ARCHITECTURES.values())})"
        )
    return model_type


def _safetensors_files(path: Path) -> list[Path]:
    """``model.safetensors``, or the shards ``model.safetensors.index.json`` names (each inside ``path``)."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise ValueError(f"{index} has no 'weight_map' of tensor names to shard file names")
        shards = sorted(set(weight_map.values()))
        # A shard name is a file name relative to the checkpoint directory: an absolute path or one that
        # climbs out with '..' would read files the checkpoint does not own.
        outside = [s for s in shards if PurePath(s).is_absolute() or ".." in PurePath(s).parts or s.strip() == ""]
        if outside:
            raise ValueError(
                f"{index} names shard files outside the checkpoint directory {str(path)!r}: {outside}. Shard names "
                f"must be relative file names such as 'model-00001-of-00002.safetensors'."
            )
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {str(path)!r}: {missing}")
        return [path / s for s in shards]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(path)!r} "
        f"(found: {sorted(p.name for p in path.iterdir())}). PyTorch .bin checkpoints are not supported: "
        "re-save them with transformers' save_pretrained(..., safe_serialization=True)."
    )


# safetensors header dtype -> torch dtype (the ones torch can hold).
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _read_headers(files: list[Path]) -> dict[str, torch.Tensor]:
    """Meta tensors with the names, shapes and dtypes the files' headers declare (no tensor data is read)."""
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with _open_safetensors(file) as f:
            for key in f.keys():  # noqa: SIM118 - safetensors' safe_open is not iterable
                info = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(info.get_dtype())
                if dtype is None:
                    raise ValueError(f"{file}: tensor {key!r} has dtype {info.get_dtype()}, which torch cannot load")
                if key in state:
                    raise ValueError(f"tensor {key!r} is stored in more than one shard (again in {file})")
                state[key] = torch.empty(info.get_shape(), dtype=dtype, device="meta")
    return state


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with _open_safetensors(file) as f:
            state.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118 - safe_open is not iterable
    return state


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as err:
        # safetensors checks that each header entry's dtype and shape fit its byte range; its message
        # names neither the file nor what to do.
        raise ValueError(
            f"{file} is not a valid safetensors file ({err}): it is damaged or its header was edited; download "
            f"or save it again"
        ) from None


def _our_state(
    hf_state: dict[str, torch.Tensor], config: ModelConfig, adapter: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    state, origin, unexpected = adapter.state_from_hf(hf_state, config) if adapter else _state_from_hf(hf_state)
    if config.tie_embeddings:
        state.pop("output.weight", None)  # some checkpoints store the tied head too; ours reuses the embedding
        origin.pop("output.weight", None)
    return state, origin, unexpected


def _get(hf: dict[str, Any], key: str) -> Any:
    if key not in hf:
        raise ValueError(f"config.json has no {key!r}, which a {hf.get('model_type')} checkpoint needs")
    return hf[key]


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, Optional[RopeScaling]]:
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older versions write
    # rope_theta and rope_scaling ({"rope_type" or "type": ...}).
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
        return float(theta), scaling
    raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (supported: 'default', 'llama3')")


def _common_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    dim = _get(hf, "hidden_size")
    n_heads = _get(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != dim // n_heads:
        raise ValueError(
            f"config.json: head_dim={head_dim} differs from hidden_size // num_attention_heads = "
            f"{dim // n_heads}; such models are not supported"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    rope_theta, rope_scaling = _rope_from_hf(hf)
    return dict(
        vocab_size=_get(hf, "vocab_size"),
        dim=dim,
        n_layers=_get(hf, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=hf.get("max_position_embeddings", 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )


def _llama_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag, False):
            raise ValueError(f"config.json: {flag}=true is not supported for llama")
    return LlamaConfig(**_common_from_hf(hf), ffn_hidden=_get(hf, "intermediate_size"))


def _mixtral_from_hf(hf: dict[str, Any]) -> MoEConfig:
    if hf.get("sliding_window") is not None:
        warnings.warn(
            f"config.json: sliding_window={hf['sliding_window']} is ignored; full causal attention is used, "
            "so outputs differ from transformers for sequences longer than the window",
            stacklevel=3,
        )
    if hf.get("router_jitter_noise", 0.0):
        warnings.warn("config.json: router_jitter_noise is ignored (no jitter is applied)", stacklevel=3)
    return MoEConfig(
        **_common_from_hf(hf),
        num_experts=_get(hf, "num_local_experts"),
        top_k=_get(hf, "num_experts_per_tok"),
        moe_hidden=_get(hf, "intermediate_size"),
        score_func="softmax",
        route_norm=True,
        aux_loss_coef=0.0,
    )


def _qwen2_moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    if hf.get("use_sliding_window", False):
        warnings.warn("config.json: use_sliding_window is ignored; full causal attention is used", stacklevel=3)
    n_layers = _get(hf, "num_hidden_layers")
    num_experts = _get(hf, "num_experts")
    step = hf.get("decoder_sparse_step", 1)
    mlp_only = set(hf.get("mlp_only_layers") or [])
    # transformers' rule for which layers are sparse (Qwen2MoeDecoderLayer).
    dense = tuple(i for i in range(n_layers) if i in mlp_only or not (num_experts > 0 and (i + 1) % step == 0))
    shared = hf.get("shared_expert_intermediate_size", 0)
    return MoEConfig(
        **_common_from_hf(hf),
        qkv_bias=bool(hf.get("qkv_bias", True)),  # transformers < 5 always had the biases
        num_experts=num_experts,
        top_k=_get(hf, "num_experts_per_tok"),
        moe_hidden=_get(hf, "moe_intermediate_size"),
        shared_expert_hidden=shared,
        shared_expert_gate=shared > 0,
        score_func="softmax",
        route_norm=bool(hf.get("norm_topk_prob", False)),
        aux_loss_coef=0.0,
        dense_layers=dense,
        dense_ffn_hidden=_get(hf, "intermediate_size") if dense else 0,
    )


_CONFIG_FROM_HF: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {"llama": _llama_from_hf, "mixtral": _mixtral_from_hf, "qwen2_moe": _qwen2_moe_from_hf}


def _state_from_hf(
    hf_state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Rename (and stack experts); returns our state, our name -> HF name, and unrecognized HF names."""
    state: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    unexpected: list[str] = []
    per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
    top_level = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                 "lm_head.weight": "output.weight"}
    for key, tensor in hf_state.items():
        if key in top_level:
            state[top_level[key]] = tensor
            origin[top_level[key]] = key
            continue
        if key.endswith("rotary_emb.inv_freq"):  # derived data in old checkpoints
            continue
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
        if match is None:
            unexpected.append(key)
            continue
        layer, rest = match.groups()
        rest = re.sub(r"^block_sparse_moe\.", "mlp.", rest)  # Mixtral's checkpoint name of the MoE block
        expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest)
        fused = re.fullmatch(r"mlp\.experts\.(gate_up_proj|down_proj)", rest)
        module, _, kind = rest.rpartition(".")
        if expert is not None and expert.group(2) in _EXPERT_PARAM_OF_PROJ:
            param = _EXPERT_PARAM_OF_PROJ[expert.group(2)]
            per_expert[(layer, param)][int(expert.group(1))] = tensor
            origin[f"layers.{layer}.feed_forward.experts.{param}"] = (
                f"model.layers.{layer}.*.experts.*.{expert.group(2)}.weight (stacked)"
            )
        elif fused is not None:
            prefix = f"layers.{layer}.feed_forward.experts."
            if fused.group(1) == "gate_up_proj":  # [E, 2F, D]: gate rows, then up rows
                gate, up = tensor.chunk(2, dim=1)
                state[prefix + "w1_EDF"] = gate.transpose(1, 2).contiguous()
                state[prefix + "w3_EDF"] = up.transpose(1, 2).contiguous()
                origin[prefix + "w1_EDF"] = origin[prefix + "w3_EDF"] = key
            else:  # [E, D, F]
                state[prefix + "w2_EFD"] = tensor.transpose(1, 2).contiguous()
                origin[prefix + "w2_EFD"] = key
        elif module in _HF_TO_OURS_MODULE and kind in ("weight", "bias"):
            name = f"layers.{layer}.{_HF_TO_OURS_MODULE[module]}.{kind}"
            state[name] = tensor
            origin[name] = key
        else:
            unexpected.append(key)
    for (layer, param), experts in per_expert.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))):
            missing = sorted(set(range(max(ids) + 1)) - set(ids))
            raise ValueError(f"layer {layer}: experts {missing} are missing from the checkpoint ({param})")
        # HF per-expert weights are nn.Linear weights [out, in]; ours are [in, out] per expert.
        state[f"layers.{layer}.feed_forward.experts.{param}"] = torch.stack(
            [experts[e].t() for e in ids]
        ).contiguous()
    return state, origin, unexpected


def _check_state(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    origin: dict[str, str],
    unexpected: list[str],
    path: Path,
) -> None:
    model_state = model.state_dict()
    optional = {name for name in model_state if name.endswith(".expert_bias")}
    expected = {n: tuple(t.shape) for n, t in model_state.items() if n in state or n not in optional}
    given = {n: tuple(t.shape) for n, t in state.items()}
    report = mismatch_report(expected, given, ours="model", theirs="checkpoint",
                             name=lambda n: f"{origin[n]} -> {n}" if n in origin else n)
    # Another kind (integers or bool where float weights belong) would be cast into garbage values.
    kinds = dtype_kind_mismatches({name: t.dtype for name, t in model_state.items()}, state, origin)
    if not (report or unexpected or kinds):
        return
    lines = [f"checkpoint {str(path)!r} does not match the model built from its config.json:"]
    if report:
        lines.append(report)
    if unexpected:
        lines.append(f"  checkpoint tensors no model parameter maps to ({len(unexpected)}): {listing(unexpected)}")
    if kinds:
        lines += ["  dtype kind mismatches (the file is damaged or its header names the wrong dtype):"]
        lines += [f"    {k}" for k in kinds]
    raise ValueError("\n".join(lines))


# ----------------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------------


def save_pretrained(
    model: nn.Module,
    config: ModelConfig,
    path: Union[str, Path],
    *,
    model_type: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers' ``from_pretrained`` loads.

    Args:
        model: a full (unsharded, not expert-parallel) :class:`Llama` or :class:`MoE`.
        config: its config.
        path: output directory (created if needed).
        model_type: for an :class:`MoE`, ``"mixtral"`` or ``"qwen2_moe"``; default: ``"qwen2_moe"`` when
            it has a shared expert, else ``"mixtral"``. ``"llama"`` for a :class:`Llama`; ``"qwen3_moe"`` /
            ``"deepseek_v3"`` for a :class:`~.qwen3_moe.Qwen3MoE` / :class:`~.deepseek_v3.DeepSeekV3`.
        dtype: cast the saved tensors to this dtype (default: keep the model's).

    .. note::
        Raises ``ValueError`` when the config uses a feature the target architecture cannot express
        (the message lists them), or when the experts are sliced by expert parallelism. A non-zero
        ``expert_bias`` (auxiliary-loss-free balancing) has no transformers counterpart for these
        architectures: it is dropped with a warning.
    """
    adapter = next((a for a in _ADAPTERS.values() if isinstance(config, a.config_class)), None)
    if adapter is not None:
        model_type = model_type or adapter.model_type
        allowed: tuple[str, ...] = (adapter.model_type,)
    elif isinstance(config, LlamaConfig):
        model_type = model_type or "llama"
        allowed = ("llama",)
    elif isinstance(config, MoEConfig):
        model_type = model_type or ("qwen2_moe" if config.shared_expert_hidden > 0 else "mixtral")
        allowed = ("mixtral", "qwen2_moe")
    else:
        raise ValueError(f"config must be a LlamaConfig or MoEConfig, got {type(config).__name__}")
    if model_type not in allowed:
        raise ValueError(f"a {type(config).__name__} can be saved as {allowed}, not model_type={model_type!r}")
    problems = adapter.export_problems(config) if adapter else _export_problems(config, model_type)
    if problems:
        raise ValueError(f"cannot save as {model_type!r}: " + "; ".join(problems))
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.w1_EDF.shape[0] != cast(MoEConfig, config).num_experts:
            raise ValueError(
                f"{name} holds {module.w1_EDF.shape[0]} of {cast(MoEConfig, config).num_experts} experts (expert parallel?); "
                "save a full model"
            )
    state = model.state_dict()
    save_dtype = dtype or next(iter(state.values())).dtype
    hf_state = adapter.state_to_hf(state, dtype) if adapter else _state_to_hf(state, model_type, dtype)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = adapter.config_to_hf(config, save_dtype) if adapter else _config_to_hf(config, model_type, save_dtype)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(hf_state, path / "model.safetensors", metadata={"format": "pt"})


def _export_problems(config: ModelConfig, model_type: str) -> list[str]:
    problems = []
    if model_type == "llama":
        if config.qkv_bias:
            problems.append("qkv_bias=True (transformers' Llama attention_bias also adds an o_proj bias)")
        return problems
    assert isinstance(config, MoEConfig)
    if config.score_func != "softmax":
        problems.append(f"score_func={config.score_func!r} (needs 'softmax')")
    if config.route_scale != 1.0:
        problems.append(f"route_scale={config.route_scale} (needs 1.0)")
    if config.num_expert_groups != 1:
        problems.append(f"num_expert_groups={config.num_expert_groups} (group-limited routing; save a DeepSeekV3)")
    if model_type == "mixtral":
        if not config.route_norm:
            problems.append("route_norm=False (Mixtral always renormalizes the top-k weights)")
        if config.shared_expert_hidden:
            problems.append("shared_expert_hidden > 0 (Mixtral has no shared expert)")
        if config.qkv_bias:
            problems.append("qkv_bias=True (Mixtral has no attention biases)")
        if config.dense_layers:
            problems.append(f"dense_layers={config.dense_layers} (every Mixtral layer is MoE)")
    else:
        if not (config.shared_expert_hidden > 0 and config.shared_expert_gate):
            problems.append("Qwen2-MoE needs a gated shared expert (shared_expert_hidden > 0, shared_expert_gate)")
    return problems


def _state_to_hf(
    state: dict[str, torch.Tensor], model_type: str, dtype: Optional[torch.dtype]
) -> dict[str, torch.Tensor]:
    def out(t: torch.Tensor) -> torch.Tensor:
        # A copy: parameters may be views into one flat buffer, which safetensors refuses to save.
        return t.detach().to(device="cpu", dtype=dtype or t.dtype, copy=True).contiguous()

    moe_prefix = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    top_level = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
    hf_state: dict[str, torch.Tensor] = {}
    dropped_bias = False
    for name, tensor in state.items():
        if name in top_level:
            hf_state[top_level[name]] = out(tensor)
            continue
        match = re.fullmatch(r"layers\.(\d+)\.(.+)\.(\w+)", name)
        if match is None:
            raise ValueError(f"no Hugging Face name for {name!r}")
        layer, module, kind = match.groups()
        prefix = f"model.layers.{layer}."
        if module == "feed_forward.experts" and kind in _EXPERT_PROJ:
            proj = _EXPERT_PROJ[kind][1 if model_type == "mixtral" else 0]
            for e in range(tensor.shape[0]):
                hf_state[f"{prefix}{moe_prefix}.experts.{e}.{proj}.weight"] = out(tensor[e].t())
        elif module == "feed_forward.router" and kind == "expert_bias":
            dropped_bias = dropped_bias or bool(tensor.any())
        elif module in _OURS_TO_HF_MODULE:
            hf_module = _OURS_TO_HF_MODULE[module]
            if module == "feed_forward.router":
                hf_module = f"{moe_prefix}.gate"
            hf_state[f"{prefix}{hf_module}.{kind}"] = out(tensor)
        else:
            raise ValueError(f"no Hugging Face name for {name!r}")
    if dropped_bias:
        warnings.warn(
            "the routers' expert_bias (auxiliary-loss-free balancing) is non-zero but has no place in a "
            f"{model_type} checkpoint: it is dropped, so transformers may choose different experts",
            stacklevel=3,
        )
    return hf_state


def _config_to_hf(config: ModelConfig, model_type: str, dtype: torch.dtype) -> dict[str, Any]:
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_scaling: Optional[dict[str, Any]] = None
    if config.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": config.rope_scaling.factor,
            "low_freq_factor": config.rope_scaling.low_freq_factor,
            "high_freq_factor": config.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings,
        }
        rope_parameters.update(rope_scaling)
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        # transformers >= 5 reads rope_parameters; older versions read rope_theta and rope_scaling.
        "rope_parameters": rope_parameters,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": config.init_std,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if model_type == "llama":
        assert isinstance(config, LlamaConfig)
        hf.update(intermediate_size=config.ffn_hidden, attention_bias=False, mlp_bias=False)
        return hf
    assert isinstance(config, MoEConfig)
    if model_type == "mixtral":
        hf.update(
            intermediate_size=config.moe_hidden,
            num_local_experts=config.num_experts,
            num_experts_per_tok=config.top_k,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
            router_aux_loss_coef=config.aux_loss_coef,
        )
    else:
        hf.update(
            intermediate_size=config.dense_ffn_hidden or config.shared_expert_hidden,
            moe_intermediate_size=config.moe_hidden,
            shared_expert_intermediate_size=config.shared_expert_hidden,
            num_experts=config.num_experts,
            num_experts_per_tok=config.top_k,
            norm_topk_prob=config.route_norm,
            qkv_bias=config.qkv_bias,
            decoder_sparse_step=1,
            mlp_only_layers=list(config.dense_layers),
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.n_layers,
            output_router_logits=False,
            router_aux_loss_coef=config.aux_loss_coef,
        )
    return hf


def hf_parameter_names(
    config: ModelConfig, names: list[str], *, model_type: Optional[str] = None
) -> dict[str, str]:
    """The Hugging Face names of our (non-expert) parameters ``names``, as :func:`save_pretrained` writes them
    (``layers.0.attention.wq.weight`` -> ``model.layers.0.self_attn.q_proj.weight``)."""
    adapter = next((a for a in _ADAPTERS.values() if isinstance(config, a.config_class)), None)
    if adapter is None:
        if isinstance(config, LlamaConfig):
            model_type = model_type or "llama"
        else:
            model_type = model_type or ("qwen2_moe" if config.shared_expert_hidden > 0 else "mixtral")
    out = {}
    for name in names:
        probe = {name: torch.zeros(1)}
        if adapter:
            hf = adapter.state_to_hf(probe, None)
        else:
            assert model_type is not None  # set above
            hf = _state_to_hf(probe, model_type, None)
        if len(hf) != 1:
            raise ValueError(f"{name} has no one-to-one Hugging Face name (an expert stack?)")
        out[name] = next(iter(hf))
    return out


# ----------------------------------------------------------------------------------------------------
# Config only
# ----------------------------------------------------------------------------------------------------


def read_pretrained_config(path: Union[str, Path], *, model_type: Optional[str] = None) -> tuple[ModelConfig, str]:
    """The model config a checkpoint directory's ``config.json`` describes, without reading any weights.

    Returns ``(config, model_type)``: the same config :func:`from_pretrained` builds the model from, and
    the resolved ``model_type`` (``"llama"``, ``"mixtral"``, ``"qwen2_moe"``, ``"qwen3_moe"`` or ``"deepseek_v3"``).

    Raises:
        FileNotFoundError: ``path`` is not a directory or has no ``config.json``.
        ValueError: an unsupported ``model_type`` or configuration (the message names the field).
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}")
    hf_config = json.loads(config_file.read_text())
    model_type = _resolve_model_type(model_type or hf_config.get("model_type"), config_file)
    adapter = _ADAPTERS.get(model_type)
    return (adapter.config_from_hf(hf_config) if adapter else _CONFIG_FROM_HF[model_type](hf_config)), model_type
