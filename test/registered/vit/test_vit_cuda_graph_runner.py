"""ViT CUDA-graph runner on sglang 0.5.17 and 0.5.23 (patch vit_cuda_graph), on CPU.

Of upstream's unit test (`test/registered/unit/multimodal/test_vit_cuda_graph_runner.py`,
sgl-project/sglang#37043) the key and rotary-workspace cases run here on the patch's key types and
leased workspaces;
its TP capture-context cases tested 0.5.17's `_capture_context()`, which the patch never enters,
and are replaced by what the patch does instead (DP: no TP communication at all; TP: two CPU-group
votes, outside that context); its backend-name case tested upstream's untouched `__init__` and is
left out. Every runner is the class activation installs (a subclass of sglang's real
`ViTCudaGraphRunner`, its engine in `runner.engine`). Most tests drive the engine's
capture/replay code with a recording fake of `torch.cuda.CUDAGraph` /
`torch.cuda.graph`: a stub block registers a "kernel" (a thunk that recomputes its
output IN PLACE from the tensors it was captured with) on the graph being captured,
and `replay()` runs those thunks. So a replay sees exactly what a CUDA graph would:
the captured tensor objects, whatever they now contain. The stub block's output
depends on the sequence boundaries, the rotary values and (checked) max_seqlen.
"""

from __future__ import annotations

import contextlib
import logging
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

import sglang.srt.multimodal.vit_cuda_graph_runner as runner_module

from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)
from sglang_ext.registry import PATCH_NAMES
from sglang_ext_testkit import internals

THIS_PATCH = "vit_cuda_graph"
vit_runner = ext_core("vit.runner")  # the patch's modules (the plugin's, or the patched tree's copies)
vit_tp = ext_core("vit.tp")
vit_strategy = ext_core("vit.strategy")


def stats_snapshot():
    """The graph-stats registry the patched runner reports to (sglang_ext's, or the patched tree's copy)."""
    return ext_core("graphs.stats").snapshot()


@pytest.fixture
def vit_patch(ext_patches):
    """Activate only this patch (strict, real activation path); returns activate(**knobs)."""

    def activate(**knobs):
        knobs.setdefault("vit_graph_mode", "layout")  # the tests of the per-layout machinery; bucket tests say so
        statuses = ext_patches(disable=",".join(n for n in PATCH_NAMES if n != THIS_PATCH), **knobs)
        if statuses:  # plugin mode (the patched tree returns {})
            assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
        return statuses

    return activate


# ---------------------------------------------------------------------------
# Keys and the rotary workspace (upstream's cases, on the patch's key and workspace types)
# ---------------------------------------------------------------------------


def layout_key(tokens, cu_seqlens, cu_window_seqlens, attention_layout_key=None):
    return vit_strategy.layout_key(tokens, cu_seqlens, cu_window_seqlens, attention_layout_key)


def test_graph_key_tells_full_and_window_boundaries_apart(vit_patch):
    """From CPU tensors (no attention_layout_key) as from the key: each part of the layout counts."""
    key = layout_key(8, torch.tensor([0, 4, 8]), torch.tensor([0, 2, 4, 8]))
    assert key != layout_key(8, torch.tensor([0, 4, 8]), torch.tensor([0, 4, 6, 8]))  # other windows
    assert key != layout_key(8, torch.tensor([0, 2, 8]), torch.tensor([0, 2, 4, 8]))  # other full
    assert key == layout_key(8, None, None, attention_layout_key=((0, 4, 8), (0, 2, 4, 8)))
    assert (key.full, key.window, key.full_slots, key.full_bound, key.window_slots, key.window_bound) == (
        (0, 4, 8), (0, 2, 4, 8), 2, 4, 3, 4)


def test_vit_graph_keeps_rotary_workspace_address_after_growth(vit_patch, fake_cuda):
    """A graph's rotary buffers never move when a larger graph grows the workspace (leased slices)."""
    vit_patch()
    runner = new_runner(StubTower(fullatt=()))
    call(runner, 4, (0, 4))
    small = graphs(runner)[key_of(runner, 4)].rotary[0].data_ptr()
    call(runner, 16, (0, 16))
    call(runner, 4, (0, 4))
    assert graphs(runner)[key_of(runner, 4)].rotary[0].data_ptr() == small
    assert runner.engine.store.retired_rotary_buffers() == 1


def test_a_call_without_boundaries_has_no_layout_key():
    """Upstream keys by token count alone (its NPU subclass, which stays sglang's, still does); the patch's
    keys need boundaries, so a call without any gets no key (it runs eager)."""
    assert layout_key(12, None, None) is None


def test_graph_key_refuses_device_boundaries_instead_of_syncing(vit_patch):
    on_device = torch.tensor([0, 4, 8], device="meta")
    with pytest.raises(ValueError, match="cu_seqlens: a meta tensor would force a device sync") as refused:
        layout_key(8, on_device, None)
    assert type(refused.value).__name__ == "DeviceSyncError"
    # An explicit CPU layout key needs no tensor read at all.
    by_key = layout_key(8, on_device, None, attention_layout_key=((0, 4, 8), None))
    assert by_key == layout_key(8, torch.tensor([0, 4, 8]), None)


def test_graph_key_same_tokens_same_layout_is_equal(vit_patch):
    assert layout_key(8, [0, 4, 8], [0, 2, 4, 8]) == layout_key(8, torch.tensor([0, 4, 8], dtype=torch.int32),
                                                                (0, 2, 4, 8))
    assert layout_key(8, [0, 4, 8], None) != layout_key(9, [0, 4, 9], None)


def new_runner(vit):
    """The runner the activation installed: sglang's module attribute, read now (this file imported
    sglang's class before any activation)."""
    return runner_module.ViTCudaGraphRunner(vit)


def graphs(runner):
    """The runner's captured graphs by key (engine.store.graphs)."""
    return runner.engine.store.graphs


def key_of(runner, tokens):
    """The key of the runner's graph of `tokens` tokens."""
    return next(k for k in graphs(runner) if k.num_tokens == tokens)


# ---------------------------------------------------------------------------
# A recording fake of CUDA graphs and a layout-sensitive stub tower
# ---------------------------------------------------------------------------

_CAPTURING: list = [None]


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replays recorded in-place thunks."""

    created: list = []

    def __init__(self):
        self.thunks = []
        self.replays = 0
        self.resets = 0
        self.pool = None
        FakeGraph.created.append(self)

    def replay(self):
        assert self.resets == 0, "replay of a graph that was reset"
        for thunk in self.thunks:
            thunk()
        self.replays += 1

    def reset(self):
        self.resets += 1
        self.thunks = []


@contextlib.contextmanager
def fake_capture(graph, pool=None, **kwargs):
    graph.pool = pool
    _CAPTURING[0] = graph
    try:
        yield
    finally:
        _CAPTURING[0] = None


POOL = (0, 424242)  # a pool handle is a pair of ints, as torch.cuda.graph_pool_handle() returns


class FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA graph API replaced by the recorder; sglang's global graph pool reset after the test.

    The pool counts as pinned already (the pin is a real tiny CUDA graph; the CUDA tests
    cover it), and the core's per-device capture streams start empty.
    """
    from sglang.srt.runtime_context import get_resources

    capture_core = ext_core("graphs.capture")
    FakeGraph.created = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: POOL)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(capture_core, "_capture_streams", {})
    monkeypatch.setattr(capture_core, "_pins", {(0, POOL): ("pinned by the fixture", None)})
    monkeypatch.setattr(get_resources(), "graph_memory_pool", None)
    return FakeGraph


