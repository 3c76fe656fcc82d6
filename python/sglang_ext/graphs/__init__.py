"""sglang-free core shared by the ViT, prefill-CP and Pi0.5 graph adapters.

Importable with torch but without sglang and without CUDA. Every decision here
depends only on the sequence of keys seen, so tensor-parallel ranks that see the
same requests decide (and capture) in lockstep.
"""

from sglang_ext.graphs.buckets import BucketDecision, select_bucket, validate_buckets
from sglang_ext.graphs.keys import (
    DeviceSyncError,
    GraphKey,
    cpu_ints,
    cumulative_lengths,
    dedup_consecutive,
    grid_thw_lengths,
)

__all__ = [
    "BucketDecision",
    "DeviceSyncError",
    "GraphKey",
    "cpu_ints",
    "cumulative_lengths",
    "dedup_consecutive",
    "grid_thw_lengths",
    "select_bucket",
    "validate_buckets",
]
