"""ViT bucket (token-budget) mode on sglang's real runner (0.5.17, 0.5.23), on CPU with the CUDA-graph recorder.

Bucket mode is the default: the budget ladder is captured before serving (at load, or at the
tower's first call without a server), calls are padded to the smallest budget that fits, calls
above the replay limit are split into whole-image chunks, and nothing is captured afterwards.
The recorder (test_vit_cuda_graph_runner.FakeGraph) replays what a CUDA graph would: the captured
tensor objects, whatever they now hold.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="base-a-test-cpu")


from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)
from test_vit_cuda_graph_runner import (  # noqa: F401  (fixtures and the recording fake)
    _CAPTURING,
    SqueezeMerger,
    StubTower,
    _layout_compute,
    call,
    fake_cuda,
    graphs,
    merged_call,
    new_runner,
    reference,
    vit_patch,
    windowed_merged_tower,
)

vit_engine = ext_core("vit.engine")  # the probe's timer lives here (the plugin's, or the patched tree's copy)
vit_strategy = ext_core("vit.strategy")


def budget_runner(vit_patch, buckets="8,16,32", replay=32, backend="triton_attn", **knobs):
    vit_patch(vit_graph_mode="bucket", vit_graph_token_buckets=buckets, vit_graph_replay_max_tokens=replay, **knobs)
    return new_runner(windowed_merged_tower(backend))  # merge unit 2, windows of 8 tokens


# Images with windows of at most 8 tokens (each image's windows inside it).
CALLS = [(12, (0, 0, 4, 12), (0, 4, 12)), (10, (0, 0, 6, 10), (0, 6, 10)), (14, (0, 0, 14), (0, 8, 14)),
         (6, (0, 0, 2, 6), (0, 2, 6)), (26, (0, 0, 20, 26), (0, 8, 16, 20, 26)), (16, (0, 0, 8, 16), (0, 8, 16))]


@pytest.mark.parametrize("backend", ["triton_attn", "fa3", "fa4"])
def test_the_ladder_is_captured_first_and_every_call_replays_its_budget(vit_patch, fake_cuda, backend):
    runner = budget_runner(vit_patch, backend=backend)
    for step, (tokens, full, window) in enumerate(CALLS * 2):
        out, want = merged_call(runner, tokens, full, window, step)
        torch.testing.assert_close(out, want, msg=f"step {step}")
    info = runner.engine.info()
    assert sorted(k.num_tokens for k in graphs(runner)) == [8, 16, 32]
    # All three at the first call, none later: every call hit, none fell back, none was captured for.
    assert (info["captures"], info["hits"], info["misses"], info["fallbacks"]) == (3, 12, 0, 0)
    assert info["precapture_graphs"] == 3 and info["replay_limit_tokens"] == 32
    # The key is the budget alone: 36 full-attention slots, window slots for 1 window per 8 tokens.
    assert set(graphs(runner)) == {vit_strategy.BudgetKey(b, full_slots=36, full_bound=b, window_slots=b // 8 + 2,
                                                          window_bound=8) for b in (8, 16, 32)}
    # One input and one attention workspace for the whole ladder: the 32-token graph's (captured first).
    inputs = {graphs(runner)[k].input.untyped_storage().data_ptr() for k in graphs(runner)}
    workspaces = {graphs(runner)[k].workspace.untyped_storage().data_ptr() for k in graphs(runner)}
    assert len(inputs) == len(workspaces) == 1
    assert info["shared_buffer_bytes"] == (32 + 32) * 4  # fp32 rows of one element: input + workspace
    want_padding = 2 * sum(min(b for b in (8, 16, 32) if b >= t) - t for t, *_ in CALLS)
    assert (info["padding_tokens"], info["real_tokens"]) == (want_padding, 2 * sum(t for t, *_ in CALLS))


# The documented default ladder without a server (knob vit_graph_token_buckets empty): 16 sizes, 512
# growing by 26 % in multiples of 64, up to 16448, written out so that a change of the default shows here.
DEFAULT_VIT_TOKEN_BUCKETS = (512, 704, 832, 1088, 1344, 1664, 2112, 2624, 3264, 4160, 5184, 6528, 8256, 10368,
                             13056, 16448)


def test_bucket_mode_default_ladder_is_the_documented_one(vit_patch, fake_cuda):
    """No vit_graph_token_buckets: the ladder captured is the documented one, a call just above each
    budget replays the next one, and past the largest a single image runs eager."""
    vit_patch(vit_graph_mode="bucket", vit_graph_replay_max_tokens=10**6)
    runner = new_runner(StubTower(fullatt=()))
    sizes = [1] + [bucket + 1 for bucket in DEFAULT_VIT_TOKEN_BUCKETS]  # 1 pads to 512, 513 to 704, ...
    for tokens in sizes:
        out, want = call(runner, tokens, (0, tokens), qwen3=True, position=1)
        torch.testing.assert_close(out, want)
    assert runner.engine.ladder.budgets == DEFAULT_VIT_TOKEN_BUCKETS
    assert sorted(key.num_tokens for key in graphs(runner)) == list(DEFAULT_VIT_TOKEN_BUCKETS)
    info = runner.engine.info()
    assert (info["padded_batches"], info["hits"], info["fallback_gate"]) == (16, 16, 1)


def test_the_last_call_boundaries_are_what_the_graph_read(vit_patch, fake_cuda):
    runner = budget_runner(vit_patch)
    merged_call(runner, *CALLS[0], 0)  # 12 tokens -> 16: full (0, 0, 4, 12) + padding, windows + one padding
    key = next(k for k in graphs(runner) if k.num_tokens == 16)
    assert graphs(runner)[key].cu_full.tolist()[:5] == [0, 0, 4, 12, 16] and set(graphs(runner)[key].cu_full.tolist()[5:]) == {16}
    assert graphs(runner)[key].cu_window.tolist() == [0, 4, 12, 16, 16]  # 16 // 8 + 2 window slots


def test_a_call_above_the_replay_limit_replays_whole_image_chunks(vit_patch, fake_cuda):
    runner = budget_runner(vit_patch, replay=16)
    tokens, full, window = 26, (0, 0, 4, 12, 20, 26), (0, 4, 12, 20, 26)  # 4 images: chunks [0, 12) [12, 26)
    for step in range(2):
        out, want = merged_call(runner, tokens, full, window, step)
        torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert sorted(k.num_tokens for k in graphs(runner)) == [8, 16]  # 32 is above the limit: not captured
    assert (info["chunked_calls"], info["chunks"], info["hits"], info["fallbacks"]) == (2, 4, 4, 0)
    assert graphs(runner)[next(k for k in graphs(runner) if k.num_tokens == 16)].cu_full.tolist()[:4] == [0, 8, 14, 16]  # the second chunk, shifted


def test_one_image_above_the_limit_runs_eager_unpadded(vit_patch, fake_cuda):
    runner = budget_runner(vit_patch, replay=16)
    tower = runner.vit
    merged_call(runner, *CALLS[3], 0)  # pre-capture
    rows_before = len(tower.blocks[0].rows)
    out, want = merged_call(runner, 20, (0, 0, 20), (0, 8, 16, 20), 1)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["fallback_gate"] == 1 and info["captures"] == 2  # nothing captured for it
    assert tower.blocks[0].rows[rows_before:] == [20] and tower.blocks[0].calls[-1] == "metadata"


def test_adjacent_chunks_no_graph_serves_run_as_one_eager_call(vit_patch, fake_cuda):
    runner = budget_runner(vit_patch, replay=16)
    tower = runner.vit
    merged_call(runner, *CALLS[3], 0)  # pre-capture
    rows_before = len(tower.blocks[0].rows)
    # Two images above the limit, then one that fits: eager once for [0, 40), a replay for [40, 46).
    full, window = (0, 0, 20, 40, 46), (0, 8, 16, 20, 28, 36, 40, 46)
    out, want = merged_call(runner, 46, full, window, 1)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert tower.blocks[0].rows[rows_before:] == [40]  # one eager call of 40 rows (the 6 replay)
    assert (info["fallback_gate"], info["hits"], info["chunks"]) == (2, 2, 3)


def test_a_call_with_more_windows_than_slots_runs_eager(vit_patch, fake_cuda):
    runner = budget_runner(vit_patch)
    window = tuple(range(0, 17, 2))  # 8 windows of 2 tokens: the 16-token graph has room for 4
    out, want = merged_call(runner, 16, (0, 0, 16), window, 0)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["fallback_no_fit"] == 1 and info["hits"] == 0 and info["captures"] == 3


def test_qwen3_rows_and_deepstack_rows_are_the_real_ones(vit_patch, fake_cuda, monkeypatch):
    real_cat = torch.cat

    def recording_cat(tensors, dim=0):  # the captured torch.cat is a kernel too: replay it
        out = real_cat(tensors, dim=dim)
        graph = _CAPTURING[0]
        if graph is not None:
            parts = list(tensors)
            graph.thunks.append(lambda: out.copy_(real_cat(parts, dim=dim)))
        return out

    monkeypatch.setattr(torch, "cat", recording_cat)
    vit_patch(vit_graph_mode="bucket", vit_graph_token_buckets="8,16", vit_graph_replay_max_tokens=8)
    tower = StubTower(fullatt=())
    tower.deepstack_visual_indexes = [0]
    tower.deepstack_merger_list = nn.ModuleList([SqueezeMerger()])
    runner = new_runner(tower)
    for tokens, full in ((5, (0, 2, 5)), (7, (0, 3, 4, 7)), (6, (0, 6)), (13, (0, 3, 7, 13))):  # 13: two chunks
        x = torch.arange(tokens, dtype=torch.float32).view(tokens, 1) * 0.5
        pos = torch.full((tokens, 1), float(tokens))
        out = runner.run(x=x, cu_seqlens=torch.tensor(full, dtype=torch.int32), cu_window_seqlens=None,
                         position_embeddings=None, rotary_pos_emb_cos=pos, rotary_pos_emb_sin=pos,
                         output_indices=None, attention_layout_key=(tuple(full), None))
        after_block0 = _layout_compute(x.unsqueeze(1), torch.tensor(full), 10**9, pos).squeeze(1)
        torch.testing.assert_close(out, torch.cat([reference(tower, x, full, None, pos), after_block0], dim=1))
    assert [k.num_tokens for k in graphs(runner)] == [8]
    info = runner.engine.info()
    assert (info["hits"], info["chunks"], info["padded_batches"]) == (5, 2, 5)


def test_the_probe_ends_the_ladder_at_the_first_budget_eager_wins(vit_patch, fake_cuda, monkeypatch):
    runner = budget_runner(vit_patch, replay=-1)
    times = {8: (1.0, 2.0), 16: (1.5, 2.0), 32: (3.0, 2.5)}
    calls = []
    capture = runner.engine.capture_budget

    def tracking_capture(sample, budget):
        calls.append(budget)
        key = capture(sample, budget)
        calls.append(budget)  # the graph side is timed after this capture, the eager side after that
        return key

    def fake_median_by_side(run, *, repeats, synchronize=None):
        run()
        budget = calls[-1]
        side = fake_median_by_side.sides.setdefault(budget, 0)
        fake_median_by_side.sides[budget] += 1
        return times[budget][side]

    fake_median_by_side.sides = {}
    monkeypatch.setattr(vit_engine, "median_wall_ms", fake_median_by_side)
    monkeypatch.setattr(runner.engine, "capture_budget", tracking_capture)
    out, want = merged_call(runner, *CALLS[0], 0)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert [(r["budget"], r["replay"]) for r in runner.engine.ladder.gate] == [(8, True), (16, True), (32, False)]
    assert [r["tokens"] for r in runner.engine.ladder.gate] == [2, 10, 18]  # the smallest call of each budget
    assert sorted(k.num_tokens for k in graphs(runner)) == [8, 16] and info["replay_limit_tokens"] == 16
    # Three probe graphs (dropped after timing), then the two that won, captured again largest first.
    assert info["captures"] == 5 and info["resident_graphs"] == 2
    assert [g.resets for g in fake_cuda.created[:3]] == [1, 1, 1]


def _probed_runner(vit_patch, monkeypatch, **knobs):
    """A bucket-mode runner whose load-time probe kept budgets 8 and 16 (32 lost to eager), pre-captured."""
    runner = budget_runner(vit_patch, replay=-1, **knobs)
    times = iter([1.0, 2.0, 1.5, 2.0, 3.0, 2.5])  # graph, eager per budget: 8 and 16 win, 32 loses

    def fake_median(run, *, repeats, synchronize=None):
        run()
        return next(times)

    monkeypatch.setattr(vit_engine, "median_wall_ms", fake_median)
    merged_call(runner, *CALLS[3], 0)  # pre-capture: the probe keeps 8 and 16
    return runner


def test_above_the_probes_break_even_a_call_runs_as_one_eager_call(vit_patch, fake_cuda, monkeypatch):
    """The probe's limit is where eager started to win: a call above it is not split into replays.

    A limit the knob sets (test_a_call_above_the_replay_limit_replays_whole_image_chunks) or the
    capacity cuts (below) still splits: graphs win there.
    """
    runner = _probed_runner(vit_patch, monkeypatch)
    tower = runner.vit
    rows_before = len(tower.blocks[0].rows)
    tokens, full, window = 26, (0, 0, 4, 12, 20, 26), (0, 4, 12, 20, 26)  # chunks of whole images would fit 16
    out, want = merged_call(runner, tokens, full, window, 1)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["replay_limit_tokens"] == 16 and tower.blocks[0].rows[rows_before:] == [26]
    assert (info["chunked_calls"], info["fallback_gate"], info["hits"]) == (0, 1, 1)


def test_above_ladder_split_replays_whole_image_chunks_above_the_break_even(vit_patch, fake_cuda, monkeypatch):
    """Knob vit_graph_above_ladder=split: the call the test above runs eager replays in chunks of whole images."""
    runner = _probed_runner(vit_patch, monkeypatch, vit_graph_above_ladder="split")
    tower = runner.vit
    rows_before = len(tower.blocks[0].rows)
    tokens, full, window = 26, (0, 0, 4, 12, 20, 26), (0, 4, 12, 20, 26)
    out, want = merged_call(runner, tokens, full, window, 1)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["replay_limit_tokens"] == 16 and tower.blocks[0].rows[rows_before:] == []  # no eager row
    assert (info["chunked_calls"], info["fallback_gate"], info["hits"]) == (1, 0, 1 + info["chunks"])
    assert info["chunks"] == 2  # [0, 12) and [12, 26)


def test_a_ladder_cut_below_the_break_even_still_splits(vit_patch, fake_cuda, monkeypatch):
    runner = budget_runner(vit_patch, replay=-1, vit_graph_max_entries=1)
    times = iter([1.0, 2.0] * 3)  # graph, eager per budget: every budget wins

    def fake_median(run, *, repeats, synchronize=None):
        run()
        return next(times)

    monkeypatch.setattr(vit_engine, "median_wall_ms", fake_median)
    merged_call(runner, *CALLS[3], 0)
    info = runner.engine.info()
    assert info["replay_limit_tokens"] == 8  # all three won; the capacity kept one
    tokens, full, window = 14, (0, 0, 2, 6, 10, 14), (0, 2, 6, 10, 14)
    out, want = merged_call(runner, tokens, full, window, 1)
    torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert info["chunked_calls"] == 1 and info["fallback_gate"] == 0


def test_a_failed_precapture_leaves_the_runner_eager_for_good(vit_patch, fake_cuda):
    vit_patch(vit_graph_mode="bucket", vit_graph_token_buckets="8,16", vit_graph_replay_max_tokens=16)
    tower = windowed_merged_tower("triton_attn")
    tower.blocks[1].fail_capture = True
    runner = new_runner(tower)
    for step in range(3):
        out, want = merged_call(runner, *CALLS[1], step)
        torch.testing.assert_close(out, want)
    info = runner.engine.info()
    assert not graphs(runner) and info["replay_limit_tokens"] == 0
    assert len(fake_cuda.created) == 1 and info["fallback_gate"] == 3  # one failed capture, never retried


def test_the_ladder_is_cut_to_the_capacity(vit_patch, fake_cuda):
    runner = budget_runner(vit_patch, vit_graph_max_entries=2)
    merged_call(runner, *CALLS[3], 0)
    info = runner.engine.info()
    assert sorted(k.num_tokens for k in graphs(runner)) == [8, 16] and info["replay_limit_tokens"] == 16
    out, want = merged_call(runner, *CALLS[4], 1)  # 26 tokens: chunks, no capture, no eviction
    torch.testing.assert_close(out, want)
    assert (runner.engine.info()["captures"], runner.engine.info()["evictions"]) == (2, 0)


def test_sdpa_runs_eager_and_never_captures(vit_patch, fake_cuda, caplog):
    runner = budget_runner(vit_patch, backend="sdpa")
    with caplog.at_level("WARNING", logger="sglang_ext.vit_cuda_graph"):
        out, want = merged_call(runner, *CALLS[0], 0)
    torch.testing.assert_close(out, want)
    assert not graphs(runner) and "sdpa" in caplog.text


class SampledTower(nn.Module):
    """A tower whose graph path hands the runner a fixed batch, as Qwen2.5-VL's forward_with_cuda_graph does."""

    def __init__(self, runner_tower):
        super().__init__()
        self.tower = runner_tower
        self.spatial_merge_unit = 2
        self.patch_embed = SimpleNamespace(proj=SimpleNamespace(weight=torch.zeros(4, 3)))
        self.cuda_graph_runner = new_runner(runner_tower)
        self.sample_grids = []

    dtype = torch.float32
    device = torch.device("cpu")

    def forward_with_cuda_graph(self, pixels, grid_thw):
        self.sample_grids.append((tuple(pixels.shape), grid_thw.tolist()))
        tokens, full, window = CALLS[0]
        x = torch.zeros(tokens, 1)
        return self.cuda_graph_runner.run(x, torch.tensor(full, dtype=torch.int32),
                                          torch.tensor(window, dtype=torch.int32), (x, x),
                                          attention_layout_key=(full, window))


