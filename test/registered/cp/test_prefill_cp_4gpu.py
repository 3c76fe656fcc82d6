"""Prefill context parallel on 4 GPUs: larger-bucket graph replay equals eager.

What runs (4 ranks, torch.multiprocessing + NCCL, NVLink multicast off):
- sglang 0.5.17's real zigzag strategy and per-rank parallel state, with the
  `prefill_cp_bucket` patch applied strictly through the activation path in every rank;
- the live batch [1534, 161, 353] (2048 tokens) whose zigzag layout needs 520 aligned
  CP-local rows while the 2048 bucket captured 512: every rank's patched
  `PrefillCudaGraphRunner.can_run_graph` admits it with the 2304 bucket, and all ranks
  agree (all_gather_object);
- a CP-sharded toy layer (linear + GELU on the local zigzag rows) captured as one CUDA
  graph per bucket with the local capacity a one-request capture records; the live batch
  is replayed in the admitted bucket's graph, the local rows are all-gathered over NCCL
  between segments (where breakable CUDA graphs run their collectives), and the
  un-zigzagged result equals the eager full-sequence result.

Left out (needs a full sglang model runner with its binary kernels): a tiny real model
with trtllm_mha prefill attention and breakable CUDA graphs, and its logits.

Run: python -m pytest -q test/registered/cp/test_prefill_cp_4gpu.py   (4 GPUs)
"""

from __future__ import annotations

import os
import socket
from types import SimpleNamespace

import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

register_cuda_ci(est_time=300, stage="base-c", runner_config="4-gpu-h100")

WORLD = 4
BUCKETS = (2048, 2304, 2560)
LIVE_LENS = [1534, 161, 353]
HIDDEN = 256

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices"
)


class _ForwardBatch(SimpleNamespace):
    """A ForwardBatch stand-in; weakly referenceable, as the dataclass is (the patch keys decisions by batch)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _zigzag_shard(x, metadata):
    """This rank's rows in zigzag order: blocks `zigzag_index` of the per-request split."""
    blocks = torch.split(x, metadata.split_list, dim=0)
    return torch.cat([blocks[i] for i in metadata.zigzag_index], dim=0)


def _zigzag_positions(metadata_per_rank, total):
    """Global row index of every local row, per rank (same ordering as _zigzag_shard)."""
    index = torch.arange(total)
    return [_zigzag_shard(index, m) for m in metadata_per_rank]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
        SGLANG_ENABLE_CP_V2="1", SGLANG_EXT="1", SGLANG_EXT_STRICT="1",
    )
    from sglang_ext.registry import PATCH_NAMES

    os.environ["SGLANG_EXT_DISABLE"] = ",".join(n for n in PATCH_NAMES if n != "prefill_cp_bucket")
    torch.cuda.set_device(rank)
    import torch.distributed as dist

    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=torch.device("cuda", rank))
    try:
        _run_rank(rank, dist, out_dir)
    finally:
        dist.destroy_process_group()


