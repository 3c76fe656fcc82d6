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

from conftest import REQUIRE_TRITON_ENV, import_triton  # noqa: E402  (test/registered/conftest.py)
from sglang_ext.kernels import (  # noqa: E402
    Partials,
    ada_rms_norm_reference,
    add_layer_norm_reference,
    first_rows_attention_reference,
    gelu_tanh_and_mul_reference,
    linear_rope_qkv_reference,
    rope_qkv_reference,
    skinny_linear_reference,
)

DTYPES = (torch.float32, torch.bfloat16)
BF16_ULP = 2.0**-7

def test_a_missing_triton_fails_where_ci_requires_it(monkeypatch):
    """The Triton checks below skip without triton on a developer machine, but fail in CI (.ci/run sets
    EXT_CI_REQUIRE_TRITON=1), so CI can never pass them by skipping."""
    monkeypatch.setenv(REQUIRE_TRITON_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="EXT_CI_REQUIRE_TRITON is set but triton_not_installed"):
        import_triton("triton_not_installed")
    monkeypatch.delenv(REQUIRE_TRITON_ENV)
    with pytest.raises(pytest.skip.Exception, match="triton_not_installed does not import"):
        import_triton("triton_not_installed")


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
    elif kind in ("rope", "linear_rope"):
        (kernels.rope_qkv if kind == "rope" else kernels.linear_rope_qkv)(**a)
        outputs.append({"q": a["q_out"], "k": a["k_out"], "v": a["v_out"]})
    elif kind == "gemm":
        out = kernels.skinny_linear(a.pop("x"), a.pop("weight"), **a)
        outputs.append({"out": out.total() if isinstance(out, kernels.Partials) else out})
    elif kind == "attn":
        outputs.append({"out": kernels.first_rows_attention(a.pop("q"), a.pop("keys"), a.pop("values"), **a)})
    elif kind == "layer_norm":
        x = a.pop("x")
        outputs.append({"out": kernels.add_layer_norm(x, **a), "x": x})
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


def _layer_norm_cases(generator):
    cases = []
    for dtype in DTYPES:
        for width, rows, residual in ((64, 50, False), (100, 7, True), (1152, 5, True)):
            args = {"x": (torch.randn(rows, width, generator=generator) * 3 + 1).to(dtype),
                    "weight": (1 + 0.1 * torch.randn(width, generator=generator)).to(dtype),
                    "bias": (0.1 * torch.randn(width, generator=generator)).to(dtype), "eps": 1e-6}
            if residual:
                args["add"] = torch.randn(rows, width, generator=generator).to(dtype)
            cases.append({"kind": "layer_norm", "name": f"layer_norm {dtype} w={width} add={residual}", "args": args})
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


def _linear_rope_cases(generator):
    cases = []
    for dtype in DTYPES:
        for heads, kv_heads, head_dim, batch, seq, prefix, k, block_n in (
            (2, 1, 32, 1, 50, 9, 64, 16), (3, 1, 64, 2, 5, 0, 96, 32), (8, 2, 64, 1, 4, 7, 128, 16),
        ):
            total = prefix + seq
            args = {
                "x": torch.randn(batch, seq, k, generator=generator).to(dtype),
                "weight": (torch.randn((heads + 2 * kv_heads) * head_dim, k, generator=generator) * 0.2).to(dtype),
                "cos_sin": torch.randn(batch * seq, head_dim, generator=generator),
                "q_out": torch.zeros(batch, seq, heads, head_dim, dtype=dtype),
                "k_out": torch.randn(batch, total, kv_heads, head_dim, generator=generator).to(dtype),
                "v_out": torch.randn(batch, total, kv_heads, head_dim, generator=generator).to(dtype),
                "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "kv_start": prefix,
                "block_n": block_n, "block_k": 32,
            }
            cases.append({"kind": "linear_rope", "args": args,
                          "name": f"linear_rope {dtype} h={heads}/{kv_heads} d={head_dim} p={prefix} n={block_n}"})
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


