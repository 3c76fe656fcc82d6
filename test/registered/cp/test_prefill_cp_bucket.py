"""Prefill context-parallel graph bucket search on sglang 0.5.17 and 0.5.23 (patch prefill_cp_bucket).

Real sglang classes throughout: a minimal `PrefillCudaGraphRunner` built with `__new__` (as
upstream's test does), the real zigzag strategy (`init_cp_strategy`) and CP-local input class
(0.5.23's `ZigzagCPBCGInput`), the real per-rank parallel state (`get_parallel().override`), and
on 0.5.23 the real KV index translator and write plan over a plain KV pool. Only GPU-side pieces
are CPU stand-ins: the static buffer registry, the logits buffer, the attention replay metadata
and the model runner around the input embedding. The end-to-end tests run the installed
release's own `load_batch` and `PrefillCPBCGInput.prepare`, and check that the bucket admitted
once in `can_run_graph` is the one `load_batch` pads to, with the requirement computed once per
batch. The first four tests port upstream's `TestPrefillCPBCGReplay` (sgl-project/sglang#33906);
the load_batch test admits the batch first, because this port decides once at admission and
refuses a replay that was never admitted.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.layers.cp.base import init_cp_strategy
from sglang.srt.layers.cp import utils as cp_utils
from sglang.srt.layers.cp.utils import prepare_cp_forward
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
from sglang.srt.runtime_context import get_parallel
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext.registry import PATCH_NAMES

register_cpu_ci(est_time=45, suite="base-a-test-cpu")

from conftest import ext_core, plugin_only, upstream  # noqa: E402  (test/registered/conftest.py)

PrefillCPBCGInput = upstream("sglang.srt.layers.cp.bcg.bcg:PrefillCPBCGInput")

THIS_PATCH = "prefill_cp_bucket"
ALIGN = 8
OVERFLOW_LENS = [1534, 161, 353]  # 2048 tokens; needs 513 rows on rank 0 -> 520 aligned


def cp_ranks(**names):
    """`get_parallel().override(**names)`; on 0.5.23 also the parallel names its CP code reads."""
    from sglang.srt import runtime_context

    leaves = getattr(runtime_context, "_parallel_config_leaves", lambda: ())()
    if "enable_cp_tp_group_sharing" in leaves:
        names.setdefault("enable_cp_tp_group_sharing", False)
    return get_parallel().override(**names)


def _init_cp(enable: bool, cp_size: int) -> None:
    if "server_args" in inspect.signature(init_cp_strategy).parameters:  # 0.5.17: from the server args
        init_cp_strategy(SimpleNamespace(enable_prefill_cp=enable, attn_cp_size=cp_size, cp_strategy="zigzag"))
    else:
        init_cp_strategy(enable_prefill_cp=enable, cp_size=cp_size, cp_strategy="zigzag")


def zigzag(cp_size: int) -> None:
    _init_cp(True, cp_size)


def no_cp() -> None:
    _init_cp(False, 1)


@pytest.fixture
def cp_patch(ext_patches, monkeypatch):
    """This patch applied strictly through the real activation path; CP v2 on; no strategy after."""
    monkeypatch.setenv("SGLANG_ENABLE_CP_V2", "1")
    statuses = ext_patches(disable=",".join(n for n in PATCH_NAMES if n != THIS_PATCH))
    if statuses:  # plugin mode (the patched tree returns {})
        assert statuses[THIS_PATCH].state == "applied", statuses[THIS_PATCH]
    yield statuses
    no_cp()


class StopAfterRecordingFill(Exception):
    pass


class RecordingRegistry:
    """Stands in for the GPU buffer registry: records the padding target, then stops load_batch."""

    def __init__(self):
        self.padded_num_tokens = None

    def fill_from(self, _source, **kwargs):
        self.padded_num_tokens = kwargs["padded_num_tokens"]
        raise StopAfterRecordingFill


def make_runner(capture_num_tokens=(2048, 2304), bucket_local_tokens=None, cp_bcg=True):
    runner = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)
    runner._is_full_backend = False
    runner.enable_lora = False
    runner._capture_chunked_prefix = False
    runner.prefill_backend_name = Backend.TC_PIECEWISE
    runner.has_mha_companion_layers = False
    runner.capture_hidden_mode = CaptureHiddenMode.NULL
    runner.capture_num_tokens = list(capture_num_tokens)
    runner.max_num_tokens = capture_num_tokens[-1]
    runner.enable_cp_bcg_capture = runner.enable_cp_v2_bcg_capture = cp_bcg  # 0.5.23, 0.5.17
    # read by 0.5.23's can_run_graph only: no context-size limit, no Qwen side channel, any backend
    runner.max_context_size = runner.max_seq_len = runner._backend_can_run_prefill_cuda_graph = None
    runner._qwen_bcg_hc_sidechannel = runner._qwen_bcg_mtp_draft = runner._fa4_prefill = False
    runner._captured_attn_metadata_max_bs = None
    runner.prefill_cp_bcg_input = PrefillCPBCGInput(
        input_embeds=torch.empty(0),
        positions=torch.empty(0),
        bucket_local_tokens=dict(bucket_local_tokens or {}),
    )
    runner.buffer_registry = RecordingRegistry()
    return runner


class _ForwardBatch(SimpleNamespace):
    """A ForwardBatch stand-in; weakly referenceable, as the dataclass is (the patch keys decisions by batch)."""


def make_forward_batch(extend_seq_lens=OVERFLOW_LENS, num_tokens=None):
    num_tokens = sum(extend_seq_lens) if num_tokens is None else num_tokens
    return _ForwardBatch(
        batch_size=len(extend_seq_lens),
        input_embeds=None,
        replace_embeds=None,
        mm_inputs=None,
        forward_mode=ForwardMode.EXTEND,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        global_num_tokens_cpu=None,
        return_logprob=False,
        input_ids=list(range(num_tokens)),
        seq_lens_cpu=list(extend_seq_lens),
        extend_seq_lens_cpu=list(extend_seq_lens),
        extend_prefix_lens_cpu=[0] * len(extend_seq_lens),
        contains_mm_inputs=lambda: False,  # 0.5.23 asks
    )


def padded_by_load_batch(runner, forward_batch):
    """What load_batch pads to (the recorder stops it right after the buffer fill)."""
    with pytest.raises(StopAfterRecordingFill):
        runner.load_batch(forward_batch)
    return runner.buffer_registry.padded_num_tokens


def align8():
    """The CP align size fixed where sglang (and the patch) read it."""
    return patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN)


# --------------------------------------------------------------------------- upstream's four


def test_local_capacity_overflow_uses_next_capture_bucket(cp_patch):
    runner = make_runner((2048, 2304, 2560), {2048: 512, 2304: 576, 2560: 640})
    zigzag(4)
    with align8():
        selected = []
        for cp_rank in range(4):
            with cp_ranks(attn_cp_rank=cp_rank, attn_cp_size=4):
                selected.append(
                    runner.prefill_cp_bcg_input.select_replay_bucket_for_batch(
                        num_tokens=2048,
                        extend_seq_lens=OVERFLOW_LENS,
                        capture_num_tokens=runner.capture_num_tokens,
                        max_padding_factor=2,
                    )
                )
        assert selected == [2304, 2304, 2304, 2304]
        with cp_ranks(attn_cp_rank=0, attn_cp_size=4):
            assert runner.can_run_graph(make_forward_batch()) is True


def test_bucket_search_preserves_two_x_padding_limit(cp_patch):
    runner = make_runner((2048, 2304), {2048: 512, 2304: 576})
    assert (
        runner.prefill_cp_bcg_input.select_replay_bucket(
            num_tokens=1024, required_local_tokens=520, capture_num_tokens=runner.capture_num_tokens, max_padding_factor=2
        )
        is None
    )
    # the same requirement is met once the live size makes 2304 legal (<= 2x)
    assert (
        runner.prefill_cp_bcg_input.select_replay_bucket(
            num_tokens=1152, required_local_tokens=520, capture_num_tokens=runner.capture_num_tokens, max_padding_factor=2
        )
        == 2304
    )


def test_bucket_search_falls_back_when_no_capture_has_capacity(cp_patch):
    runner = make_runner((2048, 2304), {2048: 512, 2304: 516})
    zigzag(4)
    forward_batch = make_forward_batch()
    with cp_ranks(attn_cp_rank=0, attn_cp_size=4), align8():
        assert runner.can_run_graph(forward_batch) is False
        # the rejection is remembered: a replay of this batch refuses instead of padding
        with pytest.raises(RuntimeError, match="rejected at admission"):
            runner.load_batch(forward_batch)
    assert runner.buffer_registry.padded_num_tokens is None


def test_load_batch_pads_to_admitted_larger_bucket(cp_patch):
    runner = make_runner((2048, 2304), {2048: 512, 2304: 576})
    zigzag(4)
    forward_batch = make_forward_batch()
    with cp_ranks(attn_cp_rank=0, attn_cp_size=4), align8():
        assert runner.can_run_graph(forward_batch)
        decision = runner.can_run_graph.decision_of(forward_batch)
        assert (decision.live_size, decision.bucket, decision.required, decision.capacity) == (2048, 2304, 520, 576)
        assert padded_by_load_batch(runner, forward_batch) == 2304
        # the bucket override is scoped to that call: the base rounding is back afterwards
        assert PrefillCudaGraphRunner._pad_to_bucket(2048, [2048, 2304]) == 2048


# --------------------------------------------------------------------------- beyond upstream


def test_all_ranks_admit_the_same_bucket_and_match_real_zigzag_rows(cp_patch):
    """Every rank decides alike, and the requirement equals what sglang's prepare builds."""
    runner = make_runner((2048, 2304, 2560), {2048: 512, 2304: 576, 2560: 640})
    zigzag(4)
    decisions, built_rows = [], []
    with align8(), patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN):
        for cp_rank in range(4):
            with cp_ranks(attn_cp_rank=cp_rank, attn_cp_size=4):
                forward_batch = make_forward_batch()
                assert runner.can_run_graph(forward_batch)
                decisions.append(runner.can_run_graph.decision_of(forward_batch))
                forward_batch.attn_cp_metadata = None
                forward_batch.out_cache_loc = None
                prepare_cp_forward(forward_batch)  # real zigzag split + physical padding
                built_rows.append(max(forward_batch.attn_cp_metadata.per_rank_actual_token))
    assert len(set(decisions)) == 1, decisions
    assert decisions[0].bucket == 2304
    assert built_rows == [decisions[0].required] * 4 == [520] * 4