def test_model_runner_captures_the_ladder_after_its_own_graphs(vit_patch, fake_cuda, monkeypatch):
    import sglang.srt.model_executor.model_runner as model_runner_module

    vit_patch(vit_graph_mode="bucket", vit_graph_replay_max_tokens=4096)
    model = nn.Module()
    model.visual = SampledTower(windowed_merged_tower("triton_attn", window_tokens=64))
    events = []
    fake_runner = SimpleNamespace(model=model, server_args=SimpleNamespace(chunked_prefill_size=1024,
                                                                           max_prefill_tokens=16384))
    init_cuda_graphs = model_runner_module.ModelRunner.init_cuda_graphs  # sglang's, wrapped by the patch
    monkeypatch.setattr(init_cuda_graphs, "__wrapped__",
                        lambda *a, **k: events.append(("sglang graphs", len(fake_cuda.created))))
    init_cuda_graphs(fake_runner)
    runner = model.visual.cuda_graph_runner
    # sglang's captures first; then the ladder, up to the largest call the prefill chunk allows:
    # 1024 LLM tokens x merge unit 2 = 2048 patches (512 growing by 26 % in multiples of 64).
    assert events == [("sglang graphs", 0)]
    assert runner.engine.ladder.budgets == (512, 704, 832, 1088, 1344, 1664, 2112)  # the default ladder's first 7
    assert model.visual.sample_grids == [((256, 3), [[1, 16, 16]])]  # the synthetic image, not served
    info = runner.engine.info()
    assert info["captures"] == 7 and info["hits"] == 0 and info["replay_limit_tokens"] == 2112
    out, want = merged_call(runner, *CALLS[0], 0)  # the first real call replays, captures nothing
    torch.testing.assert_close(out, want)
    assert (runner.engine.info()["captures"], runner.engine.info()["hits"]) == (7, 1)


