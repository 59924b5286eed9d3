"""Triton kernels of the attention layers and their launch plumbing; the APIs and the torch references
they are tested against live beside this package (attention/norm_rope.py)."""
