"""CPU tests of the sglang-free graph core: keys and bucket selection."""

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


from sglang_ext.graphs.buckets import BucketDecision, select_bucket, validate_buckets
from sglang_ext.graphs.keys import (
    DeviceSyncError,
    GraphKey,
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


def test_graph_key_is_a_hashable_value():
    a = GraphKey(8, layout=(0, 4, 8), variant=("fa3",))
    b = GraphKey(8, layout=(0, 4, 8), variant=("fa3",))
    assert a == b and hash(a) == hash(b)
    assert a != GraphKey(8, layout=(0, 2, 8), variant=("fa3",))
    assert len({a, b, GraphKey(8)}) == 2
    with pytest.raises(Exception):
        a.num_tokens = 9  # frozen


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_tokens=-1), "num_tokens"),
        (dict(num_tokens=True), "num_tokens"),
        (dict(num_tokens=2.0), "num_tokens"),
        (dict(num_tokens=2, layout=[0, 2]), "layout"),
        (dict(num_tokens=2, variant="fa3"), "variant"),
    ],
)
def test_graph_key_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:.*allowed"):
        GraphKey(**kwargs)


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

    def fits(b):
        return live <= b <= live * factor and (required is None or caps.get(b, -1) >= required)

    fitting = [b for b in buckets if fits(b)]
    if d.bucket is None:
        assert fitting == []
    else:
        assert d.bucket >= live
        assert d.bucket <= live * factor
        if required is not None:
            assert d.capacity is not None and d.capacity >= required
        assert d.bucket == min(fitting)  # minimal among fitting buckets
        assert d.padding == d.bucket - live
    assert d.live_size == live and d.required == required


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
