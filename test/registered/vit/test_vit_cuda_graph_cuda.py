"""ViT CUDA graphs on sglang (0.5.17, 0.5.23: the release on sys.path) with the vit_cuda_graph patch, on a real GPU.

Real CUDA graphs, sglang's real `ViTCudaGraphRunner` (the patch's subclass), and for the
tower tests sglang's real `Qwen2_5_VisionTransformer` / `Qwen3VLMoeVisionModel` (random
weights) on triton_attn, and on fa3 (the real FlashAttention-3 of sgl_kernel's flash_ops). The
fa3 tests run when the run asks for fa3 (SGX_BACKENDS, default "default,triton_attn": sglang's
default is fa3 on SM90) and then FAIL if FA3 does not import; SGX_BACKENDS=triton_attn skips
them. They print max |graph - eager| and how many outputs were bitwise equal.
On sglang 0.5.17 without the patch, the boundary and workspace tests fail (stale
cu_seqlens / a freed rotary buffer) and the memory test grows without bound.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from torch import nn

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=120, stage="base-b", runner_config="1-gpu-small")


from sglang_ext.registry import PATCH_NAMES  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

THIS_PATCH = "vit_cuda_graph"


@pytest.fixture
def vit_patch(ext_patches, monkeypatch):
    """Only this patch, strict, through the real activation path; ViT graph mode on."""
    monkeypatch.setenv("SGLANG_VIT_ENABLE_CUDA_GRAPH", "1")

    def activate(**knobs):
        knobs.setdefault("vit_graph_mode", "layout")  # tests of the per-layout machinery; bucket tests say so
        statuses = ext_patches(disable=",".join(n for n in PATCH_NAMES if n != THIS_PATCH), **knobs)
        if statuses:
            assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
        return statuses

    return activate


# ---------------------------------------------------------------------------
# A tower whose output depends on boundaries and positions (upstream's test shape)
# ---------------------------------------------------------------------------


class BoundaryBlock(nn.Module):
    """Upstream's `_BoundaryBlock`: out = x + cu_seqlens[1] + position."""

    def __init__(self):
        super().__init__()
        self.attn = type("AttentionConfig", (), {"num_attention_heads_per_partition": 1, "head_size": 1,
                                                  "qkv_backend_name": "triton_attn"})()

    def forward(self, x, *, cu_seqlens, position_embeddings, output_ws=None):
        boundary = cu_seqlens[0][1].to(x.dtype)
        position = position_embeddings[0][: x.shape[0], :1].unsqueeze(1)
        return x + boundary + position


