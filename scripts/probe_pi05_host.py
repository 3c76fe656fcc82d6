#!/usr/bin/env python3
"""Where the host's time goes in one Pi0.5 request on the fast path (sglang 0.5.17 + sglang-ext, graphs).

bench_pi05's per-phase table shows the GPU idle for long stretches (>= 10 us) inside the prefix: the
device waiting for the host. This runs bench_pi05's requests (graph-fast, after every layout was
captured) under cProfile, the prefix and the action calls apart, and prints per phase the host time
per request (the host time of the encode_prefix and sample_actions calls, graph replay launches
included; no sync inside) and the functions that spend it. No results file (docs/gpu-notes.md).

    python3 scripts/probe_pi05_host.py [--requests 20] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import io
import pstats
import sys
import time

import torch

import bench_pi05
from sglang_ext_testkit import pi05_random  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--mode", default="graph-fast", choices=bench_pi05.FAST_MODES)
    args = ap.parse_args()
    bench = bench_pi05.parse_args(["--impl", "0517-ext", "--modes", args.mode])  # bench's defaults otherwise
    pi05_random.activate_sglang_ext()
    policy = pi05_random.build_random_pi05(device="cuda", dtype=torch.bfloat16, seed=0, log=print)
    print(bench_pi05.configure(policy, "0517-ext", args.mode, bench))
    inputs = bench_pi05.make_inputs(policy, bench)
    for _, observation, noise in inputs:  # every layout captured
        bench_pi05.one_request(policy, observation, noise, True, bench.num_steps)
    torch.cuda.synchronize()
    for profiled in (False, True):  # host time as it is, then where it goes (cProfile slows Python)
        profiles = {"prefix": cProfile.Profile(), "denoise": cProfile.Profile()}
        host = {"prefix": 0.0, "denoise": 0.0}
        with torch.inference_mode():
            for index in range(args.requests):
                _, observation, noise = inputs[index % len(inputs)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with profiles["prefix"] if profiled else contextlib.nullcontext():
                    context = policy.encode_prefix(observation, use_cuda_graph=True)
                t1 = time.perf_counter()
                with profiles["denoise"] if profiled else contextlib.nullcontext():
                    policy.sample_actions(observation, context, noise=noise, num_steps=bench.num_steps,
                                          use_cuda_graph=True)
                host["prefix"] += t1 - t0
                host["denoise"] += time.perf_counter() - t1
        print(f"host ms per request{' (under cProfile)' if profiled else ''}: "
              + ", ".join(f"{phase} {seconds / args.requests * 1e3:.2f}" for phase, seconds in host.items()))
    for phase, profile in profiles.items():
        print(f"\n== {phase} ==")
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        print(out.getvalue().split("\n", PSTATS_PREAMBLE_LINES)[-1][:6000])
    return 0


PSTATS_PREAMBLE_LINES = 6  # pstats' header (call counts, ordering) before its table


if __name__ == "__main__":
    sys.exit(main())
