"""How a ViT call finds its graph: the key types, and the mode (layout, class or bucket) resolved once per runner.
A key says what a graph bakes in: token count and, per attention kind, sequence slots and max_seqlen bound.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Tuple

from sglang_ext.graphs.buckets import geometric_buckets, select_bucket
from sglang_ext.graphs.keys import cpu_ints
from sglang_ext.graphs.packing import sequences_between

logger = logging.getLogger("sglang_ext.vit_cuda_graph")

# Backends whose kernels read max_seqlen only as a bound and skip empty sequences: class / bucket modes need them.
CLASS_BACKENDS = ("triton_attn", "fa3", "fa4")
# In multiples of one Qwen2.5-VL attention window (scripts/sim_vit_keys.py: least padding among 16-size ladders).
DEFAULT_BUCKETS = dict(smallest=512, ratio=1.26, multiple=64)
DEFAULT_LARGEST = 16384  # the ladder's top when no server limit is known
BUCKET_SEQUENCES = 36  # full-attention sequence slots of every budget graph; a call with more is chunked
# Window slots per budget token, 1 / (this * merge unit): a window holds at least 4 merge units for
# images of the processors' minimum size (56 px), and padding windows are window-sized.
TOKENS_PER_WINDOW_UNIT = 4

Boundaries = Optional[Tuple[int, ...]]


def max_len(layout):
    """Longest sequence of a cumulative layout (0 for an empty one)."""
    return max((b - a for a, b in zip(layout, layout[1:])), default=0) if layout else 0


def _pow2(value):
    return 1 << max(0, int(value) - 1).bit_length()


@dataclass(frozen=True)
class LayoutKey:
    """A call's attention layout as CPU ints (window None for towers without windows); layout mode's key."""

    num_tokens: int
    full: Boundaries
    window: Boundaries = None
    full_slots = property(lambda self: len(self.full) - 1)
    full_bound = property(lambda self: max_len(self.full))
    window_slots = property(lambda self: None if self.window is None else len(self.window) - 1)
    window_bound = property(lambda self: max_len(self.window))

    def between(self, start, end):
        """The layout of tokens [start, end), cut at sequence boundaries both layouts share."""
        window = None if self.window is None else sequences_between(self.window, start, end)
        return LayoutKey(end - start, sequences_between(self.full, start, end), window)


def layout_key(num_tokens, cu_seqlens, cu_window_seqlens, attention_layout_key=None):
    """The call's LayoutKey from `attention_layout_key` or CPU boundaries (a device tensor raises DeviceSyncError)."""
    if attention_layout_key is None:
        if cu_seqlens is None and cu_window_seqlens is None:
            return None
        attention_layout_key = tuple(None if v is None else cpu_ints(v, field=name) for v, name in (
            (cu_seqlens, "cu_seqlens"), (cu_window_seqlens, "cu_window_seqlens")))
    full, window = attention_layout_key
    return LayoutKey(int(num_tokens), None if full is None else tuple(int(v) for v in full),
                     None if window is None else tuple(int(v) for v in window))


@dataclass(frozen=True)
class ClassKey:
    """Class mode: one graph per token count and power-of-two classes of sequence count and longest sequence."""

    num_tokens: int
    full_slots: int
    full_bound: int
    window_slots: Optional[int] = None
    window_bound: Optional[int] = None


@dataclass(frozen=True)
class BudgetKey(ClassKey):
    """Bucket mode: one graph per token budget, with room for any padded call that fits its slots."""


class LayoutKeys:
    """'layout': one graph per exact layout, its boundaries written once at capture."""

    name = "layout"

    def key(self, layout):
        return layout


class ClassKeys:
    """'class': kernels read max_seqlen only as a bound, so a replay equals eager bit for bit."""

    name = "class"

    def key(self, layout):
        tokens = layout.num_tokens

        def size_class(bounds):
            if bounds is None:
                return (None, None)
            return (_pow2(max(len(bounds) - 1, 1)), min(_pow2(max(max_len(bounds), 1)), max(tokens, 1)))

        return ClassKey(tokens, *size_class(layout.full), *size_class(layout.window))


def token_buckets(configured, unit, largest=None):
    """The candidate ladder (`configured`, else the default up to `largest` tokens): sizes the merge unit divides."""
    buckets = configured or geometric_buckets(
        largest=max(largest or DEFAULT_LARGEST, DEFAULT_BUCKETS["smallest"]), **DEFAULT_BUCKETS)
    return tuple(b for b in buckets if b % unit == 0)