def _gemm_cases(generator):
    cases = []
    for dtype in DTYPES:
        for rows, n, k, parts, block_n in ((50, 96, 256, 1, 32), (50, 96, 256, 2, 64), (3, 40, 128, 4, 32), (128, 64, 64, 1, 64)):
            args = {
                "x": torch.randn(rows, k, generator=generator).to(dtype),
                "weight": (torch.randn(n, k, generator=generator) * 0.1).to(dtype),
                "parts": parts, "block_n": block_n, "block_k": 32,
            }
            cases.append({"kind": "gemm", "name": f"gemm {dtype} {rows}x{k}->{n} parts={parts}", "args": args})
        x = torch.randn(2, 25, 64, generator=generator).to(dtype)
        gate_up = (torch.randn(2 * 48, 64, generator=generator) * 0.2).to(dtype)
        cases.append({"kind": "gemm", "name": f"gemm gated {dtype}",
                      "args": {"x": x, "weight": gate_up, "gated": True, "block_n": 16, "block_k": 32}})
    # float32 action projections: bias + bf16 output; and x_t += dt * (x @ w.T + b) in place
    state = torch.randn(1, 50, 32, generator=generator)
    w_in, b_in = torch.randn(64, 32, generator=generator) * 0.2, torch.randn(64, generator=generator)
    cases.append({"kind": "gemm", "name": "gemm f32 bias -> bf16",
                  "args": {"x": state, "weight": w_in, "bias": b_in, "out_dtype": torch.bfloat16, "block_k": 32}})
    normed, w_out = torch.randn(1, 50, 64, generator=generator), torch.randn(32, 64, generator=generator) * 0.2
    cases.append({"kind": "gemm", "name": "gemm f32 add_to",
                  "args": {"x": normed, "weight": w_out, "bias": torch.randn(32, generator=generator), "add_to": state.clone(),
                           "alpha": -0.1, "block_n": 16, "block_k": 32}})
    return cases


def _attention_cases(generator):
    cases = []
    for dtype in DTYPES:
        for batch, seq, heads, kv_heads, total, used, splits in (
            (1, 50, 8, 1, 37, None, 1), (2, 5, 4, 1, 70, (70, 20), 3), (2, 7, 4, 2, 33, (9, 33), 2), (1, 3, 2, 1, 200, (1,), 4),
        ):
            args = {
                "q": torch.randn(batch, seq, heads, 32, generator=generator).to(dtype),
                "keys": torch.randn(batch, total, kv_heads, 32, generator=generator).to(dtype),
                "values": torch.randn(batch, total, kv_heads, 32, generator=generator).to(dtype),
                "used": None if used is None else torch.tensor(used, dtype=torch.int32),
                "scale": 32 ** -0.5, "splits": splits,
            }
            cases.append({"kind": "attn", "name": f"attn {dtype} b={batch} s={seq} h={heads}/{kv_heads} t={total} "
                                                  f"used={used} splits={splits}", "args": args})
            if used is not None:  # the same keys read through a permutation: used[b] of them, any order
                rows = torch.stack([torch.randperm(total, generator=generator) for _ in range(batch)]).to(torch.int32)
                permuted = {**args, "key_rows": rows}
                cases.append({"kind": "attn", "args": permuted, "name": f"attn {dtype} b={batch} s={seq} "
                              f"h={heads}/{kv_heads} t={total} used={used} splits={splits} key_rows"})
    return cases


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    import_triton()
    generator = torch.Generator().manual_seed(0)
    cases = (_norm_cases(generator) + _layer_norm_cases(generator) + _rope_cases(generator) + _linear_rope_cases(generator) + _gelu_cases(generator)
             + _gemm_cases(generator) + _attention_cases(generator))
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
    if case["kind"] in ("rope", "linear_rope"):
        (rope_qkv_reference if case["kind"] == "rope" else linear_rope_qkv_reference)(**a)
        return {"q": a["q_out"], "k": a["k_out"], "v": a["v_out"]}
    if case["kind"] == "gemm":
        out = skinny_linear_reference(a.pop("x"), a.pop("weight"), **a)
        return {"out": out.total() if isinstance(out, Partials) else out}
    if case["kind"] == "attn":
        return {"out": first_rows_attention_reference(a.pop("q"), a.pop("keys"), a.pop("values"), **a)}
    if case["kind"] == "layer_norm":
        x = a.pop("x")
        out = add_layer_norm_reference(x, **a)
        return {"out": out, "x": x}
    return {"out": gelu_tanh_and_mul_reference(a["x"])}


