#!/usr/bin/env python3
"""What sglang-ext costs every sglang process while installed but off.

sglang calls `load_plugins()` early in every process (launcher, tokenizer,
schedulers, detokenizer). This script times that call in fresh processes:

  sglang discovery only    SGLANG_PLUGINS names no installed plugin: sglang reads the
                           entry points (sglang-ext among them) and loads none
  sglang-ext installed, off  the default: sglang loads `sglang_ext.plugin:register`
                           and calls it with SGLANG_EXT unset

and prints the median, min and max of each over N processes, the difference
(what sglang-ext adds) against the 10 ms budget, and the sglang_ext modules
the off path imported. `sglang.srt.plugins` itself is imported before the clock
starts in both cases. Needs sglang-ext installed as a distribution (its entry
point registered), e.g. `pip install --no-deps -e .`.

    python scripts/measure_plugin_overhead.py [--runs 21]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

BUDGET_MS = 10.0

CHILD = r"""
import json, sys, time
import sglang.srt.plugins as plugins
t0 = time.perf_counter()
plugins.load_plugins()
dt = time.perf_counter() - t0
print(json.dumps({"ms": dt * 1e3, "ext_modules": sorted(m for m in sys.modules if m.startswith("sglang_ext"))}))
"""

MODES = (
    ("sglang discovery only", {"SGLANG_PLUGINS": "no_such_plugin"}),
    ("sglang-ext installed, off", {}),
)


def run_child(extra_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_EXT" and k != "SGLANG_PLUGINS"}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="fresh processes per mode (default 21)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs: {args.runs} is not allowed; allowed: integers >= 1")
    import importlib.metadata as md

    eps = [ep.value for ep in md.entry_points(group="sglang.srt.plugins") if ep.name == "sglang_ext"]
    if not eps:
        print("sglang-ext is not installed as a distribution (no sglang.srt.plugins entry point); "
              "install it first: pip install --no-deps -e .", file=sys.stderr)
        return 2
    results, modules = {}, {}
    for i in range(args.runs):  # interleaved, so machine load drifts hit both modes alike
        for name, env in MODES:
            r = run_child(env)
            results.setdefault(name, []).append(r["ms"])
            modules[name] = r["ext_modules"]
    med = {name: statistics.median(v) for name, v in results.items()}
    added = med["sglang-ext installed, off"] - med["sglang discovery only"]
    print(f"load_plugins() per process, {args.runs} fresh processes per mode, interleaved "
          f"(python {sys.version.split()[0]}, sglang {md.version('sglang')}, sglang-ext {md.version('sglang-ext')})")
    print()
    print("| mode | median ms | min ms | max ms | sglang_ext modules imported |")
    print("|---|---|---|---|---|")
    for name, _ in MODES:
        v = results[name]
        print(f"| {name} | {med[name]:.2f} | {min(v):.2f} | {max(v):.2f} | {', '.join(modules[name]) or '-'} |")
    verdict = "within" if added <= BUDGET_MS else "OVER"
    print()
    print(f"sglang-ext adds {added:.2f} ms (median difference) to every process's load_plugins(): "
          f"{verdict} the {BUDGET_MS:.0f} ms budget")
    return 0 if added <= BUDGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
