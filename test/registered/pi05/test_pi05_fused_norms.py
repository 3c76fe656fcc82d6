"""CPU tests of the `pi05_fused_norms` patch on sglang 0.5.17.

Real 0.5.17 `PiGemmaRMSNorm` modules (adaptive with a random `dense`, plain with a
random `weight`) run through the patched forward and are compared with 0.5.17's
own `PiGemmaRMSNorm.forward` / `gated_residual`, compiled from pristine 0.5.17 source
by pi05_pristine.py (a plugin-only test checks they behave like the installed,
unpatched functions).

Tolerances: float32 outputs within 1e-5 (same float32 math, only the reduction
order and multiply/add grouping differ). bf16 outputs within one bf16 ulp of the
reference (2^-7 relative): both compute in float32 and round once at the end, so a
difference appears only where the float32 results straddle a rounding boundary.
gated_residual in bf16 rounds once (addcmul keeps y * gate in float) where 0.5.17
rounds twice, hence also one ulp. Gates must be identical (same GEMM, same slice).
"""

from __future__ import annotations

import dis

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from pi05_pristine import reference_forward, reference_gated_residual
from sglang.multimodal_gen.runtime.models.vlas import pi05_core

register_cpu_ci(est_time=30, suite="base-a-test-cpu")

THIS_PATCH = "pi05_fused_norms"
DIM, COND_DIM, BATCH, TOKENS = 64, 32, 2, 5
BF16_ULP = 2.0**-7  # spacing of bf16 values relative to their magnitude (upper bound)