def _layout_compute(x, cu, max_seqlen, pos):
    """Each token gets + (length of its sequence) + its rotary value; checks max_seqlen is an upper bound."""
    seq_lens = cu[1:] - cu[:-1]
    assert int(seq_lens.sum()) == x.shape[0], "boundaries do not cover the tokens"
    assert max_seqlen >= int(seq_lens.max()), f"max_seqlen {max_seqlen} below the real {int(seq_lens.max())}"
    owner_len = torch.repeat_interleave(seq_lens, seq_lens).to(x.dtype)
    return x + owner_len.view(-1, 1, 1) + pos[: x.shape[0], :1].unsqueeze(1)


class LayoutBlock(nn.Module):
    """Graph-mode contract of sglang's vision blocks: list-form cu_seqlens + output_ws, or forward_metadata."""

    def __init__(self, *, accepts_metadata: bool = True, fail_capture: bool = False):
        super().__init__()
        self.attn = SimpleNamespace(num_attention_heads_per_partition=1, head_size=1, qkv_backend_name="triton_attn")
        self.fail_capture = fail_capture
        self.calls = []
        self.forms = []  # (argument form, cu_seqlens tensor, max_seqlen) of every call
        self.rows = []  # x.shape[0] of every call
        if not accepts_metadata:
            self.forward = self._forward_without_metadata

    def _forward_without_metadata(self, x, *, cu_seqlens, position_embeddings=None, rotary_pos_emb_cos=None,
                                  rotary_pos_emb_sin=None, output_ws=None):
        return LayoutBlock.forward(self, x, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                            rotary_pos_emb_cos=rotary_pos_emb_cos, rotary_pos_emb_sin=rotary_pos_emb_sin,
                            output_ws=output_ws)

    def forward(self, x, *, cu_seqlens, position_embeddings=None, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None,
                output_ws=None, forward_metadata=None):
        graph = _CAPTURING[0]
        if graph is not None and self.fail_capture:
            raise RuntimeError("capture failed (test)")
        pos = position_embeddings[0] if position_embeddings is not None else rotary_pos_emb_cos
        self.rows.append(x.shape[0])
        if forward_metadata is not None:
            cu, max_seqlen = forward_metadata.cu_seqlens, forward_metadata.max_seqlen
            self.calls.append("metadata")
            self.forms.append(("metadata", cu, max_seqlen))
        else:
            assert isinstance(cu_seqlens, list) and output_ws is not None, "graph-mode call without graph arguments"
            cu, max_seqlen = cu_seqlens[0], cu_seqlens[-1]
            self.calls.append("capture" if graph is not None else "graph-form")
            self.forms.append((f"list{len(cu_seqlens)}", cu, max_seqlen))
        out = _layout_compute(x, cu, max_seqlen, pos)
        if graph is not None:
            graph.thunks.append(lambda: out.copy_(_layout_compute(x, cu, max_seqlen, pos)))
        return out


class SqueezeMerger(nn.Module):
    def forward(self, x):
        out = x.squeeze(1).clone()
        graph = _CAPTURING[0]
        if graph is not None:
            graph.thunks.append(lambda: out.copy_(x.squeeze(1)))
        return out


class StubTower(nn.Module):
    """Qwen2.5-like when `fullatt` is given (block 0 windowed, block 1 full), else Qwen3-like."""

    def __init__(self, *, fullatt=(1,), use_data_parallel=True, **block_kwargs):
        super().__init__()
        self.blocks = nn.ModuleList([LayoutBlock(**block_kwargs), LayoutBlock(**block_kwargs)])
        self.merger = SqueezeMerger()
        if fullatt:
            self.fullatt_block_indexes = list(fullatt)
        self.use_data_parallel = use_data_parallel
        self.deepstack_visual_indexes = []
        self.deepstack_merger_list = None
        self.max_context_len = None

    device = torch.device("cpu")
    dtype = torch.float32


def reference(tower, x, full, window, pos):
    """What the tower computes, straight (no runner)."""
    y = x.unsqueeze(1)
    for i, _ in enumerate(tower.blocks):
        use_full = not getattr(tower, "fullatt_block_indexes", None) or i in tower.fullatt_block_indexes
        layout = torch.tensor(full if use_full or window is None else window)
        y = _layout_compute(y, layout, 10**9, pos)
    return y.squeeze(1)


def random_layout(rng, total, pieces):
    cuts = sorted(rng.sample(range(1, total), pieces - 1)) if pieces > 1 else []
    return (0, *cuts, total)


def call(runner, tokens, full, window=None, position=0.0, *, with_key=True, qwen3=False):
    """One batch through the runner, as the patched model methods call it; returns (out, expected)."""
    x = torch.arange(tokens, dtype=torch.float32).view(tokens, 1) * 0.5
    pos = torch.full((tokens, 1), float(position))
    kwargs = dict(attention_layout_key=(tuple(full), None if window is None else tuple(window))) if with_key else {}
    cu = torch.tensor(full, dtype=torch.int32)
    cu_window = None if window is None else torch.tensor(window, dtype=torch.int32)
    if qwen3:
        out = runner.run(x=x, cu_seqlens=cu, cu_window_seqlens=None, position_embeddings=None,
                         rotary_pos_emb_cos=pos, rotary_pos_emb_sin=pos, output_indices=None, **kwargs)
    else:
        out = runner.run(x, cu, cu_window, (pos, pos), **kwargs)
    return out, reference(runner.vit, x, full, window, pos)


# ---------------------------------------------------------------------------
# Correctness of capture/replay
# ---------------------------------------------------------------------------


def test_equal_token_count_with_other_boundaries_gets_its_own_graph(vit_patch, fake_cuda):
    vit_patch()
    runner = new_runner(StubTower())
    first, want_first = call(runner, 8, (0, 0, 4, 8), (0, 2, 4, 8), position=1)
    second, want_second = call(runner, 8, (0, 0, 2, 8), (0, 2, 8), position=1)
    again, want_again = call(runner, 8, (0, 0, 4, 8), (0, 2, 4, 8), position=1)
    torch.testing.assert_close(first, want_first)
    torch.testing.assert_close(second, want_second)
    torch.testing.assert_close(again, want_again)
    assert not torch.equal(want_first, want_second)
    assert len(fake_cuda.created) == 2 and fake_cuda.created[0].replays == 2
    assert all(g.pool is POOL for g in fake_cuda.created), "captures must share sglang's global graph pool"


