"""CP BCG prefill graphs own their graph-break inputs (sgl-project/sglang#37606, patch prefill_cp_bucket).

Real 0.5.17 code: `PrefillCudaGraphRunner.capture_one_shape` (patched) and its original,
`PrefillCPBCGInput.prepare(capture=True)`, `BreakableCudaGraphBackend.capture_one` /
`.replay` / `.cleanup`, the `eager_on_graph` wrapper and `_weak_ref_if_tensor`, and for the
replay the patched `can_run_graph` + 0.5.17's `load_batch`. The model is a toy CP-local
body (per layer q/k/v projections, a real `eager_on_graph` break writing `out`, o-proj).
GPU parts faked on CPU: the CUDA graph segments (`FakeCapture`: segments record nothing,
their replay does nothing, so replay values are checked on the GPU only,
test_prefill_bcg_break_inputs_cuda.py) and sgl_kernel's `weak_ref_tensor` (a view over the
same bytes that owns nothing, as on the GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import types
import weakref
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch

from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
from sglang.srt.model_executor.runner.shape_key import ShapeKey
from sglang.srt.model_executor.runner_backend import breakable_cuda_graph_backend as backend_module
from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import breakable_cuda_graph as bcg_module
from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph import eager_on_graph
from sglang.srt.runtime_context import get_parallel
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext.versions import installed_sglang_version

from conftest import ext_core  # noqa: E402  (test/registered/conftest.py)

# the activation fixture and the CP runner / batch builders of the bucket tests (same directory)
from test_prefill_cp_bucket import (  # noqa: F401  (cp_patch is a fixture)
    ALIGN,
    OVERFLOW_LENS,
    VOCAB,
    align8,
    cp_patch,
    cp_ranks,
    make_live_batch,
    make_replay_runner,
    zigzag,
)

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
# 0.5.17's BreakableCudaGraphBackend capture with CPU stand-ins; 0.5.23's capture reads more than they
# provide (the TP group; its `_weak_ref_if_tensor` returns CPU tensors as they are).
pytestmark = pytest.mark.skipif(
    installed_sglang_version() != "0.5.17", reason="CPU stand-ins for 0.5.17's breakable capture only")

CP_RANK, CP_SIZE = 0, 4
BUCKETS = (2048, 2304, 2560)  # make_replay_runner's; CP-local rows 512, 576, 640


# --------------------------------------------------------------------------- the toy body


class BreakLog:
    """What the toy attention break saw: weakrefs at capture, the tensors themselves at replay."""

    def __init__(self):
        self.captured = []  # per break call during capture: [weakref(q), weakref(k), weakref(v), weakref(out)]
        self.captured_ptrs = []
        self.replayed = None  # a list while replaying, else None

    def see(self, tensors):
        if bcg_module._current_capture_var.get() is not None:  # the once-run inside a capture
            self.captured.append([weakref.ref(t) for t in tensors])
            self.captured_ptrs.append([t.data_ptr() for t in tensors])
        elif self.replayed is not None:
            self.replayed.append(list(tensors))


LOG = BreakLog()


def _toy_attention(q, k, v, out):
    LOG.see((q, k, v, out))
    out.copy_(torch.sigmoid(q) * k + v)  # row-wise, so padded rows never reach live ones


toy_attention = eager_on_graph(True)(_toy_attention)  # a graph break, as radix attention's


class ToyCPBody:
    def __init__(self, layers, hidden, device):
        g = torch.Generator().manual_seed(7)
        self.weights = [
            [(torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(device) for _ in range(4)]
            for _ in range(layers)
        ]

    def forward(self, x):
        h = x
        for wq, wk, wv, wo in self.weights:
            q, k, v = h @ wq, h @ wk, h @ wv
            out = torch.empty_like(q)
            toy_attention(q, k, v, out)
            h = h + out @ wo
        return h


def make_capture_runner(body, hidden, device, backend):
    """A CP BCG runner whose real capture_one_shape runs the toy body through `backend`."""
    embedding = torch.nn.Embedding(VOCAB, hidden).to(device)
    runner = make_replay_runner(embedding, device)
    assert tuple(runner.capture_num_tokens) == BUCKETS
    runner.prefill_cp_bcg_input.bucket_local_tokens = {}  # recorded by the real prepare(capture=True)
    runner.backend = backend
    # capture_prepare's one-request dummy batch; attention metadata is the toy's business
    runner.capture_prepare = lambda num_tokens: (make_live_batch([num_tokens], device), None)
    runner._init_forward_metadata_for_capture = lambda forward_batch, num_tokens: None
    runner._run_forward = lambda forward_batch, num_tokens: body.forward(forward_batch.input_embeds)
    return runner


def make_backend(device_module):
    tp_group = SimpleNamespace(barrier=lambda: None)
    return BreakableCudaGraphBackend(SimpleNamespace(model_runner=SimpleNamespace(tp_group=tp_group),
                                                     device_module=device_module))


@contextlib.contextmanager
def cp_rank_context():
    """Rank 0 of a 4-way zigzag CP layout with upstream's align size 8 (no process groups), no grad."""
    zigzag(CP_SIZE)
    with cp_ranks(attn_cp_rank=CP_RANK, attn_cp_size=CP_SIZE), align8(), \
            patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN), torch.no_grad():
        yield


