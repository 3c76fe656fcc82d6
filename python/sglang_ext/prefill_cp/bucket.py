"""Prefill context-parallel graph bucket chosen by CP-local capacity, once per batch.

Target symbols:
    sglang.srt.layers.cp.bcg.PrefillCPBCGInput  (adds required_local_tokens,
        select_replay_bucket, select_replay_bucket_for_batch, replay_bucket_decision)
    sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner
        .can_run_graph (original && CP-local fit), .load_batch (pads to the admitted
        bucket), ._pad_to_bucket (subclass override that honours the admitted bucket),
        .capture_one_shape (CP BCG captures hold graph-break inputs strongly)
    sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph
        .breakable_cuda_graph._weak_ref_if_tensor (the input itself inside that scope)
sglang versions: 0.5.17 (fingerprint-gated; 0.5.18+ carry upstream's version of the fix).
Upstream PR: sgl-project/sglang#33906 (first released in 0.5.18).

Why: with CP v2 (zigzag) and breakable prefill graphs, a multi-request batch can
need more CP-local rows than the smallest global bucket it fits was captured
with (e.g. 520 live rows against 512 for the 2048 bucket); 0.5.17 pads to that
bucket anyway and `PrefillCPBCGInput.prepare` raises at replay, killing the
request. Upstream searches the captured buckets for one whose recorded local
capacity fits, but computes that choice twice (admission and replay) and raises
if the two disagree.

How:
- `PrefillCPBCGInput` gets upstream's three methods with upstream's semantics,
  built on `sglang_ext.graphs.buckets.select_bucket`. The zigzag requirement is
  computed in closed form from the sorted per-request remainders: O(bs log bs)
  instead of upstream's O(bs * cp) loop, same result. `bucket_local_tokens` is
  already recorded for every captured bucket by 0.5.17's `prepare(capture=True)`.
- `can_run_graph` = original && fit check, only when the runner captured CP BCG
  and the batch is CP-active. The `BucketDecision` is made there, once, and
  stored on the forward batch (`forward_batch.prefill_cp_bucket_decision`).
- `load_batch` (same guard) requires that stored decision and pads to exactly its
  bucket; without one it raises a RuntimeError that says why (never a recomputed
  or different bucket). Every other configuration calls the original unchanged.
- 0.5.17's `load_batch` derives `static_num_tokens` from `self._pad_to_bucket`
  once, before the buffer fill and `prepare()`. Instead of copying its 180-line
  body, the replacement sets a `ContextVar` holding (live tokens, admitted
  bucket) around the original call, and a `_pad_to_bucket` override on the
  subclass returns that bucket for that size (else the base implementation). A
  ContextVar (not a runner attribute) keeps concurrent or nested calls in other
  threads/tasks from seeing each other's bucket, and is reset in `finally`.
  The fork patch thus stays short: one staticmethod, two small methods, and the
  original `load_batch`/`can_run_graph` kept as `_ext_orig_*`.
- Counters per runner (admitted, admitted with a larger bucket, rejected for no
  fit, rejected for an unknown layout, padding rows added over the smallest
  bucket, total padding rows) are registered with `sglang_ext.graphs.stats`.

Deviations from upstream:
- a `load_batch` under CP BCG that was not admitted by `can_run_graph` on the same
  forward batch raises (upstream recomputes the bucket there), so upstream's
  `test_load_batch_uses_selected_larger_bucket`, which calls load_batch directly,
  needs a `can_run_graph` call first;
- `replay_bucket_decision` (the full `BucketDecision`) is ours; upstream's three
  methods return what upstream's return;
- the search bisects `capture_num_tokens` (ascending, as 0.5.17's `_pad_to_bucket`
  already requires) and `select_bucket` rejects invalid input with ValueError
  where upstream's loop would silently return a wrong or no bucket.

Graph-break inputs held strongly (sgl-project/sglang#37606, fix proposed in #37448, open;
still weak in 0.5.23):
- Why: 0.5.17's breakable graphs keep the inputs of each graph break (radix attention's
  q/k/v/output, allocated in the graph pool by the segment before the break) only as weak
  views (`breakable_cuda_graph.eager_on_graph`: `captured_args = tuple(_weak_ref_if_tensor(a)
  ...)`). The pool's use count keeps the pool, not those blocks: once capture drops its Python
  references the allocator hands them to later captures in the same (global) pool, and
  `_capture_one_stream` captures largest first, so every bucket but the smallest replays
  eager code over memory that another bucket's graph now owns (#37606: wrong greedy output
  or an illegal memory access, by layout). Choosing a larger bucket makes it reachable for
  batches 0.5.17 would have failed: they replay an earlier-captured bucket.
- How: `capture_one_shape`, when the runner captures CP BCG, sets a ContextVar around the
  original; the module global `_weak_ref_if_tensor` that `eager_on_graph`'s wrapper calls
  then returns the input itself, so each captured bucket's replay closures own their inputs
  (they live and die with that bucket's `BreakableCUDAGraph`, i.e. until backend cleanup).
  Outside that scope (decode, non-CP prefill, diffusion) the original runs unchanged: those
  are upstream's exposure, not made reachable by this patch.
- Cost: per CP bucket, every break's inputs at that bucket's CP-local rows stay allocated:
  about sum over buckets of layers x local rows x (q + k + v + out widths) x dtype bytes,
  where 0.5.17 reuses one layer's worth across layers and buckets. Measured on the H200 by
  test_prefill_bcg_break_inputs_cuda.py (docs/gpu-notes.md).
- Retire this part once the minimum supported sglang holds break inputs strongly (#37448
  merged); the patch as a whole: below.

Retire when: upstream stores the admitted bucket with the batch instead of
recomputing it at replay (still recomputed in 0.5.23) and the minimum supported
sglang has the fit search (>= 0.5.18).
"""

