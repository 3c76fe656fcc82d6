"""ViT capture agreement under tensor parallelism: real processes, real gloo groups, sglang's TP group.

Each rank is a forked process (it inherits the activated patch and the CUDA-graph recorder
of test_vit_cuda_graph_runner, so it starts in milliseconds) holding sglang's real
`GroupCoordinator` as the TP group (gloo device and CPU groups, `get_parallel().tp_group` unpatched).
The stub tower's blocks do a real TP all-reduce through `tensor_model_parallel_all_reduce`:
each rank holds 1/world of every block output, so a skipped or unmatched all-reduce gives
a wrong result; a captured graph records the all-reduce and runs it at replay, as CUDA does.

One rank fails at one stage (buffer allocation, warm-up, capture, after capture) of the
first capture; every rank must then run that batch eager with the right output, cast the
same number of votes, and keep working (graphs for the next batch, transient failures
retried). No rank may wait on a collective another skips: a hang shows as a test failure
after TEST_TIMEOUT_S, well below the gloo timeout.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import traceback

import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

import dataclasses

import sglang.srt.multimodal.vit_cuda_graph_runner as runner_module

from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)
from test_vit_cuda_graph_runner import (  # noqa: F401  (fixtures and the recording fake)
    _CAPTURING,
    LayoutBlock,
    StubTower,
    _layout_compute,
    fake_cuda,
    graphs,
    new_runner,
    vit_patch,
)

GLOO_TIMEOUT_S = 60
TEST_TIMEOUT_S = 30
STAGES = ("allocation", "warmup", "capture", "after_capture")
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"


class TPBlock(LayoutBlock):
    """LayoutBlock whose output is all-reduced over the TP group (each rank holds 1/world of it)."""

    fail_warmup = False

    def forward(self, x, *, cu_seqlens, position_embeddings=None, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None,
                output_ws=None, forward_metadata=None):
        from sglang.srt.distributed import tensor_model_parallel_all_reduce
        from sglang.srt.runtime_context import get_parallel

        graph = _CAPTURING[0]
        if graph is None and forward_metadata is None and self.fail_warmup:  # graph-form call outside a capture
            self.fail_warmup = False
            raise torch.OutOfMemoryError(OOM)
        world = get_parallel().tp_group.world_size
        out = super().forward(x, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                              rotary_pos_emb_cos=rotary_pos_emb_cos, rotary_pos_emb_sin=rotary_pos_emb_sin,
                              output_ws=output_ws, forward_metadata=forward_metadata)
        out.div_(world)
        if graph is not None:  # the capture records the all-reduce; replays execute it
            graph.thunks.append(lambda: (out.div_(world), tensor_model_parallel_all_reduce(out)))
            return out
        return tensor_model_parallel_all_reduce(out)


def tp_tower():
    tower = StubTower(use_data_parallel=False)
    tower.blocks = torch.nn.ModuleList([TPBlock(), TPBlock()])
    return tower


def reference(x, full, window, pos):
    y = x.unsqueeze(1)
    for layout in (window, full):  # block 0 windowed, block 1 full attention
        y = _layout_compute(y, torch.tensor(layout), 10**9, pos)
    return y.squeeze(1)


def batch(tokens, full, window, step):
    x = torch.arange(tokens, dtype=torch.float32).view(tokens, 1) * 0.5 + step
    pos = torch.full((tokens, 1), float(step))
    return x, pos, reference(x, full, window, pos)


def run_batch(runner, tokens, full, window, step):
    x, pos, want = batch(tokens, full, window, step)
    out = runner.run(x, torch.tensor(full, dtype=torch.int32), torch.tensor(window, dtype=torch.int32), (pos, pos),
                     attention_layout_key=(full, window))
    return bool(torch.equal(out, want))


A = (8, (0, 0, 4, 8), (0, 2, 4, 8))
B = (8, (0, 0, 2, 8), (0, 2, 8))


def arm(runner, stage):
    """Make this rank fail at `stage` of its next capture; returns the undo."""
    if stage == "allocation":  # the first buffer of the graph (OOM: transient)
        real = torch.empty_like

        def empty_like(*args, **kwargs):
            raise torch.OutOfMemoryError(OOM)

        torch.empty_like = empty_like
        return lambda: setattr(torch, "empty_like", real)
    if stage == "warmup":  # OOM in the warm-up forward: transient
        runner.vit.blocks[0].fail_warmup = True
        return lambda: setattr(runner.vit.blocks[0], "fail_warmup", False)
    if stage == "capture":  # the second block raises inside the capture: permanent
        runner.vit.blocks[1].fail_capture = True
        return lambda: setattr(runner.vit.blocks[1], "fail_capture", False)
    store = runner.engine.store  # after the capture: its bookkeeping raises (permanent)
    real_capture = store.capture

    def capture(*args, **kwargs):
        real_capture(*args, **kwargs)
        raise RuntimeError("graph bookkeeping failed (injected)")

    store.capture = capture
    return lambda: delattr(store, "capture")


def init_tp_group(rank, world, port):
    """This process's rank of a gloo world with sglang's real TP GroupCoordinator as the TP group (0.5.17's
    layers read it from parallel_state, later releases' from get_parallel())."""
    import inspect

    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    torch.set_num_threads(1)
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", timeout=GLOO_TIMEOUT_S)
    accepted = inspect.signature(ps.init_model_parallel_group).parameters
    off = {name: False for name in ("use_custom_allreduce", "use_mscclpp_allreduce", "use_mscclpp",
                                    "use_torch_symm_mem_allreduce") if name in accepted}
    ps._TP = ps.init_model_parallel_group([list(range(world))], rank, "gloo", use_pynccl=False, group_name="tp", **off)
    if hasattr(get_parallel(), "override_permanently"):
        get_parallel().override_permanently(tp_group=ps._TP)


@contextlib.contextmanager
def forked_ranks(target, world, args_of):
    """Fork `world` ranks running target(*args_of(rank, port, results)); yields the results queue, and joins
    (or kills) every rank on the way out."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=args_of(rank, port, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    try:
        yield results
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def run_ranks(target, world, failing_rank):
    """Fork `world` ranks running target(rank, world, port, failing_rank, results); their reports by rank."""
    reports = {}
    with forked_ranks(target, world, lambda rank, port, results: (rank, world, port, failing_rank, results)) as results:
        for _ in range(world):
            rank, report = results.get(timeout=TEST_TIMEOUT_S)  # queue.Empty here = a rank hangs
            reports[rank] = report
    for rank, report in sorted(reports.items()):
        assert not isinstance(report, str), f"rank {rank} raised:\n{report}"
    return reports


def rank_main(rank, world, port, failing_rank, results):
    try:
        import torch.distributed as dist

        from sglang.srt.distributed import parallel_state as ps

        init_tp_group(rank, world, port)
        assert ext_core("vit.tp").get_parallel().tp_group is ps._TP and ps._TP.world_size == world
        cpu_group = ps._TP.cpu_group
        votes = []  # capture votes (int32 flags, graphs.agreement)
        budgets = []  # the default byte budget's MIN agreement (int64, once per runner at its first run)
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(tensor, *args, **kwargs):
            if kwargs.get("group") is cpu_group:
                (budgets if tensor.dtype == torch.int64 else votes).append(int(tensor.item()))
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        report = {}
        for stage in STAGES:
            budgets.clear()
            runner = new_runner(tp_tower())
            undo = arm(runner, stage) if rank == failing_rank else None
            votes.clear()
            exact = [run_batch(runner, *A, step=1)]
            if undo is not None:
                undo()
            after_failure = runner.engine.info()
            first_votes = list(votes)
            graphs_after_failure = len(graphs(runner))
            exact += [run_batch(runner, *B, step=s) for s in (2, 3)]  # captured then replayed on every rank
            graphs_with_b = len(graphs(runner))
            exact += [run_batch(runner, *A, step=s) for s in (4, 5, 6, 7)]  # transient: eager 2 misses, retried
            info = runner.engine.info()
            report[stage] = dict(exact=exact, first_votes=first_votes, votes=len(votes),
                                 failed=after_failure["fallback_capture_failed"], graphs_after_failure=graphs_after_failure,
                                 graphs_with_b=graphs_with_b, quarantined=info["fallback_quarantined"],
                                 captures=info["captures"], hits=info["hits"], failures=info["failures"],
                                 budgets=list(budgets), budget=runner.engine.cache.max_bytes)
        results.put((rank, report))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush the report before leaving without pytest's teardown
        os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world,failing_rank", [(2, 1), (4, 2)])
def test_a_failure_at_any_stage_on_one_rank_makes_every_rank_run_eager(vit_patch, fake_cuda, world, failing_rank):
    vit_patch(vit_graph_max_entries=4)
    reports = run_ranks(rank_main, world, failing_rank)
    for stage in STAGES:
        per_rank = [reports[rank][stage] for rank in range(world)]
        for rank, r in enumerate(per_rank):
            where = f"{stage}, rank {rank}"
            assert all(r["exact"]), f"{where}: wrong output {r['exact']}"
            assert r["failed"] == 1 and r["graphs_after_failure"] == 0, f"{where}: a graph survived {r}"
            assert r["graphs_with_b"] == 1, f"{where}: the next batch was not captured {r}"
        # The same votes on every rank: 1 when preparing failed, 2 when the capture (or its bookkeeping) did.
        expected_votes = 1 if stage in ("allocation", "warmup") else 2
        assert {len(r["first_votes"]) for r in per_rank} == {expected_votes}, (stage, per_rank)
        assert {r["votes"] for r in per_rank} == {per_rank[0]["votes"]}, (stage, per_rank)
        # The default byte budget (-1): agreed once per runner, before its first capture, equal on every rank.
        assert [(len(r["budgets"]), r["budget"]) for r in per_rank] == [(1, per_rank[0]["budget"])] * world, per_rank
        assert sorted(per_rank[failing_rank]["first_votes"]) != sorted(per_rank[1 - failing_rank]["first_votes"])
        transient = stage in ("allocation", "warmup")  # injected OOMs; the others are permanent errors
        for r in per_rank:
            if transient:  # A: eager twice (backoff 2), then captured and replayed
                assert (r["quarantined"], r["captures"], r["failures"]) == (2, 2, 1), (stage, r)
            else:  # A stays eager, no more votes for it
                assert (r["quarantined"], r["captures"], r["failures"]) == (4, 1, 1), (stage, r)


# ---------------------------------------------------------------------------
# Bucket mode: the load-time pre-capture under TP
# ---------------------------------------------------------------------------

BUDGET_STAGES = ("sample", "allocation", "warmup", "capture", "probe")


class SampledTPTower(torch.nn.Module):
    """tp_tower() behind a graph path that hands the runner batch A (what the engine's capture_at_load samples)."""

    def __init__(self, options):
        super().__init__()
        from types import SimpleNamespace

        self.tower = tp_tower()
        self.patch_embed = SimpleNamespace(proj=SimpleNamespace(weight=torch.zeros(4, 3)))
        self.runner = runner_module.ViTCudaGraphRunner(self.tower, options)
        self.fail_sample = False

    dtype = torch.float32
    device = torch.device("cpu")

    def forward_with_cuda_graph(self, pixels, grid_thw):
        if self.fail_sample:
            raise torch.OutOfMemoryError(OOM)
        tokens, full, window = A
        x = torch.zeros(tokens, 1)
        return self.runner.run(x, torch.tensor(full, dtype=torch.int32), torch.tensor(window, dtype=torch.int32),
                               (x, x), attention_layout_key=(full, window))


def arm_budget(tower, stage, rank):
    """Make this rank fail at `stage` of the pre-capture; returns the undo."""
    runner = tower.runner
    if stage == "sample":
        tower.fail_sample = True
        return lambda: setattr(tower, "fail_sample", False)
    if stage == "allocation":  # the shared input buffer of the first (largest) budget graph
        store = runner.engine.store

        def lease(*args, **kwargs):
            raise torch.OutOfMemoryError(OOM)

        store._lease = lease
        return lambda: vars(store).pop("_lease")
    if stage == "probe":  # scripted timings: the graph wins everywhere, except from 16 tokens on this rank
        return script_probe(lose_from=16)
    return arm(runner, stage)


def script_probe(lose_from):
    """median_wall_ms answers (graph 1 ms, eager 2 ms) per budget, or (3, 2) from budget `lose_from` on."""
    vit_engine = ext_core("vit.engine")
    real_median = vit_engine.median_wall_ms
    answers = []

    def median(run, *, repeats, synchronize=None):
        run()
        budget = (8, 16)[len(answers) // 2]  # the probe times graph then eager, budget after budget
        graph_ms, eager_ms = (3.0, 2.0) if budget >= lose_from else (1.0, 2.0)
        answers.append(graph_ms if len(answers) % 2 == 0 else eager_ms)
        return answers[-1]

    vit_engine.median_wall_ms = median
    return lambda: setattr(vit_engine, "median_wall_ms", real_median)


def budget_rank_main(rank, world, port, failing_rank, results):
    try:
        init_tp_group(rank, world, port)
        report = {}
        for stage in BUDGET_STAGES:  # the probe decides the ladder, else the knob's limit (16 tokens)
            options = dataclasses.replace(runner_module.ViTCudaGraphRunner.options,
                                          replay_max_tokens=-1 if stage == "probe" else 16)
            tower = SampledTPTower(options)
            runner = tower.runner
            undo = arm_budget(tower, stage, rank) if rank == failing_rank else None
            if stage == "probe" and undo is None:
                undo = script_probe(lose_from=10**9)
            runner.engine.capture_at_load(tower, None)
            if undo is not None:
                undo()
            captured = sorted(k.num_tokens for k in graphs(runner))
            exact = [run_batch(runner, *A, step=s) for s in (1, 2)] + [run_batch(runner, *B, step=3)]
            info = runner.engine.info()
            report[stage] = dict(graphs=captured, exact=exact, limit=info["replay_limit_tokens"],
                                 hits=info["hits"], captures=info["captures"],
                                 gate=[(r["budget"], r["replay"]) for r in runner.engine.ladder.gate])
        results.put((rank, report))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
        os._exit(0)


def test_bucket_precapture_failing_on_one_rank_leaves_every_rank_eager(vit_patch, fake_cuda):
    vit_patch(vit_graph_mode="bucket", vit_graph_token_buckets="8,16", vit_graph_max_entries=4)
    reports = run_ranks(budget_rank_main, 2, 1)
    for stage in BUDGET_STAGES:
        per_rank = [reports[rank][stage] for rank in range(2)]
        assert per_rank[0] == per_rank[1], (stage, per_rank)  # the same decisions and counters on both ranks
        r = per_rank[0]
        assert all(r["exact"]), (stage, r)
        if stage == "probe":  # one rank's eager won at 16 tokens: both keep only the 8-token budget
            assert (r["graphs"], r["limit"], r["gate"]) == ([8], 8, [(8, True), (16, False)]), r
        else:  # any failure: no graph on any rank, nothing captured later
            assert (r["graphs"], r["limit"], r["hits"]) == ([], 0, 0), (stage, r)