class SequenceLengthBlock(nn.Module):
    """Each token gets + the length of its sequence + its position; graph-capturable (no host reads)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.attn = type("AttentionConfig", (), {"num_attention_heads_per_partition": 1, "head_size": hidden,
                                                  "qkv_backend_name": "triton_attn"})()

    def forward(self, x, *, cu_seqlens, position_embeddings, output_ws=None, forward_metadata=None):
        cu = forward_metadata.cu_seqlens if forward_metadata is not None else cu_seqlens[0]
        tokens = torch.arange(x.shape[0], device=x.device, dtype=cu.dtype)
        owner = torch.searchsorted(cu[1:], tokens, right=True)
        owner_len = (cu[owner + 1] - cu[owner]).to(x.dtype)
        return x * 0.5 + owner_len.view(-1, 1, 1) + position_embeddings[0][: x.shape[0], :1].unsqueeze(1)


class Merger(nn.Module):
    def forward(self, x):
        return x.squeeze(1)


class Tower(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.blocks = nn.ModuleList([block])
        self.merger = Merger()
        self.use_data_parallel = True
        self.deepstack_visual_indexes = []
        self.deepstack_merger_list = None
        self.max_context_len = None
        self.register_buffer("anchor", torch.empty(0, device="cuda"))

    @property
    def device(self):
        return self.anchor.device

    @property
    def dtype(self):
        return torch.float32


def run_boundary(runner, seq_len, boundaries, position, *, with_key):
    x = torch.zeros(seq_len, 1, device="cuda")
    cu = torch.tensor(boundaries, dtype=torch.int32, device="cuda")
    positions = torch.full((seq_len, 1), float(position), device="cuda")
    key = dict(attention_layout_key=(tuple(boundaries), None)) if with_key else {}
    out = runner.run(x, cu, None, (positions, positions), **key)
    torch.cuda.synchronize()
    return out.cpu()


@pytest.mark.parametrize("with_key", [True, False], ids=["cpu-layout-key", "upstream-call-no-key"])
def test_vit_graph_replays_current_attention_and_position_metadata(vit_patch, with_key):
    """Upstream's GPU scenario. With a key: real graphs. Without (upstream's call): eager, never a sync."""
    vit_patch()
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    runner = ViTCudaGraphRunner(Tower(BoundaryBlock()))
    first = run_boundary(runner, 4, [0, 2, 4], 1, with_key=with_key)
    different_layout = run_boundary(runner, 4, [0, 1, 4], 1, with_key=with_key)
    run_boundary(runner, 8, [0, 8], 7, with_key=with_key)
    small_after_growth = run_boundary(runner, 4, [0, 2, 4], 5, with_key=with_key)

    torch.testing.assert_close(first, torch.full_like(first, 3))
    torch.testing.assert_close(different_layout, torch.full_like(different_layout, 2))
    torch.testing.assert_close(small_after_growth, torch.full_like(small_after_growth, 7))
    info = runner.engine.info()
    if with_key:
        assert (info["captures"], info["hits"], info["fallbacks"]) == (3, 1, 0)
    else:
        assert (info["captures"], info["fallback_no_cpu_layout"]) == (0, 4)


def test_small_graph_keeps_its_rotary_buffer_when_the_allocator_would_reuse_it(vit_patch):
    """0.5.17 frees the old workspace on growth; fill the allocator's free blocks with garbage to expose it."""
    vit_patch()
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    runner = ViTCudaGraphRunner(Tower(BoundaryBlock()))
    torch.testing.assert_close(run_boundary(runner, 64, [0, 32, 64], 1, with_key=True), torch.full((64, 1), 33.0))
    (small_key,) = runner.engine.store.graphs
    small_cos = runner.engine.store.graphs[small_key].rotary[0]
    small_ptr, small_bytes = small_cos.data_ptr(), small_cos.untyped_storage().nbytes()
    run_boundary(runner, 4096, [0, 4096], 7, with_key=True)  # grows the rotary workspace
    # Anything freed of that size would now be handed out again, and overwritten.
    garbage = [torch.full((small_bytes // 4,), 1000.0, device="cuda") for _ in range(64)]
    assert all(g.untyped_storage().data_ptr() != small_cos.untyped_storage().data_ptr() for g in garbage)
    after = run_boundary(runner, 64, [0, 32, 64], 5, with_key=True)
    torch.testing.assert_close(after, torch.full_like(after, 37))
    assert runner.engine.store.graphs[small_key].rotary[0].data_ptr() == small_ptr
    assert runner.engine.store.retired_rotary_buffers() == 1
    del garbage


def _expected_sequence_length_output(x, layout, position):
    lengths = torch.tensor(layout[1:]) - torch.tensor(layout[:-1])
    owner_len = torch.repeat_interleave(lengths, lengths).to(torch.float32).view(-1, 1)
    return x.cpu() * 0.5 + owner_len + position


def test_capacity_overflow_falls_back_to_eager_with_identical_output(vit_patch, set_knob):
    vit_patch(vit_graph_max_entries=2, vit_graph_policy="exact")
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    hidden = 8
    graphs = ViTCudaGraphRunner(Tower(SequenceLengthBlock(hidden)))
    layouts = [(0, 100, 256), (0, 56, 256), (0, 128, 200, 256), (0, 1, 256)]
    x = torch.randn(256, hidden, device="cuda")
    pos = torch.randn(256, 1, device="cuda").expand(256, hidden).contiguous()
    outs = []
    for layout in layouts:
        cu = torch.tensor(layout, dtype=torch.int32, device="cuda")
        outs.append(graphs.run(x, cu, None, (pos, pos), attention_layout_key=(layout, None)))
    info = graphs.engine.info()
    assert (info["captures"], info["fallback_capacity"]) == (2, 2)
    for layout, out in zip(layouts, outs):
        want = _expected_sequence_length_output(x, layout, pos[:, :1].cpu())
        torch.testing.assert_close(out.cpu(), want)
    # The eager results equal what a graph computes for the same layouts.
    set_knob("vit_graph_max_entries", "8")  # read when a runner is first used
    roomy = ViTCudaGraphRunner(Tower(SequenceLengthBlock(hidden)))
    for layout, out in zip(layouts[2:], outs[2:]):
        cu = torch.tensor(layout, dtype=torch.int32, device="cuda")
        graphed = roomy.run(x, cu, None, (pos, pos), attention_layout_key=(layout, None))
        assert torch.equal(graphed, out)
    assert roomy.engine.info()["captures"] == 2


def test_graph_memory_stays_flat_over_1000_random_layouts(vit_patch):
    vit_patch(vit_graph_max_entries=4)
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    hidden = 256
    runner = ViTCudaGraphRunner(Tower(SequenceLengthBlock(hidden)))
    rng = random.Random(0)

    def one(step):
        tokens = rng.choice((1024, 2048, 4096))
        cuts = sorted(rng.sample(range(1, tokens), rng.randint(1, 3)))  # ~never the same layout twice
        layout = (0, *cuts, tokens)
        x = torch.randn(tokens, hidden, device="cuda")
        pos = torch.full((tokens, hidden), float(step % 7), device="cuda")
        out = runner.run(x, torch.tensor(layout, dtype=torch.int32, device="cuda"), None, (pos, pos),
                         attention_layout_key=(layout, None))
        if step % 50 == 0:
            torch.testing.assert_close(out.cpu(), _expected_sequence_length_output(x, layout, float(step % 7)))

    for step in range(100):
        one(step)
    torch.cuda.synchronize()
    reserved_after_warmup = torch.cuda.memory_reserved()
    for step in range(100, 1000):
        one(step)
    torch.cuda.synchronize()
    growth = torch.cuda.memory_reserved() - reserved_after_warmup
    info = runner.engine.info()
    assert info["captures"] > 900 and info["evictions"] > 900 and info["resident_graphs"] == 4
    assert growth <= 64 << 20, f"graph memory grew by {growth / 2**20:.1f} MiB over 900 layouts"
    assert info["rotary_backing_buffers"] <= 2


class HostReadBlock(SequenceLengthBlock):
    """Reads a device value on the host while a graph captures: the capture is invalidated."""

    def forward(self, x, *, cu_seqlens, position_embeddings, output_ws=None, forward_metadata=None):
        if torch.cuda.is_current_stream_capturing():
            int(cu_seqlens[0][-1])
        return super().forward(x, cu_seqlens=cu_seqlens, position_embeddings=position_embeddings,
                               output_ws=output_ws, forward_metadata=forward_metadata)


def test_failed_capture_runs_eager_and_leaves_the_shared_pool_usable(vit_patch):
    """A capture that CUDA invalidates runs that batch eager; afterwards CUDA RNG works and other
    runners still capture into sglang's global graph pool (no 'already recording to mempool_id')."""
    vit_patch()
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    hidden = 8
    layout = (0, 40, 128)
    x = torch.randn(128, hidden, device="cuda")
    pos = torch.randn(128, 1, device="cuda").expand(128, hidden).contiguous()
    cu = torch.tensor(layout, dtype=torch.int32, device="cuda")
    want = _expected_sequence_length_output(x, layout, pos[:, :1].cpu())
    broken = ViTCudaGraphRunner(Tower(HostReadBlock(hidden)))
    for _ in range(2):
        out = broken.run(x, cu, None, (pos, pos), attention_layout_key=(layout, None))
        torch.testing.assert_close(out.cpu(), want)
    info = broken.engine.info()
    assert (info["failures"], info["fallback_capture_failed"], info["fallback_quarantined"]) == (1, 1, 1)
    assert torch.isfinite(torch.randn(64, device="cuda")).all()  # the generator left capture mode
    working = ViTCudaGraphRunner(Tower(SequenceLengthBlock(hidden)))
    for _ in range(2):
        out = working.run(x, cu, None, (pos, pos), attention_layout_key=(layout, None))
        torch.testing.assert_close(out.cpu(), want)
    info = working.engine.info()
    assert (info["captures"], info["hits"], info["failures"]) == (1, 1, 0)


# ---------------------------------------------------------------------------
# sglang's real Qwen2.5-VL vision tower
# ---------------------------------------------------------------------------


@pytest.fixture  # per test: fa3_runtime's teardown resets the published context
def qwen_runtime():
    from sglang_ext_testkit import qwen_vit_kit as kit
    from sglang.srt import runtime_context

    kit.publish_runtime("triton_attn")
    kit.init_single_rank_parallel_state()
    yield kit
    runtime_context.reset_context()


@pytest.mark.parametrize(("dtype", "mode"), [(torch.float32, "layout"), (torch.bfloat16, "layout"),
                                             (torch.float32, "class"), (torch.float32, "bucket"),
                                             (torch.bfloat16, "bucket")],
                         ids=["fp32", "bf16", "fp32-class", "fp32-bucket", "bf16-bucket"])
def test_qwen2_5_vision_tower_graph_output_equals_eager(vit_patch, qwen_runtime, dtype, mode):
    kit = qwen_runtime
    vit_patch(vit_graph_max_entries=6, vit_graph_mode=mode)
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=dtype, seed=1)
    assert vit.cuda_graph_runner is not None and vit.blocks[0].attn.qkv_backend_name == "triton_attn"
    rng = random.Random(3)
    sides = (4, 6, 8, 12, 16)
    batches = [kit.random_batch(rng, sides) for _ in range(10)]
    worst = 0.0
    for step in range(40):
        pixels, grid = batches[rng.randrange(len(batches))] if step % 3 else kit.random_batch(rng, sides)
        graphed = kit.forward(vit, pixels, grid, graph=True)
        eager = kit.forward(vit, pixels, grid, graph=False)
        assert graphed.shape == eager.shape and torch.isfinite(eager).all()
        worst = max(worst, (graphed.float() - eager.float()).abs().max().item())
        if dtype == torch.float32:
            # Bucket mode pads the GEMMs' row count: cuBLAS may pick another kernel (rounding only).
            tol = 1e-4 if mode == "bucket" else 1e-5
            torch.testing.assert_close(graphed, eager, rtol=tol, atol=tol, msg=f"step {step} grid {grid.tolist()}")
        else:
            torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2, msg=f"step {step} grid {grid.tolist()}")
    info = vit.cuda_graph_runner.engine.info()
    print(f"\nqwen2.5 tower {dtype} {mode}: max |graph - eager| = {worst:.3g}; {info}")
    assert info["hits"] > 0 and info["resident_graphs"] <= 6 and info["mode"] == mode
    if mode == "layout":
        assert info["evictions"] > 0
    if mode == "bucket":
        assert info["padded_batches"] > 0


def test_qwen2_5_tower_equal_token_batches_with_other_boundaries(vit_patch, qwen_runtime):
    """The bug report: same total tokens, different image boundaries -> must not reuse the graph."""
    kit = qwen_runtime
    vit_patch()
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=torch.float32, seed=2)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(192, 3 * 2 * 14 * 14, generator=g)
    two_images = torch.tensor([[1, 8, 12], [1, 8, 12]])  # 96 + 96 tokens
    one_image = torch.tensor([[1, 12, 16]])  # 192 tokens
    for grid in (two_images, one_image, two_images):
        graphed = kit.forward(vit, pixels, grid, graph=True)
        eager = kit.forward(vit, pixels, grid, graph=False)
        torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-5)
    info = vit.cuda_graph_runner.engine.info()
    assert (info["captures"], info["hits"]) == (2, 1)