def test_replay_without_admission_raises_clearly(cp_patch):
    runner = make_runner((2048, 2304), {2048: 512, 2304: 576})
    zigzag(4)
    with cp_ranks(attn_cp_rank=0, attn_cp_size=4), align8():
        with pytest.raises(RuntimeError, match="no admission decision"):
            runner.load_batch(make_forward_batch())
        assert runner.buffer_registry.padded_num_tokens is None

        # a decision made for another token count is not reused
        forward_batch = make_forward_batch()
        assert runner.can_run_graph(forward_batch)
        forward_batch.input_ids = list(range(2040))
        forward_batch.extend_seq_lens_cpu = [1534, 161, 345]
        with pytest.raises(RuntimeError, match="decision made for 2048 tokens"):
            runner.load_batch(forward_batch)
        assert runner.buffer_registry.padded_num_tokens is None


def test_non_zigzag_layout_unknown_runs_eager(cp_patch):
    runner = make_runner((2048, 2304), {2048: 512, 2304: 576})
    zigzag(4)
    forward_batch = make_forward_batch()
    forward_batch.extend_seq_lens_cpu = None  # no CPU lengths: requirement unknown
    with cp_ranks(attn_cp_rank=0, attn_cp_size=4), align8():
        assert runner.prefill_cp_bcg_input.required_local_tokens(None) is None
        assert runner.can_run_graph(forward_batch) is False
        assert runner.can_run_graph.decision_of(forward_batch) is None


