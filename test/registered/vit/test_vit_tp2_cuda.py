"""ViT CUDA graphs at TP=2 on two GPUs: real NCCL, sglang's custom all-reduce, the real Qwen2.5-VL tower.

Two spawned rank processes (NCCL; NVLink multicast off) start sglang's parallel state
(`single_rank.init_tp_parallel_state`: 0.5.17 takes the TP width, 0.5.23 reads published settings) with
its custom all-reduce on (CustomAllReduceV2 on CUDA by default, the legacy CustomAllreduce with
SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0; the test fails when neither comes up). Each rank builds
sglang's `Qwen2_5_VisionTransformer` at TP=2 (`use_data_parallel=False`, bf16, random weights from
the same seed, triton_attn, sgl_kernel's ops where loaded) with the `vit_cuda_graph` patch applied
strictly, and runs four phases on identical, identically seeded batches:
  failures  - one rank (1) fails a capture at allocation, warm-up or capture (its runner's stage
              functions wrapped on that rank only): both ranks run that batch eager, equal to eager,
              no graph kept, the next layout captured on both, each stage within STAGE_BOUND_S;
  equality  - graph output bitwise equal to sglang's own TP=2 eager forward over >= 500 layouts;
  bucket    - bucket mode: the runner's counters after every batch, identical on both ranks;
  churn     - >= 3,000 LRU captures and evictions (capacity 2), none failed, the custom all-reduce's
              graph-buffer registrations unchanged, memory_reserved flat within CHURN_SLACK_BYTES.
Every rank rewrites its JSON after each phase; the parent kills both ranks after RUN_TIMEOUT_S
(well below the process groups' GROUP_TIMEOUT_S), so a hang fails the test instead of waiting.

Run (2 GPUs): python -m pytest -q -s test/registered/vit/test_vit_tp2_cuda.py
"""

from __future__ import annotations

import json
import os
import random
import socket
import time
import traceback

import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=420, stage="base-c", runner_config="2-gpu-h100")


WORLD = 2
FAILING_RANK = 1
GROUP_TIMEOUT_S = 1800  # NCCL / gloo groups
RUN_TIMEOUT_S = 480  # both rank processes, all phases
STAGE_BOUND_S = 60  # one injected-failure batch, eager rerun included
STAGES = ("allocation", "warmup", "capture")
EQUALITY_STEPS, EQUALITY_MIN_LAYOUTS = 640, 500
BUCKET_STEPS = 200
CHURN_CAPTURES, CHURN_WARMUP = 3000, 100
CHURN_SLACK_BYTES = 64 << 20
SIDES = (4, 6, 8, 12, 16)
PHASES = ("failures", "equality", "bucket", "churn")
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (injected)"

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
    reason=f"needs {WORLD} CUDA devices (found {torch.cuda.device_count() if torch.cuda.is_available() else 0})",
)


# ---------------------------------------------------------------------------
# rank side
# ---------------------------------------------------------------------------


def _activate(**knobs):
    """The `vit_cuda_graph` patch alone, strict, through the real activation path (as the `vit_patch` fixture)."""
    from sglang_ext import activation
    from sglang_ext.registry import PATCH_NAMES

    for name in [n for n in os.environ if n.startswith("SGLANG_EXT_VIT_GRAPH_")]:  # the previous phase's knobs
        del os.environ[name]
    for name, value in knobs.items():
        os.environ["SGLANG_EXT_" + name.upper()] = str(value)
    os.environ.update(SGLANG_EXT="1", SGLANG_EXT_STRICT="1", SGLANG_VIT_ENABLE_CUDA_GRAPH="1",
                      SGLANG_EXT_DISABLE=",".join(n for n in PATCH_NAMES if n != "vit_cuda_graph"))
    activation.deactivate()
    status = activation.activate(eager=True)["vit_cuda_graph"]
    assert status.state == "applied", status


def _tower(kit, **knobs):
    """A fresh TP=2 tower (same seed on every rank) whose runner reads `knobs` at its first run."""
    _activate(**knobs)
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=torch.bfloat16, seed=1, use_data_parallel=False)
    assert vit.cuda_graph_runner is not None and vit.blocks[0].attn.qkv_backend_name == "triton_attn"
    return vit


def _counters(runner):
    info = runner.engine.info()
    return [info[k] for k in ("hits", "misses", "captures", "evictions", "failures", "fallbacks",
                              "padded_batches", "padding_tokens", "resident_graphs")]