from __future__ import annotations

import bisect
import contextvars
import importlib
from typing import Any, Dict, Optional, Sequence

from sglang.srt.layers.cp.base import get_cp_strategy
from sglang.srt.layers.cp.padding import get_cp_padding_align_size
from sglang.srt.layers.cp.utils import is_cp_v2_active
from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

from sglang_ext.graphs import stats as ext_graph_stats
from sglang_ext.graphs.buckets import BucketDecision, select_bucket

# Name under which graph-cache counters show up in `doctor` / stats snapshots.
PREFILL_CP_BUCKET_STATS_NAME = "prefill_cp_bucket"

# True while PrefillCudaGraphRunner.capture_one_shape captures a CP BCG prefill bucket.
_EXT_HOLD_BREAK_INPUTS: contextvars.ContextVar = contextvars.ContextVar(
    "sglang_ext_hold_break_inputs", default=False
)

# (live tokens, admitted bucket) while PrefillCudaGraphRunner.load_batch runs a CP batch.
_EXT_ADMITTED_PREFILL_BUCKET: contextvars.ContextVar = contextvars.ContextVar(
    "sglang_ext_admitted_prefill_bucket", default=None
)


# --------------------------------------------------------------------------
# sglang.srt.layers.cp.bcg.PrefillCPBCGInput
# --------------------------------------------------------------------------


