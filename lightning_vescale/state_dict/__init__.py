"""Checks every loader of named tensors shares (checkpoints, Hugging Face weights, ``init_from``): dtype kinds and
one mismatch report. torch only, so models' adapters may use them."""
