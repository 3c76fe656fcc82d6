#!/usr/bin/env python3
"""Pi0.5 single-request latency: eager vs CUDA-graph modes, sglang 0.5.17 / +sglang-ext / 0.5.19.

Pi0.5 at its real size with random weights (sglang_ext_testkit.pi05_random), one
request at a time, 10 denoise steps, LIBERO-like inputs: two 224x224 cameras, state
dim 8, action horizon 50, action dim 32; full prefixes (both cameras) and masked
prefixes (empty second camera), prompts of mixed lengths (round-robin).

Per mode: p50/p90 latency over --requests timed requests after warm-up (every
(layout, prompt length) combination once, then --warmup more), CUDA API launches
per request (kernel launches and graph launches, torch.profiler), device kernels
per request and their summed time, peak allocated memory, graph-pool growth, prefix and
denoise time (CUDA events), and accuracy over the timed requests (every mode sees the same
observations and noise): max|action - ref| / max|ref| and cosine against this process's
`eager` and `graph` modes, and against actions another process saved (--save-actions in the
0.5.17 process, --compare-actions here: 0.5.17 eager is the reference of every implementation).

Implementations (one per process; the sglang on PYTHONPATH decides):
  0517      sglang 0.5.17 as released: eager, graph (action graph, full prefixes only)
  0517-ext  0.5.17 + sglang-ext: eager, graph (exact), graph-bucket, graph-fused,
            graph-fast (knob pi05_fast: fused kernels + the fused denoise loop; skipped, with
            the reason, where this tree has no fast path), graph-fast-nopdl (the same without
            programmatic dependent launch: its kernel table gives each kernel's own time); experiments, each
            the fast path with a setting of the policy's Pi05Options set (EXPERIMENTS): graph-fast-exact-vision
            (fused_vision off: SigLIP's layers as sglang runs them, for the same-run comparison)
  0519      sglang 0.5.19 as released: eager, graph (exact), graph-bucket

On the GPU machine (docs/gpu-harness.md): `bash scripts/gpu_steps.sh bench-pi05` runs the three
implementations one after another in one run (shared run id) with a reference file; one alone:
  source scripts/gpu_env.sh && python3 scripts/bench_pi05.py --impl 0517-ext --out $OUT/ext.json
The table is printed last; --out writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import math
import os
import re
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch


import bench_results  # noqa: E402
import pi05_roofline  # noqa: E402
from sglang_ext_testkit import pi05_random  # noqa: E402

MODES = {
    "0517": ("eager", "graph"),
    "0517-ext": ("eager", "graph", "graph-bucket", "graph-fused", "graph-fast", "graph-fast-nopdl",
                 "graph-fast-exact-vision"),
    "0519": ("eager", "graph", "graph-bucket"),
}
REFERENCE_MODES = ("eager", "graph")  # run first: the other modes are compared with them
# The fast path; -nopdl without programmatic dependent launch, a diagnostic: with PDL a kernel's profiled
# time includes its wait for the one before, without it each kernel's time is its own.
# Experiments: the fast path with settings of the policy's Pi05Options set as named (every other mode: their
# defaults). graph-fast-nopdl sets `pdl` the same way.
EXPERIMENTS = {"graph-fast-exact-vision": {"fused_vision": False}}
FAST_MODES = ("graph-fast", "graph-fast-nopdl", *EXPERIMENTS)
ACTIONS_FORMAT = "bench_pi05 actions v1"
# Device kernels that are attention (SDPA's flash / memory-efficient / cuDNN kernels, FA3, Triton).
ATTENTION_KERNEL = re.compile(r"attn|attention|fmha|flash|sdpa|cudnn", re.IGNORECASE)
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")


CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reserved_bytes() -> int:
    return torch.cuda.memory_reserved() if CUDA else 0


def log(message: str) -> None:
    print(message, flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=sorted(MODES), required=True)
    ap.add_argument("--modes", default="", help="comma-separated subset of the impl's modes (default: all)")
    ap.add_argument("--requests", type=int, default=50,
                    help="timed requests per mode (>= 32 for the accuracy claims)")
    ap.add_argument("--warmup", type=int, default=5, help="extra warm-up requests after one of each combination")
    ap.add_argument("--prompt-lens", default="17,29,48,64,80,96,111")
    ap.add_argument("--layouts", default="full,masked")
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--buckets", default="32,64,128,200", help="prompt_token_buckets of graph-bucket mode")
    ap.add_argument("--prefix-entries", type=int, default=16, help="prefix graph capacity (0519 / ext; >= the 14 timed combinations)")
    ap.add_argument("--action-entries", type=int, default=16, help="action graph capacity (0519 / ext)")
    ap.add_argument("--profile-requests", type=int, default=4, help="requests profiled per mode (0 = none)")
    ap.add_argument("--quick", action="store_true", help="20 timed requests, 3 prompt lengths, 2 profiled")
    ap.add_argument("--attention", choices=("torch_sdpa", "fa", "default"), default="torch_sdpa",
                    help="multimodal_gen attention backend requested (fa: FlashAttention, sgl_kernel's FA3 on Hopper; "
                         "default: the platform's own choice, as a server without --attention-backend); the record "
                         "says what each attention module resolved to and ran")
    ap.add_argument("--custom-ops", choices=("auto", "native", "dispatch"), default="auto",
                    help="sglang custom ops (norms, activations): plain-torch forward_native, or sglang's own "
                         "dispatch (sgl_kernel); auto = dispatch where sgl_kernel's compiled ops are loaded")
    ap.add_argument("--save-actions", default="", help="write the timed requests' actions of --save-mode here")
    ap.add_argument("--save-mode", default="eager", help="the mode whose actions --save-actions writes")
    ap.add_argument("--compare-actions", default="",
                    help="compare every mode with the actions another process saved here (--save-actions)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--cpu-logic-check", action="store_true",
                    help="run the whole script on the CPU with a one-layer model (checks the script; numbers meaningless)")
    return ap


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 20)
        args.warmup = min(args.warmup, 2)
        args.prompt_lens = "23,44,61"
        args.profile_requests = min(args.profile_requests, 2)
    args.prompt_lens = [int(v) for v in args.prompt_lens.split(",") if v]
    args.layouts = [v for v in args.layouts.split(",") if v]
    args.buckets = [int(v) for v in args.buckets.split(",") if v]
    modes = [m for m in args.modes.split(",") if m] or list(MODES[args.impl])
    unknown = [m for m in modes if m not in MODES[args.impl]]
    if unknown:
        ap.error(f"--modes: {unknown} not available for --impl {args.impl}; allowed: {', '.join(MODES[args.impl])}")
    if args.save_actions and args.save_mode not in modes:
        ap.error(f"--save-mode: {args.save_mode!r} is not among the modes run; allowed: {', '.join(modes)}")
    args.modes = modes
    return args


def check_impl(impl: str) -> str:
    import sglang

    root = os.path.dirname(os.path.dirname(sglang.__file__))
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    version = installed_sglang_version() or source_tree_version(root)
    expected = "0.5.19" if impl == "0519" else "0.5.17"
    if version is None:
        log(f"[bench] sglang version at {root} unknown; assuming {expected} for --impl {impl}")
        return expected
    if version != expected:
        raise SystemExit(f"--impl {impl} needs sglang {expected} on PYTHONPATH; found {version} at {root}")
    return version


def configure(policy, impl: str, mode: str, args) -> Dict[str, Any]:
    """Rebuild the graph runners for one mode; returns a description of the mode."""
    config = policy.config
    if impl == "0517":
        runner_cls = type(policy.graph_runner)
        policy.graph_runner = runner_cls(enabled=bool(config.enable_action_cuda_graph))
        return {"prefix_graph": False, "action_graph": "full prefixes only, unbounded"}
    cuda_graph = importlib.import_module("sglang.multimodal_gen.runtime.vla.cuda_graph")
    for runner in (policy.prefix_graph_runner, policy.graph_runner):
        runner.clear()
    config.prompt_token_buckets = list(args.buckets) if mode == "graph-bucket" else []
    config.prefix_cuda_graph_max_entries = args.prefix_entries
    config.action_cuda_graph_max_entries = args.action_entries
    state = pi05_random.pi05_state(policy)  # the knobs a policy read when it was built, its graph plan
    if state is not None:
        state.plan = None  # resolved again from the config just set
    if impl == "0517-ext" and state is not None:
        options = state.options
        settings = {"pdl": mode != "graph-fast-nopdl"}
        for names in EXPERIMENTS.values():  # every experiment's settings at their defaults, but this mode's
            settings.update({name: _option_default(options, name) for name in names})
        settings.update(EXPERIMENTS.get(mode, {}))
        state.options = dataclasses.replace(
            options, fused_denoise=mode in ("graph-fused", *FAST_MODES), fast=mode in FAST_MODES,
            **{name: value for name, value in settings.items() if hasattr(options, name)})
    evict = policy._prompt_token_bucketing_enabled()
    available = getattr(config, "action_cuda_graph_available", None)
    action_enabled = available() if callable(available) else bool(config.enable_action_cuda_graph)
    policy.prefix_graph_runner = cuda_graph.VLAPrefixGraphRunner(
        enabled=policy._prefix_cuda_graph_enabled(), max_entries=args.prefix_entries, evict_on_miss=evict
    )
    policy.graph_runner = cuda_graph.VLADenoiseGraphRunner(
        enabled=action_enabled, max_entries=args.action_entries, evict_on_miss=evict
    )
    sync()
    if CUDA:
        torch.cuda.empty_cache()
    return {
        "prefix_graph": policy.prefix_graph_runner.enabled,
        "action_graph": policy.graph_runner.enabled,
        "bucket_mode": evict,
        "prompt_token_buckets": list(config.prompt_token_buckets),
        "prefix_entries": args.prefix_entries,
        "action_entries": args.action_entries,
        "fused_denoise": mode in ("graph-fused", *FAST_MODES),
        "fast": mode in FAST_MODES,
        "fused_vision": state.options.fused_vision if state is not None and mode in FAST_MODES else None,
    }


def _option_default(options, name: str):
    """The default of a Pi05Options field (None where this tree's options lack it)."""
    fields = {f.name: f.default for f in dataclasses.fields(options)}
    return fields.get(name)


def unavailable(impl: str, mode: str) -> str:
    """Why this tree cannot run the mode ("" when it can)."""
    if mode not in FAST_MODES:
        return ""
    from sglang_ext import knobs

    knob_names = {k.name for k in knobs.KNOBS}
    if "pi05_fast" not in knob_names:
        return "knob pi05_fast is not in this tree's sglang_ext.knobs"
    if importlib.util.find_spec("sglang_ext.kernels") is None:
        return "the fast path is not in this tree (no package sglang_ext.kernels)"
    for setting in (("pdl",) if mode == "graph-fast-nopdl" else ()) + tuple(EXPERIMENTS.get(mode, ())):
        options = importlib.import_module("sglang_ext.pi05.policy_graphs").Pi05Options
        if setting not in {field.name for field in dataclasses.fields(options)}:
            return f"this tree's fast path has no setting {setting} (sglang_ext.pi05.policy_graphs.Pi05Options)"
    return ""


def combos(args) -> List[tuple]:
    return [(layout, prompt_len) for layout in args.layouts for prompt_len in args.prompt_lens]


def make_inputs(policy, args):
    inputs = []
    for index, (layout, prompt_len) in enumerate(combos(args)):
        observation = pi05_random.make_observation(
            policy, prompt_len=prompt_len, masked_camera=layout == "masked", seed=1000 + index
        )
        inputs.append(((layout, prompt_len), observation, pi05_random.make_noise(policy, 2000 + index)))
    return inputs


def one_request(policy, observation, noise, graph: bool, num_steps: int, stamps=None):
    return pi05_random.run_request(policy, observation, noise, graph=graph, num_steps=num_steps, stamps=stamps)


class _Stamp:
    """A CUDA event where there is a GPU, a clock reading otherwise (--cpu-logic-check)."""

    def __init__(self):
        self.event = torch.cuda.Event(enable_timing=True) if CUDA else None
        self.t = 0.0

    def record(self):
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_until(self, later: "_Stamp") -> float:
        if self.event is not None:
            return self.event.elapsed_time(later.event)
        return (later.t - self.t) * 1000.0


def inputs_signature(args) -> Dict[str, Any]:
    """What decides the timed requests' inputs: equal signatures mean the same observations and noise
    per request (make_inputs' seeds), so actions of two processes compare request by request."""
    return {"prompt_lens": list(args.prompt_lens), "layouts": list(args.layouts), "num_steps": args.num_steps,
            "requests": args.requests, "seeds": "model 0, observation 1000+i, noise 2000+i"}


def timed_keys(inputs, args) -> List[str]:
    return [f"{layout}/{prompt_len}" for (layout, prompt_len), _, _ in
            (inputs[i % len(inputs)] for i in range(args.requests))]


def accuracy(actions: List[torch.Tensor], reference: List[torch.Tensor]) -> Dict[str, Any]:
    """Worst request: largest max|a - ref| / max|ref| and smallest cosine, over paired requests."""
    if len(actions) != len(reference) or not actions:
        raise ValueError(f"accuracy: {len(actions)} requests against {len(reference)} reference requests")
    return {"requests": len(actions),
            "max_rel_diff": max(pi05_random.relative_diff(a, r) for a, r in zip(actions, reference)),
            "min_cosine": min(pi05_random.cosine(a, r) for a, r in zip(actions, reference))}


def save_actions(path: str, *, impl: str, mode: str, version: str, signature, keys, digest, actions) -> None:
    """The timed requests' actions of one mode, for --compare-actions in another process."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save({"format": ACTIONS_FORMAT, "impl": impl, "mode": mode, "sglang": version,
                "run_id": bench_results.RUN_ID, "inputs": signature, "keys": list(keys),
                "weights_digest": list(digest), "actions": [a.detach().float().cpu() for a in actions]}, path)
    log(f"[bench] saved {len(actions)} {impl} {mode} actions to {path}")


def load_actions(path: str, *, signature, keys, digest):
    """(saved record, "") when `path` holds actions of the same inputs and weights; (None, reason) otherwise."""
    where = f"--compare-actions {path}"
    if not os.path.exists(path):
        return None, f"{where}: no such file (the reference process failed or did not run)"
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the bench goes on
        return None, f"{where}: unreadable ({type(exc).__name__}: {exc})"[:300]
    if not isinstance(saved, dict) or saved.get("format") != ACTIONS_FORMAT:
        return None, f"{where}: not a bench_pi05 actions file (format {ACTIONS_FORMAT!r} expected)"
    for field, here in signature.items():
        if saved["inputs"].get(field) != here:
            return None, f"{where}: inputs differ: {field} saved {saved['inputs'].get(field)!r}, here {here!r}"
    if list(saved["keys"]) != list(keys) or len(saved["actions"]) != len(keys):
        return None, f"{where}: the saved requests are not this run's requests"
    count, total, squares = saved["weights_digest"]
    if count != digest[0] or not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
                                     for a, b in ((total, digest[1]), (squares, digest[2]))):
        return None, (f"{where}: the model's weights differ from the saved run's (digest {saved['weights_digest']} "
                      f"vs {list(digest)})")
    return saved, ""


def kernels_record(custom_ops: str) -> Dict[str, Any]:
    """This process's `kernels` record (bench_results.PI05_KERNELS_SCHEMA)."""
    from sglang_ext_testkit.qwen_vit_kit import fa3_loaded, sgl_kernel_ops_loaded

    ops = sgl_kernel_ops_loaded()
    return {**bench_results.kernels(), "sgl_kernel_ops": "real" if ops else "absent or stand-in",
            "fa3": "real flash_ops loads" if fa3_loaded() else "not available", "custom_ops": custom_ops}


def resolve_custom_ops(choice: str) -> str:
    if choice != "auto":
        return choice
    from sglang_ext_testkit.qwen_vit_kit import sgl_kernel_ops_loaded

    return "dispatch" if sgl_kernel_ops_loaded() else "native"


def attention_ran(policy, observation, noise, args) -> Dict[str, Any]:
    """Which attention the model's LocalAttention modules hold, and which path one eager request takes
    (the masked path is torch SDPA whatever the backend; unmasked calls run the backend's impl)."""
    record: Dict[str, Any] = {"requested": args.attention}
    try:
        layers = [(n, m) for n, m in policy.named_modules() if hasattr(m, "attn_impl") and hasattr(m, "backend")]
        kinds = {n: f"{getattr(m.backend, 'name', m.backend)}:{type(m.attn_impl).__name__}".lower() for n, m in layers}
        modules: Dict[str, int] = {}
        for kind in kinds.values():
            modules[kind] = modules.get(kind, 0) + 1
        calls: Dict[str, int] = {}

        def hook(name):
            def count(_module, call_args, call_kwargs):
                mask = call_kwargs.get("attn_mask", call_args[3] if len(call_args) > 3 else None)
                key = "masked: torch sdpa" if mask is not None else f"unmasked: {kinds[name]}"
                calls[key] = calls.get(key, 0) + 1
            return count

        handles = [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in layers]
        try:
            one_request(policy, observation, noise, False, args.num_steps)
            sync()
        finally:
            for handle in handles:
                handle.remove()
        record.update(modules=modules, calls_per_request=calls)
    except Exception as exc:  # noqa: BLE001 - reported in the record
        record["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return record


def attention_summary(record: Dict[str, Any]) -> str:
    """One line for the `attention` field: requested backend and what the calls ran."""
    if not record.get("calls_per_request"):
        return f"{record.get('requested')} requested; what ran not recorded ({record.get('error', 'no calls seen')})"
    calls = ", ".join(f"{k} x{v}" for k, v in record["calls_per_request"].items())
    return f"{record['requested']} requested; ran per eager request: {calls}"


def profile(policy, inputs, graph: bool, args) -> Dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    count = max(0, min(args.profile_requests, len(inputs)))
    if count == 0:
        return {}
    picked = [inputs[i * len(inputs) // count] for i in range(count)]
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _, observation, noise in picked:
            one_request(policy, observation, noise, graph, args.num_steps, (_PhaseMark(),) * 3)
        sync()
    kernel_launches = graph_launches = kernels = marks = 0
    kernel_us = 0.0
    attention: Dict[str, int] = {}
    by_name: Dict[str, List[float]] = {}  # where the device time goes
    device_kernels = []  # (start, end, name) of kernels and copies: split by phase below
    for event in prof.events():
        name = event.name
        if name in LAUNCH_APIS:
            kernel_launches += 1
        elif name in GRAPH_LAUNCH_APIS:
            graph_launches += 1
        if event.device_type == DeviceType.CUDA:
            device_kernels.append((float(event.time_range.start), float(event.time_range.end), name))
        if event.device_type == DeviceType.CUDA and not name.startswith(("Memcpy", "Memset")):
            if PHASE_MARK.search(name):
                marks += 1
                continue
            kernels += 1
            kernel_us += float(event.device_time_total)
            entry = by_name.setdefault(name[:100], [0.0, 0.0])
            entry[0] += 1
            entry[1] += float(event.device_time_total)
            if ATTENTION_KERNEL.search(name):
                attention[name[:120]] = attention.get(name[:120], 0) + 1
    return {
        "phase_kernels_per_request": phase_kernels(device_kernels, count),
        "profiled_requests": count,
        "kernel_launches_per_request": (kernel_launches - marks) / count,  # the markers' launches are ours
        "graph_launches_per_request": graph_launches / count,
        "device_kernels_per_request": kernels / count,
        "kernel_time_ms_per_request": kernel_us / 1000.0 / count,
        "attention_kernels_per_request": {k: v / count for k, v in
                                          sorted(attention.items(), key=lambda kv: -kv[1])[:6]},
        "top_kernels_per_request": {k: [n / count, round(us / count, 1)] for k, (n, us) in
                                    sorted(by_name.items(), key=lambda kv: -kv[1][1])[:20]},
    }


PHASE_MARK = re.compile(r"spin_kernel|sleep", re.IGNORECASE)  # torch.cuda._sleep's kernel, at each phase boundary
# Kernel classes of the per-phase table, first match wins (names of cuBLAS, cuDNN, torch and our Triton kernels).
KERNEL_CLASSES = (("attention", re.compile(r"attn|attention|fmha|flash|sdpa|cudnn|_combine_kernel", re.IGNORECASE)),
                  ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|splitKreduce|linear_rope|cublas", re.IGNORECASE)),
                  ("norm", re.compile(r"norm", re.IGNORECASE)),
                  ("activation", re.compile(r"gelu|silu", re.IGNORECASE)))


class _PhaseMark:
    """run_request's stamps while profiling: a 1-cycle marker kernel before the prefix, between the phases
    and after the denoise, so the profile's kernels split by phase (they run in stream order)."""

    def record(self):
        if CUDA:
            torch.cuda._sleep(1)


def kernel_class(name: str) -> str:
    return next((label for label, pattern in KERNEL_CLASSES if pattern.search(name)), "other")


HOST_GAP_US = 10.0  # an idle stretch this long is the host's (a graph's launch gaps are about 1 us)


def phase_kernels(device_events, requests: int) -> Dict[str, Dict[str, List[float]]]:
    """{phase: {class: [count, us] per request}} from (start, end, name) of every profiled device event:
    kernels by class, "copy" (memcpy / memset), and the time the device sat idle between them, as
    "idle < 10 us" (launch gaps) and "idle >= 10 us" (waits for the host); each phase opens at the end of
    its marker kernel (three per request: prefix, denoise, end), so kernels + copies + idle make up the
    phase, less what overlaps (PDL). Empty when the markers are missing (no CUDA, or unseen)."""
    phases: Dict[str, Dict[str, List[float]]] = {}
    marks, phase, idle_from = 0, None, 0.0
    for start, end, name in sorted(device_events):
        if PHASE_MARK.search(name):
            if phase is not None and start > idle_from:
                _add(phases, phase, _idle(start - idle_from), start - idle_from, requests)
            phase, idle_from = ("prefix", "denoise", None)[marks % 3], end
            marks += 1
            continue
        if phase is None:
            continue
        _add(phases, phase, "copy" if name.startswith(("Memcpy", "Memset")) else kernel_class(name), end - start,
             requests)
        if start > idle_from:
            _add(phases, phase, _idle(start - idle_from), start - idle_from, requests)
        idle_from = max(idle_from, end)
    if marks != 3 * requests:
        return {}
    return {p: {c: [round(n, 1), round(us, 1)] for c, (n, us) in classes.items()} for p, classes in phases.items()}


def _idle(us: float) -> str:
    return f"idle {'>=' if us >= HOST_GAP_US else '<'} {HOST_GAP_US:.0f} us"


def _add(phases, phase: str, label: str, us: float, requests: int) -> None:
    entry = phases.setdefault(phase, {}).setdefault(label, [0.0, 0.0])
    entry[0] += 1.0 / requests
    entry[1] += max(0.0, us) / requests


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[index]


def run_mode(policy, impl: str, mode: str, inputs, args, timed: Dict[str, List[torch.Tensor]],
             saved=None) -> Dict[str, Any]:
    """Warm up, time, profile one mode. `timed`: the timed requests' actions of the modes run so far
    (this one is added); `saved`: (record, reason) of --compare-actions."""
    graph = mode != "eager"
    description = configure(policy, impl, mode, args)
    log(f"[bench] {impl} {mode}: {description}")
    sync()
    reserved_before = reserved_bytes()
    start = time.perf_counter()
    for _, observation, noise in inputs:  # every combination once (captures)
        one_request(policy, observation, noise, graph, args.num_steps)
    for index in range(args.warmup):
        _, observation, noise = inputs[index % len(inputs)]
        one_request(policy, observation, noise, graph, args.num_steps)
    sync()
    warmup_s = time.perf_counter() - start
    graph_pool_growth = reserved_bytes() - reserved_before
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    latencies, prefix_ms, denoise_ms, actions, by_layout = [], [], [], [], {}
    for index in range(args.requests):
        (layout, _), observation, noise = inputs[index % len(inputs)]
        stamps = (_Stamp(), _Stamp(), _Stamp())
        sync()
        t0 = time.perf_counter()
        out = one_request(policy, observation, noise, graph, args.num_steps, stamps)
        sync()
        latencies.append((time.perf_counter() - t0) * 1000.0)
        by_layout.setdefault(layout, []).append(latencies[-1])
        prefix_ms.append(stamps[0].ms_until(stamps[1]))
        denoise_ms.append(stamps[1].ms_until(stamps[2]))
        actions.append(out.detach().float().clone())  # outside the timing: graph outputs are reused
    peak_allocated = torch.cuda.max_memory_allocated() if CUDA else 0
    timed[mode] = actions
    result: Dict[str, Any] = {
        "impl": impl,
        "mode": mode,
        "config": description,
        "requests": args.requests,
        "p50_ms": statistics.median(latencies),
        "p90_ms": percentile(latencies, 0.9),
        "mean_ms": statistics.fmean(latencies),
        "min_ms": min(latencies),
        "p50_ms_by_layout": {layout: statistics.median(ms) for layout, ms in by_layout.items()},
        "prefix_p50_ms": statistics.median(prefix_ms),
        "denoise_p50_ms": statistics.median(denoise_ms),
        "warmup_s": warmup_s,
        "peak_allocated_mib": peak_allocated / 2**20,
        "graph_pool_growth_mib": graph_pool_growth / 2**20,
        "accuracy": compare(mode, actions, timed, saved),
    }
    for name in ("prefix_graph_runner", "graph_runner"):
        runner = getattr(policy, name, None)
        info = getattr(runner, "cache_info", None)
        if callable(info):
            cache = info()
            result[name + "_cache"] = cache.as_dict() if hasattr(cache, "as_dict") else vars(cache)
    result.update(profile(policy, inputs, graph, args))
    log(f"[bench] {impl} {mode}: p50 {result['p50_ms']:.1f} ms (prefix {result['prefix_p50_ms']:.1f}, denoise "
        f"{result['denoise_p50_ms']:.1f}) p90 {result['p90_ms']:.1f} ms by layout "
        f"{ {k: round(v, 2) for k, v in result['p50_ms_by_layout'].items()} } "
        f"launches {result.get('kernel_launches_per_request', float('nan')):.0f} "
        f"graphs {result.get('graph_launches_per_request', float('nan')):.1f} accuracy {result['accuracy']}")
    return result


def compare(mode: str, actions, timed: Dict[str, List[torch.Tensor]], saved) -> Dict[str, Any]:
    """Accuracy against this process's eager and graph modes and against the saved actions."""
    out: Dict[str, Any] = {}
    for name, reference in (("vs_eager", "eager"), ("vs_graph", "graph")):
        if reference != mode and reference in timed:
            out[name] = {"reference": f"this process's {reference}", **accuracy(actions, timed[reference])}
    if saved is not None:
        record, reason = saved
        if record is None:
            out["vs_saved"] = {"skipped": reason}
        else:
            out["vs_saved"] = {"reference": f"{record['impl']} {record['mode']} (run id {record['run_id']})",
                               **accuracy(actions, [a.to(actions[0].device) for a in record["actions"]])}
    return out


def run_or_report(policy, impl: str, mode: str, inputs, args, timed, saved) -> Dict[str, Any]:
    """One mode; a mode this tree lacks or one that fails becomes a row saying why, and the bench goes on."""
    reason = unavailable(impl, mode)
    if reason:
        log(f"[bench] {impl} {mode}: skipped: {reason}")
        return {"impl": impl, "mode": mode, "skipped": reason}
    try:
        return run_mode(policy, impl, mode, inputs, args, timed, saved)
    except Exception as exc:  # noqa: BLE001 - one mode's failure must not cost the others
        import traceback

        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"[:400]
        log(f"[bench] {impl} {mode}: FAILED: {error}")
        return {"impl": impl, "mode": mode, "error": error}


def main() -> int:
    args = parse_args()
    if not CUDA and not args.cpu_logic_check:
        raise SystemExit("bench_pi05 needs a CUDA device (or --cpu-logic-check)")
    version = check_impl(args.impl)
    statuses = {}
    if args.impl == "0517-ext":
        statuses = {name: str(s) for name, s in pi05_random.activate_sglang_ext().items()}
        log(f"[bench] sglang-ext: {statuses}")
    custom_ops = resolve_custom_ops(args.custom_ops)
    t0 = time.perf_counter()
    policy = pi05_random.build_random_pi05(
        device="cuda" if CUDA else "cpu", dtype=torch.bfloat16, seed=0, reduced=not CUDA, log=log,
        attention_backend=None if args.attention == "default" else args.attention,
        native_custom_ops=custom_ops == "native",
    )
    log(f"[bench] model built in {time.perf_counter() - t0:.1f} s; sglang {version}; custom ops {custom_ops}")
    inputs = make_inputs(policy, args)
    signature, keys = inputs_signature(args), timed_keys(inputs, args)
    digest = pi05_random.weights_digest(policy) if args.save_actions or args.compare_actions else None
    saved = load_actions(args.compare_actions, signature=signature, keys=keys, digest=digest) \
        if args.compare_actions else None
    if saved is not None:
        log(f"[bench] compare with {args.compare_actions}: {saved[1] or 'inputs and weights match'}")
    attention = attention_ran(policy, inputs[0][1], inputs[0][2], args)
    log(f"[bench] attention: {attention_summary(attention)}")
    kernels = kernels_record(custom_ops)
    log(f"[bench] kernels: {kernels}")
    full = sorted([i for i in inputs if i[0][0] == "full"] or inputs, key=lambda i: i[0][1])
    (_, prompt_len), observation, noise = full[len(full) // 2]
    exact = (pi05_random.pi05_knobs(policy, fast=False, fused_denoise=False)
             if pi05_random.pi05_state(policy) is not None else contextlib.nullcontext())
    work = None  # the same model's work: counted by the 0.5.17 processes (0.5.19's towers keep no config)
    if args.impl != "0519":
        with exact:  # the module path: a fused fast path would bypass the hooks
            work = {"layout": "full", "prompt_len": prompt_len,
                    **pi05_roofline.measure(policy, observation, noise, args.num_steps, one_request)}
    log(f"[bench] work per request: {work}")
    modes = [m for m in REFERENCE_MODES if m in args.modes] + [m for m in args.modes if m not in REFERENCE_MODES]
    timed: Dict[str, List[torch.Tensor]] = {}
    reference = {"saved_to": None, "saved_mode": args.save_mode if args.save_actions else None,
                 "compared_with": args.compare_actions or None,
                 "status": None if saved is None else (saved[1] or "compared")}
    results: List[Dict[str, Any]] = []

    def report() -> Dict[str, Any]:
        return {
            "run_id": bench_results.RUN_ID,
            "impl": args.impl,
            "sglang": version,
            "device": torch.cuda.get_device_name() if CUDA else "cpu (logic check)",
            "torch": torch.__version__,
            "kernels": kernels,
            "attention": attention_summary(attention),
            "attention_ran": attention,
            "command": " ".join(["python3", *sys.argv]) + (f"  (SGX_SGLANG={os.environ['SGX_SGLANG']})"
                                                           if os.environ.get("SGX_SGLANG") else ""),
            "sglang_ext": statuses,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "reference_actions": reference,
            "work": work,
            "results": results,
        }

    for mode in modes:
        results.append(run_or_report(policy, args.impl, mode, inputs, args, timed, saved))
        if args.save_actions and mode == args.save_mode and mode in timed:  # now: a later crash keeps it
            save_actions(args.save_actions, impl=args.impl, mode=mode, version=version,
                         signature=signature, keys=keys, digest=digest, actions=timed[mode])
            reference["saved_to"] = args.save_actions
        if args.out:  # after every mode: a process killed later keeps what it measured
            bench_results.write(args.out, report(), bench_results.PI05_SCHEMA, default=str)
    fast = next((r for r in results if r["mode"] == "graph-fast" and "p50_ms" in r), None)
    if fast is not None and "graph-fused" in timed and all(
            torch.equal(a, b) for a, b in zip(timed["graph-fast"], timed["graph-fused"])):
        fast["note"] = "actions bit-identical to graph-fused on every timed request: the fast path did not engage"
        if args.out:
            bench_results.write(args.out, report(), bench_results.PI05_SCHEMA, default=str)
    bench_results.print_pi05_table(results)
    print()
    if work:  # None in a 0.5.19 process: the 0.5.17 processes count the work (see above)
        print(pi05_roofline.table(work, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
