"""Capture a graph on every tensor-parallel rank or on none, without a rank left waiting.

`prepare()` is rank-local (buffers, a warm-up with local stand-ins for collectives); `capture()`
records collectives but executes none, so a rank that fails half-way leaves no peer waiting.
`agreed_capture` votes after each, so every rank runs the same votes ([1] or [1, 2]) and takes
the same decision. A vote is a MIN all-reduce of `OK` / `TRANSIENT` / `PERMANENT` over a CPU
(gloo) group: the worst outcome wins, so ranks also agree on whether to retry. Hits, replays and
misses that are not admitted never vote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_ext.graphs.cache import is_transient_failure

# Vote values: the MIN over ranks is the agreed outcome.
PERMANENT = 0
TRANSIENT = 1
OK = 2

Vote = Callable[[int], int]


def local_vote(value: int) -> int:
    """The vote of a world of one (or of a rank-local encoder)."""
    return value


def cpu_group_vote(cpu_group: Any) -> Vote:
    """A vote over `cpu_group` (a gloo process group): one MIN all-reduce of one int32."""

    def vote(value: int) -> int:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(value)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
        return int(flag.item())

    return vote


def failure_vote(exc: Optional[BaseException]) -> int:
    if exc is None:
        return OK
    return TRANSIENT if is_transient_failure(exc) else PERMANENT


class DeclinedByPeer(RuntimeError):
    """Another rank failed this capture; this rank drops its part too."""

    def __init__(self, stage: str, transient: bool):
        super().__init__(f"graph capture {stage} failed on another rank "
                         f"({'transient: retried later' if transient else 'permanent'})")
        self.stage = stage
        self.transient = transient


@dataclass
class Outcome:
    """What all ranks agreed: `ok`, else the failure (local or a peer's) and its class."""

    ok: bool
    stage: str = ""  # "prepare" or "capture" when not ok
    transient: bool = False
    error: Optional[BaseException] = None  # this rank's own error, or DeclinedByPeer
    votes: int = 0


def agreed_capture(vote: Vote, prepare: Callable[[], Any], capture: Callable[[], Any],
                   discard: Callable[[], None]) -> Outcome:
    """Run `prepare()`, vote, `capture()`, vote; on an agreed failure `discard()` (exceptions are returned)."""
    votes = 0
    for stage, step in (("prepare", prepare), ("capture", capture)):
        error: Optional[BaseException] = None
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - voted on, returned to the caller
            error = exc
        agreed = vote(failure_vote(error))
        votes += 1
        if agreed != OK:
            discard()
            transient = agreed == TRANSIENT
            if error is None:
                error = DeclinedByPeer(stage, transient)
            return Outcome(False, stage, transient, error, votes)
    return Outcome(True, votes=votes)
