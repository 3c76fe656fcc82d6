"""CPU tests of address-stable workspaces: slices never move, buffers die with their last lease."""

import sys
import weakref

import pytest
import torch

try:
    from sglang.test.ci.ci_register import register_cpu_ci
except ImportError:  # the core is sglang-free; its tests run without sglang too

    def register_cpu_ci(*args, **kwargs):
        return None


from graph_core_fakes import FakeGraph

from sglang_ext.graphs.cache import BoundedGraphCache
from sglang_ext.graphs.workspace import ALIGN_BYTES, StableWorkspacePool
from sglang_ext_testkit import internals

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TrackingAllocator:
    """Allocates CPU buffers and keeps only weak references, to observe when they are freed."""

    def __init__(self, dtype=torch.float32):
        self.dtype = dtype
        self.refs = []  # (numel, weakref) of every non-empty backing buffer

    def __call__(self, numel):
        tensor = torch.empty(numel, dtype=self.dtype)
        if numel:
            self.refs.append((numel, weakref.ref(tensor)))
        return tensor

    def alive(self):
        # No gc.collect(): a released buffer must die by reference counting at the
        # release itself, not whenever the cycle collector runs.
        return [numel for numel, ref in self.refs if ref() is not None]


def test_leases_that_fit_share_the_current_buffer():
    alloc = TrackingAllocator()
    pool = StableWorkspacePool("rotary", allocate=alloc)
    a = pool.lease("graph-a", 8, (4,))
    b = pool.lease("graph-b", 4, (4,))
    assert a.tensors[0].shape == (8, 4) and b.tensors[0].shape == (4, 4)
    assert a.tensors[0].data_ptr() == b.tensors[0].data_ptr()  # both get the first rows of one buffer
    assert (pool.backing_buffers, internals.live_leases(pool), alloc.alive()) == (1, 2, [32])
    assert pool.bytes_allocated == 32 * 4


def test_growth_never_moves_existing_slices():
    alloc = TrackingAllocator()
    pool = StableWorkspacePool("rotary", allocate=alloc)
    small = pool.lease("small", 4, (2,))
    small.tensors[0].copy_(torch.arange(8, dtype=torch.float32).view(4, 2))
    ptr = small.tensors[0].data_ptr()
    big = pool.lease("big", 10, (2,))  # does not fit in 8 elements: new buffer of max(20, 2 * 8)
    assert alloc.alive() == [8, 20]
    assert small.tensors[0].data_ptr() == ptr and big.tensors[0].data_ptr() != ptr
    big.tensors[0].fill_(-1)
    assert torch.equal(small.tensors[0], torch.arange(8, dtype=torch.float32).view(4, 2))  # untouched
    grown = pool.lease("grown", 9, (2,))  # 18 elements fit in the current 20-element buffer
    assert grown.tensors[0].data_ptr() == big.tensors[0].data_ptr()
    huge = pool.lease("huge", 30, (2,))  # growth: max(60, 2 * 20) = 60
    assert alloc.alive() == [8, 20, 60] and pool.backing_buffers == 3


def test_backing_buffer_freed_exactly_when_last_holder_goes():
    alloc = TrackingAllocator()
    pool = StableWorkspacePool("ws", allocate=alloc)
    first = [pool.lease(f"g{i}", 4) for i in range(2)]
    second = pool.lease("g2", 16)  # retires the 4-element buffer, still held by g0 and g1
    assert alloc.alive() == [4, 16]
    first[0].release()
    assert alloc.alive() == [4, 16]  # g1 still replays from it
    first[1].release()
    assert alloc.alive() == [16]  # last holder gone: freed now
    assert (pool.backing_buffers, internals.live_leases(pool)) == (1, 1)
    second.release()
    # The current buffer stays for the next capture (no re-allocation churn).
    assert alloc.alive() == [16] and internals.live_leases(pool) == 0 and pool.backing_buffers == 1


def test_unleased_current_buffer_is_dropped_on_growth():
    alloc = TrackingAllocator()
    pool = StableWorkspacePool("ws", allocate=alloc)
    pool.lease("a", 4).release()
    pool.lease("b", 64)
    assert alloc.alive() == [64]  # nobody held the old buffer: not retired


def test_release_is_idempotent_and_use_after_release_fails():
    pool = StableWorkspacePool("ws", allocate=TrackingAllocator())
    lease = pool.lease("a", 4)
    other = pool.lease("b", 4)
    lease.release()
    lease.release()
    assert internals.lease_released(lease) and internals.live_leases(pool) == 1
    with pytest.raises(RuntimeError, match="'a'.*after release"):
        lease.tensors
    other.release()
    assert internals.live_leases(pool) == 0


def test_count_gives_non_overlapping_aligned_tensors():
    pool = StableWorkspacePool("rotary", dtype=torch.float16)  # default allocator: torch.empty
    lease = pool.lease(("vit", 7), 7, (3,), count=2)
    cos, sin = lease.tensors
    assert cos.shape == sin.shape == (7, 3) and cos.dtype == torch.float16
    assert (sin.data_ptr() - cos.data_ptr()) % ALIGN_BYTES == 0
    assert sin.data_ptr() >= cos.data_ptr() + cos.numel() * cos.element_size()
    cos.fill_(1)
    sin.fill_(2)
    assert bool((cos == 1).all()) and bool((sin == 2).all())


@pytest.mark.parametrize(
    "args, kwargs, field",
    [
        (("o", -1), {}, "rows"),
        (("o", 2.0), {}, "rows"),
        (("o", 2), dict(count=0), "count"),
        (("o", 2, (-1,)), {}, "row_shape"),
    ],
)
def test_lease_bad_input_names_argument(args, kwargs, field):
    pool = StableWorkspacePool("ws", allocate=TrackingAllocator())
    with pytest.raises(ValueError, match=f"^{field}:.*allowed"):
        pool.lease(*args, **kwargs)


class GraphEntry:
    """What an adapter stores: a graph plus the workspace lease it captured with."""

    def __init__(self, graph, lease):
        self.graph = graph
        self.lease = lease

    def release(self):
        self.graph.reset()
        self.lease.release()


def test_cache_eviction_releases_workspace_of_evicted_graph():
    alloc = TrackingAllocator()
    pool = StableWorkspacePool("rotary", allocate=alloc)
    cache = BoundedGraphCache("vit", 2)
    events = []
    for key, rows in (("a", 4), ("b", 32)):  # b grows the pool: a keeps the 4-row buffer
        assert cache.admit(key).capture
        cache.put(key, GraphEntry(FakeGraph(key, events), pool.lease(key, rows, count=2)))
    assert pool.backing_buffers == 2
    assert cache.admit("c").capture  # evicts a: its graph is reset and its old buffer freed
    assert ("reset", "a") in events and pool.backing_buffers == 1
    cache.clear()
    assert internals.live_leases(pool) == 0 and len(alloc.alive()) == 1  # only the current buffer remains


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