def _layout(grid):
    return tuple(tuple(row) for row in grid.tolist())


def _phase_failures(kit, rank):
    """One rank fails one capture stage; both ranks must run that batch eager and stay in step."""
    vit = _tower(kit, vit_graph_max_entries=8, vit_graph_mode="layout")
    runner = vit.cuda_graph_runner
    rng = random.Random(11)
    kit.forward(vit, *kit.random_batch(rng, SIDES), graph=True)  # a first graph: state, budget, pool
    report = {}
    for stage in STAGES:
        failing, following = kit.random_batch(rng, SIDES), kit.random_batch(rng, SIDES)
        undo = _arm(runner, stage) if rank == FAILING_RANK else (lambda: None)
        before = runner.engine.info()
        graphs_before = len(runner.engine.store.graphs)
        start = time.monotonic()
        try:
            graphed = kit.forward(vit, *failing, graph=True)
        finally:
            undo()
        eager = kit.forward(vit, *failing, graph=False)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - start
        after = runner.engine.info()
        graphs_after_failure = len(runner.engine.store.graphs)
        next_graphed = kit.forward(vit, *following, graph=True)
        next_eager = kit.forward(vit, *following, graph=False)
        report[stage] = dict(
            seconds=round(elapsed, 3), equal=bool(torch.equal(graphed, eager)),
            max_diff=(graphed.float() - eager.float()).abs().max().item(),
            capture_failed=after["fallback_capture_failed"] - before["fallback_capture_failed"],
            failures=after["failures"] - before["failures"], graphs_before=graphs_before,
            graphs_after_failure=graphs_after_failure,
            next_captured=runner.engine.info()["captures"] - after["captures"],
            next_equal=bool(torch.equal(next_graphed, next_eager)))
    return report


def _arm(runner, stage):
    """Make this rank's next capture fail at `stage` by wrapping the runner's stage functions; returns the undo."""
    block = runner.vit.blocks[1]

    def raising_block(*args, **kwargs):
        if stage == "warmup" or torch.cuda.is_current_stream_capturing():
            raise torch.OutOfMemoryError(OOM) if stage == "warmup" else RuntimeError("capture failed (injected)")
        return type(block).forward(block, *args, **kwargs)

    def with_fault(real):
        def staged(*args, **kwargs):
            saved = torch.empty_like
            if stage == "allocation":  # the graph's first buffer

                def empty_like(*a, **k):
                    raise torch.OutOfMemoryError(OOM)

                torch.empty_like = empty_like
            else:
                block.forward = raising_block
            try:
                return real(*args, **kwargs)
            finally:
                torch.empty_like = saved
                block.__dict__.pop("forward", None)

        return staged

    store = runner.engine.store
    name = "capture" if stage == "capture" else "prepare"  # capture vs the rank-local stage
    setattr(store, name, with_fault(getattr(store, name)))
    return lambda: store.__dict__.pop(name, None)


def _phase_equality(kit):
    """Graph vs sglang's TP=2 eager forward over >= EQUALITY_MIN_LAYOUTS layouts (a quarter repeated: hits)."""
    vit = _tower(kit, vit_graph_max_entries=8, vit_graph_mode="layout")
    rng = random.Random(3)
    pool, layouts, bitwise, worst = [], set(), 0, 0.0
    for step in range(EQUALITY_STEPS):
        batch = rng.choice(pool) if step % 4 == 3 else kit.random_batch(rng, SIDES)
        pool = (pool + [batch])[-8:]
        layouts.add(_layout(batch[1]))
        graphed = kit.forward(vit, *batch, graph=True)
        eager = kit.forward(vit, *batch, graph=False)
        bitwise += bool(torch.equal(graphed, eager))
        worst = max(worst, (graphed.float() - eager.float()).abs().max().item())
    info = vit.cuda_graph_runner.engine.info()
    return dict(steps=EQUALITY_STEPS, layouts=len(layouts), bitwise=bitwise, max_diff=worst,
                hits=info["hits"], captures=info["captures"], evictions=info["evictions"],
                fallbacks=info["fallbacks"])


def _phase_bucket(kit):
    vit = _tower(kit, vit_graph_max_entries=16, vit_graph_mode="bucket", vit_graph_token_buckets="256,512,1024,2048")
    runner = vit.cuda_graph_runner
    rng = random.Random(5)
    sequence, worst = [], 0.0
    for _ in range(BUCKET_STEPS):
        batch = kit.random_batch(rng, SIDES)
        graphed = kit.forward(vit, *batch, graph=True)
        sequence.append(_counters(runner))
        eager = kit.forward(vit, *batch, graph=False)
        worst = max(worst, (graphed.float() - eager.float()).abs().max().item())
    return dict(sequence=sequence, max_diff=worst, mode=runner.engine.info()["mode"])


