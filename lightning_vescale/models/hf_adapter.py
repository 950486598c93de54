"""The shape of a per-family Hugging Face adapter, and the renaming every MoE family shares.

:func:`lightning_vescale.models.from_pretrained` and :func:`~lightning_vescale.models.save_pretrained`
dispatch a ``model_type`` with an :class:`HFAdapter` to it (families with an adapter module of their
own: ``hf_qwen3_moe.py``, ``hf_deepseek_v3.py``). An adapter says how ``config.json`` maps to the
family's config and back, and which names the tensors inside a layer have on each side; the rest is
common to every decoder here:

* ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight`` are ``tok_embeddings.weight``,
  ``norm.weight``, ``output.weight`` (a tied head is not saved);
* per-expert ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` (``[F, D]`` / ``[D, F]``, the layout of
  checkpoints on disk) are transposed and stacked into ``feed_forward.experts.w1_EDF / w3_EDF / w2_EFD``;
  the fused ``mlp.experts.gate_up_proj`` (``[E, 2F, D]``) / ``down_proj`` (``[E, D, F]``) that
  transformers 5 holds in memory are accepted too. Saving writes the per-expert layout.

Every tensor is copied bit for bit (transposes and stacking only), so an export read back by
transformers and saved again returns the same tensors.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from lightning_vescale.models.yarn import YarnScaling

if TYPE_CHECKING:
    from lightning_vescale.models.moe import MoE

__all__ = ["COMMON_LAYER_NAMES", "HFAdapter", "check_silu", "hf_get", "rope_from_hf", "rope_to_hf"]

logger = logging.getLogger(__name__)

_TOP_LEVEL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_TOP_LEVEL_TO_HF = {ours: hf for hf, ours in _TOP_LEVEL.items()}
# Grouped expert parameter -> Hugging Face per-expert projection.
_EXPERT_PROJ = {"w1_EDF": "gate_proj", "w3_EDF": "up_proj", "w2_EFD": "down_proj"}
_EXPERT_PARAM_OF_PROJ = {proj: param for param, proj in _EXPERT_PROJ.items()}

State = dict[str, torch.Tensor]

COMMON_LAYER_NAMES: tuple[tuple[str, str], ...] = (
    ("attention_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("feed_forward.w1.weight", "mlp.gate_proj.weight"),  # the dense layers' SwiGLU
    ("feed_forward.w3.weight", "mlp.up_proj.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight"),
    ("feed_forward.router.weight", "mlp.gate.weight"),
)
"""``(ours, Hugging Face)`` names inside a layer that every MoE family here shares (Qwen / DeepSeek naming)."""


@dataclass(frozen=True)
class HFAdapter:
    """How one transformers architecture maps onto one of our model families.

    Args:
        model_type: ``config.json``'s ``model_type`` (``"qwen3_moe"``).
        architecture: the transformers class name written to ``architectures``.
        config_class: our config class of the family.
        model_class: our model class, built from a ``config_class`` instance.
        layer_names: ``(ours, Hugging Face)`` tensor names inside layer i (after ``layers.{i}.`` /
            ``model.layers.{i}.``), experts excluded.
        config_from_hf: ``config.json`` (a dict) to our config; raises ``ValueError`` naming a field it
            cannot represent.
        config_to_hf: our config and the saved dtype to ``config.json``.
        export_problems: what in our config the architecture cannot express (empty: none).
        extra_layers_are_mtp: layers numbered ``>= n_layers`` in a checkpoint are multi-token-prediction
            modules (DeepSeek-V3's layer 61): skipped with a log line instead of refused.
        fp32_names: last components of Hugging Face names (``"e_score_correction_bias"``) always saved in
            float32, as transformers keeps them.
    """

    model_type: str
    architecture: str
    config_class: type
    model_class: Callable[[Any], MoE]
    layer_names: tuple[tuple[str, str], ...]
    config_from_hf: Callable[[dict[str, Any]], Any]
    config_to_hf: Callable[[Any, torch.dtype], dict[str, Any]]
    export_problems: Callable[[Any], list[str]] = lambda config: []
    extra_layers_are_mtp: bool = False
    fp32_names: tuple[str, ...] = ()
    _hf_to_ours: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hf_to_ours", {hf: ours for ours, hf in self.layer_names})

    # ------------------------------------------------------------------------------------------------
    # Loading

    def state_from_hf(self, hf_state: State, config: Any) -> tuple[State, dict[str, str], list[str]]:
        """Rename (and stack experts): our state, our name -> Hugging Face name, unrecognized Hugging Face names."""
        state: State = {}
        origin: dict[str, str] = {}
        unexpected: list[str] = []
        skipped: list[str] = []
        per_expert: dict[tuple[str, str], dict[int, torch.Tensor]] = defaultdict(dict)
        for key, tensor in hf_state.items():
            if key in _TOP_LEVEL:
                state[_TOP_LEVEL[key]] = tensor
                origin[_TOP_LEVEL[key]] = key
                continue
            if key.endswith("rotary_emb.inv_freq"):  # derived data in old checkpoints
                continue
            match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
            if match is None:
                unexpected.append(key)
                continue
            layer, rest = match.groups()
            if self.extra_layers_are_mtp and int(layer) >= config.n_layers:
                skipped.append(key)
                continue
            prefix = f"layers.{layer}.feed_forward.experts."
            expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
            fused = re.fullmatch(r"mlp\.experts\.(gate_up_proj|down_proj)", rest)
            if expert is not None:
                param = _EXPERT_PARAM_OF_PROJ[expert.group(2)]
                per_expert[(layer, param)][int(expert.group(1))] = tensor
                origin[prefix + param] = f"model.layers.{layer}.mlp.experts.*.{expert.group(2)}.weight (stacked)"
            elif fused is not None and fused.group(1) == "gate_up_proj":  # [E, 2F, D]: gate rows, then up rows
                gate, up = tensor.chunk(2, dim=1)
                state[prefix + "w1_EDF"] = gate.transpose(1, 2).contiguous()
                state[prefix + "w3_EDF"] = up.transpose(1, 2).contiguous()
                origin[prefix + "w1_EDF"] = origin[prefix + "w3_EDF"] = key
            elif fused is not None:  # down_proj [E, D, F]
                state[prefix + "w2_EFD"] = tensor.transpose(1, 2).contiguous()
                origin[prefix + "w2_EFD"] = key
            elif rest in self._hf_to_ours:
                name = f"layers.{layer}.{self._hf_to_ours[rest]}"
                state[name] = tensor
                origin[name] = key
            else:
                unexpected.append(key)
        for (layer, param), experts in per_expert.items():
            ids = sorted(experts)
            if ids != list(range(len(ids))):
                missing = sorted(set(range(max(ids) + 1)) - set(ids))
                raise ValueError(f"layer {layer}: experts {missing} are missing from the checkpoint ({param})")
            # Per-expert weights are nn.Linear weights [out, in]; ours are [in, out] per expert.
            state[f"layers.{layer}.feed_forward.experts.{param}"] = torch.stack([experts[e].t() for e in ids])
        if skipped:
            logger.info(
                "%s: skipped %d tensors of the multi-token-prediction layers (model.layers.%d and above), which "
                "the model does not use", self.model_type, len(skipped), config.n_layers,
            )
        return state, origin, unexpected

    # ------------------------------------------------------------------------------------------------
    # Saving

    def state_to_hf(self, state: State, dtype: Optional[torch.dtype]) -> State:
        """Our (full, unsharded) state dict under Hugging Face names, experts unstacked, cast to ``dtype``."""
        ours_to_hf = dict(self.layer_names)
        hf_state: State = {}
        dropped_bias = False

        def put(hf_name: str, t: torch.Tensor) -> None:
            cast = torch.float32 if hf_name.rsplit(".", 1)[-1] in self.fp32_names else (dtype or t.dtype)
            # A copy: parameters may be views into one flat buffer, which safetensors refuses to save.
            hf_state[hf_name] = t.detach().to(device="cpu", dtype=cast, copy=True).contiguous()

        for name, tensor in state.items():
            if name in _TOP_LEVEL_TO_HF:
                put(_TOP_LEVEL_TO_HF[name], tensor)
                continue
            match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
            if match is None:
                raise ValueError(f"no Hugging Face name for {name!r}")
            layer, rest = match.groups()
            prefix = f"model.layers.{layer}."
            param = rest.removeprefix("feed_forward.experts.")
            if param in _EXPERT_PROJ and rest != param:
                for e in range(tensor.shape[0]):
                    put(f"{prefix}mlp.experts.{e}.{_EXPERT_PROJ[param]}.weight", tensor[e].t())
            elif rest in ours_to_hf:
                put(prefix + ours_to_hf[rest], tensor)
            elif rest == "feed_forward.router.expert_bias":
                dropped_bias = dropped_bias or bool(tensor.any())
            else:
                raise ValueError(f"no Hugging Face name for {name!r} in a {self.model_type} checkpoint")
        if dropped_bias:
            warnings.warn(
                "the routers' expert_bias (auxiliary-loss-free balancing) is non-zero but has no place in a "
                f"{self.model_type} checkpoint: it is dropped, so transformers may choose different experts",
                stacklevel=4,
            )
        return hf_state


# ----------------------------------------------------------------------------------------------------
# config.json helpers
# ----------------------------------------------------------------------------------------------------


def hf_get(hf: dict[str, Any], key: str) -> Any:
    """``hf[key]``, or a ``ValueError`` naming the missing key and the model type."""
    if key not in hf:
        raise ValueError(f"config.json has no {key!r}, which a {hf.get('model_type')} checkpoint needs")
    return hf[key]


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, Optional[YarnScaling]]:
    """RoPE base and YaRN scaling from ``config.json`` (``rope_parameters``, or the older ``rope_theta`` +
    ``rope_scaling``). Raises ``ValueError`` for another scaling type or partial rotation."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ValueError(f"config.json: rope_type {rope_type!r} is not supported (supported: 'default', 'yarn')")
    original = int(params.get("original_max_position_embeddings", hf_get(hf, "max_position_embeddings")))
    factor = params.get("factor") or hf_get(hf, "max_position_embeddings") / original
    return theta, YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def rope_to_hf(theta: float, scaling: Optional[YarnScaling]) -> dict[str, Any]:
    """``rope_parameters`` (transformers >= 5) and ``rope_theta`` / ``rope_scaling`` (older versions)."""
    rope_scaling: Optional[dict[str, Any]] = None
    if scaling is not None:
        rope_scaling = {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
        }
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(scaling, key) is not None:
                rope_scaling[key] = getattr(scaling, key)
        if not scaling.truncate:
            rope_scaling["truncate"] = False
    rope_parameters = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    return {"rope_parameters": rope_parameters, "rope_theta": theta, "rope_scaling": rope_scaling}


def check_silu(hf: dict[str, Any]) -> None:
    """Raise unless the experts' activation is SiLU (SwiGLU), the only one the models implement."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