def test_a_sample_that_fails_leaves_graphs_off(vit_patch, fake_cuda, caplog):
    vit_patch(vit_graph_mode="bucket", vit_graph_replay_max_tokens=4096)
    tower = SampledTower(windowed_merged_tower("triton_attn", window_tokens=64))
    tower.patch_embed = None  # the synthetic image cannot be built
    runner = tower.cuda_graph_runner
    with caplog.at_level("WARNING", logger="sglang_ext.vit_cuda_graph"):
        runner.engine.capture_at_load(tower, 2048)
    assert "stay off" in caplog.text and runner.engine.ladder.replay_limit == 0 and not fake_cuda.created
    out, want = merged_call(runner, *CALLS[0], 0)
    torch.testing.assert_close(out, want)
    assert runner.engine._sampling is None and not graphs(runner)


# --- The full-attention sequence slots of a budget graph (BUCKET_SEQUENCES) ---

SLOTS = vit_strategy.BUCKET_SEQUENCES
SMALL = (SLOTS // 4 + 1) * 4  # the budget just above SLOTS one-token sequences (40 for 36 slots)
LARGE = -(-2 * SLOTS // 4) * 4  # the replay limit: room for twice as many tokens as slots (72)


def slot_runner(vit_patch):
    """Budgets SMALL and LARGE on a tower without windows and merge unit 1: every token can be a sequence."""
    vit_patch(vit_graph_mode="bucket", vit_graph_token_buckets=f"{SMALL},{LARGE}", vit_graph_replay_max_tokens=LARGE)
    return new_runner(StubTower(fullatt=()))


def sequences(*lengths):
    """cu_seqlens of sequences of these lengths."""
    cuts = [0]
    for n in lengths:
        cuts.append(cuts[-1] + n)
    return tuple(cuts)


def counted(runner):
    info = runner.engine.info()
    return {k: info[k] for k in ("hits", "fallback_no_fit", "fallback_gate", "chunked_calls", "chunks", "captures")}


@pytest.mark.parametrize("full, replays", [
    (sequences(*[1] * (SLOTS - 1), SMALL - (SLOTS - 1)), True),  # every slot, no padding
    (sequences(*[1] * (SLOTS - 1)), True),  # one slot left: the padding sequence takes it
    (sequences(*[1] * SLOTS, SMALL - SLOTS), False),  # one sequence more than the slots
    (sequences(*[1] * SLOTS), False),  # every slot taken, the padding needs one more
], ids=["slots-exactly", "slots-with-padding", "one-over", "one-over-with-padding"])
def test_a_call_replays_only_while_its_sequences_and_padding_fit_the_slots(vit_patch, fake_cuda, full, replays):
    runner = slot_runner(vit_patch)
    call(runner, SMALL, sequences(SMALL), qwen3=True)  # pre-capture, then one hit
    before = counted(runner)
    out, want = call(runner, full[-1], full, qwen3=True, position=1)
    torch.testing.assert_close(out, want)
    after = counted(runner)
    assert after["captures"] == before["captures"] == 2  # nothing captured for it
    assert (after["hits"] - before["hits"], after["fallback_no_fit"] - before["fallback_no_fit"]) == (
        (1, 0) if replays else (0, 1))
    if replays:
        key = next(k for k in graphs(runner) if k.num_tokens == SMALL)
        assert key.full_slots == SLOTS and len(graphs(runner)[key].cu_full) == SLOTS + 1
        assert graphs(runner)[key].cu_full.tolist() == list(full) + [SMALL] * (SLOTS + 1 - len(full))


def test_chunks_above_the_limit_leave_one_slot_for_their_padding(vit_patch, fake_cuda):
    """A call above the replay limit with many small images: each chunk holds SLOTS - 1 whole sequences,
    so with its padding sequence it fills every slot and replays."""
    runner = slot_runner(vit_patch)
    call(runner, SMALL, sequences(SMALL), qwen3=True)  # pre-capture
    before = counted(runner)
    tokens = 2 * (SLOTS - 1) + 10  # one-token images: chunks of SLOTS - 1, SLOTS - 1 and 10 sequences
    out, want = call(runner, tokens, sequences(*[1] * tokens), qwen3=True, position=2)
    torch.testing.assert_close(out, want)
    after = counted(runner)
    assert {k: after[k] - before[k] for k in after} == {
        "hits": 3, "fallback_no_fit": 0, "fallback_gate": 0, "chunked_calls": 1, "chunks": 3, "captures": 0}
    key = next(k for k in graphs(runner) if k.num_tokens == SMALL)
    assert graphs(runner)[key].cu_full.tolist() == list(range(11)) + [SMALL] * (SLOTS - 10)  # the last chunk's


def test_a_chunk_of_whole_sequences_fills_every_slot_of_the_largest_budget(vit_patch, fake_cuda):
    """Two-token images above the limit: each chunk, SLOTS - 1 images and the padding, fills the largest
    budget's slots (its cu_seqlens is every slot's boundary)."""
    runner = slot_runner(vit_patch)
    call(runner, SMALL, sequences(SMALL), qwen3=True)  # pre-capture
    before = counted(runner)
    images = 2 * (SLOTS - 1)
    out, want = call(runner, 2 * images, sequences(*[2] * images), qwen3=True, position=3)
    torch.testing.assert_close(out, want)
    after = counted(runner)
    assert (after["hits"] - before["hits"], after["chunks"] - before["chunks"]) == (2, 2)
    assert after["fallback_no_fit"] == before["fallback_no_fit"] and after["fallback_gate"] == before["fallback_gate"]
    key = next(k for k in graphs(runner) if k.num_tokens == LARGE)
    assert graphs(runner)[key].cu_full.tolist() == list(range(0, 2 * SLOTS - 1, 2)) + [LARGE]  # SLOTS sequences