def _qwen2_5_window_layout(grid_thw):
    """sglang 0.5.17's own Qwen2.5-VL window boundaries for `grid_thw` (its `get_window_index`, on
    the attributes it reads: 112 px windows, 14 px patches, 2x2 merge), deduplicated as the tower does."""
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VisionTransformer

    geometry = SimpleNamespace(window_size=112, spatial_merge_size=2, patch_size=14, spatial_merge_unit=4)
    _, cu_window = Qwen2_5_VisionTransformer.get_window_index(geometry, torch.tensor(grid_thw))
    return tuple(torch.unique_consecutive(torch.tensor(cu_window)).tolist())


def test_layout_mode_same_full_layout_other_windows_gets_its_own_graph(vit_patch, fake_cuda):
    """One image with height and width swapped: equal token count and full-attention layout, other
    windows. Layout mode must key on the windows too, else the second replays the first's boundaries."""
    vit_patch(vit_graph_mode="layout")
    runner = new_runner(StubTower())
    full = (0, 0, 240)  # one 12 x 20 (or 20 x 12) patch image; 0.5.17's doubled leading zero
    wide, tall = _qwen2_5_window_layout([[1, 12, 20]]), _qwen2_5_window_layout([[1, 20, 12]])
    assert wide != tall and wide[-1] == tall[-1] == 240
    for step, window in enumerate((wide, tall, wide, tall)):
        out, want = call(runner, 240, full, window, position=step)
        torch.testing.assert_close(out, want, msg=f"step {step}")
    assert len(fake_cuda.created) == 2 and [g.replays for g in fake_cuda.created] == [2, 2]
    assert sorted(graphs(runner)[key].cu_window.tolist() for key in graphs(runner)) == sorted(
        [list(wide), list(tall)])


def test_small_graph_sees_new_positions_after_workspace_growth(vit_patch, fake_cuda):
    """Upstream's metadata scenario: 4 tokens, grow to 8, replay 4 with new positions."""
    vit_patch()
    runner = new_runner(StubTower(fullatt=()))
    first, want = call(runner, 4, (0, 2, 4), position=1)
    torch.testing.assert_close(first, want)
    key_small = next(iter(graphs(runner)))
    small_ptr = graphs(runner)[key_small].rotary[0].data_ptr()
    different, want = call(runner, 4, (0, 1, 4), position=1)
    torch.testing.assert_close(different, want)
    call(runner, 8, (0, 8), position=7)
    after, want = call(runner, 4, (0, 2, 4), position=5)
    torch.testing.assert_close(after, want)
    assert graphs(runner)[key_small].rotary[0].data_ptr() == small_ptr
    assert runner.engine.store.retired_rotary_buffers() == 1  # the 4-token graphs still lease the first buffer


@pytest.mark.parametrize("mode", ["layout", "class"])
def test_graph_and_eager_results_are_identical_over_random_layouts(vit_patch, fake_cuda, mode):
    vit_patch(vit_graph_max_entries=3, vit_graph_mode=mode)
    runner = new_runner(StubTower())
    rng = random.Random(0)
    layouts = []
    for _ in range(6):  # 6 layouts (some with equal token counts) over 3 slots: hits and evictions
        tokens = rng.choice((8, 12))
        layouts.append((tokens, (0,) + random_layout(rng, tokens, rng.randint(1, 3)),
                        random_layout(rng, tokens, rng.randint(1, 4))))
    for step in range(60):
        tokens, full, window = rng.choice(layouts)
        out, want = call(runner, tokens, full, window, position=step)
        torch.testing.assert_close(out, want, msg=f"step {step}")
    info = stats_snapshot()[runner.engine.stats_name]
    assert info["size"] <= 3 and info["hits"] > 0 and info["mode"] == mode
    if mode == "layout":
        assert info["evictions"] > 0


def test_class_mode_shares_one_graph_between_layouts_and_refreshes_boundaries(vit_patch, fake_cuda):
    vit_patch(vit_graph_mode="class")
    runner = new_runner(StubTower())
    a = ((0, 0, 6, 8), (0, 2, 4, 8))  # 3 full / 3 window sequences, longest 6 / 4
    b = ((0, 0, 5, 8), (0, 1, 2, 4, 8))  # 3 / 4 sequences, longest 5 / 4: same class
    for step, (full, window) in enumerate((a, b, a, b)):
        out, want = call(runner, 8, full, window, position=step)
        torch.testing.assert_close(out, want, msg=f"step {step}")
    assert len(fake_cuda.created) == 1 and fake_cuda.created[0].replays == 4
    (key,) = graphs(runner)
    assert graphs(runner)[key].cu_window.tolist() == [0, 1, 2, 4, 8]  # b's boundaries, written for the last replay
    info = runner.engine.info()
    assert (info["captures"], info["hits"], info["mode"]) == (1, 3, "class")


def test_class_mode_pads_unused_sequences_with_zero_length(vit_patch, fake_cuda):
    vit_patch(vit_graph_mode="class")
    runner = new_runner(StubTower(fullatt=()))
    out, want = call(runner, 8, (0, 3, 5, 8), qwen3=True)  # 3 sequences -> class of 4
    torch.testing.assert_close(out, want)
    (key,) = graphs(runner)
    assert graphs(runner)[key].cu_full.tolist() == [0, 3, 5, 8, 8]
    assert graphs(runner)[key].full_lengths.tolist() == [3, 2, 3, 0]
    out, want = call(runner, 8, (0, 1, 8), qwen3=True)  # 2 sequences, longest 7 -> another class
    torch.testing.assert_close(out, want)
    assert len(graphs(runner)) == 2


class PairMerger(nn.Module):
    """A merger with spatial merge unit 2: output row i sums input rows 2i and 2i+1."""

    def forward(self, x):
        out = x.squeeze(1).view(-1, 2, x.shape[-1]).sum(1)
        graph = _CAPTURING[0]
        if graph is not None:
            graph.thunks.append(lambda: out.copy_(x.squeeze(1).view(-1, 2, x.shape[-1]).sum(1)))
        return out


def merged_tower(**kwargs):
    tower = StubTower(**kwargs)
    tower.merger = PairMerger()
    tower.spatial_merge_unit = 2
    return tower


def merged_reference(tower, x, full, window, pos):
    y = reference(tower, x, full, window, pos)
    return y.view(-1, 2, y.shape[-1]).sum(1)


# ---------------------------------------------------------------------------
# Capacity, eviction, fallback, quarantine, ownership
# ---------------------------------------------------------------------------


def test_lru_eviction_resets_the_graph_and_frees_its_buffers(vit_patch, fake_cuda):
    vit_patch(vit_graph_max_entries=2)
    runner = new_runner(StubTower(fullatt=()))
    for full in ((0, 4, 8), (0, 2, 8), (0, 8)):
        out, want = call(runner, 8, full)
        torch.testing.assert_close(out, want)
    first, second, third = fake_cuda.created
    assert (first.resets, second.resets, third.resets) == (1, 0, 0)
    assert len(graphs(runner)) == 2 and all(g.output is not None and g.rotary for g in graphs(runner).values())
    assert sum(internals.live_leases(p) for p in runner.engine.store.rotary_pools.values()) == 2
    out, want = call(runner, 8, (0, 4, 8))  # evicted layout: captured again, still right
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert (info["captures"], info["evictions"], info["resident_graphs"]) == (4, 2, 2)
    assert info["bytes_resident"] > 0


