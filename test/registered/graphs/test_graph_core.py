"""CPU tests of the sglang-free graph core: keys, bucket selection, bounded cache, stats."""

import gc
import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

try:
    from sglang.test.ci.ci_register import register_cpu_ci
except ImportError:  # the core is sglang-free; its tests run without sglang too

    def register_cpu_ci(*args, **kwargs):
        return None


from graph_core_fakes import FakeGraph, key_sequence, rank_log, resets_of, run_step

from sglang_ext.graphs import cache as cache_module
from sglang_ext.graphs import stats
from sglang_ext.graphs import capture
from sglang_ext_testkit import graph_capture
from sglang_ext_testkit import internals
from sglang_ext.graphs.buckets import BucketDecision, geometric_buckets, select_bucket, validate_buckets
from sglang_ext.graphs.cache import Admission, BoundedGraphCache, CacheInfo, release_entry
from sglang_ext.graphs.keys import (
    DeviceSyncError,
    cpu_ints,
    cumulative_lengths,
    dedup_consecutive,
    grid_thw_lengths,
)

register_cpu_ci(est_time=15, suite="base-a-test-cpu")


# --------------------------------------------------------------------------- keys


class _FakeDevice:
    def __init__(self, kind):
        self.type = kind


class FakeDeviceTensor:
    """Stands in for a CUDA tensor (no CUDA here); records whether it was read."""

    def __init__(self, values, kind="cuda"):
        self._values = list(values)
        self.device = _FakeDevice(kind)
        self.is_cuda = kind == "cuda"
        self.reads = 0

    def tolist(self):
        self.reads += 1
        return list(self._values)


@pytest.mark.parametrize(
    "values",
    [[1, 2, 3], (1, 2, 3), np.array([1, 2, 3]), torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3], dtype=torch.int32)],
    ids=["list", "tuple", "numpy", "tensor64", "tensor32"],
)
def test_cpu_ints_accepts_host_containers(values):
    out = cpu_ints(values, field="cu_seqlens")
    assert out == (1, 2, 3)
    assert all(type(v) is int for v in out)


def test_cpu_ints_refuses_device_tensor_without_opt_in():
    fake = FakeDeviceTensor([0, 4, 8])
    with pytest.raises(DeviceSyncError, match="cu_seqlens.*cuda.*allow_device_sync"):
        cpu_ints(fake, field="cu_seqlens")
    assert fake.reads == 0  # refused before touching the device
    assert isinstance(DeviceSyncError("x"), ValueError)


def test_cpu_ints_refuses_tensor_flagged_only_by_device_type():
    fake = FakeDeviceTensor([1], kind="cuda")
    fake.is_cuda = False  # e.g. an object that only exposes .device
    with pytest.raises(DeviceSyncError):
        cpu_ints(fake, field="x")
    with pytest.raises(DeviceSyncError, match="npu"):
        cpu_ints(FakeDeviceTensor([1], kind="npu"), field="x")


def test_cpu_ints_device_tensor_with_explicit_opt_in():
    fake = FakeDeviceTensor([0, 4, 8])
    assert cpu_ints(fake, field="cu_seqlens", allow_device_sync=True) == (0, 4, 8)
    assert fake.reads == 1


@pytest.mark.parametrize(
    "values", [[1, 2.5], [True, 1], torch.tensor([1.0, 2.0]), ["1"], "12", object()], ids=repr
)
def test_cpu_ints_rejects_non_integers_naming_field(values):
    with pytest.raises(ValueError, match="^lengths:.*allowed"):
        cpu_ints(values, field="lengths")


def test_cumulative_lengths():
    assert cumulative_lengths([4, 4]) == (0, 4, 8)
    assert cumulative_lengths([4, 4], leading_zeros=0) == (4, 8)
    assert cumulative_lengths(torch.tensor([3, 0, 5])) == (0, 3, 3, 8)
    assert cumulative_lengths([]) == (0,)
    with pytest.raises(ValueError, match="^lengths:"):
        cumulative_lengths([2, -1])
    with pytest.raises(ValueError, match="^leading_zeros:"):
        cumulative_lengths([2], leading_zeros=-1)


def test_grid_thw_lengths_list_and_tensor():
    grid = [[1, 4, 6], [2, 2, 2]]
    assert grid_thw_lengths(grid) == (24, 8)
    assert grid_thw_lengths(torch.tensor(grid)) == (24, 8)
    assert grid_thw_lengths(np.array(grid)) == (24, 8)
    assert grid_thw_lengths([]) == ()


@pytest.mark.parametrize("grid", [[[1, 2]], [[1, 2, -3]], [[1, 2, 3.0]], 5], ids=repr)
def test_grid_thw_lengths_rejects_bad_rows(grid):
    with pytest.raises(ValueError, match="^image_grid_thw:.*allowed"):
        grid_thw_lengths(grid, field="image_grid_thw")