def test_counters_reach_graph_stats(cp_patch):
    from sglang_ext.prefill_cp.bucket import PREFILL_CP_BUCKET_STATS_NAME

    # the stats registry the runner's code uses: sglang_ext's with the plugin, the vendored
    # sglang.ext copy in the patched fork tree
    stats = ext_core("graphs.stats")

    runner = make_runner((2048, 2304, 4096), {2048: 512, 2304: 576, 4096: 1024})
    zigzag(4)
    with cp_ranks(attn_cp_rank=0, attn_cp_size=4), align8():
        assert runner.can_run_graph(make_forward_batch())  # 2304 instead of 2048
        assert runner.can_run_graph(make_forward_batch([1024, 1024]))  # fits 2048
        runner.prefill_cp_bcg_input.bucket_local_tokens = {2048: 512}
        assert not runner.can_run_graph(make_forward_batch())  # nothing fits
        fb = make_forward_batch()
        fb.extend_seq_lens_cpu = None
        assert not runner.can_run_graph(fb)
    name = type(runner).can_run_graph.counters_of(runner).stats_name  # may carry a suffix: other runners live
    assert name.split("#")[0] == PREFILL_CP_BUCKET_STATS_NAME
    snap = stats.snapshot()[name]
    assert snap == {
        "admitted": 2,
        "admitted_larger_bucket": 1,
        "rejected_no_fit": 1,
        "rejected_unknown_layout": 1,
        "padding_rows_added": 256,
        "padding_rows_total": 256,
    }