def _run_rank(rank, dist, out_dir):
    from unittest.mock import patch

    from sglang_ext import activation

    statuses = activation.activate(eager=True)
    assert statuses["prefill_cp_bucket"].state == "applied", statuses["prefill_cp_bucket"]

    from sglang.srt.layers.cp.base import init_cp_strategy
    from sglang.srt.layers.cp.bcg import PrefillCPBCGInput
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
    from sglang.srt.runtime_context import get_parallel

    init_cp_strategy(SimpleNamespace(enable_prefill_cp=True, attn_cp_size=WORLD, cp_strategy="zigzag"))
    align = 8  # as in upstream's unit test; the capture capacities below use the same value
    device = torch.device("cuda", rank)
    torch.manual_seed(0)  # same weights and inputs on every rank
    weight = torch.randn(HIDDEN, HIDDEN, device=device) / HIDDEN**0.5
    x_full = torch.randn(sum(LIVE_LENS), HIDDEN, device=device)

    with get_parallel().override(attn_cp_rank=rank, attn_cp_size=WORLD), patch(
        "sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=align
    ), patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=align):
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.layers.cp.padding import pad_logical_token_to_physical

        strategy = get_cp_strategy()
        cp_input = PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0))

        # capture: one graph per bucket, local capacity of a one-request dummy batch (as 0.5.17 records)
        graphs, static_in, static_out = {}, {}, {}
        for bucket in BUCKETS:
            meta = strategy.build_metadata(num_tokens=bucket, seqs_len=[bucket], extend_seqs_len=[bucket])
            pad_logical_token_to_physical(meta)
            rows = meta.per_rank_actual_token[0]
            cp_input.bucket_local_tokens[bucket] = rows
            static_in[bucket] = torch.zeros(rows, HIDDEN, device=device)
            static_out[bucket] = torch.empty(rows, HIDDEN, device=device)

            def body(b=bucket):
                static_out[b].copy_(torch.nn.functional.gelu(static_in[b] @ weight))

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            graphs[bucket] = graph
        assert cp_input.bucket_local_tokens[2048] == 512

        # admission through the patched sglang runner
        runner = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)
        runner._is_full_backend = False
        runner.enable_lora = False
        runner._capture_chunked_prefix = False
        runner.prefill_backend_name = Backend.TC_PIECEWISE
        runner.has_mha_companion_layers = False
        runner.capture_hidden_mode = CaptureHiddenMode.NULL
        runner.capture_num_tokens = list(BUCKETS)
        runner.max_num_tokens = BUCKETS[-1]
        runner.enable_cp_v2_bcg_capture = True
        runner.prefill_cp_bcg_input = cp_input
        forward_batch = _ForwardBatch(
            batch_size=3, input_embeds=None, replace_embeds=None, mm_inputs=None, forward_mode=ForwardMode.EXTEND,
            capture_hidden_mode=CaptureHiddenMode.NULL, global_num_tokens_cpu=None, return_logprob=False,
            input_ids=list(range(sum(LIVE_LENS))), seq_lens_cpu=list(LIVE_LENS), extend_seq_lens_cpu=list(LIVE_LENS),
            extend_prefix_lens_cpu=[0, 0, 0],
        )
        assert runner.can_run_graph(forward_batch)
        decision = runner.can_run_graph.decision_of(forward_batch)
        decisions = [None] * WORLD
        dist.all_gather_object(decisions, (decision.bucket, decision.required))
        assert decisions == [(2304, 520)] * WORLD, decisions

        # replay the live layout in the admitted bucket's graph
        metas = []
        for r in range(WORLD):
            with get_parallel().override(attn_cp_rank=r):
                m = strategy.build_metadata(num_tokens=sum(LIVE_LENS), seqs_len=LIVE_LENS, extend_seqs_len=LIVE_LENS)
            pad_logical_token_to_physical(m)
            metas.append(m)
        live_rows = [len(p) for p in _zigzag_positions(metas, sum(LIVE_LENS))]
        assert max(live_rows) <= cp_input.bucket_local_tokens[decision.bucket]
        assert max(live_rows) > cp_input.bucket_local_tokens[2048]  # unpatched 0.5.17 would have crashed here

        bucket = decision.bucket
        local = _zigzag_shard(x_full, metas[rank])
        static_in[bucket].zero_()
        static_in[bucket][: local.shape[0]].copy_(local)
        graphs[bucket].replay()
        # the CP gather runs between captured segments, as breakable CUDA graphs run collectives
        capacity = cp_input.bucket_local_tokens[bucket]
        gathered = torch.empty(WORLD * capacity, HIDDEN, device=device)
        dist.all_gather_into_tensor(gathered, static_out[bucket])
        torch.cuda.synchronize()
        gathered = gathered.view(WORLD, capacity, HIDDEN)
        y_graph = torch.empty(sum(LIVE_LENS), HIDDEN, device=device)
        for r, positions in enumerate(_zigzag_positions(metas, sum(LIVE_LENS))):
            y_graph[positions.to(device)] = gathered[r, : len(positions)]
        y_eager = torch.nn.functional.gelu(x_full @ weight)
        torch.testing.assert_close(y_graph, y_eager, rtol=1e-4, atol=1e-4)

    with open(os.path.join(out_dir, f"rank{rank}.ok"), "w") as f:
        f.write(f"{decision.bucket}\n")


def test_four_ranks_replay_larger_bucket_equals_eager(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="spawn")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank{r}.ok" for r in range(WORLD)]
    assert {p.read_text().strip() for p in tmp_path.iterdir()} == {"2304"}
