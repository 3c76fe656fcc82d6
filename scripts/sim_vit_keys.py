"""Predict bench_vit.py's graph hits, keys and padding on CPU, before spending GPU time.

Feeds bench_vit's request stream (same seed, same resolutions) through sglang's real
`ViTCudaGraphRunner` with the vit_cuda_graph patch active, so keys, padding, pre-capture and
LRU eviction are the real code's. Only the GPU is faked: CUDA graphs record nothing and replay
nothing, and the tower is a one-channel stub (its layouts come from sglang's real Qwen2.5-VL
`get_window_index` at the 7B tower's geometry). Graph bytes are estimated for the 7B tower
(input, attention workspace, rotary, output per padded token). Prints one line per setting:

    python scripts/sim_vit_keys.py --backend fa3 --capacity 16 [--buckets 512,640,...] [--host 200]

--host N also times run() on the first N requests once more (all replays in fa3 bucket mode):
host microseconds and aten ops (each a launch, copy or allocation on a GPU) per call.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from types import SimpleNamespace

import torch
from torch import nn


# Qwen2.5-VL-7B vision: bytes per padded token held by one graph's own buffers (bf16):
# input 1280 + attention workspace 16 x 80 + rotary cos/sin 2 x 80 + merger output 3584 / 4.
BYTES_PER_TOKEN = 2 * (1280 + 16 * 80 + 2 * 80 + 3584 // 4)


class _Graph:
    def replay(self):
        pass

    def reset(self):
        pass


class _Block(nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.attn = SimpleNamespace(num_attention_heads_per_partition=1, head_size=1, qkv_backend_name=backend)

    def forward(self, x, *, cu_seqlens=None, position_embeddings=None, output_ws=None, forward_metadata=None):
        return x


class _Merger(nn.Module):
    def forward(self, x):
        return x[::4, 0, :]


class _Tower(nn.Module):
    """Qwen2.5-VL-7B's geometry (window 112 px, patch 14, merge 2, full attention in 4 of 32 blocks)."""

    def __init__(self, backend):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(backend), _Block(backend)])
        self.fullatt_block_indexes = [1]
        self.merger = _Merger()
        self.window_size, self.patch_size, self.spatial_merge_size, self.spatial_merge_unit = 112, 14, 2, 4
        self.use_data_parallel = True
        self.deepstack_visual_indexes, self.deepstack_merger_list, self.max_context_len = [], None, None

    device = torch.device("cpu")
    dtype = torch.float32


def _fake_cuda():
    from sglang.srt.runtime_context import get_resources

    from sglang_ext.graphs import capture as capture_core

    torch.cuda.CUDAGraph = _Graph
    torch.cuda.graph = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.graph_pool_handle = lambda: (0, 1)
    torch.cuda.current_device = lambda: 0
    torch.cuda.Stream = lambda *a, **k: SimpleNamespace(wait_stream=lambda other: None)
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    capture_core._pins[(0, (0, 1))] = ("sim", None)
    get_resources().graph_memory_pool = None