def test_eviction_frees_retired_rotary_workspace(vit_patch, fake_cuda):
    vit_patch(vit_graph_max_entries=1)
    runner = new_runner(StubTower(fullatt=()))
    call(runner, 4, (0, 4))
    call(runner, 16, (0, 16))  # grows the workspace; the 4-token graph is evicted first
    assert runner.engine.store.retired_rotary_buffers() == 0
    assert runner.engine.info()["rotary_backing_buffers"] == 1


def test_exact_policy_over_capacity_runs_eager_with_the_graph_result(vit_patch, fake_cuda):
    vit_patch(vit_graph_max_entries=1, vit_graph_policy="exact")
    runner = new_runner(StubTower())
    graphed, want_graphed = call(runner, 8, (0, 0, 4, 8), (0, 4, 8))
    eager, want_eager = call(runner, 8, (0, 0, 2, 8), (0, 2, 8))
    torch.testing.assert_close(graphed, want_graphed)
    torch.testing.assert_close(eager, want_eager)
    assert len(fake_cuda.created) == 1
    assert runner.vit.blocks[0].calls[-1] == "metadata"  # eager through the same blocks, with metadata
    info = runner.engine.info()
    assert info["fallback_capacity"] == 1 and info["rejections"] == 1


def test_eager_fallback_for_blocks_without_metadata_uses_graph_arguments(vit_patch, fake_cuda):
    vit_patch(vit_graph_max_entries=0)
    runner = new_runner(StubTower(accepts_metadata=False))
    out, want = call(runner, 8, (0, 0, 3, 8), (0, 2, 3, 8))
    torch.testing.assert_close(out, want)
    assert runner.vit.blocks[0].calls == ["graph-form"] and not fake_cuda.created
    assert runner.engine.info()["fallback_disabled"] == 1


def test_failed_capture_is_quarantined_and_runs_eager(vit_patch, fake_cuda):
    vit_patch()
    runner = new_runner(StubTower(fail_capture=True))
    for _ in range(3):
        out, want = call(runner, 8, (0, 0, 4, 8), (0, 4, 8))
        torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["failures"] == 1 and info["fallback_capture_failed"] == 1 and info["fallback_quarantined"] == 2
    assert fake_cuda.created[0].resets == 1, "the half-captured graph must be reset"
    assert graphs(runner) == {}
    assert sum(internals.live_leases(p) for p in runner.engine.store.rotary_pools.values()) == 0


def test_min_hits_captures_on_the_nth_sighting(vit_patch, fake_cuda):
    vit_patch(vit_graph_min_hits=3)
    runner = new_runner(StubTower())
    for _ in range(4):
        out, want = call(runner, 8, (0, 0, 4, 8), (0, 4, 8))
        torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["fallback_warming"] == 2 and info["captures"] == 1 and info["hits"] == 1


def test_replay_output_is_owned_by_the_caller(vit_patch, fake_cuda):
    """Qwen3 path (no output_indices): a later replay must not change an earlier result."""
    vit_patch()
    runner = new_runner(StubTower(fullatt=()))
    first, want_first = call(runner, 8, (0, 4, 8), position=1, qwen3=True)
    kept = first.clone()
    second, _ = call(runner, 8, (0, 4, 8), position=9, qwen3=True)  # same key: replay
    assert fake_cuda.created[0].replays == 2
    torch.testing.assert_close(first, kept)
    torch.testing.assert_close(first, want_first)
    key = next(iter(graphs(runner)))
    for out in (first, second):
        assert out.untyped_storage().data_ptr() != graphs(runner)[key].output.untyped_storage().data_ptr()


def parallel_of(group):
    """What get_parallel() answers with `group` as the TP (and attention-TP) group."""
    return SimpleNamespace(tp_group=group, attn_tp_group=group)


def use_tp_group(monkeypatch, group):
    """`group` as the TP group of the patch (vit.tp) and of upstream's `_capture_context()` (0.5.17: its
    module's get_tp_group; 0.5.21 on: get_parallel().tp_group)."""
    monkeypatch.setattr(vit_tp, "get_parallel", lambda: parallel_of(group))
    if hasattr(runner_module, "get_tp_group"):
        monkeypatch.setattr(runner_module, "get_tp_group", lambda: group)
    else:
        monkeypatch.setattr(runner_module, "get_parallel", lambda: parallel_of(group))


def test_tp_ranks_fed_the_same_batches_make_the_same_decisions(vit_patch, fake_cuda, monkeypatch):
    """Two runners (two TP ranks, non-DP encoder) see one random stream: identical captures/evictions."""
    vit_patch(vit_graph_max_entries=3, vit_graph_min_hits=2)
    group = SimpleNamespace(ca_comm=None, world_size=1)
    use_tp_group(monkeypatch, group)
    ranks = [new_runner(StubTower(use_data_parallel=False)) for _ in range(2)]
    histories = [[], []]
    rng = random.Random(7)
    for _ in range(80):
        tokens = rng.choice((8, 12))
        full = (0,) + random_layout(rng, tokens, rng.randint(1, 2))
        window = random_layout(rng, tokens, rng.randint(1, 3))
        for rank, runner in enumerate(ranks):
            call(runner, tokens, full, window)
            info = runner.engine.info()
            histories[rank].append((tuple(runner.engine.cache.entries), info["captures"], info["evictions"]))
    assert histories[0] == histories[1]
    assert histories[0][-1][2] > 0


def test_capture_failing_on_another_tp_rank_drops_the_graph_everywhere(vit_patch, fake_cuda, monkeypatch):
    vit_patch(vit_graph_max_bytes=0)  # an explicit budget: no budget agreement, only the capture vote
    group = SimpleNamespace(ca_comm=None, world_size=2, cpu_group=object())
    use_tp_group(monkeypatch, group)
    votes = []

    def all_reduce(flag, op=None, group=None):
        votes.append(int(flag.item()))
        if len(votes) == 2:
            flag.fill_(0)  # the other rank's capture failed (permanently)

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    runner = new_runner(StubTower(use_data_parallel=False))
    out, want = call(runner, 8, (0, 0, 4, 8), (0, 4, 8))
    torch.testing.assert_close(out, want)
    assert votes == [2, 2]  # prepared and captured fine, and said so both times
    assert graphs(runner) == {} and runner.engine.info()["failures"] == 1
    assert fake_cuda.created[0].resets == 1  # this rank's good graph is dropped too
    out, want = call(runner, 8, (0, 0, 4, 8), (0, 4, 8))  # permanent: quarantined, no more votes
    torch.testing.assert_close(out, want)
    assert len(votes) == 2 and runner.engine.info()["fallback_quarantined"] == 1


