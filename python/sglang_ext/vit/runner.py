"""ViT CUDA graphs keyed by attention layout, bounded, workspace-stable, never wrong.

Target symbols:
    sglang.srt.multimodal.vit_cuda_graph_runner.ViTCudaGraphRunner (methods patched
        in place: _get_graph_key, _sequence_layout_key, _get_sin_cos_ws, _create_graph,
        create_graph, replay, run; added: _retired_sin_cos_ws (property) and _ext_* helpers)
    sglang.srt.models.qwen2_5_vl.Qwen2_5_VisionTransformer.forward_with_cuda_graph
    sglang.srt.models.qwen3_vl.Qwen3VLMoeVisionModel.forward_with_cuda_graph
        (inherited by qwen3_omni_moe.Qwen3OmniMoeVisionEncoder)
sglang versions: 0.5.17 (fingerprint-gated). 0.5.19+ carry upstream's layout key, which
is still unbounded (see "Retire when").
Upstream PR: sgl-project/sglang#37043 (first released in 0.5.19).

Why: 0.5.17 keys ViT graphs by token count only. Two batches with equal token count
and different image boundaries replay the first batch's `cu_seqlens` and baked
`max_seqlen`: silently wrong embeddings. Growing the rotary sin/cos workspace moves
it while older graphs keep reading the old (freed, reusable) address. Upstream's fix
keeps every layout's graph forever (each in a private pool), never frees retired
workspaces, syncs GPU->CPU when no layout key is passed, has no eager fallback and
returns the graph-owned output buffer for Qwen3. Qwen3's graph inputs
(`_prepare_graph_inputs`, unchanged up to 0.5.23) interpolate the position embedding
by another rule than its eager `forward`, so graphs on never equalled graphs off;
our Qwen3 graph path builds its inputs as `forward` does.

How:
- Key = `GraphKey(num_tokens, layout=(full-attention cu_seqlens, window cu_seqlens))`
  as Python ints, built by the two model methods from CPU metadata (grid_thw, the
  window index list, Qwen3's grid) and passed as
  upstream's `attention_layout_key`. Device tensors are then built from the same ints,
  so the key always describes the data.
- `_get_graph_key(x_3d)` with one argument returns the token count (what 0.5.17's
  NPU subclass expects; it keeps its own state). With CPU cu_seqlens it builds the
  key from them; with device cu_seqlens and no key it raises `DeviceSyncError`
  (never a hidden sync).
- `run()` without any CPU layout (e.g. a caller passing only CUDA cu_seqlens, as
  upstream's GPU unit test does) runs the tower EAGER: no sync, no graph, counted as
  `fallback_no_cpu_layout`, with one warning per runner. Eager uses max_seqlen = token count, an upper bound;
  the triton vision kernel (kernels/ops/attention/prefill_attention.py) uses it only
  as a grid bound (programs past a sequence's length load nothing and store
  nothing), and fa3 only to size its scheduling (see layout-class mode), so the
  output is exact. Chosen over refusing (would break callers that
  work on 0.5.17) and over syncing (the point of the fix).
- Capacity: one `BoundedGraphCache` per runner (knobs vit_graph_max_entries,
  _max_bytes, _policy, _min_hits, read when the runner is first used). Byte budget
  (vit_graph_max_bytes -1, the default): a quarter of `torch.cuda.mem_get_info()`'s free
  memory at the runner's first run (what sglang left after its KV cache and weights),
  clamped to [256 MiB, 4 GiB]; non-DP encoders take the MIN over the TP CPU group (one
  gloo all-reduce, once; every rank reaches its first run in lockstep). 0 = no byte limit. LRU eviction
  resets the graph and drops its buffers before the next capture. All captures go
  into sglang's process-wide graph pool (`get_or_create_global_graph_memory_pool`),
  pinned (`sglang_ext.graphs.capture.pin_graph_pool`) so evicting the last graph never
  empties it, on one capture stream per device (`capture_stream`: the allocator reuses a
  freed pool block only on the stream that allocated it), through `guarded_capture` (no
  automatic GC inside a capture: a dropped runner's graphs collected there would reset
  inside it and invalidate it; a failed capture leaves the pool and the CUDA generator
  usable). So graph memory stays flat however many layouts come and go. Graphs sharing a pool
  may overwrite each other's intermediates, which is safe here because each replay's
  output is copied out before anything else runs on the stream (see ownership). It
  assumes, as sglang does when its prefill and decode graphs share this pool, that
  no graph whose static output outlives the next ViT replay is captured after a ViT
  graph (sglang captures its LLM graphs at start-up).
- Bytes per graph are the buffers a graph holds exclusively (input, attention
  workspace, output, rotary slice, cu_seqlens): computed from shapes, so every TP
  rank sees the same numbers and makes the same admission/eviction decisions.
  Intermediates are shared through the pool and not counted per graph.
- Eager fallback (over capacity, warming up, quarantined after a failed capture,
  capacity 0, no CPU layout): the same blocks and merger, given
  `forward_metadata=prepare_vision_attention_metadata(..., max_seqlen=<from the CPU
  layout>)`, which the vision attention backends take in preference to the graph
  path (vision.py: `if forward_metadata is not None`). Same kernels, same max_seqlen:
  the result equals the graph's. Blocks whose forward takes no `forward_metadata`
  get the graph-form arguments with a fresh `output_ws` instead.
- Tensor parallelism (non-DP encoders): a capture runs `sglang_ext.graphs.agreement`'s
  two-vote protocol over the TP CPU group (gloo MIN all-reduce of one int): rank-local
  prepare (backend check first, then the graph's buffers, rotary slices and a warm-up of
  block 0 whose TP all-reduce / all-gather are local stand-ins, so a failing rank leaves
  no peer inside a device collective) -> vote -> capture (records collectives, executes
  none) and its bookkeeping -> vote. Two votes per capture whatever fails where, none
  per hit, replay or eager run; a failure on any rank makes every rank drop the graph
  and run that batch eager, and all ranks record the same failure class.
- Failed captures: out of memory is transient (retried after 2, 4, ... misses of that
  key, capped; `BoundedGraphCache`), anything else (unsupported backend, shape errors)
  keeps the key eager until the runner's cache is cleared.
- Custom all-reduce: captures do not enter `_capture_context()` (`ca_comm.capture()`),
  whose graph-buffer registrations are never freed and fill sglang's fixed table under
  LRU churn; the custom all-reduce then captures its pre-registered staging-buffer path
  (`_create_graph` says why that is capture-safe in 0.5.17).
- Rotary sin/cos: each graph leases `[:seq_len]` slices from a `StableWorkspacePool`
  (per head_dim); growth allocates a new backing buffer, existing slices never move,
  a backing is freed once no live graph leases it. Upstream's
  `_get_sin_cos_ws(graph_key, seq_len, head_dim[, dtype])` returns the key's stable slices;
  `_retired_sin_cos_ws` lists the retired backings still leased (freed ones vanish).
- Ownership: `replay()` returns an owned tensor: `index_select` (Qwen2.5, as 0.5.17)
  or a clone (Qwen3: 0.5.17 returned `block_output[key]`, which mm_utils' embedding
  cache may keep while a later replay of the same key, or of any graph sharing the
  pool, overwrites it).
- No device sync on Qwen2.5's graph path: 0.5.17's body copies the pixels and the window
  index to the device blocking and indexes the rotary table with CPU position ids (each a
  stream sync: the host stops queueing until the device drains). The patched forward copies
  them non-blocking from pinned memory (up to 64 MiB per tensor) and calls `rot_pos_ids`
  with ints (its lru_cache then hits). Same values, same kernels.
- In-place patching: methods are replaced on the class, so runners built before
  activation, the `qwen2_5_vl` / `qwen3_vl` module globals, `qwen3_vl.graph_runners_dict`
  (whose default factory returns the same class object) and the NPU subclass all see
  the new code; new state is created lazily on a runner's first use.
- Counters (hits, misses, captures, evictions, fallbacks by reason, resident graphs
  and bytes) are registered with `sglang_ext.graphs.stats` per runner.

Layout-class mode (opt-in, `--ext-vit-graph-mode class`; vision attention triton_attn, fa3 or
fa4, other backends keep layout keys): key = (token count, per layout: sequence count rounded
up to a power of two, longest sequence rounded up to a power of two (at most the token count)).
The graph's cu_seqlens / sequence-length buffers are sized for the class and rewritten before
every replay (device copies; unused trailing sequences get length 0); the captured max_seqlen
is the class bound. Token counts are NOT padded, so every other op sees eager's shapes. Why a
larger max_seqlen and empty trailing sequences leave the attention output unchanged:
- triton_attn (kernels/ops/attention/prefill_attention.py): max_seqlen is only the grid size;
  every load/store is masked by the per-sequence length. Bitwise equal to eager.
- fa3 (sgl_kernel / FlashAttention-3 hopper `mha_fwd`): sglang's vision path calls
  `flash_attn_varlen_func` with its default `num_splits=1`, so the split heuristic (the one
  place max_seqlen changes arithmetic) never runs and PackGQA stays off (MHA). Tile sizes
  depend on head dim only; varlen runs the persistent tile scheduler, whose prepare kernel
  reads the real lengths from cu_seqlens, so each (sequence, m-block, head) tile does the same
  arithmetic whatever the bound, and zero-length sequences produce no tiles (0.5.17's Qwen2.5
  eager path already passes one: the doubled leading zero). The scheduler and split buffers
  are allocated inside the call (captured into the graph pool); no scheduler_metadata is
  passed. Expected bitwise; the GPU test measures it on the real kernel.
- fa4 (flash_attn.cute, 0.5.17 vendored): `num_splits=1` as well; on SM100 max_seqlen picks
  q_stage (2 iff max_seqlen > tile_m = 128), a power-of-two class keeps eager's choice, but it is
  a different compiled kernel when it does not (bucket mode): within rounding. 0.5.17's fa4
  backend has no graph-mode branch, so captures pass `forward_metadata` built on the graph's own
  buffers. UNRUN on hardware (no Blackwell here): key and metadata logic are CPU-tested only.
Many layouts share a graph (the same images in another order, or images of other shapes with
equal token totals). Before each capture one window and one full-attention block run eagerly
(kernels that compile on first use, e.g. fa4's per-variant JIT, must not compile in a capture).

Bucket mode (the default, `--ext-vit-graph-mode bucket`; same backends; others run eager): one
graph per token budget, keyed by the budget alone (36 full-attention sequence slots, budget / 16
window slots, the budget and the tower's window size as max_seqlen bounds), so any mix of images
that fits replays it and the ladder is known before any call. When the model loads
(`ModelRunner.init_cuda_graphs`, after sglang's own graphs, before the server reports healthy) a
synthetic image takes the tower's own graph path up to the runner (the sample: dtypes, widths,
rotary form), then the ladder is captured: 512 tokens growing by 26 % up to the largest call the
prefill limits allow (chunked prefill size x merge unit), ended by a probe that times each
budget's replay against the sync-free eager run of its smallest call and stops at the first loss
(`--ext-vit-graph-replay-max-tokens` fixes the limit instead), then cut to the capacity and byte
budget. Captured largest first: every graph's input, attention workspace and rotary slices lie in
the largest one's buffers. Every stage is voted over the TP CPU group; a failure anywhere leaves
every rank eager. After that nothing is captured. A call is padded to the smallest budget that
fits: padding rows are zeros after the real tokens, forming their own sequences (one for full
attention, window-sized ones for windows), so no real token attends to them and the merger's
first `tokens / merge unit` rows are the real output. A call above the probe's break-even runs as
one eager call (there the device bounds it, and chunk replays would add padding and fixed costs);
above a limit the knob or the capacity set lower, it is split where every layout has a boundary into
chunks of whole images, each replayed; adjacent chunks no graph serves (one image above the limit,
too many windows) run as one eager call. Cost: GEMMs see the padding
rows and another row count can pick another cuBLAS kernel, so results equal eager within bf16
rounding, not bitwise. Measured (docs/gpu-notes.md): it wins where the host bounds the server
(concurrency 1) and costs its padding where the device does.

Deviation from upstream: keys are `GraphKey`s, not `(S, layout)` tuples; a direct
`_get_graph_key(x, cuda_cu_seqlens, ...)` call without a key raises instead of syncing;
`attention_layout_key` must be `(full cu_seqlens ints, window cu_seqlens ints or None)`;
`create_graph` stores device copies of cu_seqlens owned by the graph (upstream keeps the
caller's tensors by reference); captures run outside `ca_comm.capture()` and warm up without
TP communication (upstream warms up with real all-reduces and registers every graph's buffers
with the custom all-reduce).

Retire when: upstream bounds the ViT graph count with eviction, frees retired rotary
workspaces, returns owned outputs and never syncs on the key path (all still open in
0.5.23).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math

import torch

from sglang_ext import knobs as ext_knobs
from sglang_ext.graphs import stats as ext_graph_stats
from sglang_ext.graphs.agreement import agreed_capture, cpu_group_vote, local_vote
from sglang_ext.graphs.buckets import geometric_buckets, select_bucket
from sglang_ext.graphs.cache import BoundedGraphCache
from sglang_ext.graphs.capture import capture_stream, guarded_capture, pin_graph_pool
from sglang_ext.graphs.packing import median_wall_ms, sequences_between, whole_sequence_chunks
from sglang_ext.graphs.keys import (
    GraphKey,
    cpu_ints,
    cumulative_lengths,
    dedup_consecutive,
    grid_thw_lengths,
)
from sglang_ext.graphs.workspace import AddressGuard, StableWorkspacePool

_ext_vit_logger = logging.getLogger("sglang_ext.vit_cuda_graph")

# Fallback reasons, as counted per runner.
_EXT_VIT_FALLBACK_REASONS = ("capacity", "warming", "quarantined", "disabled", "no_cpu_layout", "capture_failed",
                             "no_fit", "gate")

# Bucket mode's default token ladder: 512 patches growing by 26 % up to the largest call the server
# can send (16384 -> 16 sizes when unknown), in multiples of 64 (one Qwen2.5-VL attention window; a
# multiple of the merge unit). Chosen by scripts/sim_vit_keys.py over bench_vit.py's stream among
# 16-size ladders: least padding (10 %).
_EXT_VIT_DEFAULT_BUCKETS = dict(smallest=512, ratio=1.26, multiple=64)
# Bucket mode: full-attention sequence slots of every budget graph (images or frames, Qwen2.5's empty
# leading sequence and the padding); a call with more is split into chunks that fit.
_EXT_VIT_BUCKET_SEQUENCES = 36
# Bucket mode: window slots per budget token, 1 / (this * merge unit): a window holds at least 4 merge
# units for images of the processors' minimum size (56 px), and padding windows are window-sized.
_EXT_VIT_BUCKET_TOKENS_PER_WINDOW_UNIT = 4
# Bucket mode: the ladder's top when nothing says how large a call can be (no server limits known).
_EXT_VIT_BUCKET_DEFAULT_LARGEST = 16384
# Bucket mode, load-time gate: wall time of this many runs (median, after one warm-up) per side.
_EXT_VIT_GATE_REPEATS = 5
# The synthetic image that takes the tower's own graph path at load: grid (1, 16, 16), 256 patches.
_EXT_VIT_SAMPLE_GRID = (1, 16, 16)
# Vision attention backends whose kernels read max_seqlen only as a bound (grid size / scheduling) and skip
# zero-length sequences, so layout-class and bucket modes can share a graph between layouts (see the header).
_EXT_VIT_CLASS_BACKENDS = ("triton_attn", "fa3", "fa4")
# Default byte budget (knob -1): this fraction of the device memory free at the runner's first use,
# clamped to [floor, cap]; the MIN over TP ranks, so every rank admits and evicts the same graphs.
_EXT_VIT_AUTO_BUDGET = dict(fraction=0.25, floor=256 << 20, cap=4 << 30)
# Host tensors up to this size reach the device through pinned memory without a sync (the caching host
# allocator keeps such blocks for reuse: bounded by this); larger ones (long videos) copy blocking.
_EXT_VIT_PIN_MAX_BYTES = 64 << 20


# ---------------------------------------------------------------------------
# Helpers (module-level: transplanted into the runner module with the methods)
# ---------------------------------------------------------------------------


def _ext_vit_layout_ints(values, field):
    """CPU layout as a tuple of ints; None for None; DeviceSyncError for device tensors."""
    if values is None:
        return None
    return cpu_ints(values, field=field)


def _ext_vit_max_len(layout):
    """Longest sequence of a cumulative layout (0 for an empty one)."""
    if not layout or len(layout) < 2:
        return 0
    return max(b - a for a, b in zip(layout, layout[1:]))


def _ext_vit_pow2(value):
    return 1 << max(0, int(value) - 1).bit_length()


def _ext_vit_layout_class(layout, num_tokens):
    """(padded sequence count, max_seqlen bound) of one layout, for layout-class mode."""
    if layout is None:
        return (None, None)
    return (_ext_vit_pow2(max(len(layout) - 1, 1)),
            min(_ext_vit_pow2(max(_ext_vit_max_len(layout), 1)), max(num_tokens, 1)))


def _ext_vit_token_buckets(unit, largest=None):
    """Bucket mode's candidate ladder (knob, or the default up to `largest` tokens), sizes the merge unit divides."""
    buckets = ext_knobs.current("vit_graph_token_buckets") or geometric_buckets(
        largest=max(largest or _EXT_VIT_BUCKET_DEFAULT_LARGEST, _EXT_VIT_DEFAULT_BUCKETS["smallest"]),
        **_EXT_VIT_DEFAULT_BUCKETS)
    return tuple(b for b in buckets if b % unit == 0)


