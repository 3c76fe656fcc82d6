"""sglang_ext.kernels: each Triton kernel against its torch reference, on the CPU.

The kernels run through triton's interpreter (TRITON_INTERPRET=1, which must be set
before triton is imported, so in a subprocess); the references run here. Random
inputs, float32 and bfloat16, widths that are and are not powers of two.

float32 outputs: same math, compared at float32 rounding. bfloat16 outputs: the
interpreter truncates float32 -> bf16 where the GPU rounds to nearest, so they may
differ by one bf16 ulp (2^-7 relative) from the reference; a wrong index, mask or
formula is off by far more.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

from sglang_ext.kernels import ada_rms_norm_reference, gelu_tanh_and_mul_reference, rope_qkv_reference  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)
BF16_ULP = 2.0**-7

_RUN_KERNELS = r"""
import sys
import torch
from sglang_ext import kernels
cases = torch.load(sys.argv[1])
assert kernels.runs_triton(torch.zeros(1)), "TRITON_INTERPRET=1 must route CPU tensors to the kernels"
outputs = []
for case in cases:
    kind, a = case["kind"], {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case["args"].items()}
    if kind == "norm":
        x = a.pop("x")
        out = kernels.ada_rms_norm(x, **a)
        outputs.append({"out": out, "x": x})
    elif kind == "rope":
        kernels.rope_qkv(**a)
        outputs.append({"q": a["q_out"], "k": a["k_out"], "v": a["v_out"]})
    else:
        outputs.append({"out": kernels.gelu_tanh_and_mul(a["x"])})
