#!/usr/bin/env python3
"""Per-call device time of the Pi0.5 action expert's kernels at its real shapes, in CUDA graphs.

For each denoise GEMM (M = 50 rows: qkv, o_proj, gate_up, down) together with the kernel that
consumes its output (rope_qkv, ada_rms_norm's gated residual; gate_up: gelu_tanh_and_mul after
cuBLAS, skinny_linear's gated epilogue), and for the attention of 50 action tokens x 8 heads over
one K/V head: cuBLAS / torch's FlashAttention (what the fast path ran before) against
sglang_ext.kernels' skinny_linear and first_rows_attention in several configurations. One graph holds 18 calls with 18 distinct weights (one per layer, so the weights
stream from HBM as in a denoise step, not from L2) and is replayed 50 times.
Prints one table; no results file (docs/gpu-notes.md quotes it).

    python3 scripts/probe_pi05_kernels.py [--layers 18] [--replays 50] [--gemms-only | --layer-only]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


from sglang_ext.kernels import (  # noqa: E402
    Partials,
    ada_rms_norm,
    first_rows_attention,
    gelu_tanh_and_mul,
    rope_qkv,
    skinny_linear,
)

ROWS, WIDTH, HEADS, HEAD_DIM, MLP = 50, 1024, 8, 256, 4096
LAYER_CALLS = 18 * 10  # expert layers x denoise steps of one request
GEMMS = {"qkv": (HEADS * HEAD_DIM + 2 * HEAD_DIM, WIDTH), "o": (WIDTH, HEADS * HEAD_DIM),
         "gate_up": (2 * MLP, WIDTH), "down": (WIDTH, MLP)}


def graph_time_us(fn, calls, replays):
    """Device time per call of `fn(i)` for i in range(calls), captured once, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):  # warm-up: Triton compiles, cuBLAS picks its kernels
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * calls)