def zigzag_required_local_rows(extend_seq_lens: Sequence[Any], cp_size: int, align_size: int) -> int:
    """Aligned CP-local rows the busiest rank needs for this zigzag layout.

    Each request is cut into 2*cp blocks of `base` rows, the first `rem` blocks
    one row longer; rank r owns blocks r and 2*cp-1-r. Summed over requests,
    rank r holds 2*sum(base) + #(rem > r) + #(rem > 2*cp-1-r) rows, so one sort
    of the remainders replaces upstream's per-request, per-rank loop.
    """
    if not isinstance(extend_seq_lens, (list, tuple)):
        extend_seq_lens = [int(length) for length in extend_seq_lens]  # CPU tensor / array
    segments = 2 * cp_size
    remainders = sorted([length % segments for length in extend_seq_lens])
    total_base = (sum(extend_seq_lens) - sum(remainders)) // segments
    both = 2 * len(remainders)
    busiest = max(
        both - bisect.bisect_right(remainders, rank) - bisect.bisect_right(remainders, segments - 1 - rank)
        for rank in range(cp_size)
    )
    needed = 2 * total_base + busiest
    return int((needed + align_size - 1) // align_size * align_size)


def select_fitting_bucket(
    bucket_local_tokens: Dict[int, int],
    num_tokens: int,
    required: int,
    capture_num_tokens: Sequence[int],
    max_padding_factor: float,
) -> BucketDecision:
    """`select_bucket` over the captured buckets the padding factor allows.

    Only that window is handed over (the rest cannot qualify), so validating the
    candidates costs O(window), not O(all captured sizes), per batch.
    """
    lo = bisect.bisect_left(capture_num_tokens, num_tokens)
    hi = bisect.bisect_right(capture_num_tokens, num_tokens * max_padding_factor)
    return select_bucket(
        num_tokens,
        capture_num_tokens[lo:hi],
        max_padding_factor=max_padding_factor,
        capacity=bucket_local_tokens,
        required=required,
    )


def required_local_tokens(self, extend_seq_lens: Any) -> Optional[int]:
    """Aligned CP-local rows a live zigzag layout needs (max over ranks); None if unknown."""
    strategy = get_cp_strategy()
    if not isinstance(strategy, ZigzagCPStrategy) or extend_seq_lens is None:
        return None
    return zigzag_required_local_rows(extend_seq_lens, strategy.cp_size, get_cp_padding_align_size())


def replay_bucket_decision(
    self,
    *,
    num_tokens: int,
    extend_seq_lens: Any,
    capture_num_tokens: Sequence[int],
    max_padding_factor: float,
) -> Optional[BucketDecision]:
    """The whole decision for one batch; None when the layout's requirement is unknown."""
    required = self.required_local_tokens(extend_seq_lens)
    if required is None:
        return None
    return select_fitting_bucket(
        self.bucket_local_tokens, num_tokens, required, capture_num_tokens, max_padding_factor
    )


def select_replay_bucket(
    self,
    *,
    num_tokens: int,
    required_local_tokens: int,
    capture_num_tokens: Sequence[int],
    max_padding_factor: float,
) -> Optional[int]:
    """Smallest captured global bucket within the padding factor whose CP-local rows fit."""
    return select_fitting_bucket(
        self.bucket_local_tokens, num_tokens, required_local_tokens, capture_num_tokens, max_padding_factor
    ).bucket


def select_replay_bucket_for_batch(
    self,
    *,
    num_tokens: int,
    extend_seq_lens: Any,
    capture_num_tokens: Sequence[int],
    max_padding_factor: float,
) -> Optional[int]:
    """`select_replay_bucket` for a batch's extend lengths; None -> run eager."""
    decision = self.replay_bucket_decision(
        num_tokens=num_tokens,
        extend_seq_lens=extend_seq_lens,
        capture_num_tokens=capture_num_tokens,
        max_padding_factor=max_padding_factor,
    )
    return None if decision is None else decision.bucket


def patch_bcg(ctx, module) -> None:
    cls = module.PrefillCPBCGInput
    for fn in (required_local_tokens, replay_bucket_decision, select_replay_bucket, select_replay_bucket_for_batch):
        ctx.transplant_method(cls, fn)


# --------------------------------------------------------------------------
# sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner
# --------------------------------------------------------------------------
# `_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR` and `BaseCudaGraphRunner` below are not
# imported here on purpose: the transplanted functions resolve them among the
# prefill runner module's own globals, exactly as the same code inside that file.


class PrefillCPBucketCounters:
    """What the CP bucket search did in one runner (see `sglang_ext.graphs.stats`).

    Plain data: classes are copied into the target module as they are (not
    transplanted), so the logic that needs other names lives in functions.
    """

    __slots__ = (
        "__weakref__",
        "admitted",
        "admitted_larger_bucket",
        "rejected_no_fit",
        "rejected_unknown_layout",
        "padding_rows_added",
        "padding_rows_total",
        "stats_name",
    )

    def __init__(self) -> None:
        self.admitted = 0
        # a bucket above the smallest one >= live tokens, because that one lacked CP-local rows
        self.admitted_larger_bucket = 0
        self.rejected_no_fit = 0
        self.rejected_unknown_layout = 0  # non-zigzag strategy or no CPU extend lengths
        # rows padded beyond what the smallest bucket >= live tokens would have padded
        self.padding_rows_added = 0
        self.padding_rows_total = 0
        self.stats_name = ""  # set on registration; the stats registry may add a suffix

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__ if name not in ("__weakref__", "stats_name")}


