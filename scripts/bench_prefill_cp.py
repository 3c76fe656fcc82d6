#!/usr/bin/env python3
"""Prefill context-parallel bucket selection: decision cost and admission rates.

CPU only; uses the real sglang 0.5.17 classes with the `prefill_cp_bucket` patch
applied through the activation path (strict), the real zigzag strategy and
sglang's default prefill capture sizes (`ServerArgs._generate_prefill_cuda_graph_batch_sizes`).

1. Decision cost: median microseconds of one per-batch decision
   (`PrefillCPBCGInput.replay_bucket_decision` = requirement + bucket search) for
   bs = 1..64 and cp = 2/4/8 (target <= 10 us). For reference, the same inputs
   through upstream's per-request-per-rank loop, which upstream runs twice per
   batch (admission and replay).
2. Admission rates over random multi-request batches. Captured CP-local
   capacities are what 0.5.17's capture records: one dummy request per bucket.
   - 0.5.17 unpatched: admitted when the smallest bucket >= tokens is within 2x;
     replay then crashes (`PrefillCPBCGInput.prepare` RuntimeError) when the live
     layout needs more local rows than that bucket captured -> counted as `crash`.
   - sglang-ext: admitted with the smallest bucket whose captured rows fit
     (`graph` or `graph_larger`), else eager (`eager_no_fit`); batches the
     original `can_run_graph` refuses are `eager` in both.

Align size: 2*cp, 0.5.17's default prefill_cp_mode="in-seq-split".
These are measurements, not tests: nothing here asserts timing.

    .venv/bin/python scripts/bench_prefill_cp.py [--batches 20000] [--out docs/bench/prefill_cp.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from types import SimpleNamespace
from unittest.mock import patch

import bench_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = "prefill_cp_bucket"
CP_SIZES = (2, 4, 8)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_TOKENS = 8192
PADDING_FACTOR = 2  # 0.5.17's _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR


def activate_patch() -> None:
    from sglang_ext import activation
    from sglang_ext.registry import PATCH_NAMES

    env = dict(os.environ)
    env.update(SGLANG_EXT="1", SGLANG_EXT_STRICT="1",
               SGLANG_EXT_DISABLE=",".join(n for n in PATCH_NAMES if n != PATCH))
    statuses = activation.activate(environ=env, eager=True)
    state = statuses[PATCH].state
    if state != "applied":
        sys.exit(f"bench_prefill_cp: patch {PATCH} is {state}: {statuses[PATCH]}")


def capture_sizes(cp_size: int) -> list:
    from sglang.srt.server_args import ServerArgs

    sizes = ServerArgs._generate_prefill_cuda_graph_batch_sizes(SimpleNamespace(), MAX_TOKENS)
    return [s for s in sizes if s >= 2 * cp_size]  # filter_prefill_cp_bcg_capture_num_tokens


def upstream_required_rows(lens, cp_size, align):
    """Upstream's loop (PR #33906), for the cost reference only."""
    segments = cp_size * 2
    per_rank = [0] * cp_size
    for raw_length in lens:
        base, remainder = divmod(int(raw_length), segments)
        for rank in range(cp_size):
            opposite = segments - 1 - rank
            per_rank[rank] += base * 2 + int(rank < remainder) + int(opposite < remainder)
    return (max(per_rank) + align - 1) // align * align


def upstream_select(bucket_local_tokens, num_tokens, required, buckets, factor):
    limit = num_tokens * factor
    for bucket in buckets:
        if bucket < num_tokens:
            continue
        if bucket > limit:
            break
        cap = bucket_local_tokens.get(bucket)
        if cap is not None and required <= cap:
            return bucket
    return None


def random_lengths(rng: random.Random, bs: int, cp_size: int, max_total: int) -> list:
    """bs request lengths, each >= 2*cp (zigzag can apply), total <= max_total."""
    low = 2 * cp_size
    high = max(low, max_total // bs)
    return [rng.randint(low, high) for _ in range(bs)]


def time_us(fn, *, calls: int, rounds: int) -> tuple:
    """(median, best) microseconds per call over `rounds` rounds of `calls` calls.

    The best round shows the cost without interference from other processes on a
    shared machine; the median is the headline number.
    """
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls / 1000.0)
    return round(statistics.median(samples), 2), round(min(samples), 2)


def make_cp_input(buckets, cp_size):
    import torch
    from sglang.srt.layers.cp.bcg import PrefillCPBCGInput
    from sglang_ext.prefill_cp.bucket import zigzag_required_local_rows

    # what 0.5.17's capture records: a one-request dummy batch per bucket
    local = {b: zigzag_required_local_rows([b], cp_size, 2 * cp_size) for b in buckets}
    return PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0), bucket_local_tokens=local)