def test_qwen2_5_graph_forward_queues_a_replay_without_a_device_sync(vit_patch, qwen_runtime):
    """A hit of the patched forward never waits for the device: its host-to-device copies (pixels,
    window index, rotary position ids) are non-blocking from pinned memory. torch's sync debug mode
    turns any synchronizing call into an error. 0.5.17's body syncs at least twice (window index,
    position ids)."""
    kit = qwen_runtime
    vit_patch(vit_graph_max_entries=4, vit_graph_mode="bucket")
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=torch.bfloat16, seed=1)
    pixels, grid = kit.random_batch(random.Random(7), (4, 8, 12), dtype=torch.bfloat16)
    first = kit.forward(vit, pixels, grid, graph=True)  # captures
    torch.cuda.synchronize()
    hits = vit.cuda_graph_runner.engine.info()["hits"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = kit.forward(vit, pixels, grid, graph=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert vit.cuda_graph_runner.engine.info()["hits"] == hits + 1
    assert torch.equal(again, first)
    eager = kit.forward(vit, pixels, grid, graph=False)
    torch.testing.assert_close(again, eager, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------
# fa3 (the Hopper default): class and bucket modes on the real FlashAttention-3 kernel
# ---------------------------------------------------------------------------


@pytest.fixture
def fa3_runtime():
    from sglang_ext_testkit import qwen_vit_kit as kit

    kit.require_fa3()  # asked for (SGX_BACKENDS, default on SM90) and not importable: fails, never skips
    from sglang.srt import runtime_context

    kit.publish_runtime("fa3")
    kit.init_single_rank_parallel_state()
    yield kit
    runtime_context.reset_context()


BUCKET_KNOBS = dict(vit_graph_token_buckets="512,1024,2048,4096", vit_graph_replay_max_tokens=4096)


def _compare(label, pairs, *, bitwise_expected):
    """Max |graph - eager| over (graph, eager) pairs, printed; bitwise when the kernels allow it."""
    worst = max((g.float() - e.float()).abs().max().item() for g, e in pairs)
    bitwise = sum(bool(torch.equal(g, e)) for g, e in pairs)
    print(f"\n{label}: max |graph - eager| = {worst:.3g}; bitwise equal {bitwise} / {len(pairs)}")
    for graphed, eager in pairs:
        assert graphed.shape == eager.shape and torch.isfinite(eager).all()
        torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)  # bf16 rounding
    if bitwise_expected:
        assert bitwise == len(pairs), f"{label}: fa3 class mode should be bitwise equal to eager"
    return worst, bitwise


@pytest.mark.parametrize("mode", ["class", "bucket"])
def test_fa3_qwen2_5_tower_class_and_bucket_modes_equal_eager(vit_patch, fa3_runtime, mode):
    """Class mode: larger max_seqlen bound + empty trailing sequences -> bitwise (num_splits=1).
    Bucket mode: padded GEMM rows -> within bf16 rounding, bitwise count printed."""
    kit = fa3_runtime
    vit_patch(vit_graph_max_entries=16, vit_graph_mode=mode, **BUCKET_KNOBS if mode == "bucket" else {})
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=torch.bfloat16, seed=1)
    assert vit.blocks[0].attn.qkv_backend_name == "fa3"
    print(kit.kernel_report("fa3"))
    rng = random.Random(5)
    sides = (4, 6, 8, 12, 16, 20, 24, 32)
    batches = [kit.random_batch(rng, sides) for _ in range(12)]
    pairs = []
    for step in range(48):
        pixels, grid = batches[rng.randrange(len(batches))] if step % 3 else kit.random_batch(rng, sides)
        pairs.append((kit.forward(vit, pixels, grid, graph=True), kit.forward(vit, pixels, grid, graph=False)))
    info = vit.cuda_graph_runner.engine.info()
    _compare(f"fa3 qwen2.5 bf16 {mode}", pairs, bitwise_expected=(mode == "class"))
    print(info)
    assert info["mode"] == mode and info["attention_backend"] == "fa3" and info["hits"] > 0
    if mode == "bucket":  # one key per bucket, captured at the first run: every batch replays
        assert info["captures"] == 4 and info["misses"] == 0 and info["padded_batches"] > 0


@pytest.mark.parametrize("mode", ["class", "bucket"])
def test_fa3_qwen3_tower_class_and_bucket_modes_equal_eager(vit_patch, fa3_runtime, monkeypatch, set_knob, mode):
    """References: the same tower through the runner's eager fallback (capacity 0: the same blocks and
    merger run eagerly; bitwise in class mode) and sglang's eager `forward` (within bf16 rounding; the
    bitwise count is printed). Before our Qwen3 graph inputs, 0.5.17's graph path was 0.129 from the
    eager forward here (H200, 2026-12-01)."""
    kit = fa3_runtime
    from sglang.srt.layers.attention import vision

    monkeypatch.setattr(vision, "apply_rotary_pos_emb", vision.apply_rotary_pos_emb_native_eager)
    vit_patch(vit_graph_max_entries=16, vit_graph_mode=mode, **BUCKET_KNOBS if mode == "bucket" else {})
    graphed_vit = kit.build_qwen3_tower(dtype=torch.bfloat16, seed=2)
    eager_vit = kit.build_qwen3_tower(dtype=torch.bfloat16, seed=2)
    assert graphed_vit.blocks[0].attn.qkv_backend_name == "fa3"
    rng = random.Random(6)
    sides = (4, 8, 12, 16, 24, 32)
    batches = [kit.random_batch(rng, sides, patch_dim=kit.QWEN3_PATCH_DIM, dtype=torch.bfloat16) for _ in range(8)]
    pairs, forward_pairs = [], []
    for step in range(32):
        pixels, grid = batches[rng.randrange(len(batches))] if step % 3 else kit.random_batch(
            rng, sides, patch_dim=kit.QWEN3_PATCH_DIM, dtype=torch.bfloat16)
        graphed = kit.forward_qwen3(graphed_vit, pixels, grid, graph=True).clone()
        set_knob("vit_graph_max_entries", "0")  # read at the runner's first run
        pairs.append((graphed, kit.forward_qwen3(eager_vit, pixels, grid, graph=True)))
        set_knob("vit_graph_max_entries", "16")
        forward_pairs.append((graphed, kit.forward_qwen3(eager_vit, pixels, grid, graph=False)))
    info = graphed_vit.graph_runners.engine.info()
    eager_info = eager_vit.graph_runners.engine.info()
    _compare(f"fa3 qwen3 bf16 {mode}", pairs, bitwise_expected=(mode == "class"))
    _compare(f"fa3 qwen3 bf16 {mode} vs sglang's eager forward", forward_pairs, bitwise_expected=False)
    print(info)
    assert eager_info["captures"] == 0 and eager_info["fallback_disabled"] == len(pairs), eager_info
    assert info["mode"] == mode and info["attention_backend"] == "fa3" and info["hits"] > 0


def test_qwen3_tower_graph_output_equals_sglang_eager_forward(ext_patches, qwen_runtime, monkeypatch):
    """Real Qwen3-VL tower (triton_attn, bf16), every batch a new token count (so 0.5.17's token-count
    key cannot alias): sglang-ext's graph output equals sglang's eager `forward` bit for bit. 0.5.17's
    own graph path vs eager is printed too: it differs through its graph inputs' position embedding."""
    kit = qwen_runtime
    from sglang.srt.layers.attention import vision

    monkeypatch.setenv("SGLANG_VIT_ENABLE_CUDA_GRAPH", "1")
    monkeypatch.setattr(vision, "apply_rotary_pos_emb", vision.apply_rotary_pos_emb_native_eager)
    rng = random.Random(6)
    batches, totals = [], set()
    while len(batches) < 6:
        pixels, grid = kit.random_batch(rng, (4, 8, 12, 16), patch_dim=kit.QWEN3_PATCH_DIM, dtype=torch.bfloat16)
        if pixels.shape[0] not in totals:
            totals.add(pixels.shape[0])
            batches.append((pixels, grid))

    def outputs(vit):
        return [(kit.forward_qwen3(vit, p, g, graph=True).clone(), kit.forward_qwen3(vit, p, g, graph=False))
                for p, g in batches]

    upstream = outputs(kit.build_qwen3_tower(dtype=torch.bfloat16, seed=2))
    ext_patches(disable=",".join(n for n in PATCH_NAMES if n != THIS_PATCH), vit_graph_max_entries=16)
    ours = outputs(kit.build_qwen3_tower(dtype=torch.bfloat16, seed=2))
    for label, pairs in (("0.5.17 graph", upstream), ("sglang-ext graph", ours)):
        worst = max((g.float() - e.float()).abs().max().item() for g, e in pairs)
        print(f"\nqwen3 bf16 triton {label} vs sglang's eager forward: max |diff| = {worst:.3g}; "
              f"bitwise {sum(bool(torch.equal(g, e)) for g, e in pairs)} / {len(pairs)}")
    assert all(torch.equal(g, e) for g, e in ours), "sglang-ext graph outputs differ from sglang's eager forward"


# ---------------------------------------------------------------------------
# Bucket mode in a server's life: captured at load, probed, packed, never captured while serving
# ---------------------------------------------------------------------------


@pytest.fixture(params=["triton_attn", "fa3"])
def any_backend(request):
    """The runtime of each vision attention backend bucket mode serves on Hopper (fa4 is Blackwell-only);
    fa3 as the other fa3 tests have it (skipped unless SGX_BACKENDS asks for it, then required)."""
    from sglang_ext_testkit import qwen_vit_kit as kit
    from sglang.srt import runtime_context

    if request.param == "fa3":
        kit.require_fa3()
    kit.publish_runtime(request.param)
    kit.init_single_rank_parallel_state()
    yield kit, request.param
    runtime_context.reset_context()


def test_bucket_ladder_is_captured_at_load_and_serving_never_captures(vit_patch, any_backend):
    """The load hook's path (a synthetic image through the tower, then the ladder), then a stream of
    mixed batches: every output within bf16 rounding of eager, no capture after load, one shared
    input / workspace buffer for the whole ladder, calls above the limit replayed as chunks."""
    kit, backend = any_backend
    vit_patch(vit_graph_mode="bucket", vit_graph_replay_max_tokens=1024)
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=torch.bfloat16, seed=1)
    runner = vit.cuda_graph_runner
    runner.engine.capture_at_load(vit, 4096)  # what ModelRunner.init_cuda_graphs calls
    info = runner.engine.info()
    print(f"\n{backend}: after load {info}")
    assert runner.engine.ladder.budgets == (512, 704, 832) and info["captures"] == 3  # the budgets <= 1024
    assert len({g.input.untyped_storage().data_ptr() for g in runner.engine.store.graphs.values()}) == 1
    rng = random.Random(11)
    pairs = []
    for _ in range(24):  # 1-4 images of up to 32 x 32 patches: many calls above 1024 tokens
        pixels, grid = kit.random_batch(rng, (4, 8, 12, 16, 24, 32), dtype=torch.bfloat16)
        pairs.append((kit.forward(vit, pixels, grid, graph=True), kit.forward(vit, pixels, grid, graph=False)))
    after = runner.engine.info()
    _compare(f"{backend} qwen2.5 bf16 bucket (load-time ladder)", pairs, bitwise_expected=False)
    print(after)
    assert after["captures"] == 3, "a graph was captured while serving"
    assert after["chunked_calls"] > 0 and after["hits"] >= 24


