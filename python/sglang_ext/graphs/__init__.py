"""The sglang-free core shared by the ViT, prefill-CP and Pi0.5 adapters.

Importable with torch but without sglang and without CUDA (torch is imported only by the
functions that need it). Every decision here depends only on the sequence of keys seen, so
tensor-parallel ranks that see the same requests decide (and capture) in lockstep.
"""
