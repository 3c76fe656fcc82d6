"""Every tensor-parallel rank takes the same decision, and none is left waiting.
A rank-local step that may fail runs through `agreed`: every rank votes once whatever happened locally, a MIN
all-reduce over a CPU (gloo) group, so the worst outcome wins and ranks also agree on whether to retry.
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


def cpu_group_min(cpu_group: Any, value: int, bits: int = 32) -> int:
    """MIN of `value` over `cpu_group` (a gloo process group): one all-reduce of one int."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([int(value)], dtype=torch.int64 if bits == 64 else torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return int(flag.item())


def failure_vote(exc: Optional[BaseException]) -> int:
    if exc is None:
        return OK
    return TRANSIENT if is_transient_failure(exc) else PERMANENT


class DeclinedByPeer(RuntimeError):
    """Another rank failed this step; this rank drops its part too."""

    def __init__(self, stage: str, transient: bool):
        super().__init__(f"graph {stage} failed on another rank "
                         f"({'transient: retried later' if transient else 'permanent'})")


@dataclass
class Outcome:
    """What all ranks agreed: `ok` (with the step's `value`), else the failure (local or a peer's) and its class."""

    ok: bool
    transient: bool = False
    error: Optional[BaseException] = None  # this rank's own error, or DeclinedByPeer
    value: Any = None

    @property
    def where(self) -> str:
        return "another rank" if isinstance(self.error, DeclinedByPeer) else "this rank"


def agreed(vote: Vote, step: Callable[[], Any], stage: str) -> Outcome:
    """Run `step()` here, then vote on how it went: one vote on every rank (exceptions are returned, not raised)."""
    error: Optional[BaseException] = None
    value = None
    try:
        value = step()
    except Exception as exc:  # noqa: BLE001 - voted on, returned to the caller
        error = exc
    agreed = vote(failure_vote(error))
    if agreed != OK:
        transient = agreed == TRANSIENT
        return Outcome(False, transient, error or DeclinedByPeer(stage, transient))
    return Outcome(True, value=value)


def agreed_capture(vote: Vote, prepare: Callable[[], Any], capture: Callable[[], Any],
                   discard: Callable[[], None]) -> Outcome:
    """Run `prepare()`, vote, `capture()`, vote; on an agreed failure `discard()` (exceptions are returned)."""
    for stage, step in (("prepare", prepare), ("capture", capture)):
        outcome = agreed(vote, step, stage)
        if not outcome.ok:
            discard()
            return outcome
    return Outcome(True)