@pytest.mark.parametrize("kind", ["norm", "layer_norm", "rope", "linear_rope", "gelu", "gemm", "attn"])
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
        if kind in ("rope", "linear_rope"):
            # Rows outside the suffix keep the prefix the buffer held.
            prefix = case["args"]["kv_start"]
            assert torch.equal(got["k"][:, :prefix], case["args"]["k_out"][:, :prefix])
            assert torch.equal(got["v"][:, :prefix], case["args"]["v_out"][:, :prefix])
        if kind == "rope":  # v passes through unrotated (and unrounded: same dtype)
            prefix = case["args"]["kv_start"]
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
    outs = (torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32), torch.zeros(1, 2, 1, 32))
    with pytest.raises(ValueError, match="linear_rope_qkv: block_n=32; allowed: dividing head_dim / 2=16"):
        linear_rope_qkv_reference(torch.zeros(1, 2, 64), torch.zeros(96, 64), torch.zeros(2, 32), *outs,
                                  num_heads=1, num_kv_heads=1, head_dim=32, kv_start=0, block_n=32, block_k=32)
    with pytest.raises(ValueError, match="linear_rope_qkv: 129 rows; allowed: 1..128"):
        linear_rope_qkv_reference(torch.zeros(1, 129, 64), torch.zeros(96, 64), torch.zeros(129, 32), *outs,
                                  num_heads=1, num_kv_heads=1, head_dim=32, kv_start=0, block_k=32)


# Hopper builds of every kernel variant the fast path launches: the interpreter runs kernels as
# Python and misses what only the compiler refuses (a non-constexpr global, an unsupported dot
# shape), which otherwise first shows on the GPU machine. ptxas ships with triton's wheel.
_SKINNY_TYPES = {"rows": "i32", "n_cols": "i32", "k_dim": "i32", "k_per_part": "i32", "gate_offset": "i32",
                 "alpha": "fp32"}
HOPPER_SHARED_BYTES = 232448  # per block on sm90
_HOPPER_BUILDS = [
    ("skinny_gemm", "_skinny_gemm_kernel",
     {**_SKINNY_TYPES, "X": "*bf16", "W": "*bf16", "OUT": "*fp32", "BIAS": "*bf16"},
     [dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, PARTIAL=partial, GATED=gated, HAS_BIAS=False, ADD_TO=False, F32=False,
           UPCAST=False, PDL=pdl)
      for partial, gated in ((True, False), (False, False), (False, True)) for pdl in (False, True)]),
    ("skinny_gemm", "_skinny_gemm_kernel",
     {**_SKINNY_TYPES, "X": "*fp32", "W": "*fp32", "OUT": "*fp32", "BIAS": "*fp32"},
     [dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=32, PARTIAL=False, GATED=False, HAS_BIAS=True, ADD_TO=add_to, F32=True,
           UPCAST=False, PDL=True) for block_n, add_to in ((64, False), (16, True))]),
    ("attention", "_split_attention_kernel",
     {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "USED": "*i32", "ROWS": "*i32", "OUT": "*bf16", "ACC": "*fp32",
      "STATS": "*fp32", "seq": "i32", "total": "i32", "keys_per_split": "i32", "scale": "fp32"},
     [dict(HEADS=8, KV_HEADS=1, HEAD_DIM=256, Q_BLOCKS=7, HAS_USED=used, HAS_ROWS=rows, DIRECT=direct, UPCAST=False,
           BLOCK_M=64, BLOCK_N=64, PDL=True)
      for used, rows in ((False, False), (True, False), (True, True)) for direct in (False, True)]),
    ("attention", "_combine_kernel",
     {"ACC": "*fp32", "STATS": "*fp32", "OUT": "*bf16", "seq": "i32", "all_rows": "i32"},
     [dict(HEADS=8, KV_HEADS=1, HEAD_DIM=256, SPLITS=10, SPLITS_BLOCK=16, PDL=True)]),
    ("rms_norm", "_ada_rms_norm_kernel",
     {"X": "*bf16", "ADD": "*fp32", "GATE": "*fp32", "SCALE": "*fp32", "SHIFT": "*fp32", "OUT": "*fp32",
      "n_cols": "i32", "group": "i32", "eps": "fp32", "part_stride": "i32"},
     [dict(HAS_ADD=True, ADD_PARTS=4, HAS_GATE=True, HAS_SHIFT=True, BLOCK=1024, PDL=True)]),
    ("rope", "_rope_qkv_kernel",
     {"QKV": "*fp32", "COS_SIN": "*fp32", "Q_OUT": "*bf16", "K_OUT": "*bf16", "V_OUT": "*bf16", "seq_len": "i32",
      "kv_len": "i32", "kv_start": "i32", "part_stride": "i32"},
     [dict(PARTS=2, NUM_HEADS=8, NUM_KV=1, HEAD_DIM=256, BLOCK=128, PDL=True)]),
    ("rope", "_linear_rope_qkv_kernel",
     {"X": "*bf16", "W": "*bf16", "COS_SIN": "*fp32", "Q_OUT": "*bf16", "K_OUT": "*bf16", "V_OUT": "*bf16",
      "rows": "i32", "k_dim": "i32", "seq_len": "i32", "kv_len": "i32", "kv_start": "i32"},
     [dict(NUM_HEADS=8, NUM_KV=1, HEAD_DIM=256, BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, F32=False, UPCAST=False,
           PDL=True)]),
    ("activation", "_gelu_tanh_and_mul_kernel", {"X": "*bf16", "OUT": "*bf16", "n_inner": "i32"}, [dict(BLOCK=1024, PDL=True)]),
    ("layer_norm", "_add_layer_norm_kernel",
     {"X": "*bf16", "ADD": "*bf16", "W": "*bf16", "B": "*bf16", "OUT": "*bf16", "n_cols": "i32", "eps": "fp32"},
     [dict(HAS_ADD=add, BLOCK=2048, PDL=True) for add in (False, True)]),
]


