"""Graph memory of CP BCG prefill graphs that own their graph-break inputs (sglang#37606).

Real on the GPU: sglang 0.5.17's `BreakableCudaGraphBackend.capture_one` / `.replay` with
`BreakableCUDAGraphCapture` (real CUDA graph segments in one private graph pool),
`eager_on_graph` and `_weak_ref_if_tensor` (sgl_kernel's `weak_ref_tensor`), the patched and
the original `PrefillCudaGraphRunner.capture_one_shape`, `PrefillCPBCGInput.prepare`, and for
the replay the patched `can_run_graph` + 0.5.17's `load_batch`. Not real: the model (the toy
CP-local body of test_prefill_bcg_break_inputs.py: 8 layers of fp32 q/k/v projections, a
graph break writing `out`, o-proj; no attention kernel, no KV cache), one CP rank of four
with no process groups (`get_parallel().override`), no launch_server, no graph dedup, and a
fresh private pool instead of sglang's global one (so the two variants are measured apart).

Both variants capture the 2560, 2304 and 2048 buckets (CP-local rows 640, 576, 512) largest
first, as 0.5.17 does; `strong refs +X MiB` is (allocated after capture with the patch) -
(the same with 0.5.17's own capture_one_shape). Expected: the held q/k/v/out bytes,
4 x layers x hidden x 4 B x (640 + 576 + 512) rows = 216 MiB. Only the patched graphs are
replayed (replaying the weak ones could fault the context).

Run: python -m pytest -q -s test/registered/cp/test_prefill_bcg_break_inputs_cuda.py
"""

from __future__ import annotations

import gc

import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

# the toy body, capture/replay helpers and the activation fixture (same directory)
from test_prefill_bcg_break_inputs import (  # noqa: F401  (cp_patch is a fixture)
    BUCKETS,
    LOG,
    ToyCPBody,
    capture_buckets,
    check_held_and_replayed,
    cp_patch,
    cp_rank_context,
    make_backend,
    make_capture_runner,
)

register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-small")

LAYERS, HIDDEN = 8, 1024
MiB = 2**20


def capture_measured(hold):
    """Capture the three buckets in a fresh pool; (runner, per-bucket log, allocated delta, reserved delta)."""
    LOG.__init__()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    backend = make_backend(torch.cuda)
    backend._pool = torch.cuda.graph_pool_handle()
    backend._capture_stream = torch.cuda.Stream()
    runner = make_capture_runner(ToyCPBody(LAYERS, HIDDEN, "cuda"), HIDDEN, torch.device("cuda"), backend)
    torch.cuda.synchronize()
    with backend.replay_session():  # what capture_session wraps the captures in
        per_bucket = capture_buckets(runner, hold=hold)
    torch.cuda.synchronize()
    gc.collect()
    return runner, per_bucket, torch.cuda.memory_allocated() - allocated, torch.cuda.memory_reserved() - reserved


def release(runner):
    runner.backend.cleanup()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_held_break_inputs_cost_and_replay_reads_them(cp_patch):
    try:
        import sglang.srt.compilation.weak_ref_tensor  # noqa: F401  (sgl_kernel.weak_ref_tensor)
    except Exception as exc:  # the unpatched variant cannot capture without it
        pytest.fail(f"sgl_kernel weak_ref_tensor unavailable: {exc}", pytrace=False)

    with cp_rank_context():
        runner, per_bucket, weak_alloc, weak_reserved = capture_measured(hold=False)
        dead = sum(ref() is None for refs, _ in per_bucket.values() for layer in refs for ref in layer)
        earlier = {p for b in BUCKETS[1:] for layer in per_bucket[b][1] for p in layer}  # captured first
        later = {p for layer in per_bucket[BUCKETS[0]][1] for p in layer}
        reused = len(earlier & later)
        release(runner)
        del runner, per_bucket

        runner, per_bucket, strong_alloc, strong_reserved = capture_measured(hold=True)
        rows = runner.prefill_cp_bcg_input.bucket_local_tokens
        expected = 4 * LAYERS * HIDDEN * 4 * sum(rows.values())
        print(f"\nprefill breakable graphs: {len(BUCKETS)} buckets, strong refs "
              f"+{(strong_alloc - weak_alloc) / MiB:.1f} MiB")
        print(f"  allocated after capture: weak {weak_alloc / MiB:.1f} MiB, strong {strong_alloc / MiB:.1f} MiB; "
              f"reserved: weak {weak_reserved / MiB:.1f} MiB, strong {strong_reserved / MiB:.1f} MiB; "
              f"held inputs computed {expected / MiB:.1f} MiB; weak: {dead} of "
              f"{len(BUCKETS) * LAYERS * 4} break inputs unowned, {reused} of the 2048 bucket's "
              f"break-input addresses are an earlier bucket's", flush=True)

        assert dead == len(BUCKETS) * LAYERS * 4  # 0.5.17: no capture keeps its break inputs
        static, output = check_held_and_replayed(runner, per_bucket, HIDDEN, LAYERS)  # alive, own memory, read
        torch.cuda.synchronize()
        # the 2304 graph (captured before 2048) computes the live rows as the eager body does
        # (loose enough for TF32 / a different GEMM algorithm; stale inputs are off by O(1))
        eager = ToyCPBody(LAYERS, HIDDEN, "cuda").forward(static.input_embeds)
        torch.testing.assert_close(output, eager, rtol=1e-2, atol=1e-2)
        # H200 (2026-12-01): +184.5 MiB of the 216.0 computed: the held inputs cost at most their size;
        # ~15 % of them (not explained yet) stay allocated in the weak variant too
        assert 0.5 * expected <= strong_alloc - weak_alloc <= 1.05 * expected
        release(runner)