def _outcome(fn):
    try:
        return ("ok", fn())
    except StopAfterRecordingFill:
        return ("padded",)
    except Exception as exc:  # noqa: BLE001 - comparing failures too
        return ("raised", type(exc).__name__, str(exc))


def _non_cp_observations():
    """can_run_graph and load_batch outcomes over configurations that must not change."""
    seen = []
    configs = [
        # (cp_bcg flag, CP strategy, CP v2 env)
        (False, None, "1"),
        (False, 4, "1"),  # CP strategy but this runner captured no CP body
        # CP BCG captured, but CP v2 off: batch not CP-active (0.5.17; 0.5.20 retired the switch)
        *([(True, 4, "0")] if hasattr(cp_utils, "is_cp_v2_active") else []),
        (True, None, "1"),  # no CP strategy bound
    ]
    for cp_bcg, cp, env in configs:
        with patch.dict("os.environ", {"SGLANG_ENABLE_CP_V2": env}):
            zigzag(cp) if cp else no_cp()
            for lens in ([1534, 161, 353], [1000], [3, 5], [2304], [2000, 300], [4000]):
                runner = make_runner((2048, 2304, 4096), {2048: 512, 2304: 576, 4096: 1024}, cp_bcg=cp_bcg)
                fb = make_forward_batch(lens)
                with cp_ranks(attn_cp_rank=1, attn_cp_size=4), align8():
                    admitted = _outcome(lambda: runner.can_run_graph(fb))
                    loaded = _outcome(lambda: runner.load_batch(fb))
                seen.append((cp_bcg, cp, env, tuple(lens), admitted, loaded, runner.buffer_registry.padded_num_tokens,
                             sorted(vars(fb))))
    no_cp()
    return seen


@plugin_only
def test_non_cp_configurations_behave_as_unpatched(cp_patch):
    from sglang_ext import activation

    patched = _non_cp_observations()
    activation.deactivate()
    assert not hasattr(PrefillCPBCGInput, "replay_bucket_decision")  # really unpatched now (ours only)
    unpatched = _non_cp_observations()
    assert patched == unpatched
    # the comparison covered admitted and padded batches, not only refusals
    assert any(obs[4] == ("ok", True) and obs[5] == ("padded",) for obs in patched)
    assert any(obs[4] == ("ok", False) for obs in patched)


# --------------------------------------------------------------------------- properties


def upstream_required_rows(lens, cp_size, align):
    """Reference: upstream's per-request, per-rank loop (PR #33906)."""
    segments = cp_size * 2
    per_rank = [0] * cp_size
    for length in lens:
        base, rem = divmod(length, segments)
        for rank in range(cp_size):
            per_rank[rank] += base * 2 + int(rank < rem) + int(segments - 1 - rank < rem)
    return (max(per_rank) + align - 1) // align * align


@st.composite
def cp_cases(draw):
    cp_size = draw(st.sampled_from([2, 4, 8]))
    lens = draw(st.lists(st.integers(2 * cp_size, 3000), min_size=1, max_size=24))
    align = draw(st.sampled_from([1, cp_size, 2 * cp_size, 8]))
    buckets = sorted(draw(st.sets(st.integers(16, 40000), min_size=1, max_size=12)))
    capacity = {b: draw(st.integers(0, b)) for b in buckets if draw(st.booleans()) or b == buckets[0]}
    factor = draw(st.sampled_from([1, 1.5, 2, 4]))
    return cp_size, lens, align, buckets, capacity, factor


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cp_cases())
def test_selection_properties(cp_patch, case):
    cp_size, lens, align, buckets, capacity, factor = case
    live = sum(lens)
    zigzag(cp_size)
    cp_input = PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0), bucket_local_tokens=capacity)
    with patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=align):
        per_rank = []
        for rank in range(cp_size):
            with cp_ranks(attn_cp_rank=rank, attn_cp_size=cp_size):
                required = cp_input.required_local_tokens(lens)
                chosen = cp_input.select_replay_bucket_for_batch(
                    num_tokens=live, extend_seq_lens=lens, capture_num_tokens=buckets, max_padding_factor=factor
                )
                per_rank.append((required, chosen))
    assert len(set(per_rank)) == 1  # rank-independent
    required, chosen = per_rank[0]
    assert required == upstream_required_rows(lens, cp_size, align)
    fitting = [b for b in buckets if live <= b <= live * factor and capacity.get(b, -1) >= required]
    if chosen is None:
        assert fitting == []
    else:
        assert chosen >= live
        assert chosen <= live * factor
        assert capacity[chosen] >= required
        assert chosen == min(fitting)


