"""Hugging Face ``transformers`` checkpoints to and from our models (needs ``safetensors``, not transformers).

Supported architectures (``model_type`` in ``config.json``):

============  =========================  ===================================================
model_type    architecture               our model
============  =========================  ===================================================
``llama``     ``LlamaForCausalLM``       :class:`~.llama.Llama`
``mixtral``   ``MixtralForCausalLM``     :class:`~.moe.MoE` (softmax, top-k renormalized)
``qwen2_moe`` ``Qwen2MoeForCausalLM``    :class:`~.moe.MoE` (+ gated shared expert, q/k/v biases,
                                         dense ``mlp_only_layers``)
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
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_vescale.models.llama import Llama, LlamaConfig, RopeScaling
from lightning_vescale.models.moe import GroupedExperts, MoE, MoEConfig

__all__ = ["SUPPORTED_MODEL_TYPES", "from_pretrained", "read_pretrained_config", "save_pretrained"]

SUPPORTED_MODEL_TYPES = ("llama", "mixtral", "qwen2_moe")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
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
) -> tuple[nn.Module, ModelConfig]:
    """Load a local transformers checkpoint directory into a :class:`Llama` or :class:`MoE`.

    The directory needs ``config.json`` and either ``model.safetensors`` or a sharded
    ``model.safetensors.index.json`` with its shards. The model is built on the meta device,
    materialized on ``device`` and filled from the checkpoint (no random initialization).

    Args:
        path: the checkpoint directory.
        model_type: ``"llama"``, ``"mixtral"`` or ``"qwen2_moe"`` (or the architecture name, e.g.
            ``"LlamaForCausalLM"``); default: ``config.json``'s ``model_type``.
        dtype: dtype of the returned model's parameters and buffers.
        device: where the model is materialized.

    Returns:
        ``(model, config)``.

    .. note::
        Raises ``FileNotFoundError`` when the directory, ``config.json`` or the safetensors files are
        missing, and ``ValueError`` for an unsupported ``model_type`` or configuration (the message
        names the field), or when checkpoint tensors are missing, unexpected or of the wrong shape
        (all of them are listed, with both shapes).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r} (found: {sorted(p.name for p in path.iterdir())})")
    hf_config = json.loads(config_file.read_text())
    model_type = _resolve_model_type(model_type or hf_config.get("model_type"), config_file)
    config = _CONFIG_FROM_HF[model_type](hf_config)
    hf_state = _load_safetensors(path)

    with torch.device("meta"):
        model: nn.Module = Llama(config) if isinstance(config, LlamaConfig) else MoE(config)
    model.to_empty(device=device)
    model.init_buffers()
    state, origin, unexpected = _state_from_hf(hf_state)
    if config.tie_embeddings:
        state.pop("output.weight", None)  # some checkpoints store the tied head too; ours reuses the embedding
        origin.pop("output.weight", None)
    _check_state(model, state, origin, unexpected, path)
    model.load_state_dict(state, strict=False)
    return model.to(dtype), config


def _resolve_model_type(model_type: Optional[str], config_file: Path) -> str:
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


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {str(path)!r}: {missing}")
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(path / shard))
        return state
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(path)!r} "
        f"(found: {sorted(p.name for p in path.iterdir())}). PyTorch .bin checkpoints are not supported: "
        "re-save them with transformers' save_pretrained(..., safe_serialization=True)."
    )


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


_CONFIG_FROM_HF = {"llama": _llama_from_hf, "mixtral": _mixtral_from_hf, "qwen2_moe": _qwen2_moe_from_hf}


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
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    optional = {name for name in expected if name.endswith(".expert_bias")}
    missing = [name for name in expected if name not in state and name not in optional]
    unexpected = unexpected + [origin.get(name, name) for name in state if name not in expected]
    mismatched = [
        f"{origin.get(name, name)} -> {name}: checkpoint {tuple(t.shape)}, model {expected[name]}"
        for name, t in state.items()
        if name in expected and tuple(t.shape) != expected[name]
    ]
    if not (missing or unexpected or mismatched):
        return
    lines = [f"checkpoint {str(path)!r} does not match the model built from its config.json:"]
    if mismatched:
        lines += ["  shape mismatches:"] + [f"    {m}" for m in mismatched]
    if missing:
        lines += ["  missing from the checkpoint:"] + [f"    {m}" for m in missing]
    if unexpected:
        lines += ["  not used by the model:"] + [f"    {u}" for u in unexpected]
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
            it has a shared expert, else ``"mixtral"``. ``"llama"`` for a :class:`Llama`.
        dtype: cast the saved tensors to this dtype (default: keep the model's).

    .. note::
        Raises ``ValueError`` when the config uses a feature the target architecture cannot express
        (the message lists them), or when the experts are sliced by expert parallelism. A non-zero
        ``expert_bias`` (auxiliary-loss-free balancing) has no transformers counterpart for these
        architectures: it is dropped with a warning.
    """
    if isinstance(config, LlamaConfig):
        model_type = model_type or "llama"
        allowed = ("llama",)
    elif isinstance(config, MoEConfig):
        model_type = model_type or ("qwen2_moe" if config.shared_expert_hidden > 0 else "mixtral")
        allowed = ("mixtral", "qwen2_moe")
    else:
        raise ValueError(f"config must be a LlamaConfig or MoEConfig, got {type(config).__name__}")
    if model_type not in allowed:
        raise ValueError(f"a {type(config).__name__} can be saved as {allowed}, not model_type={model_type!r}")
    problems = _export_problems(config, model_type)
    if problems:
        raise ValueError(f"cannot save as {model_type!r}: " + "; ".join(problems))
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.w1_EDF.shape[0] != config.num_experts:
            raise ValueError(
                f"{name} holds {module.w1_EDF.shape[0]} of {config.num_experts} experts (expert parallel?); "
                "save a full model"
            )
    state = model.state_dict()
    save_dtype = dtype or next(iter(state.values())).dtype
    hf_state = _state_to_hf(state, model_type, dtype)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config = _config_to_hf(config, model_type, save_dtype)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    save_file(hf_state, path / "model.safetensors", metadata={"format": "pt"})


def _export_problems(config: ModelConfig, model_type: str) -> list[str]:
    problems = []
    if model_type == "llama":
        if config.qkv_bias:
            problems.append("qkv_bias=True (transformers' Llama attention_bias also adds an o_proj bias)")
        return problems
    if config.score_func != "softmax":
        problems.append(f"score_func={config.score_func!r} (needs 'softmax')")
    if config.route_scale != 1.0:
        problems.append(f"route_scale={config.route_scale} (needs 1.0)")
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
        hf.update(intermediate_size=config.ffn_hidden, attention_bias=False, mlp_bias=False)
    elif model_type == "mixtral":
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


# ----------------------------------------------------------------------------------------------------
# Config only
# ----------------------------------------------------------------------------------------------------


def read_pretrained_config(path: Union[str, Path], *, model_type: Optional[str] = None) -> tuple[ModelConfig, str]:
    """The model config a checkpoint directory's ``config.json`` describes, without reading any weights.

    Returns ``(config, model_type)``: the same config :func:`from_pretrained` builds the model from, and
    the resolved ``model_type`` (``"llama"``, ``"mixtral"`` or ``"qwen2_moe"``).

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
    return _CONFIG_FROM_HF[model_type](hf_config), model_type
