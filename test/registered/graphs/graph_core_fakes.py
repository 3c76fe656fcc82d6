"""Fakes shared by the graph-core tests; imports nothing heavy so rank subprocesses start fast."""

import random

from sglang_ext.graphs.cache import BoundedGraphCache


class FakeGraph:
    """Records capture/replay/reset like a torch.cuda.CUDAGraph used by a runner."""

    def __init__(self, key, events):
        self.key = key
        self.events = events
        self.replays = 0
        self.resets = 0
        events.append(("capture", key))

    def replay(self):
        assert self.resets == 0, f"replay of reset graph {self.key!r}"
        self.replays += 1

    def reset(self):
        self.resets += 1
        self.events.append(("reset", self.key))


def run_step(cache, key, events, graphs, *, nbytes=0, fail=False):
    """One forward of a runner following the documented get/admit/capture/put protocol."""
    entry = cache.get(key)
    if entry is not None:
        entry.replay()
        return "hit"
    admission = cache.admit(key, expected_bytes=nbytes)
    events.append(("admit", key, admission.name))
    if not admission.capture:
        return admission.name
    if fail:
        cache.fail(key, RuntimeError("capture failed"))
        return "failed"
    graph = FakeGraph(key, events)
    graphs.append(graph)
    if cache.put(key, graph, nbytes=nbytes):
        graph.replay()
        return "captured"
    return "rejected"


def resets_of(events):
    return [e[1] for e in events if e[0] == "reset"]


def rank_log(key_sequence):
    """Run one simulated rank over a key sequence; return its decision/eviction log."""
    events, graphs = [], []
    cache = BoundedGraphCache("rank", 4, max_bytes=300, min_hits=2)
    for key, nbytes in key_sequence:
        run_step(cache, key, events, graphs, nbytes=nbytes)
    return [list(e) for e in events], cache.info().as_dict()


def key_sequence(seed=1234, n=400):
    rng = random.Random(seed)
    keys = [f"layout-{i}" for i in range(12)]
    return [(rng.choice(keys[: rng.choice([4, 12])]), rng.choice([40, 80, 120])) for _ in range(n)]