def _ext_vit_window_slots(budget, unit, window_tokens):
    """Window-sequence slots of a `budget`-token graph (see _EXT_VIT_BUCKET_TOKENS_PER_WINDOW_UNIT)."""
    smallest = min(_EXT_VIT_BUCKET_TOKENS_PER_WINDOW_UNIT * unit, window_tokens or unit)
    return budget // max(smallest, unit) + 2


def _ext_vit_padded_layout(layout, real_tokens, bucket, chunk):
    """`layout` plus padding sequences covering [real_tokens, bucket), none longer than `chunk`."""
    if layout is None:
        return None
    cuts = list(layout)
    end = real_tokens
    while end < bucket:
        end = min(end + chunk, bucket)
        cuts.append(end)
    return tuple(cuts)


def _ext_vit_pad_rows(tensor, pad):
    """`tensor` with `pad` zero rows appended along dim 0 (one kernel)."""
    if tensor is None:
        return None
    return torch.nn.functional.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, pad))


def _ext_vit_is_device_tensor(value):
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _ext_vit_window_tokens(vit):
    """Tokens in one full attention window of a windowed tower (Qwen2.5-VL: 112 px -> 64), else None."""
    try:
        side = int(vit.window_size) // int(vit.spatial_merge_size) // int(vit.patch_size)
        return side * side * int(vit.spatial_merge_unit)
    except (AttributeError, TypeError, ValueError):
        return None


def _ext_vit_auto_budget(free_bytes):
    """The default byte budget for `free_bytes` of free device memory (None: no device, no limit)."""
    if free_bytes is None:
        return 0
    rule = _EXT_VIT_AUTO_BUDGET
    return int(min(rule["cap"], max(rule["floor"], free_bytes * rule["fraction"])))


# ---------------------------------------------------------------------------
# ViTCudaGraphRunner methods
# ---------------------------------------------------------------------------