def test_a_bucket_whose_capacity_equals_the_requirement_is_chosen(cp_patch):
    """The capacity and exact-size boundaries, deterministically (the property test above reaches them only
    by chance)."""
    lens, buckets = [100, 37], [64, 256, 512]
    zigzag(2)
    with patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=8):
        with cp_ranks(attn_cp_rank=0, attn_cp_size=2):
            probe = PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0), bucket_local_tokens={})
            required = probe.required_local_tokens(lens)
            for capacity, want in ((required, 256), (required - 1, 512)):
                cp_input = PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0),
                                             bucket_local_tokens={256: capacity, 512: required})
                chosen = cp_input.select_replay_bucket_for_batch(num_tokens=sum(lens), extend_seq_lens=lens,
                                                                 capture_num_tokens=buckets, max_padding_factor=4)
                assert chosen == want, (capacity, required, chosen)
            exact = [100, 28]  # 128 live tokens: the 128 bucket itself is the smallest that fits
            cp_input = PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0),
                                         bucket_local_tokens={128: 10**6, 256: 10**6})
            assert cp_input.select_replay_bucket_for_batch(num_tokens=128, extend_seq_lens=exact,
                                                           capture_num_tokens=[128, 256], max_padding_factor=4) == 128


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cp_size=st.sampled_from([2, 4, 8]),
    lens=st.lists(st.integers(16, 2000), min_size=1, max_size=8),
    seq_split=st.booleans(),
)
def test_requirement_equals_rows_prepare_builds(cp_patch, cp_size, lens, seq_split):
    """required_local_tokens == max physical rows of sglang's real zigzag metadata, on every rank."""
    align = 2 * cp_size if seq_split else cp_size
    zigzag(cp_size)
    cp_input = PrefillCPBCGInput(input_embeds=torch.empty(0), positions=torch.empty(0))
    with patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=align), patch(
        "sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=align
    ):
        for rank in range(cp_size):
            with cp_ranks(attn_cp_rank=rank, attn_cp_size=cp_size):
                fb = make_forward_batch(lens)
                fb.attn_cp_metadata = None
                fb.out_cache_loc = None
                prepare_cp_forward(fb)
                assert max(fb.attn_cp_metadata.per_rank_actual_token) == cp_input.required_local_tokens(lens)


# --------------------------------------------------------------------------- the crash, end to end on CPU

HIDDEN = 16
VOCAB = 4096


class _Batch(SimpleNamespace):
    """A live ForwardBatch stand-in: fields it does not set read as None (as ForwardBatch defaults do); private
    names do not (weak maps probe them)."""

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return None


class _Slot:
    def __init__(self, tensor):
        self.tensor = tensor

    def slice_for(self, _bs, num_tokens):
        return self.tensor[:num_tokens]


class PaddingRegistry:
    """CPU stand-in for the runner's static buffer registry: copies live rows, zero-pads to the bucket."""

    def __init__(self, max_tokens, device="cpu"):
        self.slots = {
            name: _Slot(torch.zeros(max_tokens, dtype=torch.int64, device=device))
            for name in ("input_ids", "positions", "out_cache_loc")
        }
        self.padded_num_tokens = None

    def has_slot(self, name):
        return name in self.slots

    def get_slot(self, name):
        return self.slots[name]

    def fill_from(self, source, *, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens, **_more):
        self.padded_num_tokens = padded_num_tokens
        for name, slot in self.slots.items():
            slot.tensor[:raw_num_tokens].copy_(getattr(source, name))
            slot.tensor[raw_num_tokens:padded_num_tokens].zero_()


def zigzag_cp_bcg_input_type():
    """The CP-local input class a zigzag runner creates: 0.5.23 picks it by strategy (its base class
    leaves the requirement to the strategy's subclass); 0.5.17 has one class."""
    try:
        from sglang.srt.layers.cp.base import ContextParallelStrategyKind
        from sglang.srt.layers.cp.bcg import get_cp_bcg_input_type
    except ImportError:  # 0.5.17
        return PrefillCPBCGInput
    return get_cp_bcg_input_type(ContextParallelStrategyKind.ZIGZAG)


