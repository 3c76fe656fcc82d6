"""Prefill context-parallel graph bucket chosen by CP-local capacity, once per batch.

Patch: prefill_cp_bucket
Targets: sglang.srt.layers.cp.bcg.bcg:PrefillCPBCGInput,
sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.can_run_graph,
sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.load_batch,
sglang.srt.model_executor.runner.prefill_cuda_graph_runner:PrefillCudaGraphRunner.capture_one_shape,
sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph:_weak_ref_if_tensor
Upstream PR: sgl-project/sglang#33906
Retire when: upstream stores the admitted bucket with the batch instead of recomputing it at replay and holds
breakable-graph break inputs strongly (#37448)

Releases: 0.5.17 (the bucket search backported), 0.5.23.
Why: with CP (zigzag) and breakable graphs, a batch can need more CP-local rows than the bucket
0.5.17 pads it to: the replay raises. 0.5.23 searches, but twice (admission, replay: a mismatch
kills the request) with an O(bs*cp) loop. Break inputs are held weakly, so later captures reuse them.
How: `PrefillCPBCGInput` gains a closed-form zigzag requirement and the bucket search; `can_run_graph`
decides once, on the forward batch; `load_batch` pads to exactly that bucket (a ContextVar read by a
`_pad_to_bucket` override on 0.5.17, by `select_replay_bucket_for_batch` on 0.5.23); CP captures hold
their break inputs strongly.
"""

from __future__ import annotations

import bisect
import contextvars
import functools
import importlib
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence

from torch.utils.weak import WeakIdKeyDictionary

from sglang.srt.layers.cp.base import get_cp_strategy
from sglang.srt.layers.cp import padding as cp_padding
from sglang.srt.layers.cp import utils as cp_utils
from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy

from sglang_ext.graphs import stats as ext_graph_stats
from sglang_ext.graphs.buckets import BucketDecision, select_bucket

PREFILL_CP_BUCKET_STATS_NAME = "prefill_cp_bucket"  # the counters' name in stats snapshots

# 0.5.17's names: is_cp_v2_active, enable_cp_v2_bcg_capture (renamed in 0.5.20)
is_cp_active = getattr(cp_utils, "is_cp_active", None) or cp_utils.is_cp_v2_active


def cp_bcg_captured(runner) -> bool:
    return bool(getattr(runner, "enable_cp_bcg_capture", False) or getattr(runner, "enable_cp_v2_bcg_capture", False))


# True while PrefillCudaGraphRunner.capture_one_shape captures a CP BCG prefill bucket.
_EXT_HOLD_BREAK_INPUTS = contextvars.ContextVar("sglang_ext_hold_break_inputs", default=False)
# (live tokens, admitted bucket) while PrefillCudaGraphRunner.load_batch runs a CP batch.
_EXT_ADMITTED_PREFILL_BUCKET = contextvars.ContextVar("sglang_ext_admitted_prefill_bucket", default=None)