def capture_buckets(runner, *, hold):
    """0.5.17's capture order (largest first); hold=False runs 0.5.17's own capture_one_shape."""
    per_bucket = {}
    for bucket in reversed(runner.capture_num_tokens):
        start = len(LOG.captured)
        if hold:
            runner.capture_one_shape(bucket)
        else:
            PrefillCudaGraphRunner.capture_one_shape.__wrapped__(runner, bucket)  # sglang's, under the patch's
        per_bucket[bucket] = (LOG.captured[start:], LOG.captured_ptrs[start:])
    return per_bucket


def replay_overflow_batch(runner, device):
    """Admit and load [1534, 161, 353] (-> the 2304 bucket), replay it; what the breaks read."""
    live = make_live_batch(OVERFLOW_LENS, device)
    assert runner.can_run_graph(live)
    bucket = runner.can_run_graph.decision_of(live).bucket
    static = runner.load_batch(live)
    LOG.replayed = []
    try:
        with runner.backend.replay_session():
            output = runner.backend.replay(ShapeKey(size=bucket), static)
    finally:
        reads, LOG.replayed = LOG.replayed, None
    return bucket, static, output, reads


# --------------------------------------------------------------------------- CPU fakes of the GPU parts


class FakeSegment:
    def replay(self):
        pass  # a CUDA graph segment: its kernels are not recorded on CPU


class FakeCapture:
    """BreakableCUDAGraphCapture's contract for eager_on_graph, without CUDA graphs."""

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", barrier_fn=None):
        self.cuda_graph = cuda_graph
        self._barrier_fn = None

    def __enter__(self):
        self._token = bcg_module._current_capture_var.set(self)
        return self

    def __exit__(self, *exc):
        self._end_current_segment()
        bcg_module._current_capture_var.reset(self._token)
        return False

    def _end_current_segment(self):
        self.cuda_graph._append_segment(FakeSegment(), False)

    def _begin_new_segment(self):
        pass


def non_owning_view(tensor):
    """sgl_kernel.weak_ref_tensor on CPU: the same bytes, no ownership of them."""
    buffer = (ctypes.c_byte * (tensor.numel() * tensor.element_size())).from_address(tensor.data_ptr())
    return torch.frombuffer(buffer, dtype=tensor.dtype).view(tensor.shape)


@pytest.fixture
def cpu_graphs(monkeypatch):
    weak_ref_module = types.ModuleType("sglang.srt.compilation.weak_ref_tensor")
    weak_ref_module.weak_ref_tensors = non_owning_view
    monkeypatch.setitem(sys.modules, "sglang.srt.compilation.weak_ref_tensor", weak_ref_module)
    monkeypatch.setattr(backend_module, "BreakableCUDAGraphCapture", FakeCapture)
    monkeypatch.setattr(bcg_module, "get_device_module", lambda: torch.cpu)  # replay's current stream
    LOG.__init__()
    yield
    LOG.__init__()


# --------------------------------------------------------------------------- tests

LAYERS, HIDDEN = 3, 16


def test_unpatched_capture_leaves_earlier_buckets_break_inputs_unowned(cp_patch, cpu_graphs):
    """#37606 on 0.5.17's own capture_one_shape: every captured bucket's break inputs are freed."""
    body = ToyCPBody(LAYERS, HIDDEN, "cpu")
    runner = make_capture_runner(body, HIDDEN, "cpu", make_backend(SimpleNamespace(synchronize=lambda: None)))
    with cp_rank_context():
        per_bucket = capture_buckets(runner, hold=False)
    gc.collect()
    assert set(runner.backend._graphs) == {ShapeKey(size=b) for b in BUCKETS}  # graphs alive ...
    for bucket, (refs, _) in per_bucket.items():
        assert len(refs) == LAYERS
        assert all(ref() is None for layer in refs for ref in layer), bucket  # ... their inputs gone