torch.save(outputs, sys.argv[2])
print("KERNELS-RAN", len(outputs))
"""


def _norm_cases(generator):
    cases = []
    for dtype in DTYPES:
        for width, batch, tokens in ((64, 1, 50), (100, 2, 5), (1024, 1, 7), (2048, 1, 3)):
            for variant in ("ada", "gated", "plain-residual", "gemma"):
                def rnd(*shape, scale=1.0, dt=dtype):
                    return (torch.randn(*shape, generator=generator) * scale).to(dt)

                args = {"x": rnd(batch, tokens, width, scale=3.0), "eps": 1e-6}
                conds = 1 if variant == "gemma" else batch
                args["scale"] = rnd(conds, width, scale=0.5, dt=torch.float32)
                if variant != "gemma":
                    args["shift"] = rnd(conds, width, scale=0.5, dt=torch.float32)
                if variant in ("gated", "plain-residual"):
                    args["add"] = rnd(batch, tokens, width)
                if variant == "gated":
                    args["gate"] = rnd(conds, width, dt=torch.float32)
                cases.append({"kind": "norm", "name": f"norm {variant} {dtype} w={width} b={batch}", "args": args})
    return cases


def _rope_cases(generator):
    cases = []
    for dtype in DTYPES:
        for heads, kv_heads, head_dim, batch, seq, prefix in ((2, 1, 32, 1, 50, 9), (3, 1, 20, 2, 5, 0), (8, 2, 256, 1, 4, 7)):
            total = prefix + seq
            args = {
                "qkv": torch.randn(batch, seq, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype),
                "cos_sin": torch.randn(batch * seq, head_dim, generator=generator),
                "q_out": torch.zeros(batch, seq, heads, head_dim, dtype=dtype),
                "k_out": torch.randn(batch, total, kv_heads, head_dim, generator=generator).to(dtype),
                "v_out": torch.randn(batch, total, kv_heads, head_dim, generator=generator).to(dtype),
                "num_heads": heads,
                "num_kv_heads": kv_heads,
                "head_dim": head_dim,
                "kv_start": prefix,
            }
            cases.append({"kind": "rope", "name": f"rope {dtype} h={heads}/{kv_heads} d={head_dim} p={prefix}", "args": args})
    return cases


def _gelu_cases(generator):
    return [
        {
            "kind": "gelu",
            "name": f"gelu {dtype} i={inner}",
            "args": {"x": (torch.randn(rows, 2 * inner, generator=generator) * 3).to(dtype)},
        }
        for dtype in DTYPES
        for rows, inner in ((50, 128), (3, 300), (2, 3000))
    ]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    cases = _norm_cases(generator) + _rope_cases(generator) + _gelu_cases(generator)
    folder = tmp_path_factory.mktemp("kernels")
    torch.save(cases, folder / "cases.pt")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_KERNELS, str(folder / "cases.pt"), str(folder / "out.pt")],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0 and "KERNELS-RAN" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return cases, torch.load(folder / "out.pt")


def _close(name, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    exact_dtype = want.dtype == torch.float32
    got, want = got.float(), want.float()
    diff = float((got - want).abs().max())
    largest = float(want.abs().max())
    bound = 1e-5 * (1.0 + largest) if exact_dtype else 2 * BF16_ULP * largest
    print(f"[{name}] max|kernel-reference|={diff:.3e} bound={bound:.3e}")
    assert diff <= bound, f"{name}: {diff:.3e} > {bound:.3e}"
    return diff


def _reference(case):
    a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case["args"].items()}
    if case["kind"] == "norm":
        x = a.pop("x")
        out = ada_rms_norm_reference(x, **a)
        return {"out": out, "x": x}
    if case["kind"] == "rope":
        rope_qkv_reference(**a)
        return {"q": a["q_out"], "k": a["k_out"], "v": a["v_out"]}
    return {"out": gelu_tanh_and_mul_reference(a["x"])}


@pytest.mark.parametrize("kind", ["norm", "rope", "gelu"])
def test_kernel_matches_reference(interpreted, kind):
    cases, outputs = interpreted
    checked = 0
    for case, got in zip(cases, outputs):
        if case["kind"] != kind:
            continue
        want = _reference(case)
        assert set(got) == set(want)
        for field in want:
            _close(f"{case['name']} {field}", got[field], want[field])
        if kind == "rope":
            # Rows outside the suffix keep the prefix the buffer held.
            prefix = case["args"]["kv_start"]
            assert torch.equal(got["k"][:, :prefix], case["args"]["k_out"][:, :prefix])
            assert torch.equal(got["v"][:, prefix:], case["args"]["qkv"].unflatten(-1, (-1, case["args"]["head_dim"]))[
                :, :, case["args"]["num_heads"] + case["args"]["num_kv_heads"]:])
        checked += 1
    assert checked >= 6


def test_reference_equals_the_model_formulas():
    """The references compute what Pi0.5's modules compute (float32 inputs: no rounding)."""
    generator = torch.Generator().manual_seed(1)
    x, add = torch.randn(2, 3, 16, generator=generator), torch.randn(2, 3, 16, generator=generator)
    scale, shift, gate = torch.randn(3, 2, 16, generator=generator)
    stream = x.clone()
    normed = ada_rms_norm_reference(stream, scale, shift, eps=1e-6, add=add, gate=gate)
    expected_stream = x + add * gate[:, None]
    torch.testing.assert_close(stream, expected_stream)
    rms = expected_stream * torch.rsqrt(expected_stream.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, rms * (1 + scale[:, None]) + shift[:, None])

    gate_up = torch.randn(4, 2 * 24, generator=generator)
    torch.testing.assert_close(
        gelu_tanh_and_mul_reference(gate_up),
        torch.nn.functional.gelu(gate_up[:, :24], approximate="tanh") * gate_up[:, 24:],
    )

    # RoPE: neox rotate-half, as sglang's apply_rotary_pos_emb with cos/sin = cat(half, half).
    heads, head_dim, seq = 2, 8, 3
    qkv = torch.randn(1, seq, (heads + 2) * head_dim, generator=generator)
    angles = torch.randn(seq, head_dim // 2, generator=generator)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    q_out = torch.empty(1, seq, heads, head_dim)
    k_out, v_out = torch.zeros(1, seq, 1, head_dim), torch.zeros(1, seq, 1, head_dim)
    rope_qkv_reference(qkv, cos_sin, q_out, k_out, v_out, num_heads=heads, num_kv_heads=1, head_dim=head_dim, kv_start=0)
    cos, sin = torch.cat((angles.cos(),) * 2, -1)[:, None], torch.cat((angles.sin(),) * 2, -1)[:, None]
    q = qkv[0, :, : heads * head_dim].view(seq, heads, head_dim)

    def rotate_half(t):
        return torch.cat((-t[..., head_dim // 2:], t[..., : head_dim // 2]), dim=-1)

    torch.testing.assert_close(q_out[0], q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(v_out[0, :, 0], qkv[0, :, (heads + 1) * head_dim:])


def test_bad_shapes_raise_one_line_errors():
    x = torch.zeros(2, 5, 8)
    with pytest.raises(ValueError, match="scale of shape"):
        ada_rms_norm_reference(x, torch.zeros(3, 8), eps=1e-6)
    with pytest.raises(ValueError, match="gate without add"):
        ada_rms_norm_reference(x, torch.zeros(2, 8), eps=1e-6, gate=torch.zeros(2, 8))
    with pytest.raises(ValueError, match="even sizes"):
        gelu_tanh_and_mul_reference(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="kv_start"):
        rope_qkv_reference(
            torch.zeros(1, 2, 3 * 4), torch.zeros(2, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 3, 1, 4),
            torch.zeros(1, 3, 1, 4), num_heads=1, num_kv_heads=1, head_dim=4, kv_start=2,
        )
