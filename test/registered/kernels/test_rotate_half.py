"""sglang_ext.kernels.rotate_half_qk against sglang's own eager rotary, and the code it builds for Hopper.

Its claim is bit-equality with `apply_rotary_pos_emb_native_eager` on the GPU. Two halves of that
are checked on the CPU: the kernel's float32 math under triton's interpreter equals sglang's
function bit for bit (bf16 outputs: within the interpreter's one-ulp truncation, see
test_fused_kernels.py), and the sm90 build of the kernel has no fused multiply-add, so the GPU
rounds each product and the sum as torch's separate kernels do.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

from conftest import import_triton  # noqa: E402  (test/registered/conftest.py)

_AGAINST_SGLANG = r"""
import torch
from sglang.srt.layers.rotary_embedding.utils import apply_rotary_pos_emb_native_eager
from sglang_ext.kernels.rotate_half import rotate_half_qk, rotate_half_qk_reference
from sglang_ext.kernels.backend import runs_triton
assert runs_triton(torch.zeros(1)), "TRITON_INTERPRET=1 must route CPU tensors to the kernel"
gen = torch.Generator().manual_seed(0)
for tokens, heads, kv_heads, dim, strided in ((37, 16, 16, 80, False), (5, 3, 1, 64, True), (1, 2, 2, 8, False)):
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
        k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
        angles = torch.randn(tokens, dim // 2, generator=gen) * 4
        cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
        if strided:  # rows of a wider table (a view, row stride 2 * dim)
            cos = torch.cat((cos, torch.full_like(cos, 7.0)), -1)[:, :dim]
            sin = torch.cat((sin, torch.full_like(sin, 7.0)), -1)[:, :dim]
        want = apply_rotary_pos_emb_native_eager(q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(rotate_half_qk_reference(q, k, cos, sin), want))
        got = rotate_half_qk(q, k, cos, sin)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
            if dtype == torch.float32:
                assert torch.equal(g, w), (tokens, heads, dim, (g - w).abs().max())
            else:
                assert ((g.float() - w.float()).abs() <= w.float().abs() * 2.0**-7 + 1e-30).all(), (tokens, heads, dim)
print("ROTATE-HALF-RAN")
"""


def test_kernel_equals_sglangs_eager_rotary_under_the_interpreter():
    import_triton()
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _AGAINST_SGLANG], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ROTATE-HALF-RAN" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("fusion", [False, True])
def test_the_hopper_build_rounds_products_and_sums_apart(fusion):
    """What the launch asks for (enable_fp_fusion=False) has no fma; the default build of the same kernel
    would contract them (so the check can tell)."""
    triton = import_triton()
    import_triton("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ext.kernels import rotate_half

    fn = rotate_half._rotate_half_qk_kernel
    constexprs = dict(Q_HEADS=16, K_HEADS=16, HEAD_DIM=80, Q_BLOCK=16, K_BLOCK=16, BLOCK=64, PDL=True)
    types = {"Q": "*bf16", "K": "*bf16", "COS": "*fp32", "SIN": "*fp32", "Q_OUT": "*bf16", "K_OUT": "*bf16",
             "cos_stride": "i32", "sin_stride": "i32"}
    signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": fusion, "num_warps": 2})
    ptx = compiled.asm["ptx"]
    assert ("fma." in ptx) == fusion
    assert "cvt.rn.bf16.f32" in ptx  # bf16 outputs round to nearest even, as torch's .to(bfloat16)
    before_wait = ptx[: ptx.index("griddepcontrol.wait")]
    assert not any(op in before_wait for op in ("ld.global", "st.global"))


def test_refused_layouts_are_named_in_one_line():
    import torch

    from sglang_ext.kernels.rotate_half import rotate_half_qk_supports

    q, k, cos = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 8)
    assert rotate_half_qk_supports(q, k, cos, cos) == ""
    assert "D even" in rotate_half_qk_supports(torch.zeros(4, 2, 7), torch.zeros(4, 1, 7), cos, cos)
    assert "allowed: both [4, 8]" in rotate_half_qk_supports(q, k, cos[:, :4], cos[:, :4])
    assert "contiguous" in rotate_half_qk_supports(q.transpose(0, 1).contiguous().transpose(0, 1), k, cos, cos)
    assert "contiguous" in rotate_half_qk_supports(q, k, cos.t().contiguous().t(), cos)


def test_the_launch_asks_for_the_build_without_contraction(monkeypatch):
    import torch

    from sglang_ext.kernels import rotate_half

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, kwargs))

    monkeypatch.setattr(rotate_half, "_rotate_half_qk_kernel", Recorder(), raising=False)
    monkeypatch.setattr(rotate_half, "runs_triton", lambda t: True)
    q, k, cos = torch.zeros(6, 4, 8), torch.zeros(6, 2, 8), torch.zeros(6, 8)
    rotate_half.rotate_half_qk(q, k, cos, cos)
    assert len(launches) == 1 and launches[0][0] == (6,)
    assert launches[0][1]["enable_fp_fusion"] is False
    assert (launches[0][1]["Q_HEADS"], launches[0][1]["K_HEADS"], launches[0][1]["BLOCK"]) == (4, 2, 4)


def test_the_wrapper_checks_unless_told_its_caller_did(monkeypatch):
    import pytest
    import torch

    from sglang_ext.kernels import rotate_half

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(rotate_half, "_rotate_half_qk_kernel", Recorder(), raising=False)
    monkeypatch.setattr(rotate_half, "runs_triton", lambda t: True)
    q, k, cos = torch.zeros(4, 2, 7), torch.zeros(4, 1, 7), torch.zeros(4, 7)
    with pytest.raises(ValueError, match=r"^rotate_half_qk: .*D even"):
        rotate_half.rotate_half_qk(q, k, cos, cos)
    assert launches == []
    checks = []
    monkeypatch.setattr(rotate_half, "rotate_half_qk_supports", lambda *a: checks.append(a) or "")
    good_q, good_k, good_cos = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8), torch.zeros(4, 8)
    rotate_half.rotate_half_qk(good_q, good_k, good_cos, good_cos, checked=True)
    assert checks == [] and launches == [(4,)]