def bench_decision(cp_size: int, rng: random.Random, calls: int, rounds: int) -> list:
    rows = []
    buckets = capture_sizes(cp_size)
    cp_input = make_cp_input(buckets, cp_size)
    for bs in BATCH_SIZES:
        lens = random_lengths(rng, bs, cp_size, MAX_TOKENS)
        num_tokens = sum(lens)

        def ext():
            return cp_input.replay_bucket_decision(num_tokens=num_tokens, extend_seq_lens=lens,
                                                   capture_num_tokens=buckets,
                                                   max_padding_factor=PADDING_FACTOR)

        def upstream_twice():
            for _ in range(2):
                required = upstream_required_rows(lens, cp_size, 2 * cp_size)
                upstream_select(cp_input.bucket_local_tokens, num_tokens, required, buckets, PADDING_FACTOR)

        ext_median, ext_best = time_us(ext, calls=calls, rounds=rounds)
        up_median, up_best = time_us(upstream_twice, calls=calls, rounds=rounds)
        rows.append({
            "cp": cp_size, "bs": bs, "num_tokens": num_tokens, "buckets": len(buckets),
            "ext_decision_us": ext_median, "ext_decision_best_us": ext_best,
            "upstream_twice_us": up_median, "upstream_twice_best_us": up_best,
        })
    return rows


def admission_rates(cp_size: int, rng: random.Random, batches: int) -> dict:
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import BaseCudaGraphRunner

    buckets = capture_sizes(cp_size)
    cp_input = make_cp_input(buckets, cp_size)
    counts = {"unpatched": {"graph": 0, "crash": 0, "eager": 0},
              "ext": {"graph": 0, "graph_larger": 0, "eager_no_fit": 0, "eager": 0}}
    ext_padding = unpatched_padding = 0
    for _ in range(batches):
        bs = rng.choice((2, 3, 4, 6, 8, 12, 16))
        lens = random_lengths(rng, bs, cp_size, rng.choice((1024, 2048, 4096, MAX_TOKENS)))
        num_tokens = sum(lens)
        # the original admission (can_replay_locally's size checks): same for both
        if num_tokens > buckets[-1]:
            counts["unpatched"]["eager"] += 1
            counts["ext"]["eager"] += 1
            continue
        smallest = BaseCudaGraphRunner._pad_to_bucket(num_tokens, buckets)
        if smallest > num_tokens * PADDING_FACTOR:
            counts["unpatched"]["eager"] += 1
            counts["ext"]["eager"] += 1
            continue
        decision = cp_input.replay_bucket_decision(num_tokens=num_tokens, extend_seq_lens=lens,
                                                   capture_num_tokens=buckets,
                                                   max_padding_factor=PADDING_FACTOR)
        if decision.required > cp_input.bucket_local_tokens[smallest]:
            counts["unpatched"]["crash"] += 1  # prepare() raises at replay
        else:
            counts["unpatched"]["graph"] += 1
            unpatched_padding += smallest - num_tokens
        if not decision.fits:
            counts["ext"]["eager_no_fit"] += 1
        else:
            counts["ext"]["graph" if decision.bucket == smallest else "graph_larger"] += 1
            ext_padding += decision.padding
    ext_graphs = counts["ext"]["graph"] + counts["ext"]["graph_larger"]
    return {
        "cp": cp_size, "batches": batches, "unpatched": counts["unpatched"], "ext": counts["ext"],
        "unpatched_crash_rate": round(counts["unpatched"]["crash"] / batches, 4),
        "unpatched_graph_rate": round(counts["unpatched"]["graph"] / batches, 4),
        "ext_graph_rate": round(ext_graphs / batches, 4),
        "ext_larger_bucket_rate": round(counts["ext"]["graph_larger"] / batches, 4),
        "ext_mean_padding_rows": round(ext_padding / max(ext_graphs, 1), 1),
        "unpatched_mean_padding_rows": round(unpatched_padding / max(counts["unpatched"]["graph"], 1), 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "bench", "prefill_cp.json"),
                    help="JSON results path (default: %(default)s)")
    ap.add_argument("--batches", type=int, default=20000, help="random batches per cp size for the admission table")
    ap.add_argument("--calls", type=int, default=200, help="decisions per timing round")
    ap.add_argument("--rounds", type=int, default=41, help="timing rounds (median and best are reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    os.environ["SGLANG_ENABLE_CP_V2"] = "1"
    activate_patch()
    from sglang.srt.layers.cp.base import init_cp_strategy
    from sglang.srt.runtime_context import get_parallel

    decision_rows, rate_rows = [], []
    for cp_size in CP_SIZES:
        init_cp_strategy(SimpleNamespace(enable_prefill_cp=True, attn_cp_size=cp_size, cp_strategy="zigzag"))
        with get_parallel().override(attn_cp_rank=0, attn_cp_size=cp_size), \
                patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", new=lambda: 2 * cp_size):
            # a plain function, not a MagicMock: a mock call costs microseconds itself
            decision_rows += bench_decision(cp_size, random.Random(args.seed * 100 + cp_size), args.calls, args.rounds)
            rate_rows.append(admission_rates(cp_size, random.Random(args.seed * 100 + cp_size + 50), args.batches))

    result = {
        "run_id": bench_results.RUN_ID,
        "bench": "prefill_cp",
        "sglang": __import__("sglang").__version__,
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        # timings are only comparable on an idle machine: the load says how idle it was
        "load_average_1m": round(os.getloadavg()[0], 2),
        "max_tokens": MAX_TOKENS,
        "align": "2*cp",
        "kernels": bench_results.kernels(),
        "attention": "none (bucket-choice logic on the CPU; no attention runs)",
        "decision": decision_rows,
        "admission": rate_rows,
        "command": "python scripts/bench_prefill_cp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    bench_results.write(args.out, result, bench_results.PREFILL_CP_SCHEMA)
    print(bench_results.prefill_cp_table(decision_rows, rate_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