def test_dp_encoder_captures_without_any_tp_communication(vit_patch, fake_cuda, monkeypatch):
    """A data-parallel encoder captures rank-locally: no TP group, no vote, no byte-budget agreement
    (the default budget, -1, is agreed over the TP group by non-DP encoders)."""
    vit_patch()
    touched = []
    monkeypatch.setattr(vit_tp, "get_parallel", lambda: touched.append("get_parallel"))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: touched.append("all_reduce"))
    runner = new_runner(StubTower(use_data_parallel=True))
    for step in range(2):  # capture, then replay
        out, want = call(runner, 8, (0, 0, 4, 8), (0, 4, 8), position=step)
        torch.testing.assert_close(out, want)
    assert touched == []
    assert runner.engine.info()["captures"] == 1 and fake_cuda.created[0].replays == 2


def test_tp_encoder_capture_is_voted_and_never_enters_the_tp_capture_context(vit_patch, fake_cuda, monkeypatch):
    """Upstream's case asserted that non-DP captures enter 0.5.17's `_capture_context()` (the custom
    all-reduce's `ca_comm.capture()`, whose buffer registrations are never freed); the patch captures
    outside it, agreed by two CPU-group votes; each replay is agreed by one (its inputs and output staged)."""
    vit_patch(vit_graph_max_bytes=0)  # an explicit budget: only the capture votes reach all_reduce
    entered, votes = [], []

    @contextlib.contextmanager
    def ca_capture():
        entered.append(True)
        yield

    group = SimpleNamespace(world_size=2, cpu_group=object(), ca_comm=SimpleNamespace(capture=ca_capture))
    use_tp_group(monkeypatch, group)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flag, op=None, group=None: votes.append(int(flag)))
    runner = new_runner(StubTower(use_data_parallel=False))
    for step in range(3):  # capture, then two replays
        out, want = call(runner, 8, (0, 0, 4, 8), (0, 4, 8), position=step)
        torch.testing.assert_close(out, want)
    assert entered == [] and votes == [2, 2] + [2] * 3  # capture (prepare, capture), then one per replay
    assert runner.engine.info()["captures"] == 1 and fake_cuda.created[0].replays == 3
    with runner._capture_context():  # control: the context is there, and records when entered
        pass
    assert entered == [True]


def test_stats_registry_reports_the_runner(vit_patch, fake_cuda):
    vit_patch(vit_graph_max_entries=1)
    runner = new_runner(StubTower())
    call(runner, 8, (0, 0, 8), (0, 8))
    call(runner, 8, (0, 0, 8), (0, 8))
    call(runner, 8, (0, 0, 4, 8), (0, 4, 8))
    info = stats_snapshot()[runner.engine.stats_name]
    assert {k: info[k] for k in ("hits", "misses", "captures", "evictions", "resident_graphs", "fallbacks")} == {
        "hits": 1, "misses": 2, "captures": 2, "evictions": 1, "resident_graphs": 1, "fallbacks": 0}
    assert info["bytes_resident"] > 0


# ---------------------------------------------------------------------------
# The swap: the runner class, qwen3's runner table, the model modules' bindings
# ---------------------------------------------------------------------------


def test_a_runner_built_before_activation_stays_sglangs_and_deactivation_restores_every_binding(
        vit_patch, ext_patches):
    from sglang.srt.models import qwen2_5_vl, qwen3_vl

    upstream = vit_runner.ViTGraphRunner.__base__
    before = runner_module.ViTCudaGraphRunner(StubTower())  # sglang's own, never changed in place
    vit_patch()
    assert type(before) is upstream and "engine" not in vars(before)
    assert issubclass(runner_module.ViTCudaGraphRunner, upstream) and runner_module.ViTCudaGraphRunner is not upstream
    ext_core("activation").deactivate()
    assert runner_module.ViTCudaGraphRunner is upstream
    assert qwen2_5_vl.ViTCudaGraphRunner is qwen3_vl.ViTCudaGraphRunner is upstream
    assert qwen3_vl.graph_runners_dict["cuda"] is upstream


def test_qwen3_runner_table_and_model_globals_build_the_patched_runner(vit_patch):
    vit_patch()
    from sglang.srt.models import qwen2_5_vl, qwen3_vl

    for runner_cls in (qwen3_vl.graph_runners_dict["cuda"], qwen3_vl.graph_runners_dict.default_factory(),
                       qwen3_vl.ViTCudaGraphRunner, qwen2_5_vl.ViTCudaGraphRunner):
        assert runner_cls is runner_module.ViTCudaGraphRunner
        runner = runner_cls(StubTower())
        assert isinstance(runner, vit_runner.ViTGraphRunner) and runner.engine.strategy.name == "layout"


# ---------------------------------------------------------------------------
# The model methods build the key from CPU metadata (real sglang towers on CPU)
# ---------------------------------------------------------------------------


class RecordingRunner:
    def __init__(self):
        self.calls = []

    def run(self, **kwargs):
        self.calls.append(kwargs)
        return kwargs["x"]


@pytest.fixture(scope="module")
def published_runtime():
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    runtime_context.publish(ServerArgs(model_path="dummy", mm_attention_backend="triton_attn", device="cpu"),
                            role="test")
    yield
    runtime_context.reset_context()


def test_qwen2_5_vision_forward_passes_the_cpu_layout_key(vit_patch, published_runtime):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VisionTransformer

    upstream = Qwen2_5_VisionTransformer.forward_with_cuda_graph
    vit_patch()
    assert Qwen2_5_VisionTransformer.forward_with_cuda_graph is not upstream

    cfg = Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=16,
                                 fullatt_block_indexes=[1], window_size=112, patch_size=14, spatial_merge_size=2,
                                 temporal_patch_size=2, in_channels=3)
    vit = Qwen2_5_VisionTransformer(cfg, use_data_parallel=True)
    vit.cuda_graph_runner = RecordingRunner()
    grid_thw = torch.tensor([[1, 4, 6], [1, 10, 4]])
    tokens = int(grid_thw.prod(dim=1).sum())
    pixels = torch.randn(tokens, 3 * 2 * 14 * 14)
    vit.forward_with_cuda_graph(pixels, grid_thw)

    (kwargs,) = vit.cuda_graph_runner.calls
    full, window = kwargs["attention_layout_key"]
    assert full == (0, 0, 24, 64)  # 0.5.17's doubled leading zero, then cumulative t*h*w
    _, window_list = vit.get_window_index(grid_thw)
    assert window == tuple(torch.unique_consecutive(torch.tensor(window_list)).tolist())
    assert kwargs["cu_seqlens"].tolist() == list(full)
    assert kwargs["cu_window_seqlens"].tolist() == list(window)
    assert all(isinstance(v, int) for v in full + window)
    assert kwargs["output_indices"] is not None and kwargs["position_embeddings"][0].shape[0] == tokens
    upstream(vit, pixels, grid_thw)  # 0.5.17's own body: the same tower inputs, bit for bit
    theirs = vit.cuda_graph_runner.calls[1]
    for name in ("x", "cu_seqlens", "cu_window_seqlens", "output_indices"):
        assert torch.equal(kwargs[name], theirs[name]), name
    assert all(torch.equal(a, b) for a, b in zip(kwargs["position_embeddings"], theirs["position_embeddings"]))


