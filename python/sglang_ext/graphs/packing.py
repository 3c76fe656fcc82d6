"""Split one encoder call into chunks of whole attention sequences (cut where every layout has a boundary, a
call encodes piece by piece), and time graph against eager. No torch at import.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple


def sequences_between(layout: Sequence[int], start: int, end: int) -> Tuple[int, ...]:
    """The boundaries of `layout` within [start, end], shifted so the piece starts at 0."""
    return tuple(int(v) - start for v in layout if start <= int(v) <= end)


def whole_sequence_chunks(layouts: Sequence[Optional[Sequence[int]]], total: int, max_tokens: int,
                          max_sequences: int) -> List[Tuple[int, int]]:
    """Token ranges [start, end) covering [0, total), cut only at boundaries all `layouts` share, each with as many
    whole sequences as fit (greedy); a sequence too large alone is its own range."""
    if max_tokens < 1 or max_sequences < 1:
        raise ValueError(f"max_tokens/max_sequences: {max_tokens}/{max_sequences}; allowed: integers >= 1")
    present = [set(int(v) for v in layout) for layout in layouts if layout is not None]
    shared = set.intersection(*present) if present else set()
    cuts = sorted(c for c in shared if 0 < c < total) + [total]
    full = layouts[0]

    def fits(start: int, end: int) -> bool:  # (empty sequences count too)
        return end - start <= max_tokens and (
            full is None or len(sequences_between(full, start, end)) - 1 <= max_sequences)

    ranges: List[Tuple[int, int]] = []
    start, last_fit = 0, None
    for cut in cuts:
        if fits(start, cut):
            last_fit = cut
            continue
        if last_fit is not None:  # close the range at the last cut that fit, then try again from there
            ranges.append((start, last_fit))
            start, last_fit = last_fit, None
            if fits(start, cut):
                last_fit = cut
                continue
        ranges.append((start, cut))  # one sequence alone is too large
        start = cut
    if start < total:
        ranges.append((start, total))
    return ranges


def median_wall_ms(run: Callable[[], Any], *, repeats: int = 5, synchronize: Optional[Callable[[], Any]] = None
                   ) -> float:
    """Median wall (not device: launches are what a graph saves) time of `run()` in ms, after a warm-up."""
    sync = synchronize or (lambda: None)
    times = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