def gemm_rows(layers, replays):
    dev, bf16 = "cuda", torch.bfloat16
    x = {name: torch.randn(ROWS, k, device=dev, dtype=bf16) for name, (n, k) in GEMMS.items()}
    weights = {name: [torch.randn(n, k, device=dev, dtype=bf16) * 0.02 for _ in range(layers)]
               for name, (n, k) in GEMMS.items()}
    hidden = torch.randn(1, ROWS, WIDTH, device=dev, dtype=bf16)
    cond = torch.randn(3, 1, WIDTH, device=dev)
    cos_sin = torch.randn(ROWS, HEAD_DIM, device=dev)
    q = torch.empty(1, ROWS, HEADS, HEAD_DIM, device=dev, dtype=bf16)
    kv = torch.empty(2, 1, 700, 1, HEAD_DIM, device=dev, dtype=bf16)

    def consume(name, out):
        if name == "qkv":
            rope_qkv(out if isinstance(out, Partials) else out.view(1, ROWS, -1), cos_sin, q, kv[0], kv[1],
                     num_heads=HEADS, num_kv_heads=1, head_dim=HEAD_DIM, kv_start=600)
        elif name == "gate_up":
            if out.shape[-1] == 2 * MLP:  # cuBLAS; skinny_linear's gated epilogue did it
                gelu_tanh_and_mul(out)
        else:
            ada_rms_norm(hidden, cond[0], cond[1], eps=1e-6, add=out, gate=cond[2])

    for name, (n, k) in GEMMS.items():
        a = x[name] if name in ("gate_up",) else x[name].view(1, ROWS, k)
        ws = weights[name]
        mb = n * k * 2 / 1e6
        configs = [("cuBLAS", None)]
        for parts in (1, 2, 4, 8, 16):
            if k % (parts * 128) or k // parts < 128 or (name == "gate_up" and parts > 1):
                continue
            for block_n in (32, 64, 128):
                configs.append((f"skinny p={parts} n={block_n}", (parts, block_n)))
        for label, cfg in configs:
            if cfg is None:
                def run(i, a=a, ws=ws):
                    consume(name, F.linear(a, ws[i]))
            else:
                def run(i, a=a, ws=ws, cfg=cfg):
                    parts, block_n = cfg
                    consume(name, skinny_linear(a, ws[i], parts=parts, block_n=block_n, gated=name == "gate_up"))
            try:
                us = graph_time_us(run, layers, replays)
            except Exception as exc:  # noqa: BLE001 - a config the kernel refuses: shown, not fatal
                yield (name, label, float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            yield (name, label, us, f"{mb / us:.2f} TB/s of weight")
        # agreement with cuBLAS on one layer
        ref = F.linear(a, ws[0]).float()
        gated = name == "gate_up"
        if gated:
            gate, up = ref.chunk(2, dim=-1)
            ref = F.gelu(gate, approximate="tanh") * up
        got = skinny_linear(a, ws[0], gated=gated)
        yield (name, "max|skinny-cuBLAS|/max", float("nan"),
               f"{float((got.float() - ref).abs().max() / ref.abs().max()):.2e}")


def attention_rows(layers, replays):
    dev, bf16 = "cuda", torch.bfloat16
    for total in (610, 690):
        q = torch.randn(1, ROWS, HEADS, HEAD_DIM, device=dev, dtype=bf16)
        kvs = [torch.randn(2, 1, total, 1, HEAD_DIM, device=dev, dtype=bf16) for _ in range(layers)]
        used = torch.tensor([total - 40], device=dev, dtype=torch.int32)
        cu_q = torch.tensor([0, ROWS], device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0, total], device=dev, dtype=torch.int32)
        scale = HEAD_DIM ** -0.5

        def sdpa_full(i):
            k, v = kvs[i][0], kvs[i][1]
            F.scaled_dot_product_attention(q.view(1, 1, ROWS * HEADS, HEAD_DIM), k.view(1, 1, total, HEAD_DIM),
                                           v.view(1, 1, total, HEAD_DIM), scale=scale)

        def varlen_masked(i):
            k, v = kvs[i][0], kvs[i][1]
            torch.ops.aten._flash_attention_forward(
                q.view(ROWS, HEADS, HEAD_DIM), k.view(total, 1, HEAD_DIM), v.view(total, 1, HEAD_DIM),
                cu_q, cu_k, ROWS, total, 0.0, False, False, scale=scale, seqused_k=used)

        configs = [("torch SDPA, one head of 400 rows (full, before)", sdpa_full),
                   ("torch flash varlen seqused_k (masked, before)", varlen_masked)]
        for splits in (1, 4, 8, 10, 16):
            for masked in (False, True):
                def run(i, splits=splits, masked=masked):
                    first_rows_attention(q, kvs[i][0], kvs[i][1], used if masked else None, scale=scale, splits=splits)
                configs.append((f"first_rows_attention splits={splits}{' masked' if masked else ''}", run))
        for label, fn in configs:
            try:
                us = graph_time_us(fn, layers, replays)
                yield (f"attn T={total}", label, us, "")
            except Exception as exc:  # noqa: BLE001
                yield (f"attn T={total}", label, float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}")
        k, v = kvs[0][0], kvs[0][1]
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).expand(1, HEADS, total, HEAD_DIM),
                                             v.transpose(1, 2).expand(1, HEADS, total, HEAD_DIM), scale=scale)
        got = first_rows_attention(q, k, v, None, scale=scale, splits=10).transpose(1, 2)
        yield (f"attn T={total}", "max|ours-SDPA|/max", float("nan"),
               f"{float((got.float() - ref.float()).abs().max() / ref.float().abs().max()):.2e}")


LAYER_KERNELS = 8  # the fast path's kernels per expert layer (attention: split + combine)

if torch.cuda.is_available():
    import triton
    import triton.language as tl

    from sglang_ext.kernels.backend import after_previous_kernel

    @triton.jit
    def touch_kernel(FLAG, PDL: tl.constexpr):
        """Wait for the previous kernel, let the next launch, write one int: a launch and nothing more."""
        after_previous_kernel(PDL)
        tl.store(FLAG + tl.program_id(0), 1)