def window_tokens(vit):
    """Tokens in one full attention window of a windowed tower (Qwen2.5-VL: 112 px -> 64), else None."""
    try:
        side = int(vit.window_size) // int(vit.spatial_merge_size) // int(vit.patch_size)
        return side * side * int(vit.spatial_merge_unit)
    except (AttributeError, TypeError, ValueError):
        return None


def padded_layout(layout, real_tokens, bucket, chunk):
    """`layout` plus padding sequences covering [real_tokens, bucket), none longer than `chunk`."""
    if layout is None:
        return None
    padding = (*range(real_tokens + chunk, bucket, chunk), bucket) if real_tokens < bucket else ()
    return tuple(layout) + padding


class BudgetLadder:
    """'bucket': a call padded to the smallest budget graph that fits (equal to eager within bf16 rounding)."""

    name = "bucket"
    replay_limit = property(lambda self: self.budgets[-1] if self.budgets else 0)  # calls up to this many replay

    def __init__(self, configured, merge_unit, window_tokens_, replay_max_tokens, above_ladder):
        self.configured = tuple(configured)
        self.merge_unit = merge_unit
        self.window_tokens = window_tokens_
        self.window_chunk = max(window_tokens_ or 0, merge_unit)  # a padding window: a full one, >= one merge unit
        self.replay_max_tokens = replay_max_tokens  # -1: the probe decides
        self.above_ladder = above_ladder
        self.budgets = token_buckets(self.configured, merge_unit)  # the captured ladder, once decided
        self.split_above_limit = True  # above the limit: chunks that replay (else one eager call)
        self.decided = False
        self.gate = []  # the load-time probe: one row per budget measured

    def key(self, layout):
        tokens = layout.num_tokens
        window = (None, None)
        if layout.window is not None:
            smallest = min(TOKENS_PER_WINDOW_UNIT * self.merge_unit, self.window_tokens or self.merge_unit)
            window = (tokens // max(smallest, self.merge_unit) + 2, self.window_chunk)
        return BudgetKey(tokens, BUCKET_SEQUENCES, max(tokens, 1), *window)

    def decide(self, captured, probed):
        """Above the probe's break-even a call runs as one eager call (unless vit_graph_above_ladder says split);
        above a limit set by the knob or a capacity / byte cut graphs still win, so it is split into chunks."""
        self.decided = True
        self.budgets = tuple(sorted(captured))
        self.split_above_limit = (self.replay_max_tokens >= 0 or len(captured) < len(probed)
                                  or self.above_ladder == "split")

    def synthetic(self, tokens, windowed):
        return LayoutKey(tokens, (0, tokens), padded_layout((0,), 0, tokens, self.window_chunk) if windowed else None)

    def plan(self, layout):
        """(budget key, padded layout) of the budget this call fits, or None; padding rows are their own sequences."""
        tokens = layout.num_tokens
        if tokens % self.merge_unit or tokens > self.replay_limit:
            return None
        bucket = select_bucket(tokens, self.budgets, max_padding_factor=float("inf")).bucket
        if bucket is None:
            return None
        padded = LayoutKey(bucket, padded_layout(layout.full, tokens, bucket, bucket),
                           padded_layout(layout.window, tokens, bucket, self.window_chunk))
        key = self.key(padded)
        fits = padded.full is not None and padded.full_slots <= key.full_slots and (padded.window is None or (
            padded.window_slots <= key.window_slots and padded.window_bound <= key.window_bound))
        return (key, padded) if fits else None


def resolve(options, backend, merge_unit, window_tokens_):
    """The strategy `options.mode` names where the attention backend allows it, else layout keys."""
    mode = options.mode
    if mode != "layout" and backend not in CLASS_BACKENDS:
        logger.warning("--ext-vit-graph-mode %s needs one of the vision attention backends %s; this tower uses %s, "
                       "so its graphs are keyed by exact layout", mode, "/".join(CLASS_BACKENDS), backend)
        mode = "layout"
    if mode == "layout":
        return LayoutKeys()
    if mode == "class":
        return ClassKeys()
    ladder = BudgetLadder(options.token_buckets, merge_unit, window_tokens_, options.replay_max_tokens,
                          options.above_ladder)
    if not ladder.budgets:
        logger.warning("--ext-vit-graph-token-buckets: no size is a multiple of this tower's merge unit %d, so "
                       "bucket mode pads nothing (every call runs eager)", merge_unit)
    return ladder