def test_cp_capture_holds_break_inputs_and_replay_reads_them(cp_patch, cpu_graphs):
    body = ToyCPBody(LAYERS, HIDDEN, "cpu")
    runner = make_capture_runner(body, HIDDEN, "cpu", make_backend(SimpleNamespace(synchronize=lambda: None)))
    with cp_rank_context():
        per_bucket = capture_buckets(runner, hold=True)
        gc.collect()
        check_held_and_replayed(runner, per_bucket, HIDDEN)

    # owned by the bucket's graph only: gone with the backend's graphs, nothing leaks
    runner.backend.cleanup()
    gc.collect()
    assert all(ref() is None for refs, _ in per_bucket.values() for layer in refs for ref in layer)


def check_held_and_replayed(runner, per_bucket, hidden, layers_count=LAYERS):
    """Every bucket's break inputs alive, in memory of their own; the 2304 replay reads exactly them."""
    assert runner.prefill_cp_bcg_input.bucket_local_tokens == {2048: 512, 2304: 576, 2560: 640}
    held = {b: [[ref() for ref in layer] for layer in refs] for b, (refs, _) in per_bucket.items()}
    for bucket, layers in held.items():
        assert len(layers) == layers_count
        assert all(t is not None for layer in layers for t in layer), f"bucket {bucket} lost its break inputs"
        rows = runner.prefill_cp_bcg_input.bucket_local_tokens[bucket]
        assert all(t.shape == (rows, hidden) for layer in layers for t in layer)
    # no block is shared between buckets: each bucket's inputs are its own memory
    ptrs = [p for _, pointers in per_bucket.values() for layer in pointers for p in layer]
    assert len(set(ptrs)) == len(ptrs) == len(BUCKETS) * layers_count * 4

    # the overflow batch replays 2304, captured before 2048
    bucket, static, output, reads = replay_overflow_batch(runner, runner.prefill_cp_bcg_input.input_embeds.device)
    assert bucket == 2304
    assert len(reads) == layers_count
    for read, captured in zip(reads, held[2304]):
        assert all(r is c for r, c in zip(read, captured))  # the held tensors themselves
    return static, output


def test_hold_is_scoped_to_the_cp_capture(cp_patch, cpu_graphs):
    """Outside a CP BCG capture (decode, non-CP prefill, diffusion) break inputs stay 0.5.17's weak views."""
    q = torch.arange(6.0).view(2, 3)
    args = (q, [q], 3)
    view = bcg_module._weak_ref_if_tensor(args)
    assert view[2] == 3
    assert view[0] is not q and view[1][0] is not q
    assert view[0].data_ptr() == q.data_ptr() == view[1][0].data_ptr()

    token = ext_core("prefill_cp.bucket")._EXT_HOLD_BREAK_INPUTS.set(True)  # what the patched capture_one_shape sets
    try:
        held = bcg_module._weak_ref_if_tensor(args)
    finally:
        ext_core("prefill_cp.bucket")._EXT_HOLD_BREAK_INPUTS.reset(token)
    assert held[0] is q and held[1][0] is q and held[2] == 3
    assert held[1] is not args[1]  # containers copied, as 0.5.17 copies them


def test_non_cp_breakable_capture_is_unchanged(cp_patch, cpu_graphs):
    """A breakable prefill runner without CP BCG captures as 0.5.17 does: break inputs not held."""
    body = ToyCPBody(LAYERS, HIDDEN, "cpu")
    runner = make_capture_runner(body, HIDDEN, "cpu", make_backend(SimpleNamespace(synchronize=lambda: None)))
    runner.enable_cp_bcg_capture = runner.enable_cp_v2_bcg_capture = False  # 0.5.23, 0.5.17

    def dummy_batch(num_tokens):
        batch = make_live_batch([num_tokens])
        batch.input_embeds = torch.randn(num_tokens, HIDDEN)
        return batch, None

    runner.capture_prepare = dummy_batch
    with torch.no_grad():
        runner.capture_one_shape(2048)
    gc.collect()
    assert ShapeKey(size=2048) in runner.backend._graphs
    assert len(LOG.captured) == LAYERS
    assert all(ref() is None for layer in LOG.captured for ref in layer)