def test_qwen3_vision_forward_passes_the_cpu_layout_key(vit_patch):
    """The real (patched) Qwen3VLMoeVisionModel.forward_with_cuda_graph on an object with the attributes it uses."""
    vit_patch()
    from sglang.srt.models.qwen3_vl import Qwen3VLMoeVisionModel
    from sglang.srt.models.utils import compute_cu_seqlens_from_grid_numpy

    grid_thw = torch.tensor([[1, 4, 6], [2, 4, 4]])
    tokens = int(grid_thw.prod(dim=1).sum())

    class Tower:
        graph_runners = RecordingRunner()
        device, dtype = torch.device("cpu"), torch.float32

        def patch_embed(self, x):
            return x

        def _use_vectorized_pos_embed(self, num_images):
            return False

        def fast_pos_embed_interpolate_from_list(self, grid):
            return torch.zeros(tokens, 8)

        def rot_pos_emb(self, grid):
            return torch.ones(tokens, 4), torch.zeros(tokens, 4)

    tower = Tower()
    Qwen3VLMoeVisionModel.forward_with_cuda_graph(tower, torch.randn(tokens, 8), grid_thw)
    (kwargs,) = tower.graph_runners.calls
    full, window = kwargs["attention_layout_key"]
    assert full == (0, 24, 40, 56) and window is None  # per frame: 4*6, then 2 frames of 4*4
    assert list(full) == compute_cu_seqlens_from_grid_numpy(grid_thw).tolist()  # 0.5.17's own boundaries
    assert kwargs["cu_seqlens"].dtype == torch.int32 and kwargs["cu_seqlens"].tolist() == list(full)
    assert kwargs["output_indices"] is None and kwargs["rotary_pos_emb_cos"] is not None


class _NoCudaGraphs:
    def __init__(self):
        raise RuntimeError("no CUDA graphs on this machine (test)")


@pytest.fixture
def world_of_one():
    from sglang_ext_testkit import qwen_vit_kit as kit

    with kit.world_of_one():
        yield


def test_real_qwen2_5_tower_falls_back_to_sglang_eager_result_when_capture_fails(vit_patch, monkeypatch, world_of_one):
    """sglang's real tower on CPU (sdpa): every capture fails, each batch still gets eager's exact result."""
    from sglang_ext_testkit import qwen_vit_kit as kit
    from sglang.srt import runtime_context

    vit_patch()
    monkeypatch.setenv("SGLANG_VIT_ENABLE_CUDA_GRAPH", "1")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _NoCudaGraphs)
    kit.publish_runtime("sdpa")
    try:
        vit = kit.build_qwen2_5_tower(device="cpu", graphs=False)
    finally:
        runtime_context.reset_context()
    kit.publish_runtime("sdpa")  # VisionAttention.forward reads the exec settings
    try:
        vit.cuda_graph_runner = new_runner(vit)  # 0.5.17 builds it only on CUDA
        rng = random.Random(0)
        for _ in range(3):
            pixels, grid = kit.random_batch(rng, (4, 6, 8))
            with torch.inference_mode():
                fallback = vit.forward_with_cuda_graph(pixels, grid)
                eager = vit.forward(pixels, grid)  # enable_cg is False: sglang's own eager path
            assert torch.equal(fallback, eager), grid.tolist()
    finally:
        runtime_context.reset_context()
    info = vit.cuda_graph_runner.engine.info()
    assert info["failures"] == 3 and info["fallback_capture_failed"] == 3 and info["resident_graphs"] == 0
    assert graphs(vit.cuda_graph_runner) == {}
    assert sum(internals.live_leases(p) for p in vit.cuda_graph_runner.engine.store.rotary_pools.values()) == 0


def test_real_qwen3_tower_graph_inputs_give_sglang_eager_result(vit_patch, monkeypatch, world_of_one):
    """sglang's real Qwen3 tower on CPU (sdpa), captures failing: the graph path (eager fallback on its
    graph inputs) equals sglang's eager `forward` bit for bit. 0.5.17's `_prepare_graph_inputs`
    interpolates the position embedding by another rule, so this fails without our graph inputs."""
    from sglang_ext_testkit import qwen_vit_kit as kit
    from sglang.srt import runtime_context
    from sglang.srt.layers.rotary_embedding import base as rotary_base

    vit_patch()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _NoCudaGraphs)
    monkeypatch.setattr(rotary_base, "_is_cpu", True)  # a CPU-only machine: the native rotary path
    kit.publish_runtime("sdpa")
    try:
        vit = kit.build_qwen3_tower(device="cpu", dtype=torch.float32)
        vit.graph_runners = new_runner(vit)  # 0.5.17 builds it only on CUDA
        rng = random.Random(3)
        for _ in range(3):
            pixels, grid = kit.random_batch(rng, (4, 6, 10), patch_dim=kit.QWEN3_PATCH_DIM)
            graph = kit.forward_qwen3(vit, pixels, grid, graph=True)
            eager = kit.forward_qwen3(vit, pixels, grid, graph=False)
            assert torch.equal(graph, eager), grid.tolist()
    finally:
        runtime_context.reset_context()
    assert vit.graph_runners.engine.info()["fallback_capture_failed"] == 3


class _RerunGraph:
    """A CUDA graph whose replay runs the captured blocks again on the captured tensors."""

    rerun = None

    def replay(self):
        self.rerun()

    def reset(self):
        pass


def _context_attention_cpu(q, k, v, o, b_start_loc, b_seq_len, max_input_len, is_causal=True, sm_scale=None):
    """CPU stand-in for triton_attn's kernel, the same in both paths: float32 softmax per sequence."""
    assert max_input_len >= int(b_seq_len.max())
    scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    starts = b_start_loc[:-1] if b_start_loc.numel() == b_seq_len.numel() + 1 else b_start_loc
    for start, length in zip(starts.tolist(), b_seq_len.tolist()):
        qs, ks, vs = (t[start:start + length].float().transpose(0, 1) for t in (q, k, v))
        probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)
        o[start:start + length] = (probs @ vs).transpose(0, 1).to(o.dtype)