def _registration_counter(ca):
    """Registrations of graph buffers by the custom all-reduce: its own table counter plus wrapped calls."""
    calls = {"n": 0}
    for name in ("register_graph_buffers", "register_peer_mapped_inputs", "_register_graph_inputs"):
        real = getattr(ca, name, None)
        if callable(real):
            def counted(*args, _real=real, **kwargs):
                calls["n"] += 1
                return _real(*args, **kwargs)

            setattr(ca, name, counted)

    def read():
        table = getattr(ca, "_graph_counter", 0) + len(getattr(ca, "_graph_inputs", ()))
        return dict(calls=calls["n"], table_rows=table)

    return read


def _phase_churn(kit, ca):
    """LRU with capacity 2 over 5 layouts in turn: every batch captures and evicts."""
    vit = _tower(kit, vit_graph_max_entries=2, vit_graph_mode="layout")
    runner = vit.cuda_graph_runner
    grids = ([[1, 4, 4]], [[1, 4, 8]], [[1, 8, 4]], [[1, 8, 8]], [[1, 4, 4], [1, 4, 4]])
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(sum(t * h * w for t, h, w in grid), 3 * 2 * 14 * 14, generator=g), torch.tensor(grid))
               for grid in grids]
    want = [kit.forward(vit, *b, graph=False) for b in batches]
    registrations = _registration_counter(ca)
    start_registrations = registrations()
    wrong, reserved_start = 0, None
    for step in range(CHURN_CAPTURES):
        if step == CHURN_WARMUP:
            torch.cuda.synchronize()
            reserved_start = torch.cuda.memory_reserved()
        out = kit.forward(vit, *batches[step % len(batches)], graph=True)
        wrong += not torch.equal(out, want[step % len(batches)])
    torch.cuda.synchronize()
    info = runner.engine.info()
    return dict(captures=info["captures"], evictions=info["evictions"], hits=info["hits"],
                failures=info["failures"], capture_failed=info["fallback_capture_failed"],
                fallbacks=info["fallbacks"], resident=info["resident_graphs"], wrong=wrong,
                reserved_start=reserved_start, reserved_end=torch.cuda.memory_reserved(),
                registrations_start=start_registrations, registrations_end=registrations())


def _rank_main(rank, port, out_dir):
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    path = os.path.join(out_dir, f"rank{rank}.json")
    result = {"rank": rank, "progress": "init"}

    def save():
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)

    try:
        torch.cuda.set_device(rank)
        from sglang_ext_testkit import qwen_vit_kit as kit
        from sglang_ext_testkit.single_rank import init_tp_parallel_state
        from sglang.srt.distributed import parallel_state as ps

        ps.set_custom_all_reduce(True)
        init_tp_parallel_state(WORLD, rank, port, "nccl", "triton_attn", timeout=GROUP_TIMEOUT_S)
        ca = ps.get_tp_group().ca_comm
        result["custom_all_reduce"] = None if ca is None else f"{type(ca).__name__} disabled={ca.disabled}"
        result["kernels"] = kit.kernel_report("triton_attn")
        save()
        assert ca is not None and not ca.disabled, f"custom all-reduce not up: {result['custom_all_reduce']}"
        for phase in PHASES:
            result["progress"] = phase
            save()
            started = time.monotonic()
            if phase == "failures":
                result[phase] = _phase_failures(kit, rank)
            elif phase == "equality":
                result[phase] = _phase_equality(kit)
            elif phase == "bucket":
                result[phase] = _phase_bucket(kit)
            else:
                result[phase] = _phase_churn(kit, ca)
            result[phase]["phase_seconds"] = round(time.monotonic() - started, 1)
        result["progress"] = "done"
    except BaseException:  # noqa: BLE001 - reported to the parent
        result["error"] = traceback.format_exc()
    save()
    os._exit(0)  # no process-group teardown: a peer that failed must not make this rank wait


