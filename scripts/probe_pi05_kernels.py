#!/usr/bin/env python3
"""Per-call device time of the Pi0.5 action expert's kernels at its real shapes, in CUDA graphs.

For each denoise GEMM (M = 50 rows: qkv, o_proj, gate_up, down) together with the kernel that
consumes its output (rope_qkv, ada_rms_norm's gated residual, gelu_tanh_and_mul), and for the
attention of 50 action tokens x 8 heads over one K/V head: cuBLAS / torch's FlashAttention (what
the fast path ran before) against sglang_ext.kernels' skinny_linear and first_rows_attention in
several configurations. One graph holds 18 calls with 18 distinct weights (one per layer, so the
weights stream from HBM as in a denoise step, not from L2) and is replayed 50 times.
Prints one table; no results file (docs/gpu-notes.md quotes it).

    python3 scripts/probe_pi05_kernels.py [--layers 18] [--replays 50]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang_ext.kernels import (  # noqa: E402
    Partials,
    ada_rms_norm,
    first_rows_attention,
    gelu_tanh_and_mul,
    rope_qkv,
    skinny_linear,
)

ROWS, WIDTH, HEADS, HEAD_DIM, MLP = 50, 1024, 8, 256, 4096
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
            gelu_tanh_and_mul(out)
        else:
            ada_rms_norm(hidden, cond[0], cond[1], eps=1e-6, add=out, gate=cond[2])

    rows = []
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
                    consume(name, skinny_linear(a, ws[i], parts=cfg[0], block_n=cfg[1]))
            try:
                us = graph_time_us(run, layers, replays)
            except Exception as exc:  # noqa: BLE001 - a config the kernel refuses: shown, not fatal
                rows.append((name, label, float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
                continue
            rows.append((name, label, us, f"{mb / us:.2f} TB/s of weight"))
        # agreement of the default-style config with cuBLAS on one layer
        ref = F.linear(a, ws[0]).float()
        got = skinny_linear(a, ws[0], parts=1)
        rows.append((name, "max|skinny-cuBLAS|/max", float("nan"),
                     f"{float((got.float() - ref).abs().max() / ref.abs().max()):.2e}"))
    return rows


def attention_rows(layers, replays):
    dev, bf16 = "cuda", torch.bfloat16
    rows = []
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
                rows.append((f"attn T={total}", label, us, ""))
            except Exception as exc:  # noqa: BLE001
                rows.append((f"attn T={total}", label, float("nan"), f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
        k, v = kvs[0][0], kvs[0][1]
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).expand(1, HEADS, total, HEAD_DIM),
                                             v.transpose(1, 2).expand(1, HEADS, total, HEAD_DIM), scale=scale)
        got = first_rows_attention(q, k, v, None, scale=scale, splits=10).transpose(1, 2)
        rows.append((f"attn T={total}", "max|ours-SDPA|/max", float("nan"),
                     f"{float((got.float() - ref.float()).abs().max() / ref.float().abs().max()):.2e}"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_pi05_kernels: needs a CUDA GPU")
    import triton

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{args.layers} calls per graph, {args.replays} replays")
    print(f"{'what':<12} {'config':<52} {'us/call':>8}  note")
    for rows in (gemm_rows(args.layers, args.replays), attention_rows(args.layers, args.replays)):
        for what, label, us, note in rows:
            print(f"{what:<12} {label:<52} {us:>8.2f}  {note}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
