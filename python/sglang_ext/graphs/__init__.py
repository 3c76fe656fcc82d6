"""sglang-free core shared by the ViT, prefill-CP and Pi0.5 graph adapters.

Importable with torch but without sglang and without CUDA (torch itself is
imported only by the functions that need it). Every decision here depends only
on the sequence of keys seen, so tensor-parallel ranks that see the same
requests decide (and capture) in lockstep.
"""

from sglang_ext.graphs import stats
from sglang_ext.graphs.agreement import Outcome, agreed_capture, cpu_group_vote, local_vote
from sglang_ext.graphs.buckets import BucketDecision, select_bucket, validate_buckets
from sglang_ext.graphs.cache import Admission, BoundedGraphCache, CacheInfo, is_transient_failure, release_entry
from sglang_ext.graphs.capture import (
    capture_graph,
    capture_measured,
    capture_stream,
    guarded_capture,
    largest_first,
    pin_graph_pool,
    pool_reserved_bytes,
    shared_graph_pool,
)
from sglang_ext.graphs.keys import (
    DeviceSyncError,
    GraphKey,
    cpu_ints,
    cumulative_lengths,
    dedup_consecutive,
    grid_thw_lengths,
)
from sglang_ext.graphs.workspace import AddressGuard, GraphInputMovedError, StableWorkspacePool, WorkspaceLease

__all__ = [
    "AddressGuard",
    "Admission",
    "BoundedGraphCache",
    "BucketDecision",
    "CacheInfo",
    "DeviceSyncError",
    "GraphInputMovedError",
    "GraphKey",
    "Outcome",
    "StableWorkspacePool",
    "WorkspaceLease",
    "agreed_capture",
    "capture_graph",
    "capture_measured",
    "capture_stream",
    "cpu_group_vote",
    "cpu_ints",
    "cumulative_lengths",
    "dedup_consecutive",
    "grid_thw_lengths",
    "guarded_capture",
    "is_transient_failure",
    "largest_first",
    "local_vote",
    "pin_graph_pool",
    "pool_reserved_bytes",
    "release_entry",
    "select_bucket",
    "shared_graph_pool",
    "stats",
    "validate_buckets",
]
