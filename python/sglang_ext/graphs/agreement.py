"""Capture a graph on every tensor-parallel rank or on none, without a rank left waiting.

A capture under tensor parallelism has two kinds of stage:
- rank-local ones, which run no collective: admission, the backend check, allocation of
  the graph's buffers, and a warm-up whose collectives are local stand-ins;
- the capture, which *records* the graph's collectives but executes none of them, so a
  rank whose capture raises half-way leaves no peer waiting in one.

`agreed_capture` runs them in that order with exactly two votes in between, whatever
fails where:

    prepare()   -> vote 1 (did every rank prepare?)   -> no: all ranks stop here
    capture()   -> vote 2 (did every rank capture?)   -> no: all ranks drop the graph

Every rank therefore executes the same sequence of votes ([1] or [1, 2]) and takes the
same decision. A vote is a MIN all-reduce of a small int (`OK`, `TRANSIENT`,
`PERMANENT`) over a CPU group (gloo), injected by the caller; the worst outcome wins,
so all ranks also agree on whether the failure may be retried (the cache's backoff
then stays in lockstep). Hits and replays vote never; a miss that is not admitted
votes never (admission depends only on the call sequence, identical on every rank).

No torch at import; `cpu_group_vote` imports it when called.
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
    """Run `prepare()` (rank-local), vote, `capture()` (records collectives only), vote.

    `discard()` undoes whatever `prepare`/`capture` left when the agreed outcome is a
    failure (this rank's or a peer's); its own errors propagate. Exceptions of
    `prepare`/`capture` are caught and voted on, never raised: the caller reads them
    from the outcome and runs the batch eager.
    """
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