def kv_index_translator(device="cpu"):
    """0.5.23's real KV index translator over a plain (untranslated) KV pool; 0.5.17 has none."""
    try:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    except ImportError:  # 0.5.17
        return None
    return KVIndexTranslator(req_to_token=torch.zeros(8, VOCAB, dtype=torch.int32, device=device),
                             token_to_kv_pool_allocator=None, token_to_kv_pool=None, page_size=1, device=device)


class ReplayModelRunner(SimpleNamespace):
    """Stands in for the ModelRunner (its model, pools and attention backend live on the GPU): the input
    embedding and the KV index translator. 0.5.23's dummy-batch hook is ModelRunner's own; no attention-TP
    sequence sharding (it follows the DP-attention / MoE gather setup, none here)."""

    prepare_dummy_forward_batch = getattr(ModelRunner, "prepare_dummy_forward_batch", None)

    def attn_tp_sequence_sharded(self, num_tokens):
        return False


def make_replay_runner(embedding, device="cpu"):
    """Minimal runner whose real load_batch runs through PrefillCPBCGInput.prepare."""
    buckets = (2048, 2304, 2560)
    runner = make_runner(buckets, {2048: 512, 2304: 576, 2560: 640})
    runner.prefill_cp_bcg_input = zigzag_cp_bcg_input_type()(
        input_embeds=torch.zeros(buckets[-1], embedding.embedding_dim, device=device),
        positions=torch.zeros(buckets[-1], dtype=torch.int64, device=device),
        bucket_local_tokens={2048: 512, 2304: 576, 2560: 640},  # one-request captures, align 8
    )
    runner.buffer_registry = PaddingRegistry(buckets[-1], device)
    runner.backend = object()  # not breakable: no MHA-state restore
    runner.capture_return_pooled_hidden_states = False
    runner._prefill_static_buffers = None
    runner.static_draft_hidden_states = None
    runner.model_runner = ReplayModelRunner(model=SimpleNamespace(get_input_embeddings=lambda: embedding),
                                            kv_index_translator=kv_index_translator(device))
    # GPU-side pieces of load_batch, recorded instead of run
    runner._next_token_logits_buffer = lambda rows: None
    runner._prefill_logits_buffer_rows = lambda forward_batch: 0
    runner.replay_metadata_calls = []  # the padded size each call was for (0.5.23 passes it in a ShapeKey)

    def prepare_forward_metadata_for_replay(forward_batch, static_forward_batch, shape):
        runner.replay_metadata_calls.append(getattr(shape, "size", shape))  # 0.5.23 returns its read ends

    runner._prepare_forward_metadata_for_replay = prepare_forward_metadata_for_replay
    return runner


def count_requirements(cp_input):
    """The extend lengths of each CP-local requirement computed on `cp_input` (the search's per-batch work)."""
    computed, compute = [], cp_input.required_local_tokens

    def required_local_tokens(extend_seq_lens):
        computed.append(list(extend_seq_lens))
        return compute(extend_seq_lens)

    cp_input.required_local_tokens = required_local_tokens
    return computed


def loaded_batch(loaded):
    """load_batch's static forward batch (0.5.23 returns it with the attention read ends)."""
    return loaded[0] if isinstance(loaded, tuple) else loaded


def make_live_batch(extend_seq_lens, device="cpu", generator=None):
    n = sum(extend_seq_lens)
    positions = torch.cat([torch.arange(length) for length in extend_seq_lens]).to(device)
    batch = _Batch(
        batch_size=len(extend_seq_lens),
        forward_mode=ForwardMode.EXTEND,
        global_forward_mode=ForwardMode.EXTEND,
        capture_hidden_mode=CaptureHiddenMode.NULL,
        return_logprob=False,
        input_ids=torch.randint(0, VOCAB, (n,), generator=generator).to(device),
        positions=positions,
        out_cache_loc=torch.arange(n, device=device),
        seq_lens_cpu=list(extend_seq_lens),
        extend_seq_lens_cpu=list(extend_seq_lens),
        extend_prefix_lens_cpu=[0] * len(extend_seq_lens),
        extend_num_tokens=n,
        contains_mm_inputs=lambda: False,  # 0.5.23 asks
    )
    translator = kv_index_translator(device)
    if translator is not None:  # 0.5.23: the iteration's KV write plan over its slots (load_batch binds it)
        seq_lens = torch.tensor(extend_seq_lens, device=device)
        batch.kv_loc_plan = translator.plan(req_pool_indices=torch.arange(len(extend_seq_lens), device=device),
                                            seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(),
                                            write_virtual=batch.out_cache_loc)
    return batch


