"""Server-shaped ViT batches through the default (bucket) mode, on CPU with the CUDA-graph recorder.

A prefill batch of 1-8 requests of 1-3 images (224-896 px) reaches the tower as one call. Each tower
here has a Qwen model's geometry and calls sglang's own (patched) graph path: Qwen2.5-VL's
`forward_with_cuda_graph` with sglang's `get_window_index` and rotary position ids, Qwen3-VL's
`forward_with_cuda_graph`; only the blocks and the merger are one-channel stubs. The ladder is
captured through the patched `ModelRunner.init_cuda_graphs`, as a server does at start; then no
call may capture, and calls up to 4,096 patches must replay.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

from test_vit_cuda_graph_runner import _CAPTURING, StubTower, fake_cuda, new_runner, vit_patch  # noqa: E402,F401

REPLAY_LIMIT = 4096  # patches


class UnitMerger(nn.Module):
    """Output row i sums input rows unit*i .. unit*i + unit - 1 (a spatial merge of `unit` patches)."""

    def __init__(self, unit):
        super().__init__()
        self.unit = unit

    def forward(self, x):
        def merged():
            return x.squeeze(1).view(-1, self.unit, x.shape[-1]).sum(1)

        out = merged()
        if _CAPTURING[0] is not None:
            _CAPTURING[0].thunks.append(lambda: out.copy_(merged()))
        return out


class PatchEmbed(nn.Module):
    """One channel in, one out: the pixels are the tower's input rows."""

    def __init__(self):
        super().__init__()
        self.proj = SimpleNamespace(weight=torch.zeros(1, 1))

    def forward(self, x):
        return x


def qwen_tower(qwen3):
    """A stub tower with Qwen2.5-VL's (patch 14, 112 px windows) or Qwen3-VL's (patch 16) geometry, merge 2."""
    from sglang.srt.models import qwen2_5_vl, qwen3_vl
    from sglang.srt.models.utils import RotaryPosMixin

    class Qwen2_5(StubTower, RotaryPosMixin):
        patch_size, spatial_merge_size, spatial_merge_unit, window_size = 14, 2, 4, 112
        get_window_index = qwen2_5_vl.Qwen2_5_VisionTransformer.get_window_index

        def rotary_pos_emb(self, seq):
            return seq.float().unsqueeze(1) / 64

        def forward_with_cuda_graph(self, x, grid_thw):  # the class's method as the patch left it
            return qwen2_5_vl.Qwen2_5_VisionTransformer.forward_with_cuda_graph(self, x, grid_thw)

    class Qwen3(StubTower):
        patch_size, spatial_merge_size, spatial_merge_unit = 16, 2, 4

        def _use_vectorized_pos_embed(self, num_images):
            return False

        def fast_pos_embed_interpolate_from_list(self, grid):
            return torch.zeros(sum(t * h * w for t, h, w in grid), 1)

        def rot_pos_emb(self, grid):
            tokens = sum(t * h * w for t, h, w in grid)
            return torch.ones(tokens, 2), torch.zeros(tokens, 2)

        def forward_with_cuda_graph(self, x, grid_thw):
            return qwen3_vl.Qwen3VLMoeVisionModel.forward_with_cuda_graph(self, x, grid_thw)

    tower = Qwen3(fullatt=()) if qwen3 else Qwen2_5(fullatt=(1,))
    for blk in tower.blocks:
        blk.forward = blk._forward_without_metadata  # the graph-form call both backends take
    tower.merger, tower.patch_embed = UnitMerger(4), PatchEmbed()
    setattr(tower, "graph_runners" if qwen3 else "cuda_graph_runner", new_runner(tower))
    return tower


def server_stream(rng, calls, unit_px, patch):
    """`calls` grids: 1-8 requests of 1-3 images each, sides 224-896 px in multiples of `unit_px`."""
    sides = range(-(-224 // unit_px), 896 // unit_px + 1)
    for _ in range(calls):
        images = sum(rng.randint(1, 3) for _ in range(rng.randint(1, 8)))
        yield [[1, rng.choice(sides) * unit_px // patch, rng.choice(sides) * unit_px // patch] for _ in range(images)]


@pytest.mark.parametrize("qwen3", [False, True], ids=["qwen2_5_vl", "qwen3_vl"])
def test_server_shaped_batches_capture_nothing_and_small_calls_replay(vit_patch, fake_cuda, monkeypatch, qwen3):
    import sglang.srt.model_executor.model_runner as model_runner_module

    vit_patch(vit_graph_mode="bucket", vit_graph_replay_max_tokens=REPLAY_LIMIT)
    tower = qwen_tower(qwen3)
    runner = tower.graph_runners if qwen3 else tower.cuda_graph_runner
    model = nn.Module()
    model.visual = tower
    init_cuda_graphs = model_runner_module.ModelRunner.init_cuda_graphs  # sglang's, wrapped by the patch
    monkeypatch.setattr(init_cuda_graphs, "__wrapped__", lambda *a, **k: None)
    init_cuda_graphs(SimpleNamespace(model=model, server_args=SimpleNamespace(chunked_prefill_size=8192)))
    at_load = runner.engine.info()["captures"]
    assert at_load == len(runner.engine.ladder.budgets) > 0 and runner.engine.ladder.replay_limit <= REPLAY_LIMIT

    small = replayed = 0
    unit_px, patch = (32, 16) if qwen3 else (28, 14)
    for grid in server_stream(random.Random(0), 300, unit_px, patch):
        grid_thw = torch.tensor(grid)
        tokens = int(grid_thw.prod(dim=1).sum())
        before = runner.engine.info()
        with torch.no_grad():
            out = tower.forward_with_cuda_graph(torch.zeros(tokens, 1), grid_thw)
        after = runner.engine.info()
        assert tuple(out.shape) == (tokens // 4, 1)
        if tokens <= REPLAY_LIMIT:
            small += 1
            replayed += after["hits"] > before["hits"] and after["fallbacks"] == before["fallbacks"]
    info = runner.engine.info()
    assert info["captures"] == at_load and info["misses"] == 0  # nothing captured while serving
    assert small >= 20 and replayed >= 0.95 * small, (replayed, small, info)