# ---------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run both ranks once; returns {rank: result}. Kills both and fails on overrun."""
    import multiprocessing

    out_dir = str(tmp_path_factory.mktemp("vit_tp2"))
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, port, out_dir)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    overrun = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    results = {}
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.json")
        results[rank] = json.load(open(path)) if os.path.exists(path) else {"progress": "never started"}
    print("\n" + json.dumps({r: {k: v for k, v in res.items() if k != "bucket"} for r, res in results.items()},
                            indent=1, default=str))
    assert not overrun, (f"ranks {overrun} still running after {RUN_TIMEOUT_S} s (hang?); last phase per rank: "
                         f"{ {r: res.get('progress') for r, res in results.items()} }")
    for rank, res in results.items():
        assert "error" not in res, f"rank {rank} raised in phase {res.get('progress')}:\n{res['error']}"
    return results


def _phase(ranks, name):
    missing = [rank for rank, res in ranks.items() if name not in res]
    assert not missing, f"phase {name} missing on ranks {missing}"
    return [ranks[rank][name] for rank in range(WORLD)]


def test_custom_all_reduce_is_up_on_both_ranks(ranks):
    for rank, res in ranks.items():
        assert res["custom_all_reduce"] and res["custom_all_reduce"].endswith("disabled=False"), (rank, res)
    print(f"custom all-reduce: {ranks[0]['custom_all_reduce']}; kernels: {ranks[0]['kernels']}")


@pytest.mark.parametrize("stage", STAGES)
def test_failure_on_one_rank_runs_that_batch_eager_on_both(ranks, stage):
    per_rank = [r[stage] for r in _phase(ranks, "failures")]
    print(f"{stage}: {per_rank}")
    for rank, r in enumerate(per_rank):
        where = f"{stage}, rank {rank}"
        assert r["seconds"] < STAGE_BOUND_S, f"{where}: {r['seconds']} s"
        assert r["equal"] and r["next_equal"], f"{where}: output differs from eager {r}"
        assert (r["capture_failed"], r["failures"]) == (1, 1), f"{where}: not eager on this rank {r}"
        assert r["graphs_after_failure"] == r["graphs_before"], f"{where}: a graph survived {r}"
        assert r["next_captured"] == 1, f"{where}: the next layout was not captured {r}"


def test_graph_output_bitwise_equals_tp2_eager_over_500_layouts(ranks):
    for rank, r in enumerate(_phase(ranks, "equality")):
        print(f"rank {rank}: max |graph - eager| = {r['max_diff']:.3g}; bitwise {r['bitwise']} / {r['steps']}; {r}")
        assert r["layouts"] >= EQUALITY_MIN_LAYOUTS, r
        assert r["fallbacks"] == 0 and r["hits"] > 0 and r["evictions"] > 0, r
        assert r["bitwise"] == r["steps"], f"rank {rank}: {r['steps'] - r['bitwise']} outputs not bitwise equal {r}"


def test_bucket_mode_hit_miss_sequences_identical_on_both_ranks(ranks):
    per_rank = _phase(ranks, "bucket")
    for rank, r in enumerate(per_rank):
        hits, misses, captures, *_ = r["sequence"][-1]
        print(f"rank {rank}: bucket max |graph - eager| = {r['max_diff']:.3g}; final hits/misses/captures "
              f"{hits}/{misses}/{captures}; padded {r['sequence'][-1][6]}")
        assert r["mode"] == "bucket" and hits > 0 and r["sequence"][-1][6] > 0, r["sequence"][-1]
        assert r["max_diff"] <= 2e-2, r["max_diff"]
    first = next((i for i, (a, b) in enumerate(zip(*(r["sequence"] for r in per_rank))) if a != b), None)
    assert first is None, f"ranks diverge at batch {first}: {[r['sequence'][first] for r in per_rank]}"


def test_lru_churn_keeps_registrations_and_memory_flat(ranks):
    for rank, r in enumerate(_phase(ranks, "churn")):
        growth = r["reserved_end"] - r["reserved_start"]
        print(f"rank {rank}: captures {r['captures']}, evictions {r['evictions']}, reserved growth "
              f"{growth / 2**20:.1f} MiB, registrations {r['registrations_start']} -> {r['registrations_end']}")
        assert r["captures"] >= CHURN_CAPTURES and r["evictions"] >= CHURN_CAPTURES - 2, r
        assert (r["failures"], r["capture_failed"], r["fallbacks"], r["wrong"]) == (0, 0, 0, 0), r
        assert r["resident"] == 2, r
        assert r["registrations_end"] == r["registrations_start"], r
        assert growth <= CHURN_SLACK_BYTES, f"rank {rank}: reserved memory grew {growth / 2**20:.1f} MiB"