def _norm(adaptive: bool, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A real 0.5.17 PiGemmaRMSNorm with random non-zero parameters (0.5.17 inits them to zero)."""
    gen = torch.Generator().manual_seed(seed)
    norm = pi05_core.PiGemmaRMSNorm(DIM, eps=1e-6, cond_dim=COND_DIM if adaptive else None)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return norm.to(dtype)


def _inputs(ndim: int, dtype: torch.dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, TOKENS, DIM) if ndim == 3 else (BATCH, DIM)
    # a per-row scale spreads magnitudes, so the rms actually normalises something
    x = torch.randn(shape, generator=gen) * (1.0 + 4.0 * torch.rand(shape[:-1] + (1,), generator=gen))
    cond = torch.randn(BATCH, COND_DIM, generator=gen)
    return x.to(dtype), cond.to(dtype)


def _assert_close(got: torch.Tensor, want: torch.Tensor, *, rounding: torch.dtype | None = None,
                  magnitude: torch.Tensor | None = None) -> None:
    """Where the results round in float32 (`rounding`, default want.dtype): within 1e-5;
    where they round in bf16: within one bf16 ulp of `magnitude` (default: of `want`)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    diff = (got.float() - want.float()).abs()
    if (rounding or want.dtype) == torch.float32:
        assert diff.max().item() <= 1e-5, diff.max().item()
    else:
        magnitude = want.float().abs() if magnitude is None else magnitude
        bound = BF16_ULP * magnitude + 1e-6
        assert bool((diff <= bound).all()), f"max abs diff {diff.max().item()} exceeds one bf16 ulp"


@pytest.fixture
def fused(ext_patches):
    statuses = ext_patches()
    if statuses:  # the patched tree has the change in sglang's source, no statuses
        assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
    return pi05_core


# (module dtype, input dtype): the model runs both in bf16; a float32 dense with bf16
# activations exercises the cond.to / gate.to conversions.
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("module_dtype,dtype", DTYPES, ids=["f32", "bf16", "f32-dense-bf16-x"])
def test_adaptive_norm_with_cond_matches_0_5_17(fused, module_dtype, dtype, ndim, grad):
    norm = _norm(adaptive=True, dtype=module_dtype)
    x, cond = _inputs(ndim, dtype)
    with torch.set_grad_enabled(grad):
        out, gate = norm(x, cond=cond)
        want, want_gate = reference_forward(norm, x, cond)
    _assert_close(out, want)
    assert gate.dtype == want_gate.dtype and torch.equal(gate, want_gate)
    if grad:  # the autograd path stays differentiable
        out.float().sum().backward()
        assert norm.dense.weight.grad is not None and norm.dense.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("module_dtype,dtype", DTYPES, ids=["f32", "bf16", "f32-weight-bf16-x"])
@pytest.mark.parametrize("adaptive,with_cond", [(False, False), (False, True), (True, False)],
                         ids=["weight", "weight-cond-ignored", "adaptive-without-cond"])
def test_norm_without_modulation_matches_0_5_17(fused, adaptive, with_cond, module_dtype, dtype, ndim):
    norm = _norm(adaptive=adaptive, dtype=module_dtype)
    x, cond = _inputs(ndim, dtype)
    cond = cond if with_cond else None
    with torch.no_grad():
        out, gate = norm(x, cond=cond)
        want, want_gate = reference_forward(norm, x, cond)
    assert gate is None and want_gate is None
    _assert_close(out, want)


def test_gated_residual_none_branches(fused):
    x, y = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    gate = torch.randn(2, 1, 4)
    assert fused.gated_residual(None, None, gate) is None
    assert fused.gated_residual(x, None, gate) is x
    assert fused.gated_residual(None, y, gate) is y
    assert torch.equal(fused.gated_residual(x, y, None), x + y)


@pytest.mark.parametrize("x_dtype,y_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("gate_shape", [(BATCH, 1, DIM), (BATCH, TOKENS, DIM)], ids=["broadcast", "full"])
def test_gated_residual_matches_0_5_17(fused, x_dtype, y_dtype, gate_shape):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, TOKENS, DIM, generator=gen).to(x_dtype)
    y = torch.randn(BATCH, TOKENS, DIM, generator=gen).to(y_dtype)
    gate = torch.randn(gate_shape, generator=gen).to(y_dtype)
    got = fused.gated_residual(x, y, gate)
    want = reference_gated_residual(x, y, gate)
    # 0.5.17 rounds y * gate to y's dtype before adding: its error scales with the terms, not the sum
    _assert_close(got, want, rounding=y_dtype, magnitude=x.float().abs() + (y.float() * gate.float()).abs())
    # the patched result rounds once: the float32 value, stored in the result dtype
    exact = x.float() + y.float() * gate.float()
    _assert_close(got, exact.to(got.dtype))


def _top_level_ops(fn):
    """Names of the top-level aten ops `fn` dispatches, and whether each did work.

    An `aten::to` without an `aten::_to_copy` child is a no-op cast (already that dtype);
    views and allocations launch no kernel either.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = []
    for event in prof.events():
        if event.cpu_parent is not None or not event.name.startswith("aten::"):
            continue
        children = {child.name for child in event.cpu_children}
        noop = (event.name in ("aten::unsqueeze", "aten::chunk", "aten::split", "aten::slice",
                               "aten::view", "aten::empty_like", "aten::empty")
                or event.name == "aten::to" and "aten::_to_copy" not in children)
        ops.append((event.name, not noop))
    return ops


def test_adaptive_norm_uses_fused_rms_norm_and_few_ops(fused):
    """The cond path runs aten::rms_norm and at most 5 ops that do work.

    Those 5: x.float(), rms_norm, the dense GEMM (linear), addcmul (normed * (1 + scale)),
    add into the output dtype (+ shift). Everything else is a view (unsqueeze, chunk),
    the output allocation, or a no-op cast (cond / gate already in the GEMM dtype).
    0.5.17 does 13 (x.float, square, mean, +eps, rsqrt, mul, linear, scale.float, 1+,
    mul, shift.float, add, .to).
    """
    norm = _norm(adaptive=True, dtype=torch.bfloat16)
    x, cond = _inputs(3, torch.bfloat16)
    with torch.no_grad():
        norm(x, cond=cond)  # warm-up: first-call dispatch noise stays out of the profile
        patched = _top_level_ops(lambda: norm(x, cond=cond))
        original = _top_level_ops(lambda: reference_forward(norm, x, cond))
    names = [name for name, _ in patched]
    assert "aten::rms_norm" in names, names
    assert not {"aten::rsqrt", "aten::mean", "aten::square", "aten::pow"} & set(names), names
    working = [name for name, works in patched if works]
    original_working = [name for name, works in original if works]
    print("patched:", working, "original:", original_working)
    assert len(working) <= 5, working
    assert len(original_working) == 13, original_working  # the reference really is 0.5.17's op sequence
    assert len(patched) <= 10, names  # + unsqueeze, chunk, empty_like and the two no-op casts


def test_callers_look_gated_residual_up_in_the_module(fused):
    """Rebinding the module global reaches every caller: none holds the function by value."""
    callers = {
        "PiGemmaDecoderLayer.forward": pi05_core.PiGemmaDecoderLayer.forward,
        "compute_layer_complete": pi05_core.compute_layer_complete,
    }
    for name, fn in callers.items():
        assert fn.__globals__ is vars(pi05_core), name
        loads = {ins.argval for ins in dis.get_instructions(fn) if ins.opname == "LOAD_GLOBAL"}
        assert "gated_residual" in loads, name


def _patched() -> bool:
    """Both targets are the patch's: its norm forward, its wrapper around 0.5.17's gated_residual."""
    from sglang_ext.pi05 import fused_norms

    forward = pi05_core.PiGemmaRMSNorm.forward is fused_norms.forward
    residual = getattr(pi05_core.gated_residual, "__wrapped__", None) is not None
    assert forward == residual, (forward, residual)
    return forward


@plugin_only
def test_reference_is_0_5_17s_code():
    """The reference functions behave exactly like the installed, unpatched 0.5.17 functions."""
    from sglang_ext import activation

    activation.deactivate()
    assert not _patched()
    for adaptive in (True, False):
        norm = _norm(adaptive=adaptive, dtype=torch.bfloat16)
        x, cond = _inputs(3, torch.bfloat16)
        with torch.no_grad():
            for c in (cond, None):
                out, gate = norm(x, cond=c)
                want, want_gate = reference_forward(norm, x, c)
                assert torch.equal(out, want)
                assert (gate is None and want_gate is None) or torch.equal(gate, want_gate)
    x, y, gate = torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 3, 4).bfloat16(), torch.randn(2, 1, 4).bfloat16()
    assert torch.equal(pi05_core.gated_residual(x, y, gate), reference_gated_residual(x, y, gate))


@plugin_only
def test_patch_applies_and_rolls_back(ext_patches):
    statuses = ext_patches()
    assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
    assert _patched()
    from sglang_ext import activation

    activation.deactivate()
    assert not _patched()
