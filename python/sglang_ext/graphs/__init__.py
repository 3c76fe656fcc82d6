"""The sglang-free core shared by the ViT, prefill-CP and Pi0.5 adapters (importable without sglang or CUDA).
Every decision depends only on the keys seen, so TP ranks that see the same requests decide in lockstep.
"""
