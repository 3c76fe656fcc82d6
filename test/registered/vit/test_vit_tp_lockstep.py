"""Every tensor allocation of the ViT graph machinery failing in turn on one TP rank: all ranks answer.

Two forked ranks hold sglang's real `GroupCoordinator` over gloo, as in
test_vit_tp_agreement (stub blocks whose output is all-reduced over the TP group, the recording
fake of CUDA graphs). A torch function mode counts the allocations a rank makes while the runner
works: load-time sample, probe and ladder capture (bucket mode), then served calls that capture,
replay, evict, pad, chunk and reorder. A clean run lists them; then, for a sample of k (the first
allocation after the runner is built, the first of every call site, the last, and some more),
the k-th allocation raises an out-of-memory error on rank 0, and then on rank 1. Every rank must
finish every call with the right (eager) output, cast the same number of votes, and never wait
long on a peer: a hang fails the test after SCENARIO_TIMEOUT_S, well below the gloo timeout.

Not counted, because nothing could fall back from them: the eager run of a served call (the
fallback itself, what sglang does with graphs off), the fake graph's replay (a real replay
allocates nothing) and the one-int flag a vote all-reduces.
"""

from __future__ import annotations

import os
import queue
import random
import sys
import time
import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)
from test_vit_cuda_graph_runner import (  # noqa: F401  (fixtures and the recording fake)
    FakeGraph,
    PairMerger,
    StubTower,
    _layout_compute,
    fake_cuda,
    new_runner,
    vit_patch,
)
from test_vit_tp_agreement import GLOO_TIMEOUT_S, OOM, TPBlock, forked_ranks, init_tp_group

SCENARIO_TIMEOUT_S = 15  # no report for this long: a rank hangs (gloo gives up only after GLOO_TIMEOUT_S)
MAX_WAIT_S = 5.0  # longest a rank may wait in one vote for its peers
MAX_SAMPLED = 24  # allocation indices tried per failing rank beyond the first of every call site
WORLD = 2

# (tokens, full layout with 0.5.17's doubled leading zero, window layout); windows of at most 8 tokens.
A = (12, (0, 0, 4, 12), (0, 4, 12))
B = (6, (0, 0, 2, 6), (0, 2, 6))
C = (8, (0, 0, 8), (0, 8))
CHUNKED = (26, (0, 0, 4, 12, 20, 26), (0, 4, 12, 20, 26))  # above the 16-token ladder: two replayed chunks
MIXED = (46, (0, 0, 20, 40, 46), (0, 8, 16, 20, 28, 36, 40, 46))  # eager [0, 40) then a replay
# Bucket mode pads, chunks and mixes eager with replays; class / layout modes capture, hit, evict
# (2 entries) and capture again. Odd steps pass no output_indices (the owned-copy path).
SERVED = {
    "bucket": (A, B, CHUNKED, MIXED, A),
    "class": (A, B, A, C, B, A),
    "layout": (A, B, A, C, B, A),
}
KNOBS = {
    "bucket": dict(vit_graph_token_buckets="8,16", vit_graph_replay_max_tokens=-1, vit_graph_above_ladder="split",
                   vit_graph_max_entries=4),
    "class": dict(vit_graph_max_entries=2),
    "layout": dict(vit_graph_max_entries=2),
}


class SampledTower(StubTower):
    """Qwen2.5-like TP tower (merge unit 2, 8-token windows) with a graph path for the load-time sample."""

    def __init__(self, backend):
        super().__init__(use_data_parallel=False)
        self.blocks = torch.nn.ModuleList([TPBlock(), TPBlock()])
        for blk in self.blocks:
            blk.attn.qkv_backend_name = backend
        self.merger = PairMerger()
        self.spatial_merge_unit = 2
        self.patch_size, self.spatial_merge_size, self.window_size = 14, 1, 28  # 2 x 2 x 2 = 8-token windows
        self.patch_embed = SimpleNamespace(proj=SimpleNamespace(weight=torch.zeros(4, 3)))
        self.runner = None

    def forward_with_cuda_graph(self, pixels, grid_thw):
        tokens, full, window = C
        x = torch.zeros(tokens, 1)
        return self.runner.run(x, torch.tensor(full, dtype=torch.int32), torch.tensor(window, dtype=torch.int32),
                               (x, x), attention_layout_key=(full, window))


def expected(x, full, window, pos):
    y = x.unsqueeze(1)
    for layout in (window, full):  # block 0 windowed, block 1 full attention
        y = _layout_compute(y, torch.tensor(layout), 10**9, pos)
    return y.squeeze(1).view(-1, 2, 1).sum(1)