def test_real_qwen3_tower_graph_rotates_with_the_float32_cos_sin_of_eager(vit_patch, fake_cuda, monkeypatch,
                                                                          world_of_one):
    """A bf16 Qwen3 tower whose rotary table is float32, as on a CUDA server (sglang keeps the
    vision rotary cache in fp32 there): graph replays equal sglang's eager `forward` bit for bit.
    With 0.5.17's bf16 rotary buffers every batch differed (0.0156 here; 0 of 200 requests
    bitwise on the H200 server)."""
    from sglang_ext_testkit import qwen_vit_kit as kit
    from sglang.srt import runtime_context
    from sglang.srt.layers.attention import vision
    from sglang.srt.layers.rotary_embedding import base as rotary_base

    vit_patch()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RerunGraph)
    monkeypatch.setattr(rotary_base, "_is_cpu", True)
    monkeypatch.setattr(vision, "context_attention_fwd", _context_attention_cpu)
    kit.publish_runtime("triton_attn")
    try:
        vit = kit.build_qwen3_tower(device="cpu", dtype=torch.bfloat16, native_ops=True)
        vit.rotary_pos_emb.cos_sin_cache = vit.rotary_pos_emb._compute_cos_sin_cache().float()
        runner = new_runner(vit)
        vit.graph_runners = runner
        store = runner.engine.store
        capture = store.capture

        def create(graph_key, rotary):
            capture(graph_key, rotary)
            store.graphs[graph_key].graph.rerun = lambda: create(graph_key, rotary)

        store.capture = create
        rng = random.Random(5)
        for _ in range(4):
            pixels, grid = kit.random_batch(rng, (4, 6, 8, 10), patch_dim=kit.QWEN3_PATCH_DIM, dtype=torch.bfloat16)
            eager = kit.forward_qwen3(vit, pixels, grid, graph=False)
            for _replay in range(2):  # the capture's run, then a replay of the cached graph
                graph = kit.forward_qwen3(vit, pixels, grid, graph=True)
                assert torch.equal(graph, eager), (grid.tolist(), float((graph.float() - eager.float()).abs().max()))
        info = runner.engine.info()
        assert info["captures"] >= 1 and info["hits"] >= 4 and info["fallbacks"] == 0, info
        assert {ws.dtype for g in graphs(runner).values() for ws in g.rotary} == {torch.float32}
    finally:
        runtime_context.reset_context()


# ---------------------------------------------------------------------------
# Custom all-reduce: evictable graphs register nothing
# ---------------------------------------------------------------------------


class CARecorder:
    """sglang 0.5.17's real CustomAllreduce over fake kernels that count graph-buffer registrations.

    The fake `ops` behave as the C++ side does: `all_reduce` with no staging buffer (reg_buffer=0,
    "registered") during a stream capture queues the input's address; `get_graph_buffer_ipc_meta`
    hands the queued addresses out and `register_graph_buffers` stores them for good (the 8 MiB
    rank_data table that is never freed).
    """

    STAGING = 0x5000

    def __init__(self, monkeypatch):
        import sglang.srt.distributed.device_communicators.custom_all_reduce as ca_module

        self.pending, self.registered, self.staged_in_capture, self.registered_in_capture = [], 0, 0, 0
        ca = object.__new__(ca_module.CustomAllreduce)
        ca.__dict__.update(_IS_CAPTURING=False, disabled=False, original_disabled=False, tms_cudagraph=False,
                           use_amd_deterministic_impl=False, rank=0, world_size=2, full_nvlink=True,
                           max_size=8 * 1024 * 1024, buffer_ptrs=[self.STAGING, self.STAGING + 1], _ptr=1,
                           group=object())
        self.ca = ca
        ops = SimpleNamespace(all_reduce=self._all_reduce, get_graph_buffer_ipc_meta=self._meta,
                              register_graph_buffers=self._register)
        monkeypatch.setattr(ca_module, "ops", ops)
        monkeypatch.setattr(ca_module, "_is_hip", False)
        monkeypatch.setattr(ca_module, "dist", SimpleNamespace(
            get_world_size=lambda group=None: 1, get_process_group_ranks=lambda group: [0],
            broadcast_object_list=lambda *args, **kwargs: None))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: _CAPTURING[0] is not None)

    def _all_reduce(self, ptr, inp, out, reg_buffer, reg_buffer_size):
        if _CAPTURING[0] is not None:
            if reg_buffer == 0:
                self.pending.append(inp.data_ptr())
                self.registered_in_capture += 1
            else:
                assert reg_buffer == self.STAGING and reg_buffer_size == self.ca.max_size
                self.staged_in_capture += 1
        out.copy_(inp)

    def _meta(self, ptr):
        return b"ipc-handle", list(self.pending)

    def _register(self, ptr, handles, offsets):
        self.registered += len(offsets[0])
        self.pending.clear()


class CABlock(LayoutBlock):
    """A cheap block (x + 1) whose output goes through the TP group's all-reduce (the custom one here)."""

    def forward(self, x, *, cu_seqlens, output_ws=None, forward_metadata=None, **rotary):
        out = x + 1
        reduced = vit_tp.get_parallel().tp_group.all_reduce(out)
        graph = _CAPTURING[0]
        if graph is not None:
            graph.thunks.append(lambda: (torch.add(x, 1, out=out), reduced.copy_(out)))
        return reduced


def test_evictable_captures_register_no_custom_all_reduce_buffers(vit_patch, fake_cuda, monkeypatch):
    """5,000 LRU captures through sglang's CustomAllreduce: zero registrations, staging path captured."""
    vit_patch(vit_graph_max_entries=2)
    recorder = CARecorder(monkeypatch)
    group = SimpleNamespace(world_size=2, ca_comm=recorder.ca, cpu_group=object(),
                            all_reduce=lambda t: recorder.ca.custom_all_reduce(t))  # GroupCoordinator's "ca" route
    use_tp_group(monkeypatch, group)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda flag, op=None, group=None: None)  # peers agree
    tower = StubTower(fullatt=(), use_data_parallel=False)
    tower.blocks = nn.ModuleList([CABlock()])
    runner = new_runner(tower)
    layouts = [(0, a, b, 16) for a in range(1, 15) for b in range(a + 1, 16)]  # 105 distinct layouts
    for step in range(5000):
        full = layouts[step % len(layouts)]
        x = torch.full((16, 1), float(step % 7))
        out = runner.run(x=x, cu_seqlens=torch.tensor(full, dtype=torch.int32), cu_window_seqlens=None,
                         position_embeddings=None, rotary_pos_emb_cos=torch.zeros(16, 1),
                         rotary_pos_emb_sin=torch.zeros(16, 1), attention_layout_key=(full, None))
        if step % 997 == 0:
            torch.testing.assert_close(out, x + 1)
    info = runner.engine.info()
    assert (info["captures"], info["evictions"], info["failures"]) == (5000, 4998, 0)
    assert recorder.registered == 0 and recorder.registered_in_capture == 0 and recorder.pending == []
    assert recorder.staged_in_capture == 5000  # the custom all-reduce ran in every graph, on its staging buffer
    # Control: 0.5.17's capture context (ca_comm.capture()) registers one entry per captured all-reduce.
    with runner._capture_context(), fake_capture(FakeGraph()):
        recorder.ca.custom_all_reduce(torch.zeros(4))
    assert recorder.registered == 1
    recorder.ca._ptr = 0  # nothing to dispose (its finaliser would call the real, CPU-less ops)


