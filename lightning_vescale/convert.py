"""``python -m lightning_vescale.convert CHECKPOINT_DIR OUTPUT``: a sharded checkpoint as one ordinary weights file.

The command's name; the code lives with the rest of the offline export in :mod:`lightning_vescale.export`
(:func:`~lightning_vescale.export.convert`, :func:`~lightning_vescale.export.load_full_model_state`).
"""

from __future__ import annotations

from lightning_vescale.export import convert, convert_main, load_full_model_state

__all__ = ["convert", "load_full_model_state", "main"]

main = convert_main

if __name__ == "__main__":
    main()