def record_bucket_decision(
    counters: PrefillCPBucketCounters, decision: Optional[BucketDecision], capture_num_tokens: Sequence[int]
) -> None:
    if decision is None:
        counters.rejected_unknown_layout += 1
    elif decision.bucket is None:
        counters.rejected_no_fit += 1
    else:
        counters.admitted += 1
        counters.padding_rows_total += decision.padding
        smallest = capture_num_tokens[bisect.bisect_left(capture_num_tokens, decision.live_size)]
        if decision.bucket > smallest:
            counters.admitted_larger_bucket += 1
            counters.padding_rows_added += decision.bucket - smallest
    ext_graph_stats.publish()  # Prometheus, when on


def prefill_cp_bucket_counters(runner) -> PrefillCPBucketCounters:
    """The runner's counters, created (and registered for stats) on first use."""
    counters = runner.__dict__.get("_ext_prefill_cp_bucket_counters")
    if counters is None:
        counters = PrefillCPBucketCounters()
        runner._ext_prefill_cp_bucket_counters = counters
        # held weakly (bound method): a dead runner's counters leave the snapshot
        counters.stats_name = ext_graph_stats.register(PREFILL_CP_BUCKET_STATS_NAME, counters.as_dict)
    return counters


def can_run_graph(self, forward_batch) -> bool:
    admitted = self._ext_orig_can_run_graph(forward_batch)
    if not (getattr(self, "enable_cp_v2_bcg_capture", False) and is_cp_v2_active(forward_batch)):
        return admitted
    decision = None
    if admitted:
        assert self.prefill_cp_bcg_input is not None
        decision = self.prefill_cp_bcg_input.replay_bucket_decision(
            num_tokens=len(forward_batch.input_ids),
            extend_seq_lens=forward_batch.extend_seq_lens_cpu,
            capture_num_tokens=self.capture_num_tokens,
            max_padding_factor=_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR,
        )
        record_bucket_decision(prefill_cp_bucket_counters(self), decision, self.capture_num_tokens)
    # Made once here; load_batch replays exactly this bucket (or refuses).
    forward_batch.prefill_cp_bucket_decision = decision
    return decision is not None and decision.fits


def load_batch(self, forward_batch, **kwargs):
    if not (getattr(self, "enable_cp_v2_bcg_capture", False) and is_cp_v2_active(forward_batch)):
        return self._ext_orig_load_batch(forward_batch, **kwargs)
    num_tokens = len(forward_batch.input_ids)
    decision = getattr(forward_batch, "prefill_cp_bucket_decision", None)
    if decision is None or not decision.fits or decision.live_size != num_tokens:
        raise RuntimeError(admission_missing_message(decision, num_tokens))
    token = _EXT_ADMITTED_PREFILL_BUCKET.set((num_tokens, decision.bucket))
    try:
        return self._ext_orig_load_batch(forward_batch, **kwargs)
    finally:
        _EXT_ADMITTED_PREFILL_BUCKET.reset(token)