def test_device_boundaries_without_a_layout_key_run_eager_and_warn_once_per_runner(vit_patch, fake_cuda, monkeypatch,
                                                                                  caplog):
    """A caller passing only device cu_seqlens (no CPU layout): eager, correct, one warning per runner."""
    vit_patch()
    # CPU has no device tensors: the runner's device test sees the batch's cu_seqlens as "on the GPU".
    monkeypatch.setattr(ext_core("vit.engine"), "on_device",
                        lambda value: isinstance(value, torch.Tensor) and value.dtype == torch.int32)
    runners = [new_runner(StubTower()), new_runner(StubTower())]
    with caplog.at_level(logging.WARNING, logger="sglang_ext.vit_cuda_graph"):
        for runner in runners:
            for step, (full, window) in enumerate((((0, 0, 4, 8), (0, 4, 8)), ((0, 0, 2, 8), (0, 2, 8))) * 2):
                out, want = call(runner, 8, full, window, position=step, with_key=False)
                torch.testing.assert_close(out, want)
    warnings = [r.getMessage() for r in caplog.records if "without attention_layout_key" in r.getMessage()]
    assert len(warnings) == 2  # once per runner, not per batch
    assert "runs such batches eager" in warnings[0]
    for runner in runners:
        info = runner.engine.info()
        assert (info["fallback_no_cpu_layout"], info["captures"]) == (4, 0) and not fake_cuda.created


def flash_tower(backend, tower=None):
    tower = tower if tower is not None else StubTower()
    for blk in tower.blocks:
        blk.attn.qkv_backend_name = backend
    return tower


@pytest.mark.parametrize("backend", ["fa3", "fa4"])
def test_class_mode_on_flash_backends_refreshes_the_graph_buffers_each_replay(vit_patch, fake_cuda, backend):
    """fa3 gets 0.5.17's list form [cu, max_seqlen]; fa4 (no graph branch in 0.5.17) gets metadata
    built on the graph's own buffers. Either way the kernel reads the buffers rewritten per replay."""
    vit_patch(vit_graph_mode="class")
    tower = flash_tower(backend)
    runner = new_runner(tower)
    a = ((0, 0, 6, 8), (0, 2, 4, 8))
    b = ((0, 0, 5, 8), (0, 1, 2, 4, 8))  # same class as a
    for step, (full, window) in enumerate((a, b, a, b)):
        out, want = call(runner, 8, full, window, position=step)
        torch.testing.assert_close(out, want, msg=f"step {step}")
    assert len(fake_cuda.created) == 1 and fake_cuda.created[0].replays == 4
    (key,) = graphs(runner)
    full_block, window_block = tower.blocks[1], tower.blocks[0]
    form, cu, max_seqlen = full_block.forms[-1]  # the captured call (warm-up, then capture)
    assert form == ("list2" if backend == "fa3" else "metadata")
    assert cu is graphs(runner)[key].cu_full and max_seqlen == 8  # class bound: longest 6 -> 8
    assert window_block.forms[-1][1] is graphs(runner)[key].cu_window and window_block.forms[-1][2] == 4
    assert graphs(runner)[key].cu_full.tolist() == [0, 0, 5, 8, 8]  # b's boundaries + one empty sequence
    assert runner.engine.info()["attention_backend"] == backend


def windowed_merged_tower(backend, window_tokens=8):
    """merged_tower (merge unit 2) with a window geometry: one full window = `window_tokens` tokens."""
    tower = flash_tower(backend, merged_tower())
    tower.patch_size, tower.spatial_merge_size = 14, 1
    tower.window_size = 14 * int((window_tokens // 2) ** 0.5)
    return tower


def merged_call(runner, tokens, full, window, step):
    x = torch.arange(tokens, dtype=torch.float32).view(tokens, 1) * 0.5 + step
    pos = torch.full((tokens, 1), float(step))
    order = torch.randperm(tokens // 2, generator=torch.Generator().manual_seed(step))
    out = runner.run(x, torch.tensor(full, dtype=torch.int32), torch.tensor(window, dtype=torch.int32),
                     (pos, pos), output_indices=order, attention_layout_key=(full, window))
    return out, merged_reference(runner.vit, x, full, window, pos).index_select(0, order)


# ---------------------------------------------------------------------------
# Default byte budget
# ---------------------------------------------------------------------------

GiB = 1 << 30


def _budget_runner(monkeypatch, free_bytes, **tower_kwargs):
    tower = StubTower(**tower_kwargs)
    tower.device = torch.device("cuda", 0)  # only read for the budget: nothing is allocated here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes, 141 * GiB))
    runner = new_runner(tower)
    runner.engine.agree_budget()
    return runner


@pytest.mark.parametrize(("free", "budget"), [(8 * GiB, 2 * GiB), (120 * GiB, 4 * GiB), (512 << 20, 256 << 20)])
def test_default_budget_is_a_quarter_of_free_memory_clamped(vit_patch, monkeypatch, free, budget):
    vit_patch()
    runner = _budget_runner(monkeypatch, free)
    assert runner.engine.cache.max_bytes == budget and runner.engine.info()["max_bytes"] == budget


def test_budget_knob_overrides_the_default(vit_patch, monkeypatch):
    vit_patch(vit_graph_max_bytes=0)
    assert _budget_runner(monkeypatch, 8 * GiB).engine.cache.max_bytes == 0  # 0 = no byte limit
    vit_patch(vit_graph_max_bytes=12345)
    assert _budget_runner(monkeypatch, 8 * GiB).engine.cache.max_bytes == 12345


def test_budget_knob_below_minus_one_is_a_one_line_error():
    from sglang_ext.errors import ExtConfigError
    from sglang_ext.knobs import load_settings

    with pytest.raises(ExtConfigError) as bad:
        load_settings({"SGLANG_EXT_VIT_GRAPH_MAX_BYTES": "-2"})
    message = str(bad.value)
    assert "\n" not in message and "--ext-vit-graph-max-bytes" in message and ">= -1" in message


def _budget_rank(rank, init_file, free_bytes, results):
    """One TP rank (a real process): the runner's budget agreed over a real gloo group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        group = SimpleNamespace(world_size=2, cpu_group=dist.group.WORLD, ca_comm=None)
        vit_tp.get_parallel = lambda: parallel_of(group)
        tower = StubTower(use_data_parallel=False)
        tower.device = torch.device("cuda", 0)
        torch.cuda.is_available = lambda: True
        torch.cuda.mem_get_info = lambda device=None: (free_bytes, 141 * GiB)
        runner = new_runner(tower)
        runner.engine.agree_budget()
        results.put((rank, runner.engine.cache.max_bytes))
    finally:
        dist.destroy_process_group()


def test_default_budget_is_the_minimum_over_tp_ranks(vit_patch, tmp_path):
    import multiprocessing

    vit_patch()
    ctx = multiprocessing.get_context("fork")  # the children inherit the activated patch
    results = ctx.Queue()
    free = {0: 6 * GiB, 1: 10 * GiB}  # alone: 1.5 GiB and 2.5 GiB
    procs = [ctx.Process(target=_budget_rank, args=(rank, tmp_path / "init", free[rank], results))
             for rank in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in procs) == [(0, 3 * GiB // 2), (1, 3 * GiB // 2)]