def layer_rows(layers, replays):
    """One action-expert layer as the fast path runs it (qkv+RoPE, attention, o, gated residual norm, gate-up,
    down, gated residual norm), 18 layers with their own weights per graph: us per layer, PDL on and off;
    then its four GEMMs alone and as many no-op kernels as it launches (the launch chain's share).
    (Weight columns read before each GEMM's wait, tried 2026-12-03, gained nothing: docs/gpu-notes.md.)"""
    from sglang_ext.kernels import backend, linear_rope_qkv
    from sglang_ext.kernels.attention import key_splits
    from sglang_ext.pi05.fast_loop import rope_plan, skinny_plan

    dev, bf16, total = "cuda", torch.bfloat16, 650
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = [{name: torch.randn(n, k, device=dev, dtype=bf16) * 0.02 for name, (n, k) in GEMMS.items()}
               for _ in range(layers)]
    plans = [dict(qkv=rope_plan(w["qkv"], HEAD_DIM, sms), o=skinny_plan(w["o"], sms),
                  gate_up=skinny_plan(w["gate_up"], sms, splittable=False, gated=True),
                  down=skinny_plan(w["down"], sms)) for w in weights]
    launch = {"pdl": True}  # every kernel's pdl argument, set per measurement below
    hidden = torch.randn(1, ROWS, WIDTH, device=dev, dtype=bf16)
    state = {"normed": torch.randn(1, ROWS, WIDTH, device=dev, dtype=bf16)}  # one layer's output, the next's input
    cond = torch.randn(3, 1, WIDTH, device=dev)
    cos_sin = torch.randn(ROWS, HEAD_DIM, device=dev)
    q = torch.empty(1, ROWS, HEADS, HEAD_DIM, device=dev, dtype=bf16)
    kvs = [torch.randn(2, 1, total, 1, HEAD_DIM, device=dev, dtype=bf16) for _ in range(layers)]
    used = torch.tensor([total - 40], device=dev, dtype=torch.int32)
    splits = key_splits(1, ROWS, HEADS, 1, total, sms)

    def qkv(i, x):  # qkv projection + RoPE of layer i into q and its K/V buffer
        weight, block_n, block_k = plans[i]["qkv"]
        linear_rope_qkv(x, weight, cos_sin, q, kvs[i][0], kvs[i][1], num_heads=HEADS, num_kv_heads=1,
                        head_dim=HEAD_DIM, kv_start=total - ROWS, block_n=block_n, block_k=block_k, **launch)

    def attention(i):
        out = first_rows_attention(q, kvs[i][0], kvs[i][1], used, scale=HEAD_DIM ** -0.5, splits=splits, **launch)
        return out.view(1, ROWS, HEADS * HEAD_DIM)

    def gemm(i, name, x):
        weight, parts, block_n, block_k = plans[i][name]
        return skinny_linear(x, weight, parts=parts, block_n=block_n, block_k=block_k, gated=name == "gate_up",
                             **launch)

    def layer(i):
        qkv(i, state["normed"])
        mid = ada_rms_norm(hidden, cond[0], cond[1], eps=1e-6, add=gemm(i, "o", attention(i)), gate=cond[2], **launch)
        out = gemm(i, "down", gemm(i, "gate_up", mid))
        state["normed"] = ada_rms_norm(hidden, cond[0], cond[1], eps=1e-6, add=out, gate=cond[2], **launch)

    def gemms(i):  # the four weight reads alone: the layer's bandwidth part
        qkv(i, state["normed"])
        gemm(i, "o", q.view(1, ROWS, HEADS * HEAD_DIM))
        gemm(i, "down", gemm(i, "gate_up", state["normed"]))

    flag = torch.zeros(sms, device=dev, dtype=torch.int32)

    def empty(i):  # as many one-wave kernels as the layer launches, doing nothing: the launch chain's floor
        for _ in range(LAYER_KERNELS):
            pdl = backend.uses_pdl(flag, launch["pdl"])
            touch_kernel[(sms,)](flag, PDL=pdl, launch_pdl=pdl)

    for pdl in (True, False):
        launch["pdl"] = pdl
        us = graph_time_us(layer, layers, replays)
        yield ("layer", f"pdl={'on' if pdl else 'off'}", us,
               f"x{LAYER_CALLS} = {us * LAYER_CALLS / 1000:.2f} ms/request")
    for pdl in (True, False):
        launch["pdl"] = pdl
        for what, fn in (("gemms", gemms), ("empty", empty)):
            us = graph_time_us(fn, layers, replays)
            note = "qkv+rope, o, gate_up, down only" if what == "gemms" else f"{LAYER_KERNELS} no-op kernels"
            yield (what, f"pdl={'on' if pdl else 'off'}", us, f"per layer; {note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--replays", type=int, default=50)
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--gemms-only", action="store_true", help="skip the attention rows")
    only.add_argument("--layer-only", action="store_true", help="only the whole-layer rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_pi05_kernels: needs a CUDA GPU")
    import triton

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{args.layers} calls per graph, {args.replays} replays")
    print(f"{'what':<12} {'config':<52} {'us/call':>8}  note")
    tables = [layer_rows] if args.layer_only else [gemm_rows] + ([] if args.gemms_only else [attention_rows])
    for table in tables:  # rows printed as they come: a run cut short keeps them
        for what, label, us, note in table(args.layers, args.replays):
            print(f"{what:<12} {label:<52} {us:>8.2f}  {note}", flush=True)


if __name__ == "__main__":
    main()