def test_bucket_probe_keeps_only_budgets_that_beat_eager(vit_patch, any_backend):
    """The load-time probe on Qwen2.5-VL-7B's real tower: the replay ladder is the run of budgets,
    smallest first, whose measured graph beat eager, and it ends at the first that did not.
    (How much a graph wins is for scripts/bench_vit.py to say, not a timed assertion here.)"""
    kit, backend = any_backend
    vit_patch(vit_graph_mode="bucket", vit_graph_replay_max_tokens=-1)
    vit = kit.build_qwen2_5_tower(kit.QWEN2_5_VL_7B_CONFIG, dtype=torch.bfloat16, seed=1)
    runner = vit.cuda_graph_runner
    from sglang_ext.vit.strategy import DEFAULT_BUCKETS, token_buckets

    candidates = token_buckets((), 4, 16384)
    assert candidates[0] == DEFAULT_BUCKETS["smallest"]
    runner.engine.capture_at_load(vit, 16384)
    gate = runner.engine.ladder.gate
    print(f"\n{backend} probe: " + "; ".join(f"{r['budget']}: graph {r['graph_ms']} / eager {r['eager_ms']} ms"
                                         for r in gate))
    kept = runner.engine.ladder.budgets
    # 512 tokens of a 7B tower: eager launches ~600 kernels for ~1 ms of device work (5x apart on the H200)
    assert kept and kept[0] == 512, f"a 7B tower at 512 tokens is launch-bound: the graph must win ({gate})"
    assert [r["budget"] for r in gate if r["replay"]] == list(kept)
    assert all(r["replay"] == (r["graph_ms"] < r["eager_ms"]) for r in gate), gate
    assert [r["budget"] for r in gate] == list(candidates[:len(gate)]), gate
    assert all(r["replay"] for r in gate[:-1]), "the probe goes on only while graphs win"
    assert len(gate) == len(candidates) or not gate[-1]["replay"], gate
    assert runner.engine.info()["captures"] >= len(kept)