def zigzag_required_local_rows(extend_seq_lens: Sequence[Any], cp_size: int, align_size: int) -> int:
    """Aligned CP-local rows the busiest rank needs for this zigzag layout.

    Each request is cut into 2*cp blocks of `base` rows, the first `rem` blocks one row longer;
    rank r owns blocks r and 2*cp-1-r, so it holds 2*sum(base) + #(rem > r) + #(rem > 2*cp-1-r).
    """
    lengths = [int(length) for length in extend_seq_lens]  # a list, CPU tensor or array
    segments = 2 * cp_size
    remainders = sorted(length % segments for length in lengths)
    total_base = (sum(lengths) - sum(remainders)) // segments
    both = 2 * len(remainders)
    busiest = max(
        both - bisect.bisect_right(remainders, rank) - bisect.bisect_right(remainders, segments - 1 - rank)
        for rank in range(cp_size)
    )
    needed = 2 * total_base + busiest
    return int((needed + align_size - 1) // align_size * align_size)


def select_fitting_bucket(bucket_local_tokens: Dict[int, int], num_tokens: int, required: int,
                          capture_num_tokens: Sequence[int], max_padding_factor: float) -> BucketDecision:
    """`select_bucket` over just the captured buckets the padding factor allows (O(window) per batch)."""
    lo = bisect.bisect_left(capture_num_tokens, num_tokens)
    hi = bisect.bisect_right(capture_num_tokens, num_tokens * max_padding_factor)
    return select_bucket(num_tokens, capture_num_tokens[lo:hi], max_padding_factor=max_padding_factor,
                         capacity=bucket_local_tokens, required=required)


def zigzag_required_local_tokens(upstream):
    """`required_local_tokens`: aligned CP-local rows a live zigzag layout needs (max over ranks);
    another strategy's from `upstream` (0.5.23's own method; None on 0.5.17: unknown)."""

    def required_local_tokens(self, extend_seq_lens: Any) -> Optional[int]:
        strategy = get_cp_strategy()
        if isinstance(strategy, ZigzagCPStrategy) and extend_seq_lens is not None:
            return zigzag_required_local_rows(extend_seq_lens, strategy.cp_size,
                                              cp_padding.get_cp_padding_align_size())
        return None if upstream is None else upstream(self, extend_seq_lens)

    return required_local_tokens


def replay_bucket_decision(self, *, num_tokens: int, extend_seq_lens: Any, capture_num_tokens: Sequence[int],
                           max_padding_factor: float) -> Optional[BucketDecision]:
    """The whole decision for one batch; None when the layout's requirement is unknown."""
    required = self.required_local_tokens(extend_seq_lens)
    if required is None:
        return None
    return select_fitting_bucket(self.bucket_local_tokens, num_tokens, required, capture_num_tokens, max_padding_factor)


def select_replay_bucket(self, *, num_tokens: int, required_local_tokens: int, capture_num_tokens: Sequence[int],
                         max_padding_factor: float) -> Optional[int]:
    """Smallest captured global bucket within the padding factor whose CP-local rows fit."""
    return select_fitting_bucket(self.bucket_local_tokens, num_tokens, required_local_tokens, capture_num_tokens,
                                 max_padding_factor).bucket


def select_replay_bucket_for_batch(self, *, num_tokens: int, extend_seq_lens: Any,
                                   capture_num_tokens: Sequence[int], max_padding_factor: float) -> Optional[int]:
    """`select_replay_bucket` for a batch's extend lengths; None -> run eager. Inside the runner's
    can_run_graph / load_batch (0.5.23 asks here in both): the one decision made for the batch."""
    admitted = _EXT_ADMITTED_PREFILL_BUCKET.get()
    if admitted is not None and admitted[0] == num_tokens:
        return admitted[1]
    decision = self.replay_bucket_decision(num_tokens=num_tokens, extend_seq_lens=extend_seq_lens,
                                           capture_num_tokens=capture_num_tokens, max_padding_factor=max_padding_factor)
    return None if decision is None else decision.bucket


def patch_bcg(ctx, module) -> None:
    cls = module.PrefillCPBCGInput
    upstream = cls.__dict__.get("required_local_tokens")  # 0.5.23: kept for strategies other than zigzag
    for fn in (zigzag_required_local_tokens(upstream), replay_bucket_decision, select_replay_bucket,
               select_replay_bucket_for_batch):
        ctx.setattr(cls, fn.__name__, fn)


@dataclass
class PrefillCPBucketCounters:
    """What the CP bucket search did in one runner (see `sglang_ext.graphs.stats`)."""

    admitted: int = 0
    admitted_larger_bucket: int = 0  # the smallest bucket >= live tokens lacked CP-local rows
    rejected_no_fit: int = 0
    rejected_unknown_layout: int = 0  # non-zigzag strategy or no CPU extend lengths
    padding_rows_added: int = 0  # beyond what the smallest bucket >= live tokens would have padded
    padding_rows_total: int = 0
    stats_name: str = ""  # set on registration; the stats registry may add a suffix

    def as_dict(self) -> Dict[str, int]:
        return {name: value for name, value in vars(self).items() if name != "stats_name"}


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


def runner_methods(upstream: Dict[str, Any]) -> Dict[str, Any]:
    """`can_run_graph`, `load_batch`, `capture_one_shape` over sglang's (`upstream`, by name): the CP
    decision is made once in can_run_graph, load_batch replays exactly that bucket (or refuses), and a
    CP capture holds its break inputs."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR

    decisions = WeakIdKeyDictionary()  # forward batch -> the decision can_run_graph made for it (load_batch's)
    # Each runner's counters, registered for stats (owner: they leave with the runner) on its first CP
    # decision; per activation of the patch, so a new activation starts from zero.
    by_runner: "weakref.WeakKeyDictionary[Any, PrefillCPBucketCounters]" = weakref.WeakKeyDictionary()

    def counters_of(runner) -> PrefillCPBucketCounters:
        counters = by_runner.get(runner)
        if counters is None:
            counters = by_runner[runner] = PrefillCPBucketCounters()
            counters.stats_name = ext_graph_stats.register(PREFILL_CP_BUCKET_STATS_NAME, counters.as_dict, owner=runner)
        return counters

    @functools.wraps(upstream["can_run_graph"])
    def can_run_graph(self, forward_batch) -> bool:
        if not (cp_bcg_captured(self) and is_cp_active(forward_batch)):
            return upstream["can_run_graph"](self, forward_batch)
        assert self.prefill_cp_bcg_input is not None
        num_tokens = len(forward_batch.input_ids)
        decision = self.prefill_cp_bcg_input.replay_bucket_decision(
            num_tokens=num_tokens, extend_seq_lens=forward_batch.extend_seq_lens_cpu,
            capture_num_tokens=self.capture_num_tokens, max_padding_factor=_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR)
        # 0.5.23's can_run_graph asks select_replay_bucket_for_batch itself: it gets this decision.
        token = _EXT_ADMITTED_PREFILL_BUCKET.set((num_tokens, decision.bucket if decision is not None else None))
        try:
            admitted = upstream["can_run_graph"](self, forward_batch)
        finally:
            _EXT_ADMITTED_PREFILL_BUCKET.reset(token)
        no_bucket = decision is None or not decision.fits  # 0.5.23's own check rejects these too
        if admitted or no_bucket:
            record_bucket_decision(counters_of(self), decision, self.capture_num_tokens)
        decisions[forward_batch] = decision if admitted or no_bucket else None
        return admitted and not no_bucket

    @functools.wraps(upstream["load_batch"])
    def load_batch(self, forward_batch, **kwargs):
        if not (cp_bcg_captured(self) and is_cp_active(forward_batch)):
            return upstream["load_batch"](self, forward_batch, **kwargs)
        num_tokens = len(forward_batch.input_ids)
        decision = decisions.get(forward_batch)
        if decision is None or not decision.fits or decision.live_size != num_tokens:
            raise RuntimeError(admission_missing_message(decision, num_tokens))
        token = _EXT_ADMITTED_PREFILL_BUCKET.set((num_tokens, decision.bucket))
        try:
            return upstream["load_batch"](self, forward_batch, **kwargs)
        finally:
            _EXT_ADMITTED_PREFILL_BUCKET.reset(token)

    @functools.wraps(upstream["capture_one_shape"])
    def capture_one_shape(self, size, **kwargs):
        if not cp_bcg_captured(self):  # set only with a BreakableCudaGraphBackend
            return upstream["capture_one_shape"](self, size, **kwargs)
        token = _EXT_HOLD_BREAK_INPUTS.set(True)
        try:
            return upstream["capture_one_shape"](self, size, **kwargs)
        finally:
            _EXT_HOLD_BREAK_INPUTS.reset(token)

    # doctor and tests read a runner's counters, and a batch's decision, through the class
    can_run_graph.counters_of, can_run_graph.decision_of = counters_of, decisions.get
    return {"can_run_graph": can_run_graph, "load_batch": load_batch, "capture_one_shape": capture_one_shape}


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
    if admitted is not None and admitted[0] == raw_size and admitted[1] is not None:
        return admitted[1]
    from sglang.srt.model_executor.runner.base_cuda_graph_runner import BaseCudaGraphRunner

    return BaseCudaGraphRunner._pad_to_bucket(raw_size, buckets)


def patch_prefill_runner(ctx, module) -> None:
    cls = module.PrefillCudaGraphRunner
    methods = runner_methods({n: cls.__dict__[n] for n in ("can_run_graph", "load_batch", "capture_one_shape")})
    for name, fn in methods.items():
        ctx.setattr(cls, name, fn)
    ctx.setattr(cls, "_pad_to_bucket", staticmethod(_pad_to_bucket))


def held_break_inputs(weak_ref_if_tensor):
    """`_weak_ref_if_tensor`: a graph-break input as `eager_on_graph` keeps it: itself inside a CP BCG
    capture (containers copied, as sglang copies them), else sglang's weak view."""

    @functools.wraps(weak_ref_if_tensor)
    def _weak_ref_if_tensor(x):
        if not _EXT_HOLD_BREAK_INPUTS.get():
            return weak_ref_if_tensor(x)
        if isinstance(x, tuple):
            return tuple(_weak_ref_if_tensor(item) for item in x)
        if isinstance(x, list):
            return [_weak_ref_if_tensor(item) for item in x]
        return x

    return _weak_ref_if_tensor


def patch_breakable_cuda_graph(ctx, prefill_runner_module) -> None:
    """Triggered by the prefill runner's import, not the breakable module's own: sglang imports that
    half-way through `sglang.srt.layers.cp`'s import chain, where importing this adapter is circular."""
    module = importlib.import_module(
        "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph")
    ctx.setattr(module, "_weak_ref_if_tensor", held_break_inputs(module.__dict__["_weak_ref_if_tensor"]))