@pytest.mark.parametrize("cp_rank", [0, 1, 2, 3])
def test_real_load_batch_replays_overflowing_layout_in_the_admitted_bucket(cp_patch, cp_rank):
    """sglang's own load_batch + prepare on CPU: the 520-row layout lands in the 2304 bucket's 576 rows."""
    torch.manual_seed(cp_rank)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN)
    runner = make_replay_runner(embedding)
    zigzag(4)
    live = make_live_batch(OVERFLOW_LENS)
    computed = count_requirements(runner.prefill_cp_bcg_input)
    with cp_ranks(attn_cp_rank=cp_rank, attn_cp_size=4), align8(), patch(
        "sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN
    ), torch.no_grad():
        assert runner.can_run_graph(live)
        static = loaded_batch(runner.load_batch(live))

        assert computed == [OVERFLOW_LENS]  # decided once, at admission (0.5.23 alone would search again here)
        assert runner.buffer_registry.padded_num_tokens == 2304
        assert len(static.input_ids) == 2304
        assert static.attn_cp_metadata.per_rank_actual_token == [576] * 4  # the captured geometry
        assert runner.replay_metadata_calls == [2304]
        # this rank's zigzag blocks of the live embeddings, then zeros up to the captured 576 rows
        metadata = static.attn_cp_metadata
        logical = metadata.per_rank_logical_token[cp_rank]
        assert logical == [513, 511, 512, 512][cp_rank]
        blocks = torch.split(embedding(live.input_ids), metadata.split_list)
        zigzag_rows = torch.cat([blocks[i] for i in metadata.zigzag_index])
        assert zigzag_rows.shape[0] == logical
        assert static.input_embeds.shape[0] == 576
        torch.testing.assert_close(static.input_embeds[:logical], zigzag_rows)
        assert torch.count_nonzero(static.input_embeds[logical:]) == 0


def test_capacities_recorded_by_real_capture_prepare_drive_the_search(cp_patch):
    """sglang's prepare(capture=True) records every bucket's local rows; the search uses exactly those."""
    embedding = torch.nn.Embedding(VOCAB, HIDDEN)
    runner = make_replay_runner(embedding)
    runner.prefill_cp_bcg_input.bucket_local_tokens = {}
    zigzag(4)
    with cp_ranks(attn_cp_rank=2, attn_cp_size=4), align8(), patch(
        "sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN
    ), torch.no_grad():
        for bucket in reversed(runner.capture_num_tokens):  # sglang's capture order (largest first)
            dummy = make_live_batch([bucket])  # capture_prepare's one-request dummy batch
            runner.prefill_cp_bcg_input.prepare(runner, dummy, static_num_tokens=bucket, capture=True)
        assert runner.prefill_cp_bcg_input.bucket_local_tokens == {2048: 512, 2304: 576, 2560: 640}
        live = make_live_batch(OVERFLOW_LENS)
        assert runner.can_run_graph(live)
        assert runner.can_run_graph.decision_of(live).bucket == 2304
        assert runner.can_run_graph.decision_of(live).capacity == 576


@plugin_only
def test_unpatched_load_batch_on_the_same_layout(cp_patch):
    """What this patch changes, unpatched: 0.5.17 pads to 2048 and prepare() refuses 520 > 512 rows (the
    crash); 0.5.23 finds the 2304 bucket itself, but searches twice: at admission and again at replay."""
    from sglang_ext import activation

    activation.deactivate()
    upstream_searches = hasattr(PrefillCPBCGInput, "select_replay_bucket_for_batch")  # 0.5.23; 0.5.17 has none
    embedding = torch.nn.Embedding(VOCAB, HIDDEN)
    runner = make_replay_runner(embedding)
    computed = count_requirements(runner.prefill_cp_bcg_input) if upstream_searches else None
    zigzag(4)
    live = make_live_batch(OVERFLOW_LENS)
    with cp_ranks(attn_cp_rank=0, attn_cp_size=4), patch(
        "sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN
    ), torch.no_grad():
        assert runner.can_run_graph(live)  # admitted ...
        if upstream_searches:
            loaded_batch(runner.load_batch(live))
            assert computed == [OVERFLOW_LENS] * 2  # ... and searched again at replay
            assert runner.buffer_registry.padded_num_tokens == 2304
            return
        with pytest.raises(RuntimeError, match="needs 520 local CP rows, but global prefill bucket 2048"):
            runner.load_batch(live)  # ... and killed at replay
    assert runner.buffer_registry.padded_num_tokens == 2048