def simulate(args) -> dict:
    from bench_vit import request_stream
    from sglang.srt.models.qwen2_5_vl import Qwen2_5_VisionTransformer
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    from sglang_ext.graphs.keys import cumulative_lengths, dedup_consecutive, grid_thw_lengths

    tower = _Tower(args.backend)
    runner = ViTCudaGraphRunner(tower)
    peak_bytes = 0
    batches = []
    for tokens, grid, _ in request_stream(args.requests, args.seed):
        grid_thw = torch.tensor(grid)
        _, cu_window = Qwen2_5_VisionTransformer.get_window_index(tower, grid_thw)
        window = dedup_consecutive(int(v) for v in cu_window)
        full = (0,) + cumulative_lengths(grid_thw_lengths(grid_thw))
        x = torch.zeros(tokens, 1)
        pos = torch.zeros(tokens, 1)
        batch = dict(x=x, cu_seqlens=torch.tensor(full, dtype=torch.int32),
                     cu_window_seqlens=torch.tensor(window, dtype=torch.int32), position_embeddings=(pos, pos),
                     output_indices=torch.arange(tokens // 4), attention_layout_key=(full, window))
        runner.run(**batch)
        batches.append(batch)
        peak_bytes = max(peak_bytes, sum(k.num_tokens for k in runner.engine.store.graphs) * BYTES_PER_TOKEN)
    info = runner.engine.info()
    lookups = info["hits"] + info["misses"]
    out = {"backend": args.backend, "capacity": args.capacity, "buckets": info["budgets"],
           "hit_rate": round(info["hits"] / lookups, 4), "captures": info["captures"],
           "resident_graphs": info["resident_graphs"], "evictions": info["evictions"],
           "fallbacks": info["fallbacks"], "padding": round(info["padding_tokens"] / max(info["real_tokens"], 1), 4),
           "est_peak_graph_buffer_mib": round(peak_bytes / 2**20)}
    if args.host:
        out.update(host_cost(runner, batches[: args.host]))
    return out


def host_cost(runner, batches) -> dict:
    """Host cost of run() on batches seen before (replays, when they all hit): median us per call and
    aten ops per call (each one a kernel launch, a copy or an allocation on a real device). The
    stub tower has one channel, so the time is dispatch and Python, not data movement."""
    import statistics
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] = self.ops.get(str(func.overloadpacket), 0) + 1
            return func(*args, **(kwargs or {}))

    misses = runner.engine.info()["misses"]
    times = []
    for _ in range(3):
        for batch in batches:
            start = time.perf_counter()
            runner.run(**batch)
            times.append(time.perf_counter() - start)
    with _Count() as count:
        for batch in batches:
            runner.run(**batch)
    return {"host_us_per_run": round(1e6 * statistics.median(times), 1),
            "aten_ops_per_run": round(sum(count.ops.values()) / len(batches), 1),
            "aten_ops": {k: round(v / len(batches), 1) for k, v in sorted(count.ops.items())},
            "all_replays": runner.engine.info()["misses"] == misses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="fa3", choices=("fa3", "triton_attn", "fa4"))
    parser.add_argument("--mode", default="bucket", choices=("layout", "class", "bucket"))
    parser.add_argument("--capacity", type=int, default=16)
    parser.add_argument("--buckets", default="", help="token ladder (default: the patch's default ladder)")
    parser.add_argument("--replay-max-tokens", type=int, default=4096,
                        help="bucket mode's replay limit (on a GPU the load-time probe times it; a stub cannot)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", type=int, default=0,
                        help="then time run() on the first N requests again (host us and aten ops per call)")
    args = parser.parse_args()
    os.environ.update({"SGLANG_EXT": "1", "SGLANG_EXT_STRICT": "1", "SGLANG_EXT_VIT_GRAPH_MODE": args.mode,
                       "SGLANG_EXT_VIT_GRAPH_MAX_ENTRIES": str(args.capacity),
                       "SGLANG_EXT_VIT_GRAPH_MAX_BYTES": "0",
                       "SGLANG_EXT_VIT_GRAPH_REPLAY_MAX_TOKENS": str(args.replay_max_tokens),
                       "SGLANG_EXT_VIT_GRAPH_TOKEN_BUCKETS": args.buckets if args.mode == "bucket" else ""})
    from sglang_ext import activation
    from sglang_ext.registry import PATCH_NAMES

    os.environ["SGLANG_EXT_DISABLE"] = ",".join(n for n in PATCH_NAMES if n != "vit_cuda_graph")
    statuses = activation.activate(force=True, eager=True)
    assert statuses["vit_cuda_graph"].state == "applied", statuses["vit_cuda_graph"]
    _fake_cuda()
    print(simulate(args))


if __name__ == "__main__":
    main()
