#!/usr/bin/env python3
"""Mutation smoke: curated one-line bugs in the central behaviours, each of which a named test must catch.

    python scripts/mutation_smoke.py               # every mutant (a stale list fails first)
    python scripts/mutation_smoke.py --baseline    # the named tests unmutated first (must pass), then every mutant
    python scripts/mutation_smoke.py --check       # only: every snippet found exactly once, every named test exists
    python scripts/mutation_smoke.py --list        # the mutants and their tests
    python scripts/mutation_smoke.py -k cache -k vit   # only mutants whose name contains one of these

How: the package folder (python/) is copied to a temporary folder without bytecode. One mutant at
a time is written into the copy, its named tests run in one pytest process (`-x`) with the copy
first on sys.path and PYTHONPATH (subprocesses of the tests inherit it) and no bytecode written,
then the file is restored. A mutant is caught when one of its tests fails; it survives when they
all pass. Each pytest process is forked from this one after it imported torch, pytest and the
sglang modules the tests use (PRELOAD; never sglang_ext itself, checked), so a mutant costs its
tests' time, not sglang's import (~20 s on 2 cores). After its tests, each process checks that
every module of the package it imported came from the copy, the mutated module among them, so
a run can never pass by testing the checkout instead of the mutant.

Adding a mutant: append `Mutant(name, file, original, replacement, tests, breaks)` to MUTANTS.
`original` is exact text found exactly once in `file` (relative to the package folder); keep it
short but unique. `tests` are pytest node ids relative to the repository root; name the few
fast tests that fail on the bug (the first failure stops the run). `--check` says at once
whether the list still matches the tree; CI runs `--baseline` (.ci/run).

Exit status: 0 every mutant caught (and the baseline passed); 1 a mutant survived, a run
errored or timed out, or the baseline failed; 2 bad command line; 3 the list is stale (a
snippet not found exactly once, a named test file or function missing): refactors must keep
the list honest.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STALE = 0, 1, 2, 3
DEFAULT_TIMEOUT_S = 180
# Imported once by this process before it forks the pytest processes (each would pay seconds for them).
PRELOAD = (
    "torch",
    "pytest",
    "_hypothesis_pytestplugin",  # pytest's entry-point plugins and hypothesis: seconds of assertion rewriting
    "hypothesis",
    "anyio.pytest_plugin",
    "sglang.test.ci.ci_register",
    "sglang.srt.multimodal.vit_cuda_graph_runner",
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner",
    "sglang.srt.layers.cp.bcg",
    "sglang.srt.distributed.parallel_state",
    "sglang.multimodal_gen.runtime.vla.denoise_cuda_graph",
)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the package folder (python/)
    original: str  # exact text, found exactly once in `file`
    replacement: str
    tests: Tuple[str, ...]  # pytest node ids relative to the repository root; one failing = caught
    breaks: str = ""  # the behaviour the bug breaks, one line

    def __post_init__(self):
        object.__setattr__(self, "tests", tuple(self.tests))


VIT_RUNNER = "sglang_ext/vit/runner.py"
VIT_STRATEGY = "sglang_ext/vit/strategy.py"
VIT_ENGINE = "sglang_ext/vit/engine.py"
VIT_MODEL_RUNNER = "sglang_ext/vit/model_runner.py"
VIT_TESTS = "test/registered/vit/test_vit_cuda_graph_runner.py"
BUDGET_TESTS = "test/registered/vit/test_vit_budget_mode.py"
MM_EMBED = "sglang_ext/vit/mm_embedding.py"
MM_EMBED_TESTS = "test/registered/vit/test_mm_embedding_sync_free.py"
VIT_ROTARY = "sglang_ext/vit/vision_rotary.py"
VIT_ROTARY_TESTS = "test/registered/vit/test_vision_rotary.py"
ROTATE_HALF = "sglang_ext/kernels/rotate_half.py"
ROTATE_HALF_TESTS = "test/registered/kernels/test_rotate_half.py"
FUSED_KERNEL_TESTS = "test/registered/kernels/test_fused_kernels.py"
PI05_FAST_TESTS = "test/registered/pi05/test_pi05_fast.py"
PI05_FAST_PATH = "sglang_ext/pi05/fast_path.py"
CACHE = "sglang_ext/graphs/cache.py"
CORE_TESTS = "test/registered/graphs/test_graph_core.py"
WORKSPACE = "sglang_ext/graphs/workspace.py"
WORKSPACE_TESTS = "test/registered/graphs/test_graph_workspace.py"
BUCKETS = "sglang_ext/graphs/buckets.py"
CP = "sglang_ext/prefill_cp/bucket.py"
CP_TESTS = "test/registered/cp/test_prefill_cp_bucket.py"
AGREEMENT = "sglang_ext/graphs/agreement.py"
TP_TESTS = "test/registered/vit/test_vit_tp_agreement.py"
LOCKSTEP_TESTS = "test/registered/vit/test_vit_tp_lockstep.py"
LOCKSTEP = f"{LOCKSTEP_TESTS}::test_an_allocation_failing_on_one_rank_leaves_every_rank_answering_eager"
VLA = "sglang_ext/pi05/vla_cuda_graph.py"
PI05_TESTS = "test/registered/pi05/test_pi05_graphs.py"
WORKER_TESTS = "test/registered/pi05/test_pi05_worker_overhead.py"
KNOBS = "sglang_ext/knobs.py"
LAUNCHER = "sglang_ext/tools/launcher.py"
LAUNCHER_TESTS = "test/registered/foundation/test_launchers.py"
BAD_FLAGS = f"{LAUNCHER_TESTS}::test_bad_flags_exit_2_naming_the_flag_and_what_is_allowed"
PATCHING = "sglang_ext/patching.py"
ACTIVATION_TESTS = "test/registered/foundation/test_activation_policy.py"
BOUND_BY_NAME = f"{ACTIVATION_TESTS}::test_a_patched_function_bound_by_name_is_sglangs_again_after_deactivate"

MUTANTS: List[Mutant] = [
    # --- ViT runner swap (vit/runner.py) ---
    Mutant("vit-runner-swap-not-recorded", VIT_RUNNER,
           '    ctx.setattr(module, "ViTCudaGraphRunner", runner_cls)\n',
           '    setattr(module, "ViTCudaGraphRunner", runner_cls)\n',
           (f"{VIT_TESTS}::test_a_runner_built_before_activation_stays_sglangs_and_deactivation_restores_every_binding",),
           "the runner class swapped without PatchContext: deactivation leaves sglang-ext's runner installed"),
    # --- ViT keys (vit/strategy.py: the key types and the strategies' key()) ---
    Mutant("vit-layout-key-drops-window", VIT_STRATEGY,
           "    window: Boundaries = None\n",
           '    window: Boundaries = __import__("dataclasses").field(default=None, compare=False)\n',
           (f"{VIT_TESTS}::test_layout_mode_same_full_layout_other_windows_gets_its_own_graph",),
           "layout mode: equal tokens and full layout, other windows replay stale window boundaries"),
    Mutant("vit-layout-key-drops-full", VIT_STRATEGY,
           "    full: Boundaries\n",
           '    full: Boundaries = __import__("dataclasses").field(compare=False)\n',
           (f"{VIT_TESTS}::test_lru_eviction_resets_the_graph_and_frees_its_buffers",
            f"{VIT_TESTS}::test_graph_and_eager_results_are_identical_over_random_layouts"),
           "layout mode: equal tokens, other full-attention boundaries replay stale ones"),
    Mutant("vit-get-key-drops-cpu-window", VIT_STRATEGY,
           '(cu_seqlens, "cu_seqlens"), (cu_window_seqlens, "cu_window_seqlens")))',
           '(cu_seqlens, "cu_seqlens"), (None, "cu_window_seqlens")))',
           (f"{VIT_TESTS}::test_graph_key_tells_full_and_window_boundaries_apart",),
           "the layout key from CPU tensors (no attention_layout_key) ignores the window boundaries"),
    Mutant("vit-class-key-swaps-full-and-window-classes", VIT_STRATEGY,
           "return ClassKey(tokens, *size_class(layout.full), *size_class(layout.window))",
           "return ClassKey(tokens, *size_class(layout.window), *size_class(layout.full))",
           (f"{VIT_TESTS}::test_class_mode_shares_one_graph_between_layouts_and_refreshes_boundaries",
            f"{VIT_TESTS}::test_graph_and_eager_results_are_identical_over_random_layouts"),
           "class mode: full attention gets the window class's bounds (too few sequences, too small max_seqlen)"),
    # --- ViT bucket (token-budget) mode: the ladder captured at load, the probe, chunks ---
    Mutant("vit-budget-key-depends-on-the-call", VIT_STRATEGY,
           "window = (tokens // max(smallest, self.merge_unit) + 2, self.window_chunk)",
           "window = (len(layout.window) - 1, self.window_chunk)",
           (f"{BUDGET_TESTS}::test_the_ladder_is_captured_first_and_every_call_replays_its_budget",),
           "bucket mode: window slots from the call, so calls miss the budget graphs captured at load"),
    Mutant("vit-precapture-captures-one-budget", VIT_ENGINE,
           "        for budget in reversed(kept):\n",
           "        for budget in kept[:1]:\n",
           (f"{BUDGET_TESTS}::test_the_ladder_is_captured_first_and_every_call_replays_its_budget",),
           "bucket mode: the ladder is not captured before serving"),
    Mutant("vit-probe-ignores-a-loss", VIT_ENGINE,
           "            if not wins:\n                break\n",
           "            if not wins:\n                pass\n",
           (f"{BUDGET_TESTS}::test_the_probe_ends_the_ladder_at_the_first_budget_eager_wins",),
           "bucket mode: budgets whose graph loses to eager are replayed"),
    Mutant("vit-ladder-ignores-the-merge-unit", VIT_MODEL_RUNNER,
           "runner.engine.capture_at_load(tower, prefill * runner.engine.merge_unit if prefill > 0 else None)",
           "runner.engine.capture_at_load(tower, prefill if prefill > 0 else None)",
           (f"{BUDGET_TESTS}::test_model_runner_captures_the_ladder_after_its_own_graphs",),
           "bucket mode: the ladder's top counts LLM tokens, not patches (calls above it chunk needlessly)"),
    Mutant("vit-default-ladder-changed", VIT_STRATEGY,
           "DEFAULT_BUCKETS = dict(smallest=512, ratio=1.26, multiple=64)",
           "DEFAULT_BUCKETS = dict(smallest=1024, ratio=1.5, multiple=64)",
           (f"{BUDGET_TESTS}::test_bucket_mode_default_ladder_is_the_documented_one",),
           "bucket mode: another default token ladder than the documented one"),
    Mutant("vit-eager-chunks-split", VIT_ENGINE,
           "                eager_from = start if eager_from is None else eager_from\n                continue\n",
           "                rows[start // unit:end // unit].copy_(self.eager_call(*call_of(start, end)))\n"
           "                continue\n",
           (f"{BUDGET_TESTS}::test_adjacent_chunks_no_graph_serves_run_as_one_eager_call",),
           "bucket mode: adjacent chunks no graph serves run as several eager calls"),
    Mutant("vit-probe-limit-still-splits", VIT_STRATEGY,
           "        self.split_above_limit = (self.replay_max_tokens >= 0 or len(captured) < len(probed)\n"
           "                                  or self.above_ladder == \"split\")\n",
           "        self.split_above_limit = True\n",
           (f"{BUDGET_TESTS}::test_above_the_probes_break_even_a_call_runs_as_one_eager_call",),
           "bucket mode: a call above the probe's break-even is split into chunk replays"),
    Mutant("vit-above-ladder-split-ignored", VIT_STRATEGY,
           "        self.split_above_limit = (self.replay_max_tokens >= 0 or len(captured) < len(probed)\n"
           "                                  or self.above_ladder == \"split\")\n",
           "        self.split_above_limit = self.replay_max_tokens >= 0 or len(captured) < len(probed)\n",
           (f"{BUDGET_TESTS}::test_above_ladder_split_replays_whole_image_chunks_above_the_break_even",),
           "bucket mode: knob vit_graph_above_ladder=split leaves calls above the break-even eager"),
    Mutant("mm-embed-count-misses-the-last-token", MM_EMBED,
           "        first, last = prefix_length[i], prefix_length[i] + length - 1\n",
           "        first, last = prefix_length[i], prefix_length[i] + length - 2\n",
           (f"{MM_EMBED_TESTS}::test_host_count_equals_the_device_mask",),
           "sync-free embedding: the host count of placeholders drops the extend range's last token"),
    Mutant("mm-embed-pinned-copy-inside-captures", MM_EMBED,
           "            and not torch.cuda.is_current_stream_capturing())\n", "            )\n",
           (f"{MM_EMBED_TESTS}::test_only_python_int_lists_bound_for_cuda_skip_the_wait",),
           "mm_utils's as_tensor: a pinned non-blocking copy inside a CUDA graph capture"),
    Mutant("mm-embed-floats-take-the-pinned-copy", MM_EMBED,
           "all(type(v) is int for v in data)", "all(isinstance(v, (int, float)) for v in data)",
           (f"{MM_EMBED_TESTS}::test_only_python_int_lists_bound_for_cuda_skip_the_wait",),
           "mm_utils's as_tensor: lists other than Python ints take the pinned copy"),
    Mutant("mm-embed-skips-the-check-always", MM_EMBED,
           "        if _host_count.get() == embedding.shape[0]:\n",
           "        if True:\n",
           (f"{MM_EMBED_TESTS}::test_without_a_matching_host_count_sglangs_own_check_runs",),
           "sync-free embedding: sglang's length check skipped even when the host count disagrees"),
    Mutant("vit-rotary-compiled-outside-bucket-eager", VIT_ROTARY,
           "        if _eager_depth[0] and compiled_allowed(q):\n",
           "        if compiled_allowed(q):\n",
           (f"{VIT_ROTARY_TESTS}::test_outside_the_bucket_eager_block_the_original_runs",),
           "ViT rotary: the compiled kernel also runs outside bucket mode's eager calls (captures' warm-up, "
           "class and layout modes)"),
    Mutant("vit-rotary-eager-call-outside-the-block", VIT_ENGINE,
           "        with compiled_rotary():\n",
           "        with torch.no_grad():\n",
           (f"{VIT_ROTARY_TESTS}::test_the_bucket_runners_eager_call_runs_inside_the_block",),
           "ViT rotary: bucket mode's eager calls keep the unfused eager rotary"),
    Mutant("vit-triton-rotary-ignores-refusals", VIT_ROTARY,
           "unsqueeze_dim == 1 and not rotate_half_qk_supports(q, k, cos, sin):\n",
           "unsqueeze_dim == 1:\n",
           (f"{VIT_ROTARY_TESTS}::test_knob_vit_triton_rotary_sends_every_supported_call_to_the_one_kernel",),
           "ViT rotary: the one-kernel rotary is asked for layouts it does not take (non-contiguous q)"),
    Mutant("vit-triton-rotary-off-by-default", KNOBS,
           '    Knob("vit_triton_rotary", "bool", True,\n', '    Knob("vit_triton_rotary", "bool", False,\n',
           (f"{VIT_ROTARY_TESTS}::test_knob_vit_triton_rotary_sends_every_supported_call_to_the_one_kernel",),
           "ViT rotary: the one-kernel rotary (measured faster, bitwise equal) no longer the default"),
    Mutant("pi05-fast-modes-apart", PI05_FAST_PATH,
           "copy.copy(known) if known else Pi05FastPath(core, self, mode)", "Pi05FastPath(core, self, mode)",
           (f"{PI05_FAST_TESTS}::test_the_modes_of_one_model_share_its_state",),
           "Pi0.5 fast path: another mode's path on fresh state (its time tables and packed q/k/v made twice)"),
    Mutant("pi05-fast-reads-fp8-checkpoints", "sglang_ext/pi05/fast_support.py",
           "        if any(quantized(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):\n",
           "        if False:\n",
           (f"{PI05_FAST_TESTS}::test_fp8_quantized_checkpoint_keeps_the_exact_denoise",),
           "Pi0.5 fast path: a ModelOpt FP8 checkpoint's float8 projections read as plain weights"),
    Mutant("pi05-graphs-under-segmented-actions", "sglang_ext/pi05/graph_settings.py",
           '    return bool(getattr(config, "enable_segmented_actions", False))', "    return False",
           ("test/registered/pi05/test_pi05_load_capture.py::test_segmented_actions_switch_every_graph_off",),
           "Pi0.5 graphs captured although segmented actions (0.5.23) denoise eagerly"),
    Mutant("rotate-half-launch-contracts", ROTATE_HALF,
           "enable_fp_fusion=False", "enable_fp_fusion=True",
           (f"{ROTATE_HALF_TESTS}::test_the_launch_asks_for_the_build_without_contraction",),
           "rotate_half_qk: the GPU build fuses multiply-adds, no longer rounding as sglang's eager rotary"),
    Mutant("vit-precapture-sample-not-voted", VIT_ENGINE,
           "        if self.vote(failure_vote(error)) != OK:\n",
           "        if error is not None:\n",
           (f"{TP_TESTS}::test_bucket_precapture_failing_on_one_rank_leaves_every_rank_eager",),
           "TP: a rank whose load-time sample failed decides alone (its peers wait in the next vote)"),
    # --- graph cache (graphs/cache.py) ---
    Mutant("cache-hit-keeps-lru-order", CACHE,
           "        self._entries.move_to_end(key)\n        self.hits += 1\n",
           "        self.hits += 1\n",
           (f"{CORE_TESTS}::test_capacity_n_lru_order",),
           "a hit does not make the entry most recently used: LRU evicts a graph in use"),
    Mutant("cache-eviction-skips-reset", CACHE,
           "        self.evictions += 1\n        self.discard(key)\n",
           "        self.evictions += 1\n        self._entries.pop(key)\n        self._nbytes.pop(key, None)\n",
           (f"{CORE_TESTS}::test_capacity_one_swaps_and_resets_the_previous_graph",
            f"{CORE_TESTS}::test_every_release_path_resets_exactly_once"),
           "an evicted graph is dropped without reset(): its pool memory comes back only with the GC"),
    Mutant("cache-evicts-after-capture", CACHE,
           "        while self._entries and self._over_budget(1, expected_bytes):\n            self._evict_oldest()\n",
           "",
           (f"{CORE_TESTS}::test_byte_budget_evicts_by_bytes_before_capture",),
           "admission no longer evicts before the capture, so the new graph cannot reuse the evicted memory"),
    # --- address-stable workspaces (graphs/workspace.py) ---
    Mutant("workspace-keeps-retired-backings-forever", WORKSPACE,
           "            self._retired.pop(id(backing), None)\n",
           "            pass\n",
           (f"{WORKSPACE_TESTS}::test_backing_buffer_freed_exactly_when_last_holder_goes",),
           "a retired rotary backing outlives its last lease (upstream's unbounded growth)"),
    Mutant("workspace-forgets-retired-backing", WORKSPACE,
           "            self._retired[id(current)] = current  # graphs still replay from it",
           "            pass  # graphs still replay from it",
           (f"{WORKSPACE_TESTS}::test_growth_never_moves_existing_slices",),
           "growth stops tracking the retired backing that live graphs still lease"),
    Mutant("workspace-cos-and-sin-overlap", WORKSPACE,
           "        stride = self._aligned(per_tensor)\n",
           "        stride = self._aligned(per_tensor) // 2\n",
           (f"{WORKSPACE_TESTS}::test_count_gives_non_overlapping_aligned_tensors",
            f"{VIT_TESTS}::test_small_graph_sees_new_positions_after_workspace_growth"),
           "the tensors of one lease (rotary cos and sin) share memory"),
    # --- prefill CP bucket choice (prefill_cp/bucket.py, graphs/buckets.py) ---
    Mutant("cp-bucket-skips-exact-size", CP,
           "lo = bisect.bisect_left(capture_num_tokens, num_tokens)",
           "lo = bisect.bisect_right(capture_num_tokens, num_tokens)",
           (f"{CP_TESTS}::test_a_bucket_whose_capacity_equals_the_requirement_is_chosen",),
           "a batch the size of a captured bucket skips it: not the smallest bucket that fits"),
    Mutant("cp-requirement-of-the-idlest-rank", CP,
           "    busiest = max(\n",
           "    busiest = min(\n",
           (f"{CP_TESTS}::test_requirement_equals_rows_prepare_builds",),
           "the CP-local requirement is the least loaded rank's, so the busiest rank overflows its bucket"),
    Mutant("cp-capacity-equal-to-requirement-rejected", BUCKETS,
           "if required is not None and (cap is None or cap < required):",
           "if required is not None and (cap is None or cap <= required):",
           (f"{CP_TESTS}::test_a_bucket_whose_capacity_equals_the_requirement_is_chosen",),
           "a bucket whose CP-local capacity equals the requirement is passed over (capacity boundary)"),
    Mutant("cp-padding-limit-excludes-the-boundary", CP,
           "hi = bisect.bisect_right(capture_num_tokens, num_tokens * max_padding_factor)",
           "hi = bisect.bisect_left(capture_num_tokens, num_tokens * max_padding_factor)",
           (f"{CP_TESTS}::test_bucket_search_preserves_two_x_padding_limit",
            f"{CP_TESTS}::test_selection_properties"),
           "a bucket exactly at the padding limit no longer qualifies"),
    # --- TP capture vote (graphs/agreement.py) ---
    Mutant("tp-vote-max-instead-of-min", AGREEMENT,
           "op=dist.ReduceOp.MIN", "op=dist.ReduceOp.MAX",
           (f"{TP_TESTS}::test_a_failure_at_any_stage_on_one_rank_makes_every_rank_run_eager[2-1]",),
           "the vote takes the best outcome: ranks keep graphs a peer failed to capture"),
    Mutant("tp-rank-ignores-a-peers-failure", AGREEMENT,
           "    if agreed != OK:\n",
           "    if error is not None:\n",
           (f"{VIT_TESTS}::test_capture_failing_on_another_tp_rank_drops_the_graph_everywhere",),
           "a rank whose own capture worked keeps its graph although a peer voted failure"),
    Mutant("tp-budget-inputs-decided-alone", VIT_ENGINE,
           '        inputs = agreed(self.vote, lambda: self._synthetic_call(sample, budget), "inputs")\n',
           '        inputs = agreed(lambda value: value, lambda: self._synthetic_call(sample, budget), "inputs")\n',
           (f"{LOCKSTEP}[bucket-fa3]",),
           "TP: a rank whose probe inputs failed leaves the ladder alone (its peers wait in the capture vote)"),
    Mutant("tp-replay-staged-alone", VIT_ENGINE,
           '            staged = agreed(self.vote, stage, "replay")\n',
           '            staged = agreed(lambda value: value, stage, "replay")\n',
           (f"{LOCKSTEP}[layout-triton_attn]",),
           "TP: a rank that could not stage a replay runs eager alone (its peers wait in the graph's all-reduce)"),
    # --- Pi0.5 K/V refresh keyed by context generation (pi05/vla_cuda_graph.py) ---
    Mutant("cache-seal-ignored", "sglang_ext/graphs/cache.py",
           "        if self.sealed:\n            self.sealed_misses += 1", "        if False:\n            self.sealed_misses += 1",
           ("test/registered/graphs/test_graph_core.py::"
            "test_sealed_cache_replays_what_it_holds_and_never_captures_again",),
           "a cache sealed after the load-time capture captures again while serving"),
    Mutant("pi05-observation-values-unchecked", "sglang_ext/pi05/observation_checks.py",
           '        _finite(field, observation.get(f"observation.{field}") if value is None else value)',
           "        pass",
           ("test/registered/pi05/test_pi05_observation_checks.py::test_camera_checks_name_the_allowed_cameras",),
           "a NaN or infinite state or noise reaches the model"),
    Mutant("pi05-camera-names-unchecked", "sglang_ext/pi05/observation_checks.py",
           "    unknown = [] if camera_order else [name for name in images if name not in order]",
           "    unknown = []",
           ("test/registered/pi05/test_pi05_observation_checks.py::test_camera_checks_name_the_allowed_cameras",),
           "a camera the checkpoint does not name is dropped silently"),
    Mutant("pi05-refresh-keyed-by-id", VLA,
           "        generation = prefix_context_generation(prefix_context)\n        digest",
           "        generation = id(prefix_context.past_key_values)\n        digest",
           (f"{PI05_TESTS}::test_generation_keyed_refresh_copies_new_requests_kv",),
           "the K/V refresh trusts id(), which CPython reuses for the next request's K/V"),
    Mutant("pi05-refresh-ignores-mutable-output", VLA,
           "        if not prefix_context.layout.get(\"mutable_graph_output\", False) and (\n",
           "        if (\n",
           (f"{PI05_TESTS}::test_generation_refresh_skips_the_copy_for_the_same_context",),
           "a prefix-graph output rewritten in place is not copied again into the action graph"),
    # --- the multimodal_gen worker around the Pi0.5 pipeline (mg_worker/memory_snapshot.py, pi05/stage_logs.py) ---
    Mutant("worker-snapshot-peak-reads-current", "sglang_ext/mg_worker/memory_snapshot.py",
           'peak_reserved_mb=_counter(stats, "reserved_bytes", "peak")',
           'peak_reserved_mb=_counter(stats, "reserved_bytes", "current")',
           (f"{WORKER_TESTS}::test_worker_snapshots_equal_sglangs_from_one_read",),
           "the one-read memory snapshot reports the current reserved bytes as the peak"),
    Mutant("stage-lines-stay-at-info", "sglang_ext/pi05/stage_logs.py",
           "        return self._logger.debug(msg, *args, **kwargs)\n",
           "        return self._logger.info(msg, *args, **kwargs)\n",
           (f"{WORKER_TESTS}::test_action_stage_lines_go_to_debug_with_the_same_answers",),
           "an action request's stage start/finish lines still go out at info level"),
    # --- knob validation and exit codes (knobs.py, launcher.py) ---
    Mutant("knob-int-list-accepts-duplicates", KNOBS,
           "if any(b <= a for a, b in zip(values, values[1:])):",
           "if any(b < a for a, b in zip(values, values[1:])):",
           (BAD_FLAGS,),
           "an int_list knob accepts a repeated value (two identical buckets)"),
    Mutant("knob-int-minimum-off-by-one", KNOBS,
           "if self.minimum is not None and value < self.minimum:",
           "if self.minimum is not None and value < self.minimum - 1:",
           (BAD_FLAGS,),
           "an int knob accepts a value one below its minimum"),
    Mutant("knob-env-typo-ignored", KNOBS,
           "    typos = unknown_env_names(env)\n",
           "    typos = []\n",
           (f"{LAUNCHER_TESTS}::test_unknown_sglang_ext_environment_variable_is_rejected",),
           "a misspelt SGLANG_EXT_* variable is silently ignored"),
    Mutant("launcher-bad-flag-exit-1", LAUNCHER,
           "USAGE_EXIT = 2", "USAGE_EXIT = 1",
           (BAD_FLAGS,),
           "a bad --ext-* flag exits 1 instead of argparse's 2"),
    Mutant("launcher-half-applies-bad-flags", LAUNCHER,
           "        values, rest = split_ext_args(argv)\n",
           "        os.environ[MASTER_ENV] = \"1\"\n        values, rest = split_ext_args(argv)\n",
           (BAD_FLAGS,),
           "a rejected command line leaves SGLANG_EXT=1 behind (half applied)"),
    # --- rollback (patching.py) ---
    Mutant("rollback-keeps-a-bound-patched-copy", PATCHING,
           "            return s.original\n",
           "            return current\n",
           (BOUND_BY_NAME,),
           "a module that bound a patched function by name keeps it after deactivation, its helpers gone"),
]


# ---------------------------------------------------------------------------
# The list against the tree
# ---------------------------------------------------------------------------


def module_name(relative_file: str) -> str:
    """`sglang_ext/graphs/cache.py` -> `sglang_ext.graphs.cache` (a package's `__init__.py` -> the package)."""
    parts = relative_file[:-3].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_NODE = re.compile(r"^(?P<path>[^:]+\.py)((::(?P<parts>[^\[]+))(\[.*\])?)?$")


def stale_entries(mutants: Sequence[Mutant], source_root: str, cwd: str) -> List[str]:
    """Why the list no longer matches the tree: one line per problem (empty: it matches)."""
    problems = []
    seen = set()
    for m in mutants:
        if m.name in seen:
            problems.append(f"{m.name}: name used twice")
        seen.add(m.name)
        path = os.path.join(source_root, m.file)
        if not os.path.isfile(path):
            problems.append(f"{m.name}: {m.file} does not exist")
            continue
        with open(path, encoding="utf-8") as f:
            count = f.read().count(m.original)
        if count != 1:
            problems.append(f"{m.name}: snippet found {count} times in {m.file} (must be exactly once): "
                            f"{m.original.strip()[:80]!r}")
        if m.replacement == m.original:
            problems.append(f"{m.name}: replacement equals the original")
        if not m.tests:
            problems.append(f"{m.name}: names no test")
        for node in m.tests:
            problems.extend(f"{m.name}: {p}" for p in _missing_test(node, cwd))
    return problems


def _missing_test(node: str, cwd: str) -> List[str]:
    match = _NODE.match(node)
    if not match:
        return [f"{node!r} is not a node id (path.py::test_name[params])"]
    path = os.path.join(cwd, match["path"])
    if not os.path.isfile(path):
        return [f"{match['path']} does not exist"]
    if not match["parts"]:
        return []
    with open(path, encoding="utf-8") as f:
        text = f.read()
    missing = [p for p in match["parts"].split("::")
               if not re.search(rf"^\s*(async\s+def|def|class)\s+{re.escape(p)}\b", text, re.M)]
    return [f"{match['path']} has no {p}" for p in missing]


def select(mutants: Sequence[Mutant], keywords: Sequence[str]) -> List[Mutant]:
    return [m for m in mutants if not keywords or any(k in m.name for k in keywords)]


def load_mutants_json(path: str) -> List[Mutant]:
    with open(path, encoding="utf-8") as f:
        return [Mutant(**entry) for entry in json.load(f)]


# ---------------------------------------------------------------------------
# One pytest process per run, forked from this (preloaded) process
# ---------------------------------------------------------------------------


@dataclass
class RunResult:
    status: str  # "passed" | "caught" | "survived" | "error" | "timeout"
    seconds: float
    failed: List[str] = field(default_factory=list)  # node ids that failed (first one caught the mutant)
    detail: str = ""
    log: str = ""


class _Outcomes:
    """pytest plugin: what each test did."""

    def __init__(self):
        self.failed, self.passed, self.skipped = [], [], []

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid)
        elif report.skipped:
            self.skipped.append(report.nodeid)
        elif report.when == "call" and report.passed:
            self.passed.append(report.nodeid)