@pytest.mark.parametrize("module,kernel,types,variants", _HOPPER_BUILDS, ids=[f"{m}.{k}" for m, k, _, _ in _HOPPER_BUILDS])
def test_kernels_build_for_hopper(module, kernel, types, variants):
    triton = import_triton()
    import_triton("triton.backends.nvidia")
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_ext.kernels import attention
    from sglang_ext.kernels.skinny_gemm import STAGES

    fn = getattr(importlib.import_module(f"sglang_ext.kernels.{module}"), kernel)
    for constexprs in variants:
        signature = {name: "constexpr" if name in constexprs else types[name] for name in fn.arg_names}
        # the loops' stages and warps as launched (skinny_gemm.STAGES, attention.STAGES)
        if "BLOCK_K" in constexprs:
            options = {"num_stages": STAGES}
        elif kernel == "_split_attention_kernel":
            options = {"num_stages": attention.STAGES, "num_warps": 8}  # HEAD_DIM 256
        else:
            options = {}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm.get("cubin"), (kernel, constexprs)
        # shared memory with room: the H200's triton asked 1.36x what this one reported for a kernel
        # (311 KB vs 229 KB, a GEMM variant since removed)
        assert compiled.metadata.shared <= HOPPER_SHARED_BYTES / 1.5, (kernel, constexprs, compiled.metadata.shared)
        ptx = compiled.asm["ptx"]
        # under PDL nothing may touch memory before the wait
        assert ("griddepcontrol.wait" in ptx) == bool(constexprs.get("PDL")), (kernel, constexprs)
        if constexprs.get("PDL"):
            before_wait = ptx[: ptx.index("griddepcontrol.wait")]
            assert not any(op in before_wait for op in ("ld.global", "st.global", "cp.async", "atom.")), (kernel, constexprs)


def test_kernels_build_without_grid_dependency_control(monkeypatch):
    """triton < 3.3 has no gdc_wait: PDL is off there and the kernels still build."""
    triton = import_triton()
    import_triton("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import types as types_ns

    from sglang_ext.kernels import backend
    from sglang_ext.kernels.activation import _gelu_tanh_and_mul_kernel

    hopper_tensor = types_ns.SimpleNamespace(is_cuda=True, device=types_ns.SimpleNamespace(index=0))
    monkeypatch.setattr(backend, "_sm_major", lambda index: 9)
    monkeypatch.setattr(backend, "INTERPRET", False)
    assert backend.uses_pdl(hopper_tensor)
    assert not backend.uses_pdl(hopper_tensor, False)  # a kernel's pdl=False: a plain launch
    monkeypatch.setattr(backend, "gdc_wait", None)
    monkeypatch.setattr(backend, "gdc_launch_dependents", None)
    assert not backend.uses_pdl(hopper_tensor)
    constexprs = dict(BLOCK=1024, PDL=False)
    types = {"X": "*bf16", "OUT": "*bf16", "n_inner": "i32"}
    signature = {name: "constexpr" if name in constexprs else types[name] for name in _gelu_tanh_and_mul_kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=_gelu_tanh_and_mul_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm.get("cubin") and "griddepcontrol" not in compiled.asm["ptx"]