def _ext_ensure_state(self):
    """Create the sglang-ext state on first use (also for runners built before activation)."""
    if "_ext_cache" in self.__dict__:
        return
    policy = ext_knobs.current("vit_graph_policy")
    self._ext_max_bytes = self._ext_graph_budget()
    self._ext_cache = BoundedGraphCache(
        "vit_cuda_graph",
        ext_knobs.current("vit_graph_max_entries"),
        policy=policy,
        max_bytes=self._ext_max_bytes,
        min_hits=ext_knobs.current("vit_graph_min_hits"),
        release=self._ext_release_graph,
    )
    self._ext_mode = ext_knobs.current("vit_graph_mode")
    # Merger rows: `spatial_merge_unit` input tokens make one output row (1 for towers without merging).
    self._ext_merge_unit = int(getattr(self.vit, "spatial_merge_unit", 1) or 1)
    self._ext_token_buckets = (_ext_vit_token_buckets(self._ext_merge_unit, self.__dict__.get("_ext_server_tokens"))
                               if self._ext_mode == "bucket" else ())
    # Bucket mode: calls up to this many tokens replay (decided at pre-capture; the ladder's top until then).
    self._ext_replay_limit = self._ext_token_buckets[-1] if self._ext_token_buckets else 0
    self._ext_gate = []  # load-time probe: one row per budget measured
    self._ext_precapture_info = {"precapture_graphs": 0, "precapture_ms": 0, "precapture_reserved_bytes": 0}
    self._ext_chunking = {"chunked_calls": 0, "chunks": 0}
    self._ext_padding = {"padded_batches": 0, "padding_tokens": 0, "real_tokens": 0}
    self._ext_window_tokens = _ext_vit_window_tokens(self.vit)
    self._ext_precaptured = False
    self._ext_split_above_limit = True  # decided at pre-capture
    if self._ext_mode != "layout" and self._attn_backend not in _EXT_VIT_CLASS_BACKENDS:
        _ext_vit_logger.warning("--ext-vit-graph-mode %s needs one of the vision attention backends %s; this "
                                "tower uses %s, so its graphs are keyed by exact layout", self._ext_mode,
                                "/".join(_EXT_VIT_CLASS_BACKENDS), self._attn_backend)
    elif self._ext_mode == "bucket" and not self._ext_token_buckets:
        _ext_vit_logger.warning("--ext-vit-graph-token-buckets: no size is a multiple of this tower's merge unit "
                                "%d, so bucket mode pads nothing (class mode keys only)", self._ext_merge_unit)
    self._ext_rotary_pools = {}
    self._ext_rotary_leases = {}
    self._ext_buffer_pools = {}  # bucket mode: input and attention workspace shared by the budget graphs
    self._ext_buffer_leases = {}
    self._ext_rotary_current = {}
    self._sin_cos_ws_by_graph = {}
    self._ext_graph_bytes = {}
    self._ext_max_lens = {}
    self._ext_fallbacks = {reason: 0 for reason in _EXT_VIT_FALLBACK_REASONS}
    # --ext-debug-addresses: assert at every replay that no captured tensor moved.
    self._ext_address_guard = AddressGuard()
    blocks = getattr(self.vit, "blocks", None) or [None]
    forward = getattr(blocks[0], "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    self._ext_blk_accepts_metadata = "forward_metadata" in params
    self._ext_stats_name = f"vit_cuda_graph:{type(self.vit).__name__}@{id(self):x}"
    ext_graph_stats.register(self._ext_stats_name, self._ext_graph_info)


def _ext_graph_budget(self):
    """Byte budget of this runner's resident graphs: the knob, or (-1) sized from free device memory.

    Read once, when the runner's state is created (its first run). Non-data-parallel encoders
    take the MIN over the TP CPU group: every TP rank reaches its first run() with the same
    batch, and equal budgets keep admission and eviction identical on all ranks.
    """
    configured = ext_knobs.current("vit_graph_max_bytes")
    if configured >= 0:
        return configured
    free = None
    device = getattr(self.vit, "device", None)
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        free = int(torch.cuda.mem_get_info(device)[0])
    budget = _ext_vit_auto_budget(free)
    if not getattr(self.vit, "use_data_parallel", False):
        group = self._ext_tower_group()
        if getattr(group, "world_size", 1) > 1:
            agreed = torch.tensor([budget], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
            budget = int(agreed.item())
    _ext_vit_logger.info("ViT CUDA graph byte budget: %d MiB (%s)", budget >> 20,
                         "no device: no limit" if free is None else f"{free >> 20} MiB free at first use")
    return budget


def _ext_graph_info(self):
    """Counters for `sglang-ext doctor` / periodic debug logs."""
    info = self._ext_cache.info().as_dict()
    info["mode"] = "bucket" if self._ext_bucket_mode() else "class" if self._ext_class_mode() else "layout"
    info["attention_backend"] = self._attn_backend
    info.update(self._ext_padding)
    info["resident_graphs"] = len(self._ext_cache)
    info["fallbacks"] = sum(self._ext_fallbacks.values())
    for reason, count in self._ext_fallbacks.items():
        info[f"fallback_{reason}"] = count
    info["rotary_backing_buffers"] = sum(p.backing_buffers for p in self._ext_rotary_pools.values())
    info["rotary_bytes"] = sum(p.bytes_allocated for p in self._ext_rotary_pools.values())
    info["shared_buffer_bytes"] = sum(p.bytes_allocated for p in self._ext_buffer_pools.values())
    info["bytes_resident"] += info["shared_buffer_bytes"]
    info["replay_limit_tokens"] = self._ext_replay_limit
    info["budgets"] = len(self._ext_token_buckets)
    info.update(self._ext_precapture_info)
    info.update(self._ext_chunking)
    return info


def _ext_release_graph(self, entry):
    """Drop everything one graph holds (cache release callback: exactly once per cache entry).

    `entry` is `(graph_key, graph)`; a stale entry (its key since re-captured) only resets its graph.
    """
    graph_key, graph = entry
    if self.block_graphs.get(graph_key) is graph:
        self._ext_drop_graph_state(graph_key)
    elif graph is not None:
        graph.reset()


def _ext_drop_graph_state(self, graph_key):
    graph = self.block_graphs.pop(graph_key, None)
    if graph is not None:
        try:
            graph.reset()
        except Exception as exc:  # noqa: BLE001 - a half-captured graph must not mask the capture error
            _ext_vit_logger.debug("reset of ViT graph %s failed: %s", graph_key, exc)
    for table in (self.block_input, self.block_ws, self.block_output, self.cu_full_len,
                  self.cu_window_len, self.cu_full_len_kk, self.cu_window_len_kk):
        table.pop(graph_key, None)
    self._ext_graph_bytes.pop(graph_key, None)
    self._ext_max_lens.pop(graph_key, None)
    guard = self.__dict__.get("_ext_address_guard")
    if guard is not None:
        guard.forget(graph_key)
    self._sin_cos_ws_by_graph.pop(graph_key, None)
    lease = self._ext_rotary_leases.pop(graph_key, None)
    if lease is not None:
        lease.release()
    for lease in self._ext_buffer_leases.pop(graph_key, ()):
        lease.release()


def _sequence_layout_key(cu_seqlens):
    """Upstream's name; CPU values only (a device tensor raises DeviceSyncError, never syncs)."""
    return _ext_vit_layout_ints(cu_seqlens, "cu_seqlens")


def _get_graph_key(self, x_3d, cu_seqlens=None, cu_window_seqlens=None, attention_layout_key=None):
    """Include attention boundaries so equal-length batches stay distinct.

    One argument (0.5.17's NPU subclass): the token count, as before.
    """
    num_tokens = int(x_3d.shape[0])
    if attention_layout_key is None:
        if cu_seqlens is None and cu_window_seqlens is None:
            return num_tokens
        attention_layout_key = (
            _ext_vit_layout_ints(cu_seqlens, "cu_seqlens"),
            _ext_vit_layout_ints(cu_window_seqlens, "cu_window_seqlens"),
        )
    full, window = attention_layout_key
    full = None if full is None else tuple(int(v) for v in full)
    window = None if window is None else tuple(int(v) for v in window)
    return GraphKey(num_tokens, layout=(full, window))


def _ext_class_mode(self):
    """Layout-class (and bucket) mode: only for backends that read max_seqlen as a mere bound (see the header)."""
    return self._ext_mode in ("class", "bucket") and self._attn_backend in _EXT_VIT_CLASS_BACKENDS


def _ext_bucket_mode(self):
    return self._ext_mode == "bucket" and self._attn_backend in _EXT_VIT_CLASS_BACKENDS


def _ext_graph_key_for(self, layout_key):
    """The cache key of a batch: its layout key, or in class mode its (tokens, class) key.

    Bucket mode: the key depends on the token budget only (fixed full-attention and window slots,
    the budget and the tower's window size as max_seqlen bounds), so the ladder is captured before
    any call and one graph serves any mix of images that fits it (`_ext_budget_fits`).
    """
    if not self._ext_class_mode():
        return layout_key
    full, window = layout_key.layout
    tokens = layout_key.num_tokens
    if self._ext_bucket_mode():
        window_class = (None, None)
        if window is not None:
            window_class = (_ext_vit_window_slots(tokens, self._ext_merge_unit, self._ext_window_tokens),
                            max(self._ext_window_tokens or 0, self._ext_merge_unit))
        return GraphKey(tokens, variant=("bucket", _EXT_VIT_BUCKET_SEQUENCES, max(tokens, 1)) + window_class)
    return GraphKey(tokens, variant=("class",) + _ext_vit_layout_class(full, tokens)
                    + _ext_vit_layout_class(window, tokens))


def _ext_budget_fits(self, padded_key, graph_key):
    """Whether a padded layout fits its budget graph's sequence slots and window bound."""
    _, full_slots, _, window_slots, window_bound = graph_key.variant
    full, window = padded_key.layout
    if full is None or len(full) - 1 > full_slots:
        return False
    return window is None or (len(window) - 1 <= window_slots and _ext_vit_max_len(window) <= window_bound)


def _ext_sample_rows(tensor, rows):
    """Zeros shaped like `tensor` with `rows` rows (None stays None)."""
    if tensor is None:
        return None
    return torch.zeros((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)


def _ext_synthetic_call(self, sample, tokens):
    """A call of `tokens` zero rows shaped like `sample`: one image, window-sized windows."""
    x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin = sample
    chunk = max(self._ext_window_tokens or 0, self._ext_merge_unit)
    window = _ext_vit_padded_layout((0,), 0, tokens, chunk) if self._fullatt_block_indexes else None
    pos = None if position_embeddings is None else tuple(_ext_sample_rows(t, tokens) for t in position_embeddings)
    return (GraphKey(tokens, layout=((0, tokens), window)), _ext_sample_rows(x_3d, tokens), pos,
            _ext_sample_rows(rotary_pos_emb_cos, tokens), _ext_sample_rows(rotary_pos_emb_sin, tokens))


def _ext_capture_budget(self, sample, budget):
    """Capture the graph of one budget (agreed by every TP rank: raises on all of them or none)."""
    layout_key, x, pos, cos, sin = self._ext_synthetic_call(sample, budget)
    full, window = layout_key.layout
    return self.create_graph(x, torch.tensor(full, dtype=torch.int32),
                             None if window is None else torch.tensor(window, dtype=torch.int32), pos, cos, sin,
                             attention_layout_key=(full, window))


def _ext_probe_ladder(self, sample, ladder):
    """The budgets whose graph beats eager, measured on this GPU and model, agreed by every rank.

    For each budget, smallest first: capture its graph, time a replay of the smallest call it
    serves (the most padding) against the sync-free eager run of that call, drop the graph. The
    ladder ends at the first budget where eager wins on any rank (a MIN vote), or whose capture
    fails: larger calls are device-bound, where padding only adds work. Probe graphs are captured
    and timed with the TP collectives as local stand-ins (both sides alike), so a rank that fails
    half-way through its timing leaves no peer inside a device collective.
    """
    from sglang_ext.graphs.agreement import OK, PERMANENT

    on_cuda = self.device.type == "cuda" if isinstance(self.device, torch.device) else False
    sync = torch.cuda.synchronize if on_cuda else None
    kept, previous = [], 0
    for budget in ladder:
        try:
            with self._ext_warm_up_context():
                graph_key = self._ext_capture_budget(sample, budget)
        except Exception:  # noqa: BLE001 - agreed on every rank; create_graph logged nothing, so say it here
            _ext_vit_logger.warning("ViT CUDA graph probe: capture of the %d-token budget failed; the ladder "
                                    "ends below it", budget, exc_info=True)
            break
        tokens = previous + self._ext_merge_unit
        call = self._ext_synthetic_call(sample, tokens)
        error = None
        try:
            with torch.no_grad(), self._ext_warm_up_context():
                graph_ms = median_wall_ms(lambda: self._ext_replay_budget(*call, counted=False),
                                          repeats=_EXT_VIT_GATE_REPEATS, synchronize=sync)
                eager_ms = median_wall_ms(lambda: self._ext_run_eager_call(*call), repeats=_EXT_VIT_GATE_REPEATS,
                                          synchronize=sync)
        except Exception as exc:  # noqa: BLE001 - voted on below
            error, graph_ms, eager_ms = exc, math.inf, 0.0
        self._ext_cache.discard(graph_key)
        wins = self._ext_vote()(OK if error is None and graph_ms < eager_ms else PERMANENT) == OK
        self._ext_gate.append({"budget": budget, "tokens": tokens, "graph_ms": round(graph_ms, 3),
                               "eager_ms": round(eager_ms, 3), "replay": wins})
        if error is not None:
            _ext_vit_logger.warning("ViT CUDA graph probe of the %d-token budget failed: %s: %s", budget,
                                    type(error).__name__, error)
        if not wins:
            break
        kept.append(budget)
        previous = budget
    return kept


def _ext_precapture(self, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """Bucket mode: decide the replay ladder and capture it, before serving (knob vit_graph_precapture).

    Runs at load (`_ext_precapture_at_load`) or, without a server or with the knob off, at the
    runner's first run. The
    ladder: the knob's budgets up to --ext-vit-graph-replay-max-tokens, or (-1) the budgets the
    load-time probe found faster than eager; then cut to the capacity and byte budget, both the
    same on every rank. Captured largest first: every graph's input, attention workspace and
    rotary slices lie in the largest one's buffers and its intermediates in the shared pool, so
    the ladder costs about one graph's memory. A failure on any rank (agreed) leaves the runner
    eager on every rank. After this, bucket mode never captures.
    """
    self._ext_precaptured = True
    if not self._ext_bucket_mode():
        return
    started = _ext_vit_now()
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    sample = (x_3d[:1], position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    limit = ext_knobs.current("vit_graph_replay_max_tokens")
    ladder = self._ext_token_buckets
    kept = [b for b in ladder if b <= limit] if limit >= 0 else self._ext_probe_ladder(sample, ladder)
    probed = list(kept)
    cache = self._ext_cache
    kept = kept[:cache.capacity]
    while kept and cache.max_bytes > 0 and self._ext_expected_bytes(
            torch.empty((kept[-1],) + tuple(x_3d.shape[1:]), dtype=x_3d.dtype, device="meta")) > cache.max_bytes:
        kept.pop()
    captured = []
    for budget in reversed(kept):
        try:
            captured.append(self._ext_capture_budget(sample, budget))
        except Exception as exc:  # noqa: BLE001 - agreed on every rank: all stay eager
            _ext_vit_logger.warning("ViT CUDA graph pre-capture of the %d-token budget failed, so ViT graphs stay "
                                    "off: %s: %s", budget, type(exc).__name__, exc)
            for graph_key in captured:
                cache.discard(graph_key)
            captured = []
            break
    self._ext_token_buckets = tuple(sorted(k.num_tokens for k in captured))
    self._ext_replay_limit = self._ext_token_buckets[-1] if captured else 0
    # Above the probe's break-even eager wins outright (chunk replays would add their padding and fixed
    # costs to a device-bound call): such calls run as one eager call. Above a limit set by the knob or by
    # the capacity / byte cut, graphs still win, so those calls are split into chunks that replay.
    self._ext_split_above_limit = limit >= 0 or len(captured) < len(probed)
    info = self._ext_precapture_info
    info["precapture_graphs"] = len(captured)
    info["precapture_ms"] = int(_ext_vit_now() - started)
    if torch.cuda.is_available():
        info["precapture_reserved_bytes"] = int(torch.cuda.memory_reserved() - reserved)
    _ext_vit_logger.info("ViT CUDA graphs: captured %d budgets (%s tokens) in %d ms, %d MiB reserved; calls up to "
                         "%d tokens replay; probe: %s", len(captured), ",".join(map(str, self._ext_token_buckets)),
                         info["precapture_ms"], info["precapture_reserved_bytes"] >> 20, self._ext_replay_limit,
                         self._ext_gate or "skipped (--ext-vit-graph-replay-max-tokens)")


def _ext_vit_now():
    """Milliseconds on a monotonic clock."""
    import time

    return time.perf_counter() * 1e3


def _ext_precapture_at_load(self, vit, server_tokens):
    """Bucket mode at server start: run a synthetic image through the tower's own graph path up to
    the runner, keep what reaches it as the sample, and pre-capture from it.

    `server_tokens` bounds the ladder (the largest call the server's prefill limits allow). The
    sample stage is rank-local and voted on before any capture, so a rank that fails it (say, out
    of memory) leaves every rank eager and none waiting.
    """
    from sglang_ext.graphs.agreement import OK, failure_vote

    self._ext_server_tokens = server_tokens
    self._ext_ensure_state()
    if self._ext_precaptured or not (self._ext_bucket_mode() and ext_knobs.current("vit_graph_precapture")):
        return
    error = None
    self._ext_sample = None  # run() keeps the sample here while this attribute exists
    try:
        t, h, w = _EXT_VIT_SAMPLE_GRID
        proj = vit.patch_embed.proj.weight
        pixels = torch.zeros(t * h * w, proj[0].numel(), dtype=vit.dtype, device=vit.device)
        with torch.no_grad():
            vit.forward_with_cuda_graph(pixels, torch.tensor([[t, h, w]], dtype=torch.int64))
        if self._ext_sample is None:
            raise RuntimeError("the tower's graph path did not reach the runner")
    except Exception as exc:  # noqa: BLE001 - voted on below
        error = exc
    finally:
        sample = self.__dict__.pop("_ext_sample", None)
    if self._ext_vote()(failure_vote(error)) != OK:
        self._ext_precaptured = True
        self._ext_replay_limit = 0
        _ext_vit_logger.warning("ViT CUDA graphs stay off: the load-time sample failed on %s: %s",
                                "this rank" if error else "another rank", error)
        return
    with torch.no_grad():
        self._ext_precapture(*sample)


def _ext_budget_batch(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """Bucket mode: (graph key, padded key, padded tensors...) of the captured budget this call fits, or None.

    Padding rows are zeros and form their own attention sequences (one for full attention,
    window-sized ones for window attention), so no real token attends to them; they come after
    the real tokens, so the merger's first `tokens / merge unit` rows are the real output.
    """
    tokens = layout_key.num_tokens
    unit = self._ext_merge_unit
    if tokens % unit or tokens > self._ext_replay_limit:
        return None
    decision = select_bucket(tokens, self._ext_token_buckets, max_padding_factor=math.inf)
    if decision.bucket is None:
        return None
    bucket, pad = decision.bucket, decision.padding
    full, window = layout_key.layout
    full = _ext_vit_padded_layout(full, tokens, bucket, bucket)
    window = _ext_vit_padded_layout(window, tokens, bucket, max(self._ext_window_tokens or 0, unit))
    padded_key = GraphKey(bucket, layout=(full, window))
    graph_key = self._ext_graph_key_for(padded_key)
    if not self._ext_budget_fits(padded_key, graph_key):
        return None
    if position_embeddings is not None:
        position_embeddings = tuple(_ext_vit_pad_rows(t, pad) for t in position_embeddings)
    return (graph_key, padded_key, _ext_vit_pad_rows(x_3d, pad), position_embeddings,
            _ext_vit_pad_rows(rotary_pos_emb_cos, pad), _ext_vit_pad_rows(rotary_pos_emb_sin, pad))


def _ext_replay_budget(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                       counted=True):
    """Bucket mode: the call's merger rows from its budget graph (owned), or None when no graph serves it.

    counted=False (the load-time probe): no hit, miss or padding is counted.
    """
    batch = self._ext_budget_batch(layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    if batch is None:
        return None
    graph_key, padded_key, x_pad, pos, cos, sin = batch
    if (self._ext_cache.get(graph_key) if counted else self._ext_cache.entries.get(graph_key)) is None:
        return None
    tokens = layout_key.num_tokens
    if counted:
        self._ext_padding["real_tokens"] += tokens
        if graph_key.num_tokens > tokens:
            self._ext_padding["padded_batches"] += 1
            self._ext_padding["padding_tokens"] += graph_key.num_tokens - tokens
    device = self.device
    full, window = padded_key.layout
    self._ext_write_layout(graph_key, torch.tensor(full, dtype=torch.int32).to(device, non_blocking=True),
                           None if window is None
                           else torch.tensor(window, dtype=torch.int32).to(device, non_blocking=True))
    rows = torch.arange(tokens // self._ext_merge_unit, device=device)
    return self.replay(graph_key, x_pad, position_embeddings=pos, rotary_pos_emb_cos=cos, rotary_pos_emb_sin=sin,
                       output_indices=rows)


def _ext_run_eager_call(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """The sync-free eager run of one call given by its CPU layout."""
    device = x_3d.device
    full, window = layout_key.layout
    cu_window = None if window is None else torch.tensor(window, dtype=torch.int32).to(device, non_blocking=True)
    return self._ext_run_eager(x_3d, torch.tensor(full, dtype=torch.int32).to(device, non_blocking=True), cu_window,
                               position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin, None,
                               _ext_vit_max_len(full), _ext_vit_max_len(window))


def _ext_run_budget(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                    output_indices):
    """Bucket mode: replay the call, or its whole-image chunks, where a captured budget serves them; else eager.

    A call above the probe's break-even runs as one eager call. A call above a lower limit (the
    knob, or the ladder cut to its capacity or byte budget) is split at boundaries of every
    attention layout into chunks of at most the limit (`whole_sequence_chunks`); each chunk
    replays its budget graph, or runs eager unpadded when none serves it (one image above the
    limit, too many windows); adjacent such chunks run as one eager call. The rows of the chunks,
    in order, are the rows of the call.
    """
    tokens = layout_key.num_tokens
    full, window = layout_key.layout
    limit = self._ext_replay_limit
    ranges = [(0, tokens)]
    if limit and tokens > limit and not self._ext_split_above_limit:
        limit = 0  # above the probe's break-even: one eager call
    elif limit and tokens > limit:
        ranges = whole_sequence_chunks((full, window), tokens, limit, _EXT_VIT_BUCKET_SEQUENCES - 1)
        self._ext_chunking["chunked_calls"] += 1
        self._ext_chunking["chunks"] += len(ranges)

    def call_of(start, end):
        if (start, end) == (0, tokens):
            return layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin
        return (GraphKey(end - start, layout=(sequences_between(full, start, end),
                                              None if window is None else sequences_between(window, start, end))),
                x_3d[start:end],
                None if position_embeddings is None else tuple(t[start:end] for t in position_embeddings),
                None if rotary_pos_emb_cos is None else rotary_pos_emb_cos[start:end],
                None if rotary_pos_emb_sin is None else rotary_pos_emb_sin[start:end])

    # Adjacent chunks no graph serves run as ONE eager call: eager costs about the same host time
    # whatever its size, so splitting it would multiply that cost.
    parts, eager_from = [], None
    for start, end in ranges:
        out = self._ext_replay_budget(*call_of(start, end)) if limit else None
        if out is None:
            self._ext_fallbacks["gate" if not limit or end - start > limit else "no_fit"] += 1
            eager_from = start if eager_from is None else eager_from
            continue
        if eager_from is not None:
            parts.append(self._ext_run_eager_call(*call_of(eager_from, start)))
            eager_from = None
        parts.append(out)
    if eager_from is not None:
        parts.append(self._ext_run_eager_call(*call_of(eager_from, tokens)))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return out if output_indices is None else out.index_select(0, output_indices)


def _ext_write_layout(self, graph_key, cu_seqlens, cu_window_seqlens):
    """Class mode: write this batch's boundaries into the graph's buffers (device copies, no sync).

    Unused trailing sequences get the token count as boundary: zero length, so the
    triton kernel's programs for them load and store nothing.
    """
    tokens = graph_key.num_tokens
    pairs = [(self.cu_full_len[graph_key], self.cu_full_len_kk[graph_key], cu_seqlens)]
    if self._fullatt_block_indexes:
        pairs.append((self.cu_window_len[graph_key], self.cu_window_len_kk[graph_key], cu_window_seqlens))
    for buffer, lengths, source in pairs:
        count = source.shape[0]
        buffer[:count].copy_(source, non_blocking=True)
        buffer[count:].fill_(tokens)
        torch.sub(buffer[1:], buffer[:-1], out=lengths)


def _get_sin_cos_ws(self, graph_key, seq_len, head_dim, dtype=None):
    """Return the stable rotary buffers captured by one graph (leased until the graph is released).

    dtype: that of the cos/sin the tower computed (default the tower's). Qwen3-VL's rotary table
    is float32 on CUDA and its eager path rotates with float32 cos/sin; 0.5.17's bf16 buffers
    round them, so its graphs never equal graphs off (every request differed on the H200)."""
    self._ext_ensure_state()
    cached = self._sin_cos_ws_by_graph.get(graph_key)
    if cached is not None:
        return cached
    dtype = dtype or self.dtype
    pool_key = (head_dim, dtype)
    pool = self._ext_rotary_pools.get(pool_key)
    if pool is None:
        name = f"vit_rotary_hd{head_dim}" + ("" if dtype == self.dtype else f"_{str(dtype).split('.')[-1]}")
        pool = StableWorkspacePool(name, dtype=dtype, device=self.device)
        self._ext_rotary_pools[pool_key] = pool
    lease = pool.lease(graph_key, seq_len, (head_dim,), count=2)
    self._ext_rotary_leases[graph_key] = lease
    self._sin_cos_ws_by_graph[graph_key] = tuple(lease.tensors)
    # A lease always comes from the pool's current buffer: remember which one that is.
    self._ext_rotary_current[pool_key] = lease.tensors[0].untyped_storage().data_ptr()
    self.sin_cos_ws = self._sin_cos_ws_by_graph[graph_key]  # 0.5.17's name: the newest slices
    return self._sin_cos_ws_by_graph[graph_key]


def _ext_fill_rotary(self, graph_key, seq_len, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """Copy this call's cos/sin into the graph's stable rotary buffers; the block kwargs that
    pass those buffers (empty for a tower without rotary inputs)."""
    if position_embeddings is not None:
        cos, sin = position_embeddings
    elif rotary_pos_emb_cos is not None and rotary_pos_emb_sin is not None:
        cos, sin = rotary_pos_emb_cos, rotary_pos_emb_sin
    else:
        return {}
    cos_ws, sin_ws = self._get_sin_cos_ws(graph_key, seq_len, cos.shape[1], cos.dtype)
    cos_ws.copy_(cos)
    sin_ws.copy_(sin)
    if position_embeddings is not None:
        return {"position_embeddings": (cos_ws, sin_ws)}
    return {"rotary_pos_emb_cos": cos_ws, "rotary_pos_emb_sin": sin_ws}


def _retired_sin_cos_ws(self):
    """Retired rotary backings still leased by a live graph, one (cos, sin) each; freed ones drop out."""
    leases = self.__dict__.get("_ext_rotary_leases") or {}
    current = self.__dict__.get("_ext_rotary_current") or {}
    retired = {}
    for lease in leases.values():
        cos, sin = lease.tensors
        backing = cos.untyped_storage().data_ptr()
        if current.get((cos.shape[-1], cos.dtype)) != backing:
            retired.setdefault(backing, (cos, sin))
    return list(retired.values())


def _ext_graph_pool(self):
    """sglang's process-wide graph pool, pinned so that evicting every ViT graph never empties it."""
    from sglang.srt.model_executor.runner_utils.pool import get_or_create_global_graph_memory_pool

    pool = get_or_create_global_graph_memory_pool(torch.cuda)
    pin_graph_pool(pool)
    return pool


def _ext_tower_group(self):
    """The group the tower's TP collectives run on.

    0.5.17's vision linears reduce over the attention-TP group under DP attention
    (`use_dp_attention_reduce=is_dp_attention_enabled()`, qwen3_vl.py), where each
    attention-TP group encodes its own images; over the TP group otherwise.
    """
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    try:
        dp_attention = is_dp_attention_enabled()
    except Exception:  # noqa: BLE001 - no runtime flags published (unit tests, offline use): plain TP
        dp_attention = False
    if dp_attention:
        from sglang.srt.distributed.parallel_state import get_attn_tp_group

        return get_attn_tp_group()
    return get_tp_group()


def _ext_vote(self):
    """How the ranks encoding this batch agree on a capture: a MIN vote over their CPU group (gloo).

    DP encoders capture rank-locally, and a world of one has nobody to agree with.
    """
    if getattr(self.vit, "use_data_parallel", False):
        return local_vote
    group = self._ext_tower_group()
    if getattr(group, "world_size", 1) <= 1:
        return local_vote
    return cpu_group_vote(group.cpu_group)


class _ExtVitLocalCollectives:
    """The TP group's all-reduce / all-gather as local stand-ins (same shapes, no communication).

    For the warm-up only: its output is thrown away, it exists to run lazy initialisation
    (cuBLAS handles, kernel compilation) outside the capture. Without communication, a
    rank whose warm-up fails leaves no peer inside a device collective, so the warm-up
    belongs to the rank-local stage before the first vote. These are the collectives
    sglang 0.5.17's vision towers call (linear layers: all_reduce; vision attention's
    qk-norm: all_gather); the communicators themselves were initialised at start-up.
    """

    _MISSING = object()

    def __init__(self, group):
        self.group = group
        self.saved = {}

    def __enter__(self):
        world = self.group.world_size

        def all_gather(input_, dim=-1, output_tensor_list=None):
            if output_tensor_list is not None:
                for out in output_tensor_list:
                    out.copy_(input_)
                return None
            return torch.cat([input_] * world, dim=dim)

        for name, stand_in in (("all_reduce", lambda input_: input_), ("all_gather", all_gather)):
            self.saved[name] = self.group.__dict__.get(name, self._MISSING)
            setattr(self.group, name, stand_in)
        return self

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is self._MISSING:
                delattr(self.group, name)
            else:
                setattr(self.group, name, value)
        return False


def _ext_warm_up_context(self):
    """Local stand-ins on the tower's group (and the TP group) for `with`; installed when called."""
    if self._ext_vote() is local_vote:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    groups = []
    for group in (self._ext_tower_group(), get_tp_group()):
        if all(group is not seen for seen in groups):
            groups.append(group)
            stack.enter_context(_ExtVitLocalCollectives(group))
    return stack


def _ext_vit_rotary_kwargs(position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    if position_embeddings is not None:
        return {"position_embeddings": position_embeddings}
    if rotary_pos_emb_cos is not None and rotary_pos_emb_sin is not None:
        return {"rotary_pos_emb_cos": rotary_pos_emb_cos, "rotary_pos_emb_sin": rotary_pos_emb_sin}
    return {}


def _create_graph(self, graph_key, position_embeddings=None, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None):
    """Capture the tower for `graph_key` from its prepared buffers (warm-up: `create_graph`'s prepare stage).

    Not inside `_capture_context()` (the TP custom all-reduce's `ca_comm.capture()`), unlike
    0.5.17. In sglang 0.5.17 (srt/distributed/device_communicators/custom_all_reduce.py) that
    context makes every custom all-reduce recorded in the graph use the graph's own input
    buffers (`registered=True`) and, on exit, `register_graph_buffers()` appends their IPC
    addresses to a table in the fixed `rank_data` buffer (8 MiB, ~131k entries) that is never
    freed: evicted graphs keep their entries, so LRU churn fills it (~64 entries per capture
    of a 32-block tower, full after ~2,000 captures) and every later capture fails. Outside
    that context `_IS_CAPTURING` is False and `custom_all_reduce` takes
    `_all_reduce_impl(registered=False)`: the kernel first copies its input into the
    staging buffer `buffer_ptrs`, registered once at start-up, so a capture registers
    nothing. That path is capture-safe: it is the one sglang itself captures when
    SGLANG_MEMORY_SAVER_CUDA_GRAPH is set (`registered=not self.tms_cudagraph`), the
    copy is an ordinary stream operation, the staging buffer's address is fixed for the
    communicator's life and eager calls reuse it in stream order exactly as replays do.
    Cost: one device copy of at most 8 MiB per all-reduce. Inputs above the custom
    all-reduce's size limit fall back to NCCL with or without the context. It also drops
    the context's exit-time CPU collective (`register_graph_buffers` broadcasts over
    the group), which a rank that failed before entering it would never join.
    """
    graph = torch.cuda.CUDAGraph()
    vit = self.vit
    rotary_kwargs = _ext_vit_rotary_kwargs(position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    self.block_graphs[graph_key] = graph  # registered before capture: a failed capture is reset too
    pool = self._ext_graph_pool()
    # guarded_capture: no GC inside the capture (a collected graph's reset() would invalidate it),
    # a failed capture leaves the pool and the CUDA generator usable; one capture stream per
    # device, so blocks of evicted graphs are reused by the next capture.
    with guarded_capture(graph, pool=pool, stream=capture_stream()):
        y = self.block_input[graph_key]
        deepstack_outs = []
        for layer_num, blk in enumerate(vit.blocks):
            y = blk(y, **self._ext_block_kwargs(graph_key, layer_num), **rotary_kwargs)
            if self._deepstack_visual_indexes and layer_num in self._deepstack_visual_indexes:
                if self._deepstack_merger_list is None:
                    raise RuntimeError("deepstack_visual_indexes exists but deepstack_merger_list is missing.")
                deepstack_outs.append(self._deepstack_merger_list[len(deepstack_outs)](y))
        main_out = vit.merger(y)
        self.block_output[graph_key] = torch.cat([main_out] + deepstack_outs, dim=1) if deepstack_outs else main_out


def _ext_prepare_graph(self, graph_key, layout_key, x_3d, cu_seqlens, cu_window_seqlens, rotary):
    """Rank-local stage of a capture: backend check, buffers, rotary slices, warm-up. Returns rotary kwargs."""
    backend = self._attn_backend
    if backend not in _EXT_VIT_CLASS_BACKENDS:  # before anything is allocated
        raise RuntimeError(f"ViT CUDA graph does not support attention backend: {backend}")
    full_layout, window_layout = layout_key.layout
    seq_len = graph_key.num_tokens
    device = self.device
    attn = self.vit.blocks[0].attn
    ws_row = (attn.num_attention_heads_per_partition, attn.head_size)
    if graph_key.variant and graph_key.variant[0] == "bucket":  # slices of buffers all budget graphs share
        self.block_input[graph_key] = self._ext_shared_rows("input", graph_key, seq_len, x_3d.shape[1:], x_3d.dtype)
        self.block_ws[graph_key] = self._ext_shared_rows("attention_ws", graph_key, seq_len, ws_row, self.dtype)
    else:
        self.block_input[graph_key] = torch.empty_like(x_3d, device=device).contiguous()
        self.block_ws[graph_key] = torch.empty((seq_len,) + ws_row, device=device, dtype=self.dtype)
    # Graph-owned boundary buffers: the graph reads these addresses at every replay.
    if graph_key.variant:  # class mode: room for the class's sequence count, refreshed per replay
        _, full_count, full_max, window_count, window_max = graph_key.variant
        self.cu_full_len[graph_key] = torch.empty(full_count + 1, dtype=torch.int32, device=device)
        self.cu_full_len_kk[graph_key] = torch.empty(full_count, dtype=torch.int32, device=device)
        if self._fullatt_block_indexes:
            self.cu_window_len[graph_key] = torch.empty(window_count + 1, dtype=torch.int32, device=device)
            self.cu_window_len_kk[graph_key] = torch.empty(window_count, dtype=torch.int32, device=device)
        self._ext_write_layout(graph_key, cu_seqlens.to(device=device, dtype=torch.int32),
                               None if cu_window_seqlens is None
                               else cu_window_seqlens.to(device=device, dtype=torch.int32))
        self._ext_max_lens[graph_key] = (full_max, window_max)
    else:
        cu_full = cu_seqlens.to(device=device, dtype=torch.int32).clone()
        self.cu_full_len[graph_key] = cu_full
        self.cu_full_len_kk[graph_key] = cu_full[1:] - cu_full[:-1]
        if self._fullatt_block_indexes:
            cu_window = cu_window_seqlens.to(device=device, dtype=torch.int32).clone()
            self.cu_window_len[graph_key] = cu_window
            self.cu_window_len_kk[graph_key] = cu_window[1:] - cu_window[:-1]
        self._ext_max_lens[graph_key] = (_ext_vit_max_len(full_layout), _ext_vit_max_len(window_layout))
    self.block_input[graph_key].copy_(x_3d)
    rotary_kwargs = self._ext_fill_rotary(graph_key, seq_len, *rotary)
    # Warm-up (lazy initialisation outside the capture), one block per attention kind (window and
    # full): kernels that compile on first use (triton autotune, fa4's CuTe JIT per
    # max_seqlen-dependent variant) must not compile inside the capture. Local stand-ins for the TP
    # collectives; the sync surfaces this rank's asynchronous errors before the vote.
    warm_layers = {}
    for layer_num in range(len(self.vit.blocks)):
        warm_layers.setdefault(self._ext_block_is_full(layer_num), layer_num)
    with torch.no_grad(), self._ext_warm_up_context():
        for layer_num in sorted(warm_layers.values()):
            self.vit.blocks[layer_num](self.block_input[graph_key], **self._ext_block_kwargs(graph_key, layer_num),
                                       **rotary_kwargs)
    torch.cuda.synchronize()
    return rotary_kwargs


def _ext_shared_rows(self, name, graph_key, rows, row_shape, dtype):
    """`rows` rows of the runner's shared `name` buffer, leased by `graph_key` until its release.

    Budget graphs are captured largest first, so every later lease slices the first backing buffer:
    the ladder's inputs and workspaces cost one graph's. Graphs never replay concurrently and each
    replay rewrites its rows first, so sharing is safe (graphs.workspace).
    """
    pool_key = (name, tuple(row_shape), dtype)
    pool = self._ext_buffer_pools.get(pool_key)
    if pool is None:
        pool = self._ext_buffer_pools[pool_key] = StableWorkspacePool(f"vit_{name}", dtype=dtype, device=self.device)
    lease = pool.lease(graph_key, rows, tuple(row_shape))
    self._ext_buffer_leases.setdefault(graph_key, []).append(lease)
    return lease.tensor


def _ext_attention_kwargs(self, graph_key, cu, seq_lens, max_len):
    """Block kwargs for one attention kind of a graph, per backend (vision.py's graph-mode contract).

    triton_attn: list `[cu_seqlens, seq_lens, max_seqlen]` + `output_ws`; fa3: `[cu_seqlens,
    max_seqlen]` (0.5.17's list form); fa4 has no graph-mode branch in 0.5.17, so it gets
    `forward_metadata` built on the graph's own buffers (the backends prefer metadata to the list).
    """
    backend = self._attn_backend
    if backend == "fa4":
        from sglang.srt.layers.attention.vision import VisionAttentionMetadata

        metadata = VisionAttentionMetadata(cu_seqlens=cu, seq_lens=seq_lens, max_seqlen=max_len)
        return {"cu_seqlens": cu, "forward_metadata": metadata}
    seqlens = [cu, seq_lens, max_len] if backend == "triton_attn" else [cu, max_len]
    return {"cu_seqlens": seqlens, "output_ws": self.block_ws[graph_key]}


def _ext_block_is_full(self, layer_num):
    return not self._fullatt_block_indexes or layer_num in self._fullatt_block_indexes


def _ext_block_kwargs(self, graph_key, layer_num):
    """Attention kwargs of block `layer_num` in graph `graph_key`, from the graph's own buffers."""
    max_full_len, max_window_len = self._ext_max_lens[graph_key]
    if self._ext_block_is_full(layer_num):
        return self._ext_attention_kwargs(graph_key, self.cu_full_len[graph_key], self.cu_full_len_kk[graph_key],
                                          max_full_len)
    return self._ext_attention_kwargs(graph_key, self.cu_window_len[graph_key], self.cu_window_len_kk[graph_key],
                                      max_window_len)


def create_graph(self, x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos=None,
                 rotary_pos_emb_sin=None, attention_layout_key=None):
    """Capture one graph for this batch's key, agreed by all TP ranks (no admission check: `run` decides).

    Stages (graphs.agreement): prepare (rank-local) -> vote -> capture and its bookkeeping
    -> vote; two CPU-group votes whatever fails where. A failure on any rank quarantines the
    key on every rank (with the agreed transient/permanent class) and raises here.
    Returns the key.
    """
    self._ext_ensure_state()
    layout_key = self._get_graph_key(x_3d, cu_seqlens, cu_window_seqlens, attention_layout_key)
    graph_key = self._ext_graph_key_for(layout_key)
    if graph_key in self.block_graphs:
        return graph_key
    prepared = {}

    def prepare():
        prepared.update(self._ext_prepare_graph(graph_key, layout_key, x_3d, cu_seqlens, cu_window_seqlens,
                                                (position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)))

    def capture():
        self._create_graph(graph_key, **prepared)
        tensors = self._ext_graph_tensors(graph_key)
        self._ext_address_guard.record(graph_key, tensors)
        shared = {id(lease.tensor) for lease in self._ext_buffer_leases.get(graph_key, ())}  # counted once, below
        self._ext_graph_bytes[graph_key] = sum(t.numel() * t.element_size() for t in tensors if id(t) not in shared)

    outcome = agreed_capture(self._ext_vote(), prepare, capture, lambda: self._ext_drop_graph_state(graph_key))
    if not outcome.ok:
        self._ext_cache.fail(graph_key, outcome.error, transient=outcome.transient)
        raise outcome.error
    # False (exact policy, over budget): the cache has already released the entry.
    self._ext_cache.put(graph_key, (graph_key, self.block_graphs[graph_key]), nbytes=self._ext_graph_bytes[graph_key])
    return graph_key


def replay(self, graph_key, x_3d, position_embeddings=None, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None,
           output_indices=None):
    seq_len = graph_key.num_tokens if isinstance(graph_key, GraphKey) else int(graph_key)
    self._ext_fill_rotary(graph_key, seq_len, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    self.block_input[graph_key].copy_(x_3d)
    guard = self.__dict__.get("_ext_address_guard")
    if guard is not None and guard.enabled:
        guard.check(graph_key, self._ext_graph_tensors(graph_key))
    self.block_graphs[graph_key].replay()
    out = self.block_output[graph_key]
    # Owned result: the static output is rewritten by the next replay of this key
    # (and may be by any graph sharing the pool).
    if output_indices is not None:
        return out.index_select(0, output_indices)
    return out.clone()


def _ext_graph_tensors(self, graph_key):
    """Every static tensor a captured graph reads or writes: their addresses are baked into it."""
    tensors = [self.block_input[graph_key], self.block_ws[graph_key], self.block_output[graph_key],
               self.cu_full_len[graph_key], self.cu_full_len_kk[graph_key]]
    if self._fullatt_block_indexes:
        tensors += [self.cu_window_len[graph_key], self.cu_window_len_kk[graph_key]]
    tensors += list(self._sin_cos_ws_by_graph.get(graph_key, ()))
    return tuple(tensors)


def _ext_expected_bytes(self, x_3d):
    """Input + attention workspace bytes of a graph for x_3d (known before capturing)."""
    attn = getattr(self.vit.blocks[0], "attn", None)
    heads = getattr(attn, "num_attention_heads_per_partition", 0)
    head_size = getattr(attn, "head_size", 0)
    seq_len = int(x_3d.shape[0])
    return x_3d.numel() * x_3d.element_size() + seq_len * heads * head_size * x_3d.element_size()


def _ext_run_eager(self, x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos,
                   rotary_pos_emb_sin, output_indices, max_full_len, max_window_len):
    """The captured computation, run eagerly through the same blocks (same kernels, same result)."""
    from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata

    self._ext_ensure_state()
    vit = self.vit
    device = x_3d.device
    backend = self._attn_backend
    full_md = window_md = None
    if self._ext_blk_accepts_metadata:
        full_md = prepare_vision_attention_metadata(cu_seqlens, device=device, max_seqlen=max_full_len)
        if self._fullatt_block_indexes:
            window_md = prepare_vision_attention_metadata(cu_window_seqlens, device=device,
                                                          max_seqlen=max_window_len)
    else:
        cu_full = cu_seqlens.to(device=device, dtype=torch.int32)
        if self._fullatt_block_indexes:
            cu_window = cu_window_seqlens.to(device=device, dtype=torch.int32)

    rotary_kwargs = _ext_vit_rotary_kwargs(position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)

    y = x_3d
    deepstack_outs = []
    for layer_num, blk in enumerate(vit.blocks):
        full = self._ext_block_is_full(layer_num)
        if self._ext_blk_accepts_metadata:
            md = full_md if full else window_md
            y = blk(y, cu_seqlens=md.cu_seqlens, forward_metadata=md, **rotary_kwargs)
        else:
            cu, max_len = (cu_full, max_full_len) if full else (cu_window, max_window_len)
            seqlens = [cu, cu[1:] - cu[:-1], max_len] if backend != "fa3" else [cu, max_len]
            attn = blk.attn
            output_ws = torch.empty(y.shape[0], attn.num_attention_heads_per_partition, attn.head_size,
                                    device=device, dtype=self.dtype)
            y = blk(y, cu_seqlens=seqlens, output_ws=output_ws, **rotary_kwargs)
        if self._deepstack_visual_indexes and layer_num in self._deepstack_visual_indexes:
            deepstack_outs.append(self._deepstack_merger_list[len(deepstack_outs)](y))
    out = vit.merger(y)
    if deepstack_outs:
        out = torch.cat([out] + deepstack_outs, dim=1)
    if output_indices is not None:
        out = out.index_select(0, output_indices)
    return out


def run(self, x, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos=None,
        rotary_pos_emb_sin=None, output_indices=None, attention_layout_key=None):
    self._ext_ensure_state()
    x_3d = x.unsqueeze(1)  # [S, 1, H]
    num_tokens = int(x_3d.shape[0])
    eager_batch = (x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                   output_indices)
    graph_key = None
    if attention_layout_key is not None or not (
        _ext_vit_is_device_tensor(cu_seqlens) or _ext_vit_is_device_tensor(cu_window_seqlens)
    ):
        graph_key = self._get_graph_key(x_3d, cu_seqlens, cu_window_seqlens, attention_layout_key)
    if not isinstance(graph_key, GraphKey):
        max_full_len = max_window_len = num_tokens  # upper bound: exact for the triton kernel, no sync
        reason = "no_cpu_layout"
        if not self._ext_fallbacks["no_cpu_layout"]:  # once per runner: it is the caller's choice, not a fault
            _ext_vit_logger.warning("ViT CUDA graphs: cu_seqlens on %s without attention_layout_key; this runner "
                                    "runs such batches eager (building a key would sync the device). Pass "
                                    "attention_layout_key=(full cu_seqlens ints, window cu_seqlens ints or None) "
                                    "to use graphs", getattr(cu_seqlens, "device", "a device"))
    else:
        max_full_len = _ext_vit_max_len(graph_key.layout[0])
        max_window_len = _ext_vit_max_len(graph_key.layout[1])
        layout_key = graph_key
        if self._ext_bucket_mode():
            if "_ext_sample" in self.__dict__:  # the load-time sample (_ext_precapture_at_load): keep, run nothing
                self._ext_sample = (x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
                return None
            if not self._ext_precaptured:
                self._ext_precapture(x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
            out = self._ext_run_budget(layout_key, x_3d, position_embeddings, rotary_pos_emb_cos,
                                       rotary_pos_emb_sin, output_indices)
            ext_graph_stats.maybe_log(_ext_vit_logger, ext_knobs.current("stats_log_interval_s"))
            ext_graph_stats.publish()
            return out
        graph_key = self._ext_graph_key_for(layout_key)
        reason = None
        if self._ext_cache.get(graph_key) is None:
            admission = self._ext_cache.admit(graph_key, expected_bytes=self._ext_expected_bytes(x_3d))
            if admission.capture:
                try:
                    self.create_graph(x_3d, cu_seqlens, cu_window_seqlens, position_embeddings,
                                      rotary_pos_emb_cos, rotary_pos_emb_sin,
                                      attention_layout_key=layout_key.layout)
                except Exception as exc:  # noqa: BLE001 - the batch still gets a correct result
                    # create_graph quarantined the key on every rank (transient failures are retried).
                    retry = self._ext_cache.retry_in(graph_key)
                    _ext_vit_logger.warning("ViT CUDA graph capture failed for %d tokens; running eager %s: %s: %s",
                                            num_tokens, "from now on for this layout" if retry is None else
                                            f"for this layout's next {retry} misses, then retrying",
                                            type(exc).__name__, exc)
                    reason = "capture_failed"
                else:
                    if graph_key not in self._ext_cache:  # exact policy: the capture did not fit the budget
                        reason = "capacity"
            else:
                reason = admission.name.lower().replace("eager_", "")
    ext_graph_stats.maybe_log(_ext_vit_logger, ext_knobs.current("stats_log_interval_s"))
    if reason is not None:
        self._ext_fallbacks[reason] += 1
        ext_graph_stats.publish()
        return self._ext_run_eager(*eager_batch, max_full_len, max_window_len)
    ext_graph_stats.publish()
    if graph_key.variant:  # class mode: this batch's boundaries into the shared graph
        device = self.device
        self._ext_write_layout(graph_key, cu_seqlens.to(device=device, dtype=torch.int32),
                               None if cu_window_seqlens is None
                               else cu_window_seqlens.to(device=device, dtype=torch.int32))
    return self.replay(graph_key, x_3d, position_embeddings=position_embeddings,
                       rotary_pos_emb_cos=rotary_pos_emb_cos, rotary_pos_emb_sin=rotary_pos_emb_sin,
                       output_indices=output_indices)


# ---------------------------------------------------------------------------
# Model methods: build the key from CPU metadata, before any host-to-device copy
# ---------------------------------------------------------------------------


def _ext_vit_host_grid(grid_thw):
    """grid_thw as CPU rows (0.5.17 already reads it on the host in get_window_index / rot_pos_emb)."""
    if isinstance(grid_thw, torch.Tensor) and grid_thw.device.type != "cpu":
        return grid_thw.cpu()
    return grid_thw


def _ext_vit_to_device(tensor, device, dtype=None):
    """`tensor.to(device, dtype)` without a stream sync for host tensors bound for the GPU.

    A blocking host-to-device copy waits for all queued GPU work (0.5.17's `.to(device)` and
    indexing a device tensor with a CPU index do), so the host stops queueing while the device
    drains. Staged through pinned memory and copied non-blocking instead: the caching host
    allocator keeps the pinned block until the copy has run. Same values, no sync. Tensors over
    `_EXT_VIT_PIN_MAX_BYTES` (long videos) copy as before, so cached pinned blocks stay bounded.
    """
    if (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and torch.device(device).type == "cuda"
            and tensor.numel() * tensor.element_size() <= _EXT_VIT_PIN_MAX_BYTES):
        return tensor.pin_memory().to(device=device, dtype=dtype, non_blocking=True)
    return tensor.to(device=device, dtype=dtype)


def _ext_vit_rot_pos_emb(vit, grid_thw):
    """0.5.17's `rot_pos_emb`, with its CPU position ids copied to the device without a sync (and
    plain ints as `rot_pos_ids` arguments, so its lru_cache hits: tensor scalars hash by identity)."""
    pos_ids = []
    for t, h, w in grid_thw.tolist():
        base = vit.rot_pos_ids(h, w, vit.spatial_merge_size)
        pos_ids.append(base if t == 1 else base.repeat(t, 1))
    pos_ids = _ext_vit_to_device(torch.cat(pos_ids, dim=0), vit.device)
    table = vit.rotary_pos_emb(torch.arange(int(grid_thw[:, 1:].max()), device=vit.device))
    return table[pos_ids].flatten(1)


def forward_with_cuda_graph(self, x, grid_thw):
    """Qwen2_5_VisionTransformer: 0.5.17's body, plus the attention layout key from CPU metadata,
    and no device sync (host-to-device copies non-blocking from pinned memory)."""
    grid_thw = _ext_vit_host_grid(grid_thw)
    x = _ext_vit_to_device(x, self.device, self.dtype)
    x = self.patch_embed(x)
    rotary_pos_emb = _ext_vit_rot_pos_emb(self, grid_thw)

    window_index, cu_window_list = self.get_window_index(grid_thw)
    window_layout = dedup_consecutive(int(v) for v in cu_window_list)  # == torch.unique_consecutive
    # Doubled leading zero, as 0.5.17's cu_seqlens has it.
    full_layout = (0,) + cumulative_lengths(grid_thw_lengths(grid_thw))
    cu_window_seqlens = torch.tensor(window_layout, dtype=torch.int32).to(x.device, non_blocking=True)
    cu_seqlens = torch.tensor(full_layout, dtype=torch.int32).to(x.device, non_blocking=True)

    window_index = _ext_vit_to_device(window_index, x.device)
    reverse_indices = permute_inv(window_index)
    rotary_pos_emb = rotary_pos_emb.to(device=x.device, dtype=x.dtype)

    seq_len, _ = x.size()
    x = x.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
    x = x[window_index, :, :]
    x = x.reshape(seq_len, -1)
    rotary_pos_emb = rotary_pos_emb.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
    rotary_pos_emb = rotary_pos_emb[window_index, :, :]
    rotary_pos_emb = rotary_pos_emb.reshape(seq_len, -1)
    emb = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
    position_embeddings = (emb.cos().to(x.device, x.dtype), emb.sin().to(x.device, x.dtype))

    return self.cuda_graph_runner.run(
        x=x,
        position_embeddings=position_embeddings,
        cu_seqlens=cu_seqlens,
        cu_window_seqlens=cu_window_seqlens,
        output_indices=reverse_indices,
        attention_layout_key=(full_layout, window_layout),
    )


def _ext_qwen3_graph_inputs(self, x, grid_thw):
    """0.5.17's `_prepare_graph_inputs`, with the position embedding of the eager `forward`.

    0.5.17's graph inputs interpolate the learned position embedding with its legacy rule
    (`fast_pos_embed_interpolate`: align_corners from enable_precise_embedding_interpolation, off
    by default) while `forward` always samples it at linspace points (align_corners=True, as HF
    does): ViT graphs on gave other embeddings than graphs off (0.127 apart on the tiny tower, H200).
    Returns the full-attention boundaries as Python ints (host data, no sync).
    """
    x = self.patch_embed(x.to(device=self.device, dtype=self.dtype, non_blocking=True))
    grid = grid_thw if isinstance(grid_thw, list) else grid_thw.tolist()
    if self._use_vectorized_pos_embed(len(grid)):
        x += self.fast_pos_embed_interpolate_vectorized(grid)
    else:
        x += self.fast_pos_embed_interpolate_from_list(grid)
    rotary_pos_emb_cos, rotary_pos_emb_sin = self.rot_pos_emb(grid)
    full_layout = [0]
    for t, h, w in grid:  # one attention sequence per frame, as eager's token_cu_seqlens
        for _ in range(int(t)):
            full_layout.append(full_layout[-1] + int(h) * int(w))
    return x, tuple(full_layout), rotary_pos_emb_cos, rotary_pos_emb_sin


def _ext_qwen3_forward_with_cuda_graph(self, x, grid_thw):
    """Qwen3VLMoeVisionModel.forward_with_cuda_graph (installed under that name)."""
    x, full_layout, rotary_pos_emb_cos, rotary_pos_emb_sin = _ext_qwen3_graph_inputs(self, x, grid_thw)
    cu_seqlens = torch.tensor(full_layout, dtype=torch.int32).to(x.device, non_blocking=True)
    return self.graph_runners.run(
        x=x,
        position_embeddings=None,
        rotary_pos_emb_cos=rotary_pos_emb_cos,
        rotary_pos_emb_sin=rotary_pos_emb_sin,
        cu_seqlens=cu_seqlens,
        cu_window_seqlens=None,
        output_indices=None,
        attention_layout_key=(full_layout, None),
    )


# ---------------------------------------------------------------------------
# Parts (registry: patch vit_cuda_graph)
# ---------------------------------------------------------------------------

_RUNNER_METHODS = (
    _ext_ensure_state, _ext_graph_budget, _ext_graph_info, _ext_release_graph, _ext_drop_graph_state,
    _get_graph_key, _ext_class_mode, _ext_bucket_mode, _ext_graph_key_for, _ext_budget_fits, _ext_synthetic_call,
    _ext_capture_budget, _ext_probe_ladder, _ext_precapture, _ext_precapture_at_load, _ext_budget_batch,
    _ext_replay_budget, _ext_run_eager_call, _ext_run_budget, _ext_shared_rows, _ext_write_layout, _get_sin_cos_ws, _ext_fill_rotary, _ext_graph_pool, _ext_tower_group,
    _ext_vote, _ext_warm_up_context, _create_graph, _ext_attention_kwargs, _ext_block_is_full, _ext_block_kwargs,
    _ext_prepare_graph, create_graph, replay, _ext_graph_tensors, _ext_expected_bytes, _ext_run_eager, run,
)


def patch_runner(ctx, module) -> None:
    cls = module.ViTCudaGraphRunner
    for fn in _RUNNER_METHODS:
        ctx.transplant_method(cls, fn)
    ctx.transplant_method(cls, _sequence_layout_key, kind="staticmethod")
    ctx.transplant_method(cls, _retired_sin_cos_ws, kind="property")


def _check_runner_bindings(module) -> None:
    """The model module must use the runner class this patch changed in place."""
    import sglang.srt.multimodal.vit_cuda_graph_runner as runner_module

    bound = getattr(module, "ViTCudaGraphRunner", None)
    if bound is not runner_module.ViTCudaGraphRunner:
        raise RuntimeError(f"{module.__name__}.ViTCudaGraphRunner is not "
                           "sglang.srt.multimodal.vit_cuda_graph_runner.ViTCudaGraphRunner (rebound by someone else)")


def patch_qwen2_5_vl(ctx, module) -> None:
    _check_runner_bindings(module)
    ctx.transplant_method(module.Qwen2_5_VisionTransformer, forward_with_cuda_graph)


def _ext_vit_precapture_model(model_runner):
    """Pre-capture the bucket-mode ladder of every ViT graph runner in the loaded model (TP ranks in lockstep).

    The ladder's top is the largest call the server's prefill limits let one ViT call carry: the
    images of one prefill chunk (chunked prefill size, else max prefill tokens, in LLM tokens) times
    the tower's merge unit.
    """
    from sglang.srt.multimodal.vit_cuda_graph_runner import ViTCudaGraphRunner

    args = getattr(model_runner, "server_args", None)
    chunk = getattr(args, "chunked_prefill_size", None) or 0
    prefill = chunk if chunk > 0 else (getattr(args, "max_prefill_tokens", None) or 0)
    for tower in model_runner.model.modules():
        for name in ("cuda_graph_runner", "graph_runners"):  # Qwen2.5-VL's attribute, Qwen3-VL's
            runner = tower.__dict__.get(name)
            if isinstance(runner, ViTCudaGraphRunner):
                unit = int(getattr(tower, "spatial_merge_unit", 1) or 1)
                runner._ext_precapture_at_load(tower, prefill * unit if prefill > 0 else None)


def init_cuda_graphs(self, *args, **kwargs):
    """ModelRunner.init_cuda_graphs: sglang's own captures, then the ViT graphs (before the server is healthy)."""
    result = self._ext_orig_init_cuda_graphs(*args, **kwargs)
    _ext_vit_precapture_model(self)
    return result


def patch_model_runner(ctx, module) -> None:
    cls = module.ModelRunner
    ctx.setattr(cls, "_ext_orig_init_cuda_graphs", cls.__dict__["init_cuda_graphs"])
    ctx.transplant_method(cls, init_cuda_graphs)


def patch_qwen3_vl(ctx, module) -> None:
    _check_runner_bindings(module)
    table = module.graph_runners_dict
    for device_type, runner_cls in list(table.items()):
        if device_type != "npu" and runner_cls is not module.ViTCudaGraphRunner:
            raise RuntimeError(f"qwen3_vl.graph_runners_dict[{device_type!r}] is {runner_cls!r}, "
                               "not the patched ViTCudaGraphRunner")
    ctx.transplant_method(module.Qwen3VLMoeVisionModel, _ext_qwen3_forward_with_cuda_graph,
                          name="forward_with_cuda_graph")
