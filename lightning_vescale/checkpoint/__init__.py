"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): resharding, all-or-nothing, code-free loads.

Sharded parameters and the optimizer states shaped like them are :class:`~lightning_vescale.engine.tensor.RaggedTensor` s,
which tell DCP their chunks through its tensor-subclass hooks (as DTensor does): every rank writes only its
pieces, and a load on any world size reads exactly the saved boxes that overlap its new pieces, never a
gather. Non-tensor values are stored as JSON (never pickled), every stored item is checksummed, and a load
changes nothing unless every rank read everything intact. See ``_save_load`` for the format and the load
protocol, ``_directory`` for atomic saves, ``_storage`` for what reading may execute and the checksums,
``_state`` for the state-dict adapter and ``_full_state`` for full (unsharded) state dicts.

Modules:
    ``_state``      state dicts of the model and optimizer, keyed by parameter name
    ``_save_load``  ``save`` / ``load`` of checkpoint directories
    ``_directory``  atomic directory replacement, ``.old`` fallback, leftovers
    ``_storage``    safe metadata reading, checksums, :class:`CheckpointError`
    ``_values``     non-tensor values as typed JSON
    ``_full_state`` full state dicts and files (safetensors / torch)
"""

from lightning_vescale.checkpoint._full_state import (
    export_full_optimizer_state_dict,
    export_full_state_dict,
    load_full_optimizer_state_dict,
    load_full_state_dict,
    read_state_file,
    save_full,
    save_pretrained,
)
from lightning_vescale.checkpoint._save_load import FORMAT_VERSION, load, read_full_checkpoint, read_full_tensors, save
from lightning_vescale.checkpoint._state import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from lightning_vescale.checkpoint._storage import CheckpointError, add_checksums

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "add_checksums",
    "export_full_optimizer_state_dict",
    "export_full_state_dict",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "load",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "read_full_checkpoint",
    "read_full_tensors",
    "read_state_file",
    "save",
    "save_full",
    "save_pretrained",
    "set_model_state_dict",
    "set_optimizer_state_dict",
]
