"""Vision rotary: the one-kernel rotary by default; knob off, bucket-mode eager calls reach sglang's compiled one.

Real sglang 0.5.17 `sglang.srt.layers.attention.vision` with patch vit_cuda_graph applied (CPU): the
name VisionAttention.forward calls when ViT graphs are on is wrapped. Which rotary function a call
reaches is checked with recording stand-ins for sglang's two, the CUDA / capture condition set
through `compiled_allowed`; the bucket runner's eager call is checked to run inside the block.
Knob vit_triton_rotary (the default; off in the fixture) sends every supported call to the one-kernel rotary
instead (kernel: test_rotate_half.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci


from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


@pytest.fixture
def vision(ext_patches):
    from sglang.srt.layers.attention import vision as module

    statuses = ext_patches(vit_triton_rotary=0)  # sglang's rotary functions; the kernel: the knob's test
    assert statuses["vit_cuda_graph"].state == "applied", statuses["vit_cuda_graph"]
    return module


@pytest.fixture
def calls(vision, monkeypatch):
    """Calls that reached sglang's compiled rotary (a recording stand-in); the others must return
    exactly what sglang's eager rotary returns."""
    from sglang.srt.layers.rotary_embedding import utils

    assert vision.apply_rotary_pos_emb_native_eager is not utils.apply_rotary_pos_emb_native_eager, "not wrapped"
    seen = []
    monkeypatch.setattr(vision, "apply_rotary_pos_emb", lambda *a, **k: seen.append("compiled") or "compiled")
    return seen


def _eager_result(vision, q, k, cos, sin):
    from sglang.srt.layers.rotary_embedding import utils

    got = vision.apply_rotary_pos_emb_native_eager(q, k, cos, sin)
    want = utils.apply_rotary_pos_emb_native_eager(q, k, cos, sin)
    return all(torch.equal(a, b) for a, b in zip(got, want))


def _qk():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(12, 2, 8, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.randn(12, 8, generator=gen).cos(), torch.randn(12, 8, generator=gen).sin()
    return q, k, cos, sin


def test_outside_the_bucket_eager_block_the_original_runs(vision, calls, monkeypatch):
    rotary = ext_core("vit.vision_rotary")
    monkeypatch.setattr(rotary, "compiled_allowed", lambda q: True)  # as on CUDA, not capturing
    assert _eager_result(vision, *_qk())
    assert calls == []


def test_inside_it_on_cuda_the_compiled_kernel_runs(vision, calls, monkeypatch):
    rotary = ext_core("vit.vision_rotary")
    monkeypatch.setattr(rotary, "compiled_allowed", lambda q: True)
    with rotary.compiled_rotary():
        assert vision.apply_rotary_pos_emb_native_eager(*_qk()) == "compiled"
    assert _eager_result(vision, *_qk())
    assert calls == ["compiled"]


@pytest.mark.parametrize("allowed", [False, None], ids=["capturing", "cpu-tensors"])
def test_inside_it_a_capture_or_a_cpu_tensor_keeps_the_original(vision, calls, monkeypatch, allowed):
    rotary = ext_core("vit.vision_rotary")
    if allowed is not None:
        monkeypatch.setattr(rotary, "compiled_allowed", lambda q: allowed)
    with rotary.compiled_rotary():
        assert _eager_result(vision, *_qk())
    assert calls == []


def test_the_bucket_runners_eager_call_runs_inside_the_block():
    engine, rotary, strategy = ext_core("vit.engine"), ext_core("vit.vision_rotary"), ext_core("vit.strategy")
    depths = []

    def run_eager(*args):
        depths.append(rotary._eager_depth[0])
        return "rows"

    layout = strategy.LayoutKey(8, (0, 0, 8), (0, 4, 8))
    an_engine = SimpleNamespace(store=SimpleNamespace(run_eager=run_eager))
    assert engine.ViTGraphEngine.eager_call(an_engine, layout, torch.zeros(8, 1, 4), (None, None, None)) == "rows"
    assert depths == [1] and rotary._eager_depth[0] == 0


@pytest.mark.parametrize("knob", [None, 1, 0])
def test_knob_vit_triton_rotary_sends_every_supported_call_to_the_one_kernel(ext_patches, monkeypatch, knob):
    """Eager and captured calls alike (no block needed), by default (None: the knob not given). Layouts
    the kernel does not take, CPU tensors outside the interpreter, and the knob off keep sglang's own
    function."""
    from sglang.srt.layers.attention import vision

    knobs = {} if knob is None else {"vit_triton_rotary": knob}
    assert ext_patches(**knobs)["vit_cuda_graph"].state == "applied"
    rotary = ext_core("vit.vision_rotary")
    seen = []
    monkeypatch.setattr(rotary, "rotate_half_qk", lambda *a, **kw: seen.append((a, kw)) or "kernel")
    monkeypatch.setattr(rotary, "runs_triton", lambda q: True)  # as on CUDA
    q, k, cos, sin = _qk()
    if knob is None or knob:
        assert vision.apply_rotary_pos_emb_native_eager(q, k, cos, sin) == "kernel"
        # Checked once, by the patch: the kernel's wrapper is told so instead of checking again.
        assert len(seen) == 1 and all(a is b for a, b in zip(seen[0][0], (q, k, cos, sin)))
        assert seen[0][1] == {"checked": True}
    else:
        assert _eager_result(vision, q, k, cos, sin) and seen == []
    seen.clear()
    strided_q = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous: refused
    assert _eager_result(vision, strided_q, k, cos, sin)
    monkeypatch.setattr(rotary, "runs_triton", lambda q: False)  # CPU tensors, no interpreter
    assert _eager_result(vision, q, k, cos, sin)
    assert seen == []
