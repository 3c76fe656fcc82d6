"""The sglang-free core shared by the ViT, prefill-CP and Pi0.5 adapters.

Importable without sglang and without CUDA. Every decision here depends only on the sequence of
keys seen, so tensor-parallel ranks that see the same requests decide (and capture) in lockstep.
"""