def admission_missing_message(decision: Optional[BucketDecision], num_tokens: int) -> str:
    prefix = f"Prefill CP CUDA graph replay of a {num_tokens}-token batch "
    if decision is None:
        return (prefix + "has no admission decision: can_run_graph() must admit this forward batch "
                "(and find a bucket with enough CP-local rows) before load_batch()")
    if not decision.fits:
        return (prefix + f"was rejected at admission: no captured bucket has {decision.required} "
                "CP-local rows within the padding limit; it must run eager")
    return (prefix + f"carries a decision made for {decision.live_size} tokens "
            f"(bucket {decision.bucket}); the batch changed after can_run_graph()")


def _pad_to_bucket(raw_size, buckets):
    """Base bucket rounding, except inside a CP load_batch: the admitted bucket."""
    admitted = _EXT_ADMITTED_PREFILL_BUCKET.get()
    if admitted is not None and admitted[0] == raw_size:
        return admitted[1]
    return BaseCudaGraphRunner._pad_to_bucket(raw_size, buckets)


def capture_one_shape(self, size, **kwargs):
    # 0.5.17 sets enable_cp_v2_bcg_capture only with a BreakableCudaGraphBackend.
    if not getattr(self, "enable_cp_v2_bcg_capture", False):
        return self._ext_orig_capture_one_shape(size, **kwargs)
    token = _EXT_HOLD_BREAK_INPUTS.set(True)
    try:
        return self._ext_orig_capture_one_shape(size, **kwargs)
    finally:
        _EXT_HOLD_BREAK_INPUTS.reset(token)


def patch_prefill_runner(ctx, module) -> None:
    cls = module.PrefillCudaGraphRunner
    # The replacements call the originals under a distinct name (no closures: adapter rule 3).
    for name in ("can_run_graph", "load_batch", "capture_one_shape"):
        ctx.setattr(cls, f"_ext_orig_{name}", cls.__dict__[name])
    ctx.transplant_method(cls, can_run_graph)
    ctx.transplant_method(cls, load_batch)
    ctx.transplant_method(cls, capture_one_shape)
    ctx.transplant_method(cls, _pad_to_bucket, kind="staticmethod")


# --------------------------------------------------------------------------
# sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph
# --------------------------------------------------------------------------
# `_ext_orig_weak_ref_if_tensor` is set on that module by the part below; the function
# resolves it there, as the same code inside that file would.


def _weak_ref_if_tensor(x):
    """A graph-break input as `eager_on_graph` keeps it: itself inside a CP BCG capture, else 0.5.17's weak view.

    Tuples and lists are copied as 0.5.17 copies them, so a container the model mutates
    after the break never changes what the replay passes.
    """
    if not _EXT_HOLD_BREAK_INPUTS.get():
        return _ext_orig_weak_ref_if_tensor(x)  # noqa: F821
    if isinstance(x, tuple):
        return tuple(_weak_ref_if_tensor(item) for item in x)
    if isinstance(x, list):
        return [_weak_ref_if_tensor(item) for item in x]
    return x


BREAKABLE_CUDA_GRAPH_MODULE = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"


def patch_breakable_cuda_graph(ctx, prefill_runner_module) -> None:
    """Triggered by the prefill runner's import, which has imported the breakable module.

    Not by the breakable module's own import: sglang imports it half-way through
    `sglang.srt.layers.cp`'s import chain, where importing this adapter (it imports
    `sglang.srt.layers.cp.utils`) would be circular.
    """
    module = importlib.import_module(BREAKABLE_CUDA_GRAPH_MODULE)
    ctx.setattr(module, "_ext_orig_weak_ref_if_tensor", module.__dict__["_weak_ref_if_tensor"])
    ctx.transplant_function(module, _weak_ref_if_tensor)