def serve(runner, call, step, faults):
    """One call through the runner (under `faults`); whether its output is right."""
    tokens, full, window = call
    x = torch.arange(tokens, dtype=torch.float32).view(tokens, 1) * 0.5 + step
    pos = torch.full((tokens, 1), float(step))
    order = torch.randperm(tokens // 2, generator=torch.Generator().manual_seed(step)) if step % 2 == 0 else None
    want = expected(x, full, window, pos)
    cu, cu_window = torch.tensor(full, dtype=torch.int32), torch.tensor(window, dtype=torch.int32)
    with faults:
        out = runner.run(x, cu, cu_window, (pos, pos), output_indices=order, attention_layout_key=(full, window))
    return bool(torch.equal(out, want if order is None else want.index_select(0, order)))


class AllocationFaults(TorchFunctionMode):
    """Counts the tensors the graph machinery allocates (torch calls returning new storage); the
    `fail_at`-th raises an out-of-memory error instead of returning."""

    def __init__(self, excluded, fail_at=None):
        super().__init__()
        self.excluded = excluded  # (code objects whose allocations do not count, the probe's code)
        self.fail_at = fail_at
        self.sites = []  # (file, line, function) of every counted allocation
        self.fired = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and allocates(out, args, kwargs):
            site = self.site()
            if site is not None:
                self.sites.append(site)
                if len(self.sites) == self.fail_at:
                    self.fired = True
                    raise torch.OutOfMemoryError(OOM)
        return out

    def site(self):
        """The call site of the allocation, or None when it does not count."""
        skipped, probe = self.excluded
        frame, site = sys._getframe(2), None
        in_probe = in_skipped = False
        while frame is not None:
            code = frame.f_code
            if site is None and f"{os.sep}torch{os.sep}" not in code.co_filename:
                site = (os.path.basename(code.co_filename), frame.f_lineno, code.co_name)
            in_skipped = in_skipped or code in skipped
            in_probe = in_probe or code is probe
            frame = frame.f_back
        if site is None or site[0] == "agreement.py" or (in_skipped and not in_probe):
            return None
        return site


def allocates(out, args, kwargs):
    """Whether `out` has storage of its own: not a view, not an input, no input's storage."""
    if out._is_view():
        return False
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    ptr = out.untyped_storage().data_ptr()
    return all(t is not out and (ptr == 0 or t.untyped_storage().data_ptr() != ptr) for t in inputs)


def excluded_code():
    engine = ext_core("vit.engine").ViTGraphEngine
    skipped = {ext_core("vit.capture").GraphStore.run_eager.__code__, engine.eager_call.__code__,
               FakeGraph.replay.__code__}
    return skipped, engine._probe.__code__


def scripted_median(run, *, repeats, synchronize=None):
    """The probe's timing, deterministic: a run that replayed a graph takes 1 ms, an eager run 2 ms."""
    before = sum(g.replays for g in FakeGraph.created)
    run()
    return 1.0 if sum(g.replays for g in FakeGraph.created) > before else 2.0


def scenario(mode, backend, fail_at, cpu_group, waits):
    """One runner through load and the served calls; (report, allocation sites)."""
    FakeGraph.created = []
    tower = SampledTower(backend)
    runner = tower.runner = new_runner(tower)
    faults = AllocationFaults(excluded_code(), fail_at)
    waits.clear()
    started = time.monotonic()
    with faults:
        runner.engine.capture_at_load(tower, None)
    exact = [serve(runner, call, step, faults) for step, call in enumerate(SERVED[mode])]
    info = runner.engine.info()
    torch.distributed.barrier(group=cpu_group)
    report = dict(exact=exact, votes=len(waits), max_wait=max(waits, default=0.0), fired=faults.fired,
                  wall=time.monotonic() - started,
                  decisions={k: info[k] for k in ("hits", "captures", "evictions", "fallbacks", "replay_limit_tokens")})
    return report, faults.sites


def chosen_indices(sites):
    """1-based indices to fail: the first allocation, the first of every call site, the last, and a
    seeded sample of the rest (at most MAX_SAMPLED)."""
    first_of_site = {}
    for index, site in enumerate(sites, 1):
        first_of_site.setdefault(site[:2], index)
    chosen = {1, len(sites)} | set(first_of_site.values())
    rest = sorted(set(range(1, len(sites) + 1)) - chosen)
    chosen |= set(random.Random(0).sample(rest, min(MAX_SAMPLED, len(rest))))
    return sorted(chosen), len(first_of_site)


def rank_main(rank, mode, backend, port, results):
    try:
        import torch.distributed as dist

        from sglang.srt.distributed import parallel_state as ps

        init_tp_group(rank, WORLD, port)
        cpu_group = ps._TP.cpu_group
        ext_core("vit.engine").median_wall_ms = scripted_median
        waits = []
        real_all_reduce = dist.all_reduce

        def timed_all_reduce(tensor, *args, **kwargs):
            if kwargs.get("group") is not cpu_group:
                return real_all_reduce(tensor, *args, **kwargs)
            t0 = time.monotonic()
            try:
                return real_all_reduce(tensor, *args, **kwargs)
            finally:
                waits.append(time.monotonic() - t0)

        dist.all_reduce = timed_all_reduce
        clean, sites = scenario(mode, backend, None, cpu_group, waits)
        indices, distinct = chosen_indices(sites)
        results.put((rank, "plan", dict(clean=clean, sites=sites, indices=indices, distinct=distinct)))
        for failing_rank in range(WORLD):
            for k in indices:
                report, _ = scenario(mode, backend, k if rank == failing_rank else None, cpu_group, waits)
                results.put((rank, (failing_rank, k), report))
        results.put((rank, "done", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the reports before leaving without pytest's teardown
        os._exit(0)


def run_ranks(mode, backend):
    """Fork the ranks; every report by (rank, what), failing at once on a rank error or silence."""
    reports, done, progress = {}, set(), {rank: -1 for rank in range(WORLD)}  # -1: the clean run
    args_of = lambda rank, port, results: (rank, mode, backend, port, results)  # noqa: E731
    with forked_ranks(rank_main, WORLD, args_of) as results:
        while len(done) < WORLD:
            try:
                rank, what, report = results.get(timeout=SCENARIO_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"{mode}/{backend}: no report for {SCENARIO_TIMEOUT_S} s, a rank hangs: "
                            f"{stuck_in(reports, progress, done)}", pytrace=False)
            assert what != "error", f"{mode}/{backend}: rank {rank} raised:\n{report}"
            done.update([rank] if what == "done" else [])
            progress[rank] += what not in ("plan", "done")
            reports[rank, what] = report
    return reports


def stuck_in(reports, progress, done):
    """Where each unfinished rank is: the scenario after its last report."""
    where = []
    for rank in sorted(set(range(WORLD)) - done):
        plan = reports.get((rank, "plan"))
        if plan is None:
            where.append(f"rank {rank} in the clean run")
            continue
        failing_rank, k = [(r, k) for r in range(WORLD) for k in plan["indices"]][progress[rank] + 1]
        where.append(f"rank {rank} with allocation {k} ({plan['sites'][k - 1]}) failing on rank {failing_rank}")
    return "; ".join(where)


@pytest.mark.parametrize("backend", ["triton_attn", "fa3"])
@pytest.mark.parametrize("mode", ["bucket", "class", "layout"])
def test_an_allocation_failing_on_one_rank_leaves_every_rank_answering_eager(vit_patch, fake_cuda, mode, backend):
    assert SCENARIO_TIMEOUT_S * 2 <= GLOO_TIMEOUT_S  # a hang is reported long before gloo would end it
    vit_patch(vit_graph_mode=mode, **KNOBS[mode])
    reports = run_ranks(mode, backend)
    plans = [reports[rank, "plan"] for rank in range(WORLD)]
    # The clean run: both ranks allocate at the same sites in the same order, use graphs, agree.
    assert plans[0]["sites"] == plans[1]["sites"], "ranks allocate differently without a failure"
    sites, indices = plans[0]["sites"], plans[0]["indices"]
    clean = plans[0]["clean"]
    assert all(clean["exact"]) and clean["decisions"]["hits"] > 0 and clean["decisions"]["captures"] > 0, clean
    assert len(sites) >= 10 and plans[0]["distinct"] >= 5, (len(sites), plans[0]["distinct"])
    for failing_rank in range(WORLD):
        for k in indices:
            where = f"{mode}/{backend}: allocation {k} of {len(sites)} ({sites[k - 1]}) failing on rank {failing_rank}"
            per_rank = [reports[rank, (failing_rank, k)] for rank in range(WORLD)]
            assert per_rank[failing_rank]["fired"], f"{where}: never reached"
            for rank, r in enumerate(per_rank):
                assert all(r["exact"]), f"{where}: rank {rank} wrong output {r['exact']}"
                assert r["max_wait"] < MAX_WAIT_S, f"{where}: rank {rank} waited {r['max_wait']:.1f} s on a vote"
            assert per_rank[0]["votes"] == per_rank[1]["votes"], f"{where}: votes {[r['votes'] for r in per_rank]}"
            assert per_rank[0]["decisions"] == per_rank[1]["decisions"], f"{where}: {per_rank}"