# --------------------------------------------------------------------------- replay in the admitted bucket == eager
# (the same rank loop with real CUDA graphs: test_prefill_cp_graph_1gpu.py)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay() reruns the captured body on the same buffers."""

    def __init__(self, body):
        self.body = body

    def replay(self):
        self.body()


def capture_fake_graph(local_input, weight):
    out = torch.empty(local_input.shape[0], weight.shape[1], device=local_input.device)

    def body():
        out.copy_(torch.nn.functional.gelu(local_input @ weight))

    body()  # "capture" runs the body once on the dummy rows, as warm-up + capture would
    return FakeGraph(body), out


def replay_all_ranks(device, capture):
    """Capture per bucket and replay the overflow batch on each of 4 CP ranks in turn; check == eager.

    `capture(local_input, weight) -> (graph, output)` makes a graph of the CP-local toy body
    (CUDA graph on a GPU, `FakeGraph` on CPU). Returns the bucket each rank replayed.
    """
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN).to(device)
    weight = torch.randn(HIDDEN, HIDDEN, device=device) / HIDDEN**0.5
    live_ids_seed = torch.Generator().manual_seed(1)  # the same live batch on every rank
    live_ids = make_live_batch(OVERFLOW_LENS, generator=live_ids_seed).input_ids
    zigzag(4)

    decisions, rank_rows, rank_outputs, replayed = [], [], [], []
    with align8(), patch("sglang.srt.layers.cp.padding.get_cp_padding_align_size", return_value=ALIGN), \
            torch.no_grad():
        for rank in range(4):
            with cp_ranks(attn_cp_rank=rank, attn_cp_size=4):
                runner = make_replay_runner(embedding, device)
                cp_input = runner.prefill_cp_bcg_input
                cp_input.bucket_local_tokens = {}
                graphs, outputs = {}, {}
                for bucket in reversed(runner.capture_num_tokens):  # sglang's capture order (largest first)
                    dummy = make_live_batch([bucket], device)
                    cp_input.prepare(runner, dummy, static_num_tokens=bucket, capture=True)
                    rows = cp_input.bucket_local_tokens[bucket]
                    graphs[bucket], outputs[bucket] = capture(cp_input.input_embeds[:rows], weight)
                assert cp_input.bucket_local_tokens == {2048: 512, 2304: 576, 2560: 640}

                live = make_live_batch(OVERFLOW_LENS, device)
                live.input_ids = live_ids.to(device)
                assert runner.can_run_graph(live)
                decision = runner.can_run_graph.decision_of(live)
                decisions.append((decision.bucket, decision.required))
                static = loaded_batch(runner.load_batch(live))  # sglang's body; prepare() fills the fixed buffer
                graphs[decision.bucket].replay()
                replayed.append(decision.bucket)
                if device.type == "cuda":
                    torch.cuda.synchronize()

                metadata = static.attn_cp_metadata
                logical = metadata.per_rank_logical_token[rank]
                rank_outputs.append(outputs[decision.bucket][:logical].clone())
                rank_rows.append(_zigzag_rows(len(live_ids), metadata))

        assert decisions == [(2304, 520)] * 4
        y_graph = torch.empty(len(live_ids), HIDDEN, device=device)
        for rows, out in zip(rank_rows, rank_outputs):
            assert len(rows) == out.shape[0]
            y_graph[rows.to(device)] = out
        assert sorted(torch.cat(rank_rows).tolist()) == list(range(len(live_ids)))
        y_eager = torch.nn.functional.gelu(embedding(live_ids.to(device)) @ weight)
        torch.testing.assert_close(y_graph, y_eager, rtol=1e-4, atol=1e-4)
    return replayed


def _zigzag_rows(total, metadata):
    """Sequence index of every logical local row of one rank, in its zigzag order."""
    blocks = torch.split(torch.arange(total), metadata.split_list)
    return torch.cat([blocks[i] for i in metadata.zigzag_index])


def test_replay_in_admitted_bucket_equals_eager_on_every_rank(cp_patch):
    assert replay_all_ranks(torch.device("cpu"), capture_fake_graph) == [2304] * 4