def _child(tests: Sequence[str], copy_root: str, package: str, cwd: str, must_import: Optional[str],
           result_path: str) -> int:
    """In the forked process: run the tests on the copy, then check where the package came from."""
    os.chdir(cwd)
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([copy_root] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    sys.path.insert(0, copy_root)
    importlib.invalidate_caches()
    import pytest

    outcomes = _Outcomes()
    rc = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests], plugins=[outcomes]))
    prefix = os.path.realpath(copy_root) + os.sep
    loaded = {name: getattr(mod, "__file__", None) or "" for name, mod in list(sys.modules.items())
              if name == package or name.startswith(package + ".")}
    elsewhere = sorted(f"{name} from {path or '(no file)'}" for name, path in loaded.items()
                       if not os.path.realpath(path).startswith(prefix))
    result = dict(rc=rc, failed=outcomes.failed, passed=outcomes.passed, skipped=outcomes.skipped,
                  elsewhere=elsewhere, imported_from=os.path.dirname(loaded.get(package, "")) if package in loaded
                  else "", must_import_missing=bool(must_import) and must_import not in loaded)
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def run_tests(tests: Sequence[str], *, copy_root: str, package: str, cwd: str, must_import: Optional[str],
              timeout_s: float, workdir: str) -> Tuple[Optional[dict], float, str, bool]:
    """Fork, run `tests` in the child; returns (its result or None, seconds, log tail, timed out)."""
    result_path = os.path.join(workdir, "result.json")
    log_path = os.path.join(workdir, "pytest.log")
    with contextlib.suppress(FileNotFoundError):
        os.remove(result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.collect()
    gc.freeze()  # the child's collections skip (and do not copy) this process's objects
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: never returns
        status = 70
        try:
            os.setsid()  # its own process group: a timeout ends the tests' subprocesses too
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            status = _child(tests, copy_root, package, cwd, must_import, result_path)
        except BaseException:  # noqa: BLE001 - reported through the log
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(status)
    timed_out = False
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - start > timeout_s:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    seconds = time.monotonic() - start
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # whatever the tests left running in the child's group
    log = ""
    with contextlib.suppress(OSError), open(log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()[-4000:]
    result = None
    with contextlib.suppress(OSError, ValueError), open(result_path, encoding="utf-8") as f:
        result = json.load(f)
    return result, seconds, log, timed_out


def _matches(named: str, nodeid: str) -> bool:
    return nodeid == named or nodeid.startswith(named + "[") or nodeid.startswith(named + "::")


def classify(result: Optional[dict], seconds: float, log: str, timed_out: bool, tests: Sequence[str],
             *, baseline: bool) -> RunResult:
    if timed_out:
        return RunResult("timeout", seconds, detail="no result in time: name tests that fail instead of hanging",
                         log=log)
    if result is None:
        return RunResult("error", seconds, detail="the pytest process ended without a result", log=log)
    if result["elsewhere"]:
        return RunResult("error", seconds, detail="imported outside the copy: " + "; ".join(result["elsewhere"][:3]),
                         log=log)
    if result["must_import_missing"]:
        return RunResult("error", seconds, detail="the tests never imported the mutated module", log=log)
    rc = result["rc"]
    if baseline:
        silent = [n for n in tests if not any(_matches(n, p) for p in result["passed"])]
        skipped = [p for p in result["skipped"] if any(_matches(n, p) for n in tests)]
        if rc == 0 and not silent and not skipped:
            return RunResult("passed", seconds)
        why = (f"failed: {', '.join(result['failed'][:3])}" if result["failed"] else
               f"skipped (cannot catch anything): {', '.join(skipped[:3])}" if skipped else
               f"did not pass: {', '.join(silent[:3])}" if silent else f"pytest exit {rc}")
        return RunResult("error", seconds, failed=result["failed"], detail=why, log=log)
    if rc == 1 and result["failed"]:
        return RunResult("caught", seconds, failed=result["failed"])
    if rc == 0:
        skipped = [p for p in result["skipped"] if any(_matches(n, p) for n in tests)]
        return RunResult("survived", seconds, detail="skipped: " + ", ".join(skipped[:3]) if skipped else "",
                         log=log)
    return RunResult("error", seconds, detail=f"pytest exit {rc} (collection or usage error)", log=log)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def preload(modules: Sequence[str], package: str) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise SystemExit(f"mutation_smoke: --preload {name}: {exc}; allowed: importable modules "
                             "(PRELOAD in scripts/mutation_smoke.py)") from None
    leaked = sorted(n for n in sys.modules if n == package or n.startswith(package + "."))
    if leaked:
        raise SystemExit(f"mutation_smoke: preloading {', '.join(modules)} imported {', '.join(leaked[:3])}: "
                         f"{package} must be imported in the forked pytest processes only, from the copy")


def copy_package(source_root: str, package: str, into: str) -> str:
    root = os.path.join(into, "src")
    os.makedirs(root)
    shutil.copytree(os.path.join(source_root, package), os.path.join(root, package),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return root


def short(node: str) -> str:
    return node.split("/")[-1]


def print_table(rows: Sequence[Tuple[str, RunResult]]) -> None:
    width = max([len("mutant")] + [len(name) for name, _ in rows])
    print(f"{'mutant':<{width}}  {'result':<8}  {'seconds':>7}  caught by / why")
    for name, r in rows:
        by = short(r.failed[0]) if r.status == "caught" and r.failed else r.detail
        print(f"{name:<{width}}  {r.status:<8}  {r.seconds:7.1f}  {by}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", action="store_true", help="run every named test unmutated first (must pass)")
    parser.add_argument("--check", action="store_true", help="only check the list against the tree")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests")
    parser.add_argument("-k", dest="keywords", action="append", default=[],
                        help="only mutants whose name contains this (repeatable)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per pytest process")
    # For reuse and for this script's own test (a synthetic package):
    parser.add_argument("--mutants-json", help="read the mutants from this JSON list instead of MUTANTS")
    parser.add_argument("--source-root", default=os.path.join(REPO, "python"), help="folder holding the package")
    parser.add_argument("--package", default="sglang_ext", help="the package to copy and mutate")
    parser.add_argument("--cwd", default=REPO, help="where pytest runs (node ids are relative to it)")
    parser.add_argument("--preload", default=",".join(PRELOAD), help="modules to import before forking")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error(f"--timeout: {args.timeout} is not allowed; allowed: seconds > 0")

    mutants = load_mutants_json(args.mutants_json) if args.mutants_json else MUTANTS
    chosen = select(mutants, args.keywords)
    if not chosen:
        parser.error(f"-k {' -k '.join(args.keywords)}: no mutant matches; allowed: parts of "
                     + ", ".join(m.name for m in mutants))
    if args.list:
        for m in chosen:
            print(f"{m.name}  ({m.file}): {m.breaks}")
            for node in m.tests:
                print(f"    {node}")
        return EXIT_OK
    problems = stale_entries(chosen, args.source_root, args.cwd)
    if problems:
        for line in problems:
            print(f"mutation_smoke: stale: {line}", file=sys.stderr)
        print(f"mutation_smoke: FAILED: {len(problems)} entr{'y' if len(problems) == 1 else 'ies'} of the "
              "mutant list no longer match the tree (update MUTANTS in scripts/mutation_smoke.py)", file=sys.stderr)
        return EXIT_STALE
    if args.check:
        print(f"mutation_smoke: {len(chosen)} mutants match the tree (each snippet once, every test found)")
        return EXIT_OK

    start = time.monotonic()
    preload([m for m in args.preload.split(",") if m], args.package)
    print(f"mutation_smoke: preloaded in {time.monotonic() - start:.1f} s; {len(chosen)} mutants", flush=True)
    with tempfile.TemporaryDirectory(prefix="mutation_smoke.") as tmp:
        copy_root = copy_package(args.source_root, args.package, tmp)
        run = dict(copy_root=copy_root, package=args.package, cwd=args.cwd, timeout_s=args.timeout, workdir=tmp)
        if args.baseline:
            tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
            result, seconds, log, timed_out = run_tests(tests, must_import=None, **run)
            base = classify(result, seconds, log, timed_out, tests, baseline=True)
            where = result.get("imported_from", "") if result else ""
            print(f"mutation_smoke: baseline ({len(tests)} tests, unmutated, {args.package} from {where}): "
                  f"{base.status} in {base.seconds:.1f} s{': ' + base.detail if base.detail else ''}", flush=True)
            if base.status != "passed":
                print(base.log, file=sys.stderr)
                print("mutation_smoke: FAILED: the named tests must pass on the unmutated tree", file=sys.stderr)
                return EXIT_FAILED
        rows = []
        for m in chosen:
            path = os.path.join(copy_root, m.file)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(m.original, m.replacement, 1))
            try:
                result, seconds, log, timed_out = run_tests(m.tests, must_import=module_name(m.file), **run)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            outcome = classify(result, seconds, log, timed_out, m.tests, baseline=False)
            rows.append((m.name, outcome))
            print(f"mutation_smoke: {m.name}: {outcome.status} ({outcome.seconds:.1f} s)", flush=True)
    print()
    print_table(rows)
    bad = [(name, r) for name, r in rows if r.status != "caught"]
    total = time.monotonic() - start
    for name, r in bad:
        print(f"\n--- {name}: {r.status}: {r.detail or 'every named test passed with the bug in place'}\n{r.log}",
              file=sys.stderr)
    if bad:
        print(f"mutation_smoke: FAILED: {len(bad)} of {len(rows)} mutants not caught "
              f"({', '.join(name for name, _ in bad)}) in {total:.0f} s", file=sys.stderr)
        return EXIT_FAILED
    print(f"mutation_smoke: all {len(rows)} mutants caught in {total:.0f} s")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
