"""Prefill CP on one GPU: CUDA-graph replay in the admitted larger bucket equals eager.

The four CP ranks run one after another in this process (`get_parallel().override`), each
with its own `PrefillCPBCGInput` fixed-address buffers, exactly as each rank would:
- capture: 0.5.17's real `prepare(capture=True)` fills the fixed CP-local input buffer
  for a one-request dummy batch and records the bucket's local rows; a toy CP-local body
  (linear + GELU) reading that buffer is captured as a CUDA graph per bucket;
- replay: the patched `can_run_graph` admits [1534, 161, 353] with the 2304 bucket (the
  2048 bucket captured 512 rows, the layout needs 520), 0.5.17's real `load_batch` +
  `prepare(capture=False)` write the live zigzag rows into the same fixed buffer, and the
  2304 graph is replayed.
The ranks' outputs, put back in sequence order (the CP gather, done here by indexing),
equal the eager computation on the whole sequence. Collectives across real ranks: see
test_prefill_cp_4gpu.py.

Run: python -m pytest -q test/registered/cp/test_prefill_cp_graph_1gpu.py
"""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci.ci_register import register_cuda_ci

# the rank loop and the activation fixture of the CPU tests (same directory)
from test_prefill_cp_bucket import cp_patch, replay_all_ranks  # noqa: F401  (cp_patch is a fixture)

register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-small")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_larger_bucket_graph_replay_equals_eager_for_every_rank(cp_patch):
    graphs_replayed = replay_all_ranks(torch.device("cuda"), capture_local_body)
    assert graphs_replayed == [2304] * 4


def capture_local_body(local_input, weight):
    """CUDA graph of a CP-local toy layer reading the fixed-address CP input rows."""
    out = torch.empty(local_input.shape[0], weight.shape[1], device=local_input.device)

    def body():
        out.copy_(torch.nn.functional.gelu(local_input @ weight))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph, out