def test_grid_thw_lengths_refuses_device_tensor():
    with pytest.raises(DeviceSyncError, match="grid_thw"):
        grid_thw_lengths(FakeDeviceTensor([[1, 2, 2]]))


def test_dedup_consecutive_matches_torch():
    values = [0, 0, 4, 4, 4, 8, 4, 4, 12]
    expected = tuple(torch.unique_consecutive(torch.tensor(values)).tolist())
    assert dedup_consecutive(values) == expected == (0, 4, 8, 4, 12)
    assert dedup_consecutive([]) == ()


# ------------------------------------------------------------------------ buckets


def test_validate_buckets():
    assert validate_buckets([1, 2, 8]) == (1, 2, 8)
    assert validate_buckets(np.array([4, 16])) == (4, 16)


@pytest.mark.parametrize(
    "buckets, what",
    [
        ([4, 2], "out of order"),
        ([2, 2], "duplicate"),
        ([0, 2], "element 0"),
        ([-2], "element -2"),
        ([1.5], "element 1.5"),
        ([True, 2], "element True"),
        (7, "7"),
    ],
)
def test_validate_buckets_rejects_bad_lists(buckets, what):
    with pytest.raises(ValueError, match=f"^cp_buckets:.*{what}.*allowed: positive integers, strictly increasing"):
        validate_buckets(buckets, field="cp_buckets")


def test_select_bucket_exactly_at_a_bucket_and_between():
    d = select_bucket(64, [32, 64, 128])
    assert d == BucketDecision(64, 64, None, None) and d.fits and d.padding == 0
    d = select_bucket(65, [32, 64, 128])
    assert d.bucket == 128 and d.padding == 63


def test_select_bucket_live_size_above_all_buckets():
    d = select_bucket(129, [32, 64, 128], max_padding_factor=float("inf"))
    assert d.bucket is None and not d.fits and d.padding == 0


def test_select_bucket_padding_factor_limit():
    assert select_bucket(50, [100]).bucket == 100  # exactly 2x is allowed
    assert select_bucket(49, [100]).bucket is None  # 100 > 49 * 2
    assert select_bucket(49, [100], max_padding_factor=2.05).bucket == 100
    assert select_bucket(99, [100], max_padding_factor=1).bucket is None
    assert select_bucket(100, [100], max_padding_factor=1).bucket == 100
    assert select_bucket(0, [1, 2]).bucket is None  # nothing to pad: no bucket is within 0 * factor
    assert select_bucket(0, [1, 2], max_padding_factor=float("inf")).bucket == 1  # inf = no limit


def test_select_bucket_required_vs_capacity():
    caps = {64: 10, 128: 40, 256: 100}
    d = select_bucket(60, [64, 128, 256], max_padding_factor=8, capacity=caps, required=30)
    assert (d.bucket, d.required, d.capacity) == (128, 30, 40)
    # The same requirement but 256 is past the padding limit: no fit.
    assert select_bucket(60, [64, 128, 256], max_padding_factor=2, capacity=caps, required=50).bucket is None
    # capacity == required is enough.
    assert select_bucket(60, [64, 128], capacity=caps, required=10).bucket == 64
    # Without a requirement the capacity is only reported.
    assert select_bucket(60, [64, 128], capacity=caps) == BucketDecision(60, 64, None, 10)


def test_select_bucket_unknown_capacity_is_unusable():
    caps = {128: 40}  # 64 has no entry
    assert select_bucket(60, [64, 128], max_padding_factor=4, capacity=caps, required=1).bucket == 128
    assert select_bucket(60, [64, 128], capacity=None, required=1).bucket is None
    assert select_bucket(60, [64, 128], capacity=None, required=None).bucket == 64


