"""GPU tests of the graph core with real torch.cuda.CUDAGraph (1 GPU, well under a minute).

Run with `-s` to see one summary line per test.
"""

import gc
import random
import sys
import time

import pytest
import torch

try:
    from sglang.test.ci.ci_register import register_cuda_ci
except ImportError:  # the core is sglang-free; its tests run without sglang too

    def register_cuda_ci(*args, **kwargs):
        return None


from sglang_ext.graphs.cache import BoundedGraphCache
from sglang_ext.graphs.workspace import StableWorkspacePool
from sglang_ext.graphs.capture import capture_stream, guarded_capture
from sglang_ext_testkit import internals
from sglang_ext_testkit.graph_capture import capture_graph, capture_measured, pool_reserved_bytes, shared_graph_pool

register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 1 << 20
# Allowed drift of reserved memory across the eviction loop: one extra 20 MiB
# large-block segment (allocator fragmentation) plus slack. Keeping each evicted
# graph would add >= 0.75 MiB (output + input) x 224 evictions = 168 MiB.
FLAT_TOLERANCE = 24 * MiB


@pytest.fixture(autouse=True, scope="module")
def _frozen_gc():
    """Some torch versions gc.collect() on every capture; with sglang and pytest loaded that
    costs ~0.1 s each. Freezing the objects that exist now keeps ~400 captures fast."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


class GraphEntry:
    """A cached graph as an adapter stores it: graph, its output, its workspace lease."""

    def __init__(self, graph, output, lease=None):
        self.graph = graph
        self.output = output
        self.lease = lease
        self.static_in = None  # the captured input, if the test allocated one
        self.releases = 0

    def release(self):
        self.releases += 1
        self.graph.reset()
        self.output = None  # the output block goes back to the shared pool
        # The test keeps released entries to count resets: drop the captured input too,
        # or 224 of them (0.25-2 MiB each) stay allocated and look like pool growth.
        self.static_in = None
        if self.lease is not None:
            self.lease.release()


def _overlaps(a_ptr, a_len, b_ptr, b_len):
    return a_ptr < b_ptr + b_len and b_ptr < a_ptr + a_len


def _summary(name, **values):
    print(f"[graph-core-cuda] {name}: " + " ".join(f"{k}={v}" for k, v in values.items()))


@torch.no_grad()
def test_evicted_graphs_return_pool_memory():
    start = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device("cuda")
    pool = shared_graph_pool()
    assert shared_graph_pool(device) is pool  # one pool per device
    weight = torch.randn(1024, 2048, device=device)
    stream = capture_stream()
    row_cycle = [64, 128, 192, 256, 320, 384, 448, 512]  # outputs of 0.5 .. 4 MiB
    released = []

    def capture(cache, step):
        rows = row_cycle[step % len(row_cycle)]
        key = (step, rows)  # a new layout every step: every step misses
        assert cache.get(key) is None
        assert cache.admit(key).capture  # under lru this resets the LRU graph first
        static_in = torch.randn(rows, 1024, device=device)
        (graph, out), nbytes = capture_measured(
            lambda: capture_graph(lambda: torch.relu(static_in @ weight) + 1, pool=pool, stream=stream)
        )
        entry = GraphEntry(graph, out)
        entry.static_in = static_in
        cache.put(key, entry, nbytes=nbytes)
        released.append(entry)
        return nbytes

    cache = BoundedGraphCache("cuda-lru", 4)
    warmup_steps, total_steps = 40, 264
    for step in range(warmup_steps):
        capture(cache, step)
    torch.cuda.synchronize()
    baseline = pool_reserved_bytes()
    peak, late_measured = baseline, 0
    for step in range(warmup_steps, total_steps):
        late_measured += capture(cache, step)
        peak = max(peak, pool_reserved_bytes())
    torch.cuda.synchronize()
    evictions = cache.info().evictions
    assert evictions == total_steps - 4
    assert evictions - (warmup_steps - 4) >= 200
    evicted = released[: total_steps - 4]
    assert [e.releases for e in evicted] == [1] * len(evicted)  # every evicted graph reset exactly once
    assert [e.releases for e in released[-4:]] == [0] * 4
    # Replay the survivors: still correct after 200+ resets of their pool neighbours.
    for entry in cache.entries.values():
        entry.graph.replay()
        torch.testing.assert_close(entry.output, torch.relu(entry.static_in @ weight) + 1)
    assert peak - baseline <= FLAT_TOLERANCE, f"reserved grew {(peak - baseline) / MiB:.1f} MiB across evictions"
    assert late_measured <= FLAT_TOLERANCE

    # Control: the same captures WITHOUT eviction must grow reserved memory, or the check above proves nothing.
    cache.clear()
    keep_all = BoundedGraphCache("cuda-keep", 1000)
    before = pool_reserved_bytes()
    for step in range(40):
        capture(keep_all, step)
    torch.cuda.synchronize()
    control_growth = pool_reserved_bytes() - before
    keep_all.clear()
    assert control_growth > 2 * FLAT_TOLERANCE, f"control grew only {control_growth / MiB:.1f} MiB"
    _summary(
        "evicted graphs return pool memory",
        evictions=evictions,
        reserved_mib=f"{baseline / MiB:.1f}",
        drift_mib=f"{(peak - baseline) / MiB:.2f}",
        tolerance_mib=FLAT_TOLERANCE // MiB,
        control_growth_mib=f"{control_growth / MiB:.1f}",
        seconds=f"{time.perf_counter() - start:.1f}",
    )


@torch.no_grad()
def test_replay_after_workspace_growth_reads_its_own_slice():
    start = time.perf_counter()
    torch.manual_seed(1)
    device = torch.device("cuda")
    pool = shared_graph_pool()
    weight = torch.randn(256, 256, device=device)
    workspace = StableWorkspacePool("cuda-ws", dtype=torch.float32, device=device)

    def capture(rows):
        lease = workspace.lease(("g", rows), rows, (256,))
        x = lease.tensors[0]
        x.normal_()
        graph, out = capture_graph(lambda: x @ weight, pool=pool)
        return GraphEntry(graph, out, lease)

    small = capture(8)
    small_ptr = small.lease.tensors[0].data_ptr()
    small_block = small.lease.tensors[0].numel()
    big = capture(4096)  # does not fit: growth starts a new backing buffer
    assert workspace.backing_buffers == 2
    assert big.lease.tensors[0].data_ptr() != small_ptr

    # Defeat allocator reuse: take blocks of the small buffer's size and fill them with a sentinel.
    # Had the small graph's buffer been freed at growth, some of them would overlap its address range.
    nbytes = small_block * 4
    holders = [torch.full((small_block,), 1e6, device=device) for _ in range(64)]
    assert not any(_overlaps(h.data_ptr(), nbytes, small_ptr, nbytes) for h in holders)
    xs, xb = torch.randn(8, 256, device=device), torch.randn(4096, 256, device=device)
    small.lease.tensors[0].copy_(xs)  # what the runner does before a replay: write the graph's own slice
    big.lease.tensors[0].copy_(xb)
    small.graph.replay()
    big.graph.replay()
    torch.cuda.synchronize()
    assert small.lease.tensors[0].data_ptr() == small_ptr
    torch.testing.assert_close(small.output, xs @ weight)
    torch.testing.assert_close(big.output, xb @ weight)

    # Releasing the last holder of the old buffer gives its memory back to the allocator.
    allocated = torch.cuda.memory_allocated()
    small.release()
    del small
    gc.collect()
    freed = allocated - torch.cuda.memory_allocated()
    assert workspace.backing_buffers == 1 and freed >= small_block * 4

    # Control: a buffer freed under a live graph IS handed out again, and the replay then reads the
    # sentinel. This is the failure the checks above exclude, and shows the sentinel method detects it.
    scratch = torch.randn(8, 256, device=device)
    scratch_ptr = scratch.data_ptr()
    graph, out = capture_graph(lambda: scratch @ weight, pool=pool)
    graph.replay()
    before = out.clone()
    del scratch
    overlapped = False
    for _ in range(512):
        holders.append(torch.full((8, 256), 1e6, device=device))
        if _overlaps(holders[-1].data_ptr(), nbytes, scratch_ptr, nbytes):
            overlapped = True
            break
    assert overlapped, "control: the allocator did not hand out the freed block again"
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.allclose(out, before), "control: replay did not read the reused memory"
    graph.reset()
    big.release()
    _summary(
        "replay after workspace growth",
        small_ptr=hex(small_ptr),
        freed_bytes=freed,
        holders=len(holders),
        seconds=f"{time.perf_counter() - start:.1f}",
    )


@torch.no_grad()
def test_replayed_graph_matches_eager_on_random_inputs():
    start = time.perf_counter()
    torch.manual_seed(2)
    device = torch.device("cuda")
    pool = shared_graph_pool()
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).to(device).eval()
    inputs = StableWorkspacePool("cuda-inputs", dtype=torch.float32, device=device)
    cache = BoundedGraphCache("cuda-mlp", 2)
    batch_sizes = [1, 7, 32]  # three keys, two slots: graphs are evicted and re-captured
    max_diff, replays = 0.0, 0
    rng = random.Random(2)
    for i in range(30):
        bs = rng.choice(batch_sizes)
        entry = cache.get(bs)
        if entry is None:
            assert cache.admit(bs).capture
            lease = inputs.lease(bs, bs, (512,))
            static_in = lease.tensors[0]
            static_in.zero_()
            graph, out = capture_graph(lambda: model(static_in), pool=pool)
            entry = GraphEntry(graph, out, lease)
            cache.put(bs, entry)
        x = torch.randn(bs, 512, device=device)
        entry.lease.tensors[0].copy_(x)
        entry.graph.replay()
        expected = model(x)
        torch.cuda.synchronize()
        torch.testing.assert_close(entry.output, expected, rtol=1e-5, atol=1e-5)
        max_diff = max(max_diff, (entry.output - expected).abs().max().item())
        replays += 1
    info = cache.info()
    assert info.evictions > 0 and info.hits > 0
    cache.clear()
    assert internals.live_leases(inputs) == 0
    _summary(
        "replay equals eager",
        replays=replays,
        captures=info.captures,
        evictions=info.evictions,
        max_abs_diff=f"{max_diff:.2e}",
        seconds=f"{time.perf_counter() - start:.1f}",
    )


@torch.no_grad()
def test_emptying_the_shared_pool_keeps_later_captures_working():
    """Evict the pool's only graph while a caller still holds its output, over and over.

    Without the pin in shared_graph_pool() the pool's use count would reach 0 at each
    eviction and, with a block still alive, the next capture would fail PyTorch's
    internal assert in create_or_incref_pool.
    """
    start = time.perf_counter()
    torch.manual_seed(3)
    device = torch.device("cuda")
    pool = shared_graph_pool()
    weight = torch.randn(128, 128, device=device)
    cache = BoundedGraphCache("cuda-one", 1)
    kept = []  # outputs of evicted graphs that a caller still holds
    for step in range(60):
        if step == 30:
            cache.clear()  # the other way to empty the pool
        assert cache.admit(step).capture
        x = torch.randn(16 + step % 4, 128, device=device)
        graph, out = capture_graph(lambda: x @ weight, pool=pool)
        cache.put(step, GraphEntry(graph, out))
        kept.append(out)
        x.normal_()
        graph.replay()
        torch.testing.assert_close(out, x @ weight)
    assert cache.info().evictions == 29 and len(cache) == 1  # counters restart at clear()
    cache.clear()
    _summary("pool emptied repeatedly", captures=60, kept_outputs=len(kept), seconds=f"{time.perf_counter() - start:.1f}")


@torch.no_grad()
def test_garbage_collection_inside_a_capture_cannot_invalidate_it():
    """A captured graph that only a dead reference cycle holds (a dropped runner) must not be
    collected inside a later capture: its destructor resets it, which CUDA refuses while a
    stream captures, and the capture fails. guarded_capture keeps the GC off meanwhile."""
    pool, stream = shared_graph_pool(), capture_stream()
    x = torch.randn(64, 64, device="cuda")
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # without the guard the GC would run at nearly every allocation
    try:
        for step in range(5):
            old_graph, _ = capture_graph(lambda: x * 2, pool=pool, stream=stream)
            holder = [old_graph]
            del old_graph

            def body():
                dead = {"graph": holder.pop()}
                dead["self"] = dead  # now only the cyclic GC can free the graph
                del dead
                junk = [[i] for i in range(5000)]  # allocations that trigger collections
                return x @ x + len(junk)

            graph, out = capture_graph(body, pool=pool, stream=stream, warmup_iters=0)
            graph.replay()
            torch.testing.assert_close(out, x @ x + 5000)
        assert gc.isenabled()
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()  # the dead graphs are reset here, outside any capture
    torch.cuda.synchronize()


@torch.no_grad()
def test_a_failed_capture_leaves_the_pool_the_generator_and_the_stream_usable():
    """A host read inside a capture invalidates it; afterwards the shared pool takes new captures,
    CUDA RNG works and the caller is back on its own stream (PyTorch alone leaves all three broken)."""
    pool, stream = shared_graph_pool(), capture_stream()
    x = torch.randn(32, 32, device="cuda")
    caller = torch.cuda.current_stream()
    for attempt in range(3):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(Exception):  # noqa: B017 - CUDA reports it as AcceleratorError or RuntimeError
            with guarded_capture(graph, pool=pool, stream=stream):
                (x @ x).sum().item()
        assert torch.cuda.current_stream() == caller and gc.isenabled()
        noise = torch.randn(16, device="cuda")  # raised "Offset increment outside graph capture" before
        assert torch.isfinite(noise).all()
        good, out = capture_graph(lambda: x @ x + attempt, pool=pool, stream=stream)
        x.normal_()
        good.replay()
        torch.testing.assert_close(out, x @ x + attempt)
        good.reset()
    # A capture that uses the generator still works and replays different numbers each time.
    rng_graph, rand_out = capture_graph(lambda: torch.rand(1024, device="cuda"), pool=pool, stream=stream)
    rng_graph.replay()
    first = rand_out.clone()
    rng_graph.replay()
    assert not torch.equal(first, rand_out)


@torch.no_grad()
def test_evicting_gemm_graphs_keeps_the_surviving_graphs_valid():
    """vllm-omni #6587 shape: cuBLAS allocates its per-(handle, stream) workspace lazily, so on a
    fresh stream the first capture allocates it, from that capture's pool, and every later GEMM
    graph on the stream uses the same workspace. Evicting (resetting) graphs, the first one
    included, while others survive must leave the survivors' memory alone: here all graphs share
    one pinned pool and the workspace stays owned by cuBLAS, so survivors replay exactly, also
    after the freed blocks were reused by new captures and the cache was emptied. Run it under
    `compute-sanitizer --tool memcheck` to see invalid accesses rather than wrong numbers."""
    start = time.perf_counter()
    torch.manual_seed(0)
    device = torch.device("cuda")
    pool = shared_graph_pool()
    stream = torch.cuda.Stream()  # fresh: cuBLAS has no workspace for it yet, the first capture makes one
    w1 = torch.randn(256, 512, device=device) / 16
    w2 = torch.randn(512, 256, device=device) / 16
    cache = BoundedGraphCache("gemm-evict", 3)
    first_key, replays = None, 0

    def gemms(x):
        return torch.relu(x @ w1) @ w2 + x

    for step in range(30):
        key = ("gemm", step, 64 * (1 + step % 5))  # a new shape every step: every step evicts
        if cache.get(key) is None and cache.admit(key).capture:
            static_in = torch.randn(key[2], 256, device=device)
            graph = torch.cuda.CUDAGraph()
            with guarded_capture(graph, pool=pool, stream=stream):  # no warm-up on this stream, on purpose
                out = gemms(static_in)
            entry = GraphEntry(graph, out)
            entry.static_in = static_in
            cache.put(key, entry)
            first_key = first_key or key
        # The freed blocks of evicted graphs get new contents, and unused cached blocks go back.
        junk = torch.full((4 << 20,), float("nan"), device=device)
        del junk
        torch.cuda.empty_cache()
        for survivor in cache.entries.values():
            survivor.static_in.normal_()
            survivor.graph.replay()
            replays += 1
            torch.testing.assert_close(survivor.output, gemms(survivor.static_in), rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()
    info = cache.info()
    assert first_key not in cache and info.evictions == 27 and info.captures == 30
    cache.clear()
    _summary("gemm graphs evicted under survivors", captures=30, evictions=27, survivor_replays=replays,
             seconds=f"{time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