def test_bucket_eager_calls_use_the_compiled_rotary_and_captures_the_eager_one(vit_patch, any_backend, monkeypatch):
    """Knob vit_triton_rotary off: bucket mode's eager calls apply rotary with sglang's compiled kernel
    (what a graphs-off server runs), the capture and its replays with sglang's capture-safe eager
    function; outputs within bf16 rounding of sglang's forward."""
    kit, backend = any_backend
    from sglang.srt.layers.attention import vision

    compiled, reached = vision.apply_rotary_pos_emb, []

    def recording(*args, **kwargs):
        reached.append(torch.cuda.is_current_stream_capturing())
        return compiled(*args, **kwargs)

    monkeypatch.setattr(vision, "apply_rotary_pos_emb", recording)
    vit_patch(vit_graph_mode="bucket", vit_graph_token_buckets="512", vit_graph_replay_max_tokens=512,
              vit_triton_rotary=0)
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=torch.bfloat16, seed=1)
    runner = vit.cuda_graph_runner
    runner.engine.capture_at_load(vit, 4096)
    assert runner.engine.ladder.budgets == (512,) and reached == [], reached
    rng = random.Random(5)
    small = kit.random_batch(rng, (8,), max_images=1, dtype=torch.bfloat16)  # 64 tokens: a replay
    large = kit.random_batch(rng, (32,), max_images=1, dtype=torch.bfloat16)  # 1,024 tokens: eager
    pairs = [(kit.forward(vit, *small, graph=True), kit.forward(vit, *small, graph=False))]
    assert reached == [], "a replay reached the compiled rotary"
    pairs.append((kit.forward(vit, *large, graph=True), kit.forward(vit, *large, graph=False)))
    assert reached == [False] * len(vit.blocks), reached  # once per block, never inside a capture
    assert runner.engine.info()["hits"] == 1
    _compare(f"{backend} qwen2.5 bf16 bucket: compiled rotary on eager calls", pairs, bitwise_expected=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_knob_triton_rotary_is_sglangs_eager_rotary_bit_for_bit_in_calls_and_captures(vit_patch, any_backend,
                                                                                    monkeypatch, dtype):
    """vit_triton_rotary (the default): the one-kernel rotary returns sglang's eager rotary bit for bit at
    the head shapes of the 7B Qwen2.5-VL tower (16 x 80) and the Qwen3-VL tower (16 x 64), and layout mode
    keeps graph == eager bitwise with the kernel in its captures and its eager calls (both reached)."""
    kit, backend = any_backend
    from sglang.srt.layers.rotary_embedding.utils import apply_rotary_pos_emb_native_eager

    from conftest import ext_core

    rotate_half_qk = ext_core("kernels.rotate_half").rotate_half_qk
    gen = torch.Generator(device="cuda").manual_seed(3)
    for tokens, head_dim in ((1, 80), (63, 80), (4096, 80), (63, 64), (4096, 64)):
        q, k = (torch.randn(tokens, 16, head_dim, device="cuda", generator=gen).to(dtype) for _ in range(2))
        angles = torch.randn(tokens, head_dim // 2, device="cuda", generator=gen) * 8
        cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
        assert all(torch.equal(a, b) for a, b in zip(rotate_half_qk(q, k, cos, sin),
                                                     apply_rotary_pos_emb_native_eager(q, k, cos, sin))), \
            (tokens, head_dim)
    vit_patch(vit_triton_rotary=1)
    rotary = ext_core("vit.vision_rotary")
    reached = []
    monkeypatch.setattr(rotary, "rotate_half_qk",
                        lambda *a, **kw: reached.append(torch.cuda.is_current_stream_capturing())
                        or rotate_half_qk(*a, **kw))
    vit = kit.build_qwen2_5_tower(kit.SMALL_CONFIG, dtype=dtype, seed=1)
    rng = random.Random(7)
    batches = [kit.random_batch(rng, (4, 8, 16), dtype=dtype) for _ in range(6)]
    pairs = [(kit.forward(vit, *b, graph=True), kit.forward(vit, *b, graph=False)) for b in batches]
    assert True in reached and False in reached, "the kernel ran in no capture or in no eager call"
    _compare(f"{backend} qwen2.5 {dtype} layout: one-kernel rotary", pairs, bitwise_expected=True)