@pytest.mark.parametrize(
    "args, kwargs, field",
    [
        ((-1, [1]), {}, "live_size"),
        ((2.0, [1]), {}, "live_size"),
        ((True, [1]), {}, "live_size"),
        ((2, [2, 1]), {}, "buckets"),
        ((2, [2, 2]), {}, "buckets"),
        ((2, [2]), dict(max_padding_factor=0.5), "max_padding_factor"),
        ((2, [2]), dict(max_padding_factor=float("nan")), "max_padding_factor"),
        ((2, [2]), dict(max_padding_factor="2"), "max_padding_factor"),
        ((2, [2]), dict(required=-1), "required"),
        ((2, [2]), dict(required=1.5), "required"),
    ],
)
def test_select_bucket_bad_input_names_argument(args, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:.*allowed"):
        select_bucket(*args, **kwargs)


_buckets = st.lists(st.integers(1, 4096), min_size=1, max_size=12, unique=True).map(sorted)


@settings(max_examples=300, deadline=None)
@given(
    live=st.integers(0, 5000),
    buckets=_buckets,
    factor=st.sampled_from([1, 1.25, 1.5, 2, 3, 8, float("inf")]),
    caps=st.dictionaries(st.integers(1, 4096), st.integers(0, 100), max_size=12),
    required=st.one_of(st.none(), st.integers(0, 100)),
)
def test_select_bucket_properties(live, buckets, factor, caps, required):
    d = select_bucket(live, buckets, max_padding_factor=factor, capacity=caps, required=required)

    limit = float("inf") if factor == float("inf") else live * factor

    def fits(b):
        return live <= b <= limit and (required is None or caps.get(b, -1) >= required)

    fitting = [b for b in buckets if fits(b)]
    if d.bucket is None:
        assert fitting == []
    else:
        assert d.bucket >= live
        assert d.bucket <= limit
        if required is not None:
            assert d.capacity is not None and d.capacity >= required
        assert d.bucket == min(fitting)  # minimal among fitting buckets
        assert d.padding == d.bucket - live
    assert d.live_size == live and d.required == required


@settings(max_examples=200, deadline=None)
@given(
    smallest=st.integers(1, 2048),
    span=st.integers(0, 50_000),
    ratio=st.sampled_from([1.01, 1.1, 1.125, 1.5, 2.0]),
    multiple=st.sampled_from([1, 4, 64]),
)
def test_geometric_buckets_bound_the_padding(smallest, span, ratio, multiple):
    largest = smallest + span
    sizes = geometric_buckets(smallest, largest, ratio=ratio, multiple=multiple)
    assert validate_buckets(sizes) == sizes  # positive, strictly increasing
    assert all(b % multiple == 0 for b in sizes)
    assert sizes[0] >= smallest and sizes[-1] >= largest
    assert len(sizes) == 1 or sizes[-2] < largest  # stops at the first size covering `largest`
    for a, b in zip(sizes, sizes[1:]):  # each step grows by at most the ratio, plus rounding
        assert b <= a * ratio + multiple


def test_geometric_buckets_default_vit_ladder():
    sizes = geometric_buckets(256, 16384, ratio=1.125, multiple=64)
    assert sizes[:4] == (256, 320, 384, 448) and sizes[-1] >= 16384 and len(sizes) == 36


@pytest.mark.parametrize("kwargs, field", [
    (dict(smallest=0, largest=8, ratio=2.0), "smallest"),
    (dict(smallest=8, largest=4, ratio=2.0), "largest"),
    (dict(smallest=8, largest=16, ratio=1.0), "ratio"),
    (dict(smallest=1, largest=10**6, ratio=1.0000001), "ratio"),
    (dict(smallest=8, largest=16, ratio=float("inf")), "ratio"),
    (dict(smallest=8, largest=16, ratio=2.0, multiple=0), "multiple"),
])
def test_geometric_buckets_bad_input_names_argument(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: .*allowed"):
        geometric_buckets(**kwargs)


# -------------------------------------------------------------------------- cache


def test_capacity_zero_runs_everything_eager():
    events, graphs = [], []
    cache = BoundedGraphCache("zero", 0)
    assert [run_step(cache, k, events, graphs) for k in "aab"] == ["EAGER_DISABLED"] * 3
    assert graphs == [] and len(cache) == 0
    g = FakeGraph("x", events)
    assert cache.put("x", g) is False and g.resets == 1  # refused entries are released, not leaked
    info = cache.info()
    assert (info.size, info.capacity, info.captures, info.misses) == (0, 0, 0, 3)


def test_capacity_one_swaps_and_resets_the_previous_graph():
    events, graphs = [], []
    cache = BoundedGraphCache("one", 1)
    assert [run_step(cache, k, events, graphs) for k in "aabab"] == [
        "captured", "hit", "captured", "captured", "captured"
    ]
    assert resets_of(events) == ["a", "b", "a"]
    assert tuple(cache.entries) == ("b",)
    # The reset of the evicted graph happens before the new capture (pool memory is free first).
    assert events.index(("reset", "a")) < events.index(("capture", "b"))
    assert cache.info().evictions == 3


def test_capacity_n_lru_order():
    events, graphs = [], []
    cache = BoundedGraphCache("n", 3)
    for k in "abc":
        run_step(cache, k, events, graphs)
    assert tuple(cache.entries) == ("a", "b", "c")
    assert run_step(cache, "a", events, graphs) == "hit"
    assert tuple(cache.entries) == ("b", "c", "a")
    run_step(cache, "d", events, graphs)
    assert tuple(cache.entries) == ("c", "a", "d") and resets_of(events) == ["b"]
    assert list(cache.entries) == ["c", "a", "d"]
    with pytest.raises(TypeError):
        cache.entries["z"] = None  # read-only view
    info = cache.info()
    assert (info.size, info.hits, info.misses, info.captures, info.evictions) == (3, 1, 4, 4, 1)


def test_exact_policy_keeps_first_keys_and_rejects_later_ones():
    events, graphs = [], []
    cache = BoundedGraphCache("exact", 2, policy="exact")
    out = [run_step(cache, k, events, graphs) for k in "abcca"]
    assert out == ["captured", "captured", "EAGER_CAPACITY", "EAGER_CAPACITY", "hit"]
    assert tuple(cache.entries) == ("b", "a") and resets_of(events) == []
    late = FakeGraph("c", events)
    assert cache.put("c", late) is False and late.resets == 1  # a put past capacity is refused too
    info = cache.info()
    assert (info.rejections, info.evictions, info.size) == (3, 0, 2)
    assert cache.discard("a") and run_step(cache, "c", events, graphs) == "captured"


def test_anti_thrash_captures_on_the_kth_sighting_without_evicting_before():
    events, graphs = [], []
    cache = BoundedGraphCache("warm", 1, min_hits=3)
    assert [run_step(cache, "a", events, graphs) for _ in range(4)] == [
        "EAGER_WARMING", "EAGER_WARMING", "captured", "hit"
    ]
    # A one-off key neither evicts nor captures; 'a' keeps its graph.
    assert run_step(cache, "b", events, graphs) == "EAGER_WARMING"
    assert run_step(cache, "a", events, graphs) == "hit"
    assert [run_step(cache, "b", events, graphs) for _ in range(2)] == ["EAGER_WARMING", "captured"]
    assert resets_of(events) == ["a"]
    # Sightings restart after eviction: 'a' must warm up again.
    assert run_step(cache, "a", events, graphs) == "EAGER_WARMING"
    assert cache.info().min_hits == 3


def test_byte_budget_evicts_by_bytes_before_capture():
    events, graphs = [], []
    cache = BoundedGraphCache("bytes", 10, max_bytes=100)
    for k in "abc":
        assert run_step(cache, k, events, graphs, nbytes=40) in ("captured",)
    # a+b+c = 120 > 100: 'a' was evicted when 'c' was admitted, before its capture.
    assert tuple(cache.entries) == ("b", "c") and cache.bytes_resident == 80
    assert events.index(("reset", "a")) < events.index(("capture", "c"))
    # Larger than the whole budget: eager, nothing evicted.
    assert run_step(cache, "huge", events, graphs, nbytes=101) == "EAGER_CAPACITY"
    assert tuple(cache.entries) == ("b", "c") and cache.info().rejections == 1
    # A capture that measured more than expected: evict LRU after the put, never the new entry.
    assert cache.admit("d", expected_bytes=10).capture and tuple(cache.entries) == ("b", "c")
    d = FakeGraph("d", events)
    assert cache.put("d", d, nbytes=95) is True
    assert tuple(cache.entries) == ("d",) and d.resets == 0 and cache.bytes_resident == 95
    assert cache.put("e", FakeGraph("e", events), nbytes=150) is True  # alone over budget: kept, others go
    assert tuple(cache.entries) == ("e",) and d.resets == 1
    info = cache.info()
    assert (info.bytes_resident, info.max_bytes, info.evictions) == (150, 100, 4)


def test_every_release_path_resets_exactly_once():
    events, graphs = [], []
    cache = BoundedGraphCache("paths", 2)
    for k in "ab":
        run_step(cache, k, events, graphs)
    run_step(cache, "c", events, graphs)  # evict a
    replacement = FakeGraph("b", events)
    cache.put("b", replacement)  # replace b
    assert cache.discard("c") is True and cache.discard("c") is False  # discard c
    partial = FakeGraph("p", events)
    cache.put("p", partial)
    cache.fail("p", RuntimeError("first replay failed"))  # fail releases the partial entry
    run_step(cache, "q", events, graphs)
    cache.clear()  # clear releases b (replacement) and q
    everything = graphs + [replacement, partial]
    assert [g.resets for g in everything] == [1] * len(everything)
    assert sorted(resets_of(events)) == sorted(["a", "b", "c", "p", "b", "q"])
    assert len(cache) == 0


def test_release_entry_prefers_release_then_graph_reset():
    calls = []

    class WithRelease:
        def release(self):
            calls.append("release")

        graph = FakeGraph("g", calls)

    class WithGraph:
        graph = FakeGraph("g2", calls)

    release_entry(WithRelease())
    release_entry(WithGraph())
    release_entry(object())  # tolerated: nothing to release
    assert calls == [("capture", "g"), ("capture", "g2"), "release", ("reset", "g2")]


def test_custom_release_and_clear_releases_all_even_if_one_raises():
    released = []

    def release(entry):
        released.append(entry)
        if entry == "bad":
            raise RuntimeError("reset failed")

    cache = BoundedGraphCache("custom", 3, release=release)
    for key in ("x", "bad", "y"):
        cache.put(key, key)
    with pytest.raises(RuntimeError, match="reset failed"):
        cache.clear()
    assert released == ["x", "bad", "y"] and len(cache) == 0


def test_failed_capture_quarantines_key_and_cache_keeps_working():
    events, graphs = [], []
    cache = BoundedGraphCache("fail", 2)
    assert run_step(cache, "a", events, graphs) == "captured"
    assert run_step(cache, "bad", events, graphs, fail=True) == "failed"
    assert [run_step(cache, "bad", events, graphs) for _ in range(3)] == ["EAGER_QUARANTINED"] * 3
    assert internals.is_quarantined(cache, "bad")
    assert "RuntimeError: capture failed" in internals.quarantine_reason(cache, "bad")
    assert [run_step(cache, k, events, graphs) for k in "bca"] == ["captured", "captured", "captured"]
    assert cache.put("bad", FakeGraph("bad", events)) is False  # never stored once quarantined
    info = cache.info()
    assert (info.failures, info.quarantined, info.size) == (1, 1, 2)
    cache.clear()
    assert not internals.is_quarantined(cache, "bad") and cache.info() == CacheInfo(
        "fail", 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, "lru", 1, 0
    )


def _fail_with(cache, key, exc, events, graphs):
    assert cache.admit(key).capture
    cache.fail(key, exc)


def test_transient_failure_is_retried_after_a_doubling_backoff(monkeypatch):
    """Out of memory: eager for 2, 4, 8 ... misses of that key (capped), then captured again."""
    monkeypatch.setattr(cache_module, "MAX_RETRY_BACKOFF", 8)
    events, graphs = [], []
    cache = BoundedGraphCache("transient", 4)
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    waits = []
    for _ in range(4):
        _fail_with(cache, "k", oom, events, graphs)
        assert cache.retry_in("k") is not None
        eager = 0
        while not cache.admit("k").capture:
            eager += 1
        waits.append(eager)
    assert waits == [2, 4, 8, 8]  # capped at MAX_RETRY_BACKOFF
    assert cache.put("k", FakeGraph("k", events)) is True  # the retry succeeded: failures forgotten
    assert not internals.is_quarantined(cache, "k") and cache.get("k") is not None
    cache.discard("k")
    _fail_with(cache, "k", MemoryError("host"), events, graphs)
    assert cache.retry_in("k") == 2  # the backoff starts over
    assert cache.info().failures == 5


def test_permanent_failure_stays_quarantined_and_the_class_can_be_given():
    events, graphs = [], []
    cache = BoundedGraphCache("permanent", 4)
    _fail_with(cache, "shape", RuntimeError("mat1 and mat2 shapes cannot be multiplied"), events, graphs)
    _fail_with(cache, "backend", RuntimeError("ViT CUDA graph does not support attention backend: sdpa"),
               events, graphs)
    # A class agreed across ranks overrides this rank's own error (a peer ran out of memory).
    _fail_with(cache, "agreed", ValueError("declined by a peer"), events, graphs)
    cache.fail("agreed", ValueError("declined by a peer"), transient=True)
    assert cache.retry_in("shape") is None and cache.retry_in("backend") is None and cache.retry_in("agreed") == 2
    assert all(cache.admit(k) is Admission.EAGER_QUARANTINED for _ in range(100) for k in ("shape", "backend"))
    assert cache.put("shape", FakeGraph("shape", events)) is False
    assert cache_module.is_transient_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert not cache_module.is_transient_failure(None)


def test_quarantine_and_warming_bookkeeping_are_bounded(monkeypatch):
    monkeypatch.setattr(cache_module, "MAX_TRACKED_KEYS", 3)
    cache = BoundedGraphCache("bounded", 2, min_hits=2)
    for i in range(5):
        cache.fail(f"k{i}")
    assert [internals.is_quarantined(cache, f"k{i}") for i in range(5)] == [False, False, True, True, True]
    for i in range(5):
        assert cache.admit(f"w{i}") is Admission.EAGER_WARMING
    assert cache.admit("w0") is Admission.EAGER_WARMING  # forgotten: starts over
    assert cache.admit("w4") is Admission.CAPTURE


def test_decisions_are_identical_across_four_ranks():
    seq = key_sequence()
    logs = []
    for rank in range(4):
        # Each rank builds its own key objects (equal values, different identities).
        logs.append(rank_log([("".join(list(k)), n) for k, n in seq]))
    assert all(log == logs[0] for log in logs[1:])
    events, info = logs[0]
    assert info["evictions"] > 10 and info["captures"] > 10 and info["hits"] > 10  # the log is non-trivial


def test_decisions_do_not_depend_on_hash_seed():
    """4 rank processes with different PYTHONHASHSEED (set/dict hash order differs) decide identically."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "import graph_core_fakes as t; print(json.dumps(t.rank_log(t.key_sequence())))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    outputs = []
    for rank in range(4):
        env = dict(os.environ, PYTHONHASHSEED=str(rank + 1))
        proc = subprocess.run([sys.executable, "-c", code, here], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert all(out == outputs[0] for out in outputs[1:])
    assert outputs[0] == json.loads(json.dumps(rank_log(key_sequence())))


_ops = st.lists(
    st.tuples(st.sampled_from(["step", "step", "step", "fail", "discard"]), st.integers(0, 9), st.integers(0, 60)),
    max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(
    ops=_ops,
    capacity=st.integers(0, 4),
    policy=st.sampled_from(["lru", "exact"]),
    max_bytes=st.sampled_from([0, 50, 100]),
    min_hits=st.integers(1, 3),
)
def test_cache_invariants_under_random_operations(ops, capacity, policy, max_bytes, min_hits):
    events, graphs = [], []
    cache = BoundedGraphCache("prop", capacity, policy=policy, max_bytes=max_bytes, min_hits=min_hits)
    for op, key, nbytes in ops:
        before = set(tuple(cache.entries))
        if op == "step":
            run_step(cache, key, events, graphs, nbytes=nbytes)
        elif op == "fail":
            cache.fail(key)
        else:
            cache.discard(key)
        resident = set(tuple(cache.entries))
        assert len(cache) <= capacity
        assert max_bytes == 0 or cache.bytes_resident <= max_bytes or len(cache) == 1
        assert not any(internals.is_quarantined(cache, k) for k in resident)
        if policy == "exact" and op == "step" and len(before) == capacity:
            assert resident == before  # exact: a full cache keeps what it has
        info = cache.info()
        assert info.size == len(resident) and info.captures == len(graphs)
    resident_ids = {id(e) for e in cache.entries.values()}
    for graph in graphs:  # resident graphs never reset, every dropped one exactly once
        assert graph.resets == (0 if id(graph) in resident_ids else 1)
    assert cache.info().evictions + len(resident_ids) <= len(graphs)


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        (dict(max_entries=-1), "max_entries", "integers >= 0"),
        (dict(max_entries=True), "max_entries", "integers >= 0"),
        (dict(max_entries=2.5), "max_entries", "integers >= 0"),
        (dict(max_entries="3"), "max_entries", "integers >= 0"),
        (dict(max_entries=2, policy="fifo"), "policy", "lru, exact"),
        (dict(max_entries=2, min_hits=0), "min_hits", "integers >= 1"),
        (dict(max_entries=2, max_bytes=-1), "max_bytes", "integers >= 0"),
        (dict(max_entries=2, release=None), "release", "a callable"),
        (dict(name="", max_entries=2), "name", "a non-empty string"),
    ],
)
def test_cache_bad_input_names_argument_and_allowed_values(kwargs, field, allowed):
    kwargs.setdefault("name", "c")
    with pytest.raises(ValueError, match=f"^{field}:.*allowed: {allowed}"):
        BoundedGraphCache(**kwargs)


def test_cache_bad_sizes_in_calls():
    cache = BoundedGraphCache("c", 2)
    with pytest.raises(ValueError, match="^expected_bytes:"):
        cache.admit("a", expected_bytes=-1)
    with pytest.raises(ValueError, match="^nbytes:"):
        cache.put("a", FakeGraph("a", []), nbytes=1.5)


def test_admission_capture_property():
    assert [a for a in Admission if a.capture] == [Admission.CAPTURE]


# -------------------------------------------------------------------------- stats


class _Runner:
    def __init__(self, name):
        self.cache = BoundedGraphCache(name, 2)

    def describe(self):
        return {"size": len(self.cache), "kind": "runner"}


def test_stats_snapshot_follows_live_caches():
    cache = BoundedGraphCache("stats-vit", 2)
    cache.put("a", FakeGraph("a", []))
    name = stats.register("stats-vit", cache.info)
    other = BoundedGraphCache("stats-vit", 2)
    name2 = stats.register("stats-vit", other.info)
    assert (name, name2) == ("stats-vit", "stats-vit#2")
    snap = stats.snapshot()
    assert snap["stats-vit"]["size"] == 1 and snap["stats-vit"]["policy"] == "lru"
    assert snap["stats-vit#2"]["size"] == 0
    del cache
    gc.collect()
    assert "stats-vit" not in stats.snapshot()  # a dead cache disappears by itself
    internals.unregister(name2)
    assert "stats-vit#2" not in stats.snapshot()


def test_stats_owner_ties_plain_callables_to_an_object():
    runner = _Runner("stats-owner")
    fn = lambda: {"size": 7}  # noqa: E731 - a plain callable, held strongly
    stats.register("stats-owner", fn, owner=runner)
    stats.register("stats-owner-method", runner.describe)
    snap = stats.snapshot()
    assert snap["stats-owner"] == {"size": 7} and snap["stats-owner-method"]["kind"] == "runner"
    del runner
    gc.collect()
    snap = stats.snapshot()
    assert "stats-owner" not in snap and "stats-owner-method" not in snap


def test_stats_bad_registration():
    with pytest.raises(ValueError, match="^info_fn:.*allowed"):
        stats.register("x", None)
    with pytest.raises(ValueError, match="^name:.*allowed"):
        stats.register("", lambda: {})


# ------------------------------------------------------------------------ capture


def test_largest_first_capture_order():
    assert graph_capture.largest_first([4, 16, 8, 16, 1]) == (16, 8, 4, 1)


def test_capture_helpers_without_cuda_need_no_device():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    assert graph_capture.pool_reserved_bytes() == 0
    assert graph_capture.capture_measured(lambda: "graph") == ("graph", 0)


def test_capture_helpers_bad_input():
    with pytest.raises(ValueError, match="^device:.*allowed"):
        graph_capture.shared_graph_pool("cpu")
    with pytest.raises(ValueError, match="^warmup_iters:.*allowed"):
        graph_capture.capture_graph(lambda: None, warmup_iters=-1)


class _RecordingCapture:
    """Stands in for torch.cuda.graph: records GC state inside the capture; capture_end may fail."""

    def __init__(self, log, *, end_fails=False):
        self.log, self.end_fails = log, end_fails

    def __call__(self, graph, pool=None, stream=None, **kwargs):
        self.log.append(("graph", graph, pool, stream))
        return self

    def __enter__(self):
        self.log.append(("begin", gc.isenabled()))

    def __exit__(self, *exc):
        self.log.append(("end", gc.isenabled()))
        if self.end_fails:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


class _ResettableGraph:
    def __init__(self, log):
        self.log = log

    def reset(self):
        self.log.append(("reset", self))


@pytest.fixture
def recording_cuda(monkeypatch):
    """The torch.cuda pieces guarded_capture touches, recorded (no GPU needed)."""
    log = []
    recorder = _RecordingCapture(log)
    monkeypatch.setattr(torch.cuda, "graph", recorder)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: _Recorded(log, "stream", s))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 7))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _ResettableGraph(log))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(1))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda dev, pool: log.append(("endpool", dev, pool)),
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda dev, pool: log.append(("release", dev, pool)),
                        raising=False)
    monkeypatch.setattr(capture, "_runtime_begin", [None])  # the fallback undo, unless a test installs one
    return recorder, log


class _Recorded:
    def __init__(self, log, what, value):
        self.log, self.what, self.value = log, what, value

    def __enter__(self):
        self.log.append((self.what + "-in", self.value))

    def __exit__(self, *exc):
        self.log.append((self.what + "-out", self.value))


def test_guarded_capture_turns_automatic_gc_off_only_inside_the_capture(recording_cuda):
    recorder, log = recording_cuda
    graph = _ResettableGraph(log)
    assert gc.isenabled()
    with capture.guarded_capture(graph, pool=(0, 3), stream="s"):
        assert not gc.isenabled()  # a CUDAGraph collected here would reset inside the capture
    assert gc.isenabled()
    assert log == [("stream-in", "s"), ("graph", graph, (0, 3), "s"), ("begin", False), ("end", False),
                   ("stream-out", "s")]
    gc.disable()
    try:  # a caller that had GC off keeps it off
        with capture.guarded_capture(graph, pool=(0, 3), stream="s"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_guarded_capture_undoes_a_capture_whose_end_failed(recording_cuda):
    recorder, log = recording_cuda
    recorder.end_fails = True
    graph = _ResettableGraph(log)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        with capture.guarded_capture(graph, pool=(0, 3), stream="s"):
            pass
    assert gc.isenabled()
    # End the pool's recording and its use, reset the graph, then one throwaway capture (its own
    # pool) whose end takes the generator out of capture mode; the caller's stream is restored last.
    assert log[4:7] == [("endpool", 0, (0, 3)), ("release", 0, (0, 3)), ("reset", graph)]
    repair = log[7][1]
    assert log[7] == ("graph", repair, None, "s") and repair is not graph
    assert log[8:] == [("begin", False), ("end", False), ("reset", repair), ("stream-out", "s")]


def test_guarded_capture_undo_reruns_capture_end_inside_a_reopened_capture(recording_cuda, monkeypatch):
    """Preferred undo: the graph's own capture_end, run again once the stream captures (empty)."""
    recorder, log = recording_cuda
    recorder.end_fails = True

    class Graph(_ResettableGraph):
        def capture_end(self):
            self.log.append(("capture_end", self))

    def begin(stream_handle, mode):
        log.append(("begin-raw", stream_handle, mode))
        return 0

    monkeypatch.setattr(capture, "_runtime_begin", [begin])
    stream = type("Stream", (), {"cuda_stream": 1234})()
    graph = Graph(log)
    with pytest.raises(RuntimeError, match="previous error during capture"):
        with capture.guarded_capture(graph, pool=(0, 3), stream=stream):
            pass
    # No private-API pool calls and no throwaway capture: capture_end ends both recordings itself.
    assert log[4:] == [("begin-raw", 1234, 2), ("capture_end", graph), ("reset", graph), ("stream-out", stream)]
    assert gc.isenabled()


def test_guarded_capture_body_error_propagates_after_the_undo(recording_cuda):
    recorder, log = recording_cuda
    recorder.end_fails = True
    graph = _ResettableGraph(log)
    with pytest.raises(ValueError, match="body"):
        with capture.guarded_capture(graph, pool=(0, 3), stream="s"):
            raise ValueError("body")
    assert ("endpool", 0, (0, 3)) in log and ("reset", graph) in log and log[-1] == ("stream-out", "s")
    # A body error whose capture still ended cleanly: nothing to undo, the caller resets the graph.
    recorder.end_fails = False
    log.clear()
    with pytest.raises(ValueError, match="body"):
        with capture.guarded_capture(graph, pool=(0, 3), stream="s"):
            raise ValueError("body")
    assert [e[0] for e in log] == ["stream-in", "graph", "begin", "end", "stream-out"]


def test_guarded_capture_without_a_pool_uses_a_known_private_pool(recording_cuda):
    recorder, log = recording_cuda
    recorder.end_fails = True
    with pytest.raises(RuntimeError):
        with capture.guarded_capture(_ResettableGraph(log), stream="s"):
            pass
    assert log[1][2] == (0, 7) and ("endpool", 0, (0, 7)) in log


@pytest.mark.parametrize("version", ["2.10.0", "2.15.0+cu130", "3.0.0"])
def test_undo_is_skipped_on_an_untested_torch_release(recording_cuda, monkeypatch, caplog, version):
    """Outside the tested releases no internal is touched: the error propagates (the key is quarantined)."""
    recorder, log = recording_cuda
    recorder.end_fails = True
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(capture, "_warned_no_repair", [])
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="sglang_ext.graphs.capture"):
            with pytest.raises(RuntimeError, match="previous error during capture"):
                with capture.guarded_capture(_ResettableGraph(log), pool=(0, 3), stream="s"):
                    pass
    assert not any(e[0] in ("endpool", "release", "reset", "begin-raw") for e in log), log
    assert [e[0] for e in log].count("graph") == 2  # the two captures themselves, no throwaway repair capture
    warnings = [r.getMessage() for r in caplog.records if "not repaired" in r.getMessage()]
    assert len(warnings) == 1 and f"torch {version} is outside" in warnings[0]
    assert gc.isenabled() and log[-1] == ("stream-out", "s")


def test_undo_is_skipped_when_the_torch_internals_are_missing(recording_cuda, monkeypatch, caplog):
    """Internals removed (a tested release): no repair, no reopened capture, one warning naming them."""
    recorder, log = recording_cuda
    recorder.end_fails = True
    monkeypatch.setattr(capture, "_warned_no_repair", [])
    monkeypatch.delattr(torch._C, "_cuda_endAllocateToPool")
    monkeypatch.delattr(torch._C, "_cuda_releasePool")
    began = []
    monkeypatch.setattr(capture, "_runtime_begin", [lambda handle, mode: began.append(handle) or 0])
    graph = _ResettableGraph(log)  # no capture_end either: the preferred undo is out too
    with caplog.at_level(logging.WARNING, logger="sglang_ext.graphs.capture"):
        with pytest.raises(RuntimeError, match="previous error during capture"):
            with capture.guarded_capture(graph, pool=(0, 3), stream=type("S", (), {"cuda_stream": 9})()):
                pass
    assert began == [], "a capture was re-opened with nothing to end it"
    assert not any(e[0] in ("endpool", "release", "reset") for e in log), log
    [warning] = [r.getMessage() for r in caplog.records if "not repaired" in r.getMessage()]
    assert "torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool" in warning
    assert capture.repair_unavailable() is None  # this torch is a tested release


def test_repair_guard_reads_torch_release():
    assert capture._torch_release("2.11.0+cu130") == (2, 11)
    assert capture._torch_release("2.14.1") == (2, 14)
    assert capture._torch_release("2.12.0a0+git1234") == (2, 12)
    low, high = capture.REPAIR_TESTED_TORCH
    assert low <= capture._torch_release(torch.__version__) <= high, "CPU CI must run a tested torch"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_validated_bucket_cache_does_not_admit_equal_non_ints():
    """The fast path for already-validated lists must not let True/1.0 pass as 1."""
    from sglang_ext.graphs.buckets import validate_buckets

    assert validate_buckets([1, 2]) == (1, 2)
    assert validate_buckets([1, 2]) == (1, 2)  # cached
    for bad in ([True, 2], [1.0, 2], (1, 2.0)):
        with pytest.raises(ValueError, match="buckets"):
            validate_buckets(bad)


def test_sealed_cache_replays_what_it_holds_and_never_captures_again():
    released = []
    cache = BoundedGraphCache("sealed", 4, policy="lru", release=released.append)
    assert cache.admit("a") is Admission.CAPTURE and cache.put("a", "graph-a", nbytes=10)
    cache.seal()
    assert cache.get("a") == "graph-a"  # what was captured before the seal still replays
    for key in ("b", "b", "c"):  # a miss runs eager: counted, nothing evicted, nothing admitted
        assert cache.get(key) is None and cache.admit(key) is Admission.EAGER_SEALED
    info = cache.info()
    assert (info.sealed, info.sealed_misses, info.size, info.captures, info.evictions) == (True, 3, 1, 1, 0)
    cache.clear()  # releases the graphs, keeps the seal (a policy, not a cached state)
    assert released == ["graph-a"] and cache.admit("a") is Admission.EAGER_SEALED
    cache.seal(False)
    assert cache.admit("a") is Admission.CAPTURE
