"""ViT CUDA graphs keyed by attention layout, bounded, workspace-stable and never wrong.

Patch: vit_cuda_graph
Targets: sglang.srt.multimodal.vit_cuda_graph_runner:ViTCudaGraphRunner
Upstream PR: sgl-project/sglang#37043
Retire when: upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs

Why: 0.5.17 keys ViT graphs by token count only (other image boundaries replay stale cu_seqlens),
moves the rotary workspace under captured graphs, and never frees a graph.
How: the runner's methods are replaced on the class: keys from CPU layouts, a bounded LRU cache
with an eager fallback, owned outputs (capture.py, budget.py, tp.py).
"""

from __future__ import annotations

import inspect
import logging

import torch

import sglang.srt.multimodal.vit_cuda_graph_runner as vit_cuda_graph_runner
from sglang.srt.layers.attention.vision import prepare_vision_attention_metadata
from sglang_ext import knobs as ext_knobs
from sglang_ext.graphs import stats as ext_graph_stats
from sglang_ext.graphs.agreement import agreed
from sglang_ext.graphs.cache import BoundedGraphCache
from sglang_ext.graphs.keys import GraphKey, cpu_ints
from sglang_ext.graphs.workspace import AddressGuard
from sglang_ext.vit import budget, capture, tp
from sglang_ext.vit.budget import BUCKET_SEQUENCES, token_buckets, window_slots, window_tokens
from sglang_ext.vit.capture import CLASS_BACKENDS, fill_rows, max_len, rotary_kwargs

logger = logging.getLogger("sglang_ext.vit_cuda_graph")

# Fallback reasons, as counted per runner.
FALLBACK_REASONS = ("capacity", "warming", "quarantined", "disabled", "no_cpu_layout", "capture_failed", "no_fit",
                    "gate", "replay_failed")
# Default byte budget (knob -1): this fraction of the free device memory, clamped to [floor, cap].
AUTO_BUDGET = dict(fraction=0.25, floor=256 << 20, cap=4 << 30)


def layout_ints(values, field):
    """CPU layout as a tuple of ints; None for None; DeviceSyncError for device tensors."""
    return None if values is None else cpu_ints(values, field=field)


def _pow2(value):
    return 1 << max(0, int(value) - 1).bit_length()


def layout_class(layout, num_tokens):
    """(padded sequence count, max_seqlen bound) of one layout, for layout-class mode."""
    if layout is None:
        return (None, None)
    return (_pow2(max(len(layout) - 1, 1)), min(_pow2(max(max_len(layout), 1)), max(num_tokens, 1)))


def is_device_tensor(value):
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


# --- State, created on a runner's first use ---


def _ext_ensure_state(self):
    """Create the sglang-ext state on first use; every knob the runner uses is read here, once."""
    if "_ext_cache" in self.__dict__:
        return
    self._ext_max_bytes = self._ext_graph_budget()
    self._ext_cache = BoundedGraphCache("vit_cuda_graph", ext_knobs.current("vit_graph_max_entries"),
                                        policy=ext_knobs.current("vit_graph_policy"), max_bytes=self._ext_max_bytes,
                                        min_hits=ext_knobs.current("vit_graph_min_hits"),
                                        release=self._ext_release_graph)
    self._ext_mode = ext_knobs.current("vit_graph_mode")
    self._ext_stats_log_interval_s = ext_knobs.current("stats_log_interval_s")
    # Merger rows: `spatial_merge_unit` input tokens make one output row (1 for towers without merging).
    self._ext_merge_unit = int(getattr(self.vit, "spatial_merge_unit", 1) or 1)
    self._ext_token_buckets = (token_buckets(ext_knobs.current("vit_graph_token_buckets"), self._ext_merge_unit,
                                             self.__dict__.get("_ext_server_tokens"))
                               if self._ext_mode == "bucket" else ())
    self._ext_replay_max_tokens = ext_knobs.current("vit_graph_replay_max_tokens")
    self._ext_precapture_enabled = ext_knobs.current("vit_graph_precapture")
    self._ext_above_ladder = ext_knobs.current("vit_graph_above_ladder")
    # Bucket mode: calls up to this many tokens replay (decided at pre-capture; the ladder's top until then).
    self._ext_replay_limit = self._ext_token_buckets[-1] if self._ext_token_buckets else 0
    self._ext_gate = []  # load-time probe: one row per budget measured
    self._ext_precapture_info = {"precapture_graphs": 0, "precapture_ms": 0, "precapture_reserved_bytes": 0}
    self._ext_chunking = {"chunked_calls": 0, "chunks": 0}
    self._ext_padding = {"padded_batches": 0, "padding_tokens": 0, "real_tokens": 0}
    self._ext_window_tokens = window_tokens(self.vit)
    self._ext_precaptured = False
    self._ext_split_above_limit = True  # decided at pre-capture
    if self._ext_mode != "layout" and self._attn_backend not in CLASS_BACKENDS:
        logger.warning("--ext-vit-graph-mode %s needs one of the vision attention backends %s; this tower uses %s, "
                       "so its graphs are keyed by exact layout", self._ext_mode, "/".join(CLASS_BACKENDS),
                       self._attn_backend)
    elif self._ext_mode == "bucket" and not self._ext_token_buckets:
        logger.warning("--ext-vit-graph-token-buckets: no size is a multiple of this tower's merge unit %d, so "
                       "bucket mode pads nothing (class mode keys only)", self._ext_merge_unit)
    self._ext_rotary_pools = {}
    self._ext_rotary_leases = {}
    self._ext_buffer_pools = {}  # bucket mode: input and attention workspace shared by the budget graphs
    self._ext_buffer_leases = {}
    self._ext_rotary_current = {}
    self._sin_cos_ws_by_graph = {}
    self._ext_graph_bytes = {}
    self._ext_max_lens = {}
    self._ext_fallbacks = {reason: 0 for reason in FALLBACK_REASONS}
    # --ext-debug-addresses: assert at every replay that no captured tensor moved.
    self._ext_address_guard = AddressGuard()
    self._ext_blk_accepts_metadata = "forward_metadata" in inspect.signature(self.vit.blocks[0].forward).parameters
    self._ext_stats_name = f"vit_cuda_graph:{type(self.vit).__name__}@{id(self):x}"
    ext_graph_stats.register(self._ext_stats_name, self._ext_graph_info)


def _ext_graph_budget(self):
    """Byte budget of this runner's resident graphs: the knob, or (-1) sized from free device memory,
    the MIN over TP ranks (equal budgets keep admission and eviction identical on all ranks)."""
    configured = ext_knobs.current("vit_graph_max_bytes")
    if configured >= 0:
        return configured
    free, auto = None, 0  # no device: no limit
    device = getattr(self.vit, "device", None)
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        free = int(torch.cuda.mem_get_info(device)[0])
        auto = int(min(AUTO_BUDGET["cap"], max(AUTO_BUDGET["floor"], free * AUTO_BUDGET["fraction"])))
    limit = tp.min_over_ranks(self, auto)
    logger.info("ViT CUDA graph byte budget: %d MiB (%s)", limit >> 20,
                "no device: no limit" if free is None else f"{free >> 20} MiB free at first use")
    return limit


def _ext_graph_info(self):
    """Counters for `sglang-ext doctor` / periodic debug logs."""
    info = self._ext_cache.info().as_dict()
    shared_bytes = sum(p.bytes_allocated for p in self._ext_buffer_pools.values())
    info["bytes_resident"] += shared_bytes
    info.update(mode="bucket" if self._ext_bucket_mode() else "class" if self._ext_class_mode() else "layout",
                attention_backend=self._attn_backend, **self._ext_padding, resident_graphs=len(self._ext_cache),
                fallbacks=sum(self._ext_fallbacks.values()),
                **{f"fallback_{reason}": count for reason, count in self._ext_fallbacks.items()},
                rotary_backing_buffers=sum(p.backing_buffers for p in self._ext_rotary_pools.values()),
                rotary_bytes=sum(p.bytes_allocated for p in self._ext_rotary_pools.values()),
                shared_buffer_bytes=shared_bytes, replay_limit_tokens=self._ext_replay_limit,
                budgets=len(self._ext_token_buckets), **self._ext_precapture_info, **self._ext_chunking)
    return info


# --- Keys ---


def _get_graph_key(self, x_3d, cu_seqlens=None, cu_window_seqlens=None, attention_layout_key=None):
    """Include attention boundaries so equal-length batches stay distinct (one argument: the token count)."""
    num_tokens = int(x_3d.shape[0])
    if attention_layout_key is None:
        if cu_seqlens is None and cu_window_seqlens is None:
            return num_tokens
        attention_layout_key = (layout_ints(cu_seqlens, "cu_seqlens"),
                                layout_ints(cu_window_seqlens, "cu_window_seqlens"))
    full, window = attention_layout_key
    full = None if full is None else tuple(int(v) for v in full)
    window = None if window is None else tuple(int(v) for v in window)
    return GraphKey(num_tokens, layout=(full, window))


def _ext_class_mode(self):
    """Layout-class (and bucket) mode: only for backends that read max_seqlen as a mere bound."""
    return self._ext_mode in ("class", "bucket") and self._attn_backend in CLASS_BACKENDS


def _ext_bucket_mode(self):
    return self._ext_mode == "bucket" and self._attn_backend in CLASS_BACKENDS


def _ext_graph_key_for(self, layout_key):
    """The cache key of a batch: its layout key, in class mode its (tokens, class) key, in bucket
    mode the token budget alone (one graph serves any mix of images that fits it)."""
    if not self._ext_class_mode():
        return layout_key
    full, window = layout_key.layout
    tokens = layout_key.num_tokens
    if self._ext_bucket_mode():
        window_class = (None, None)
        if window is not None:
            window_class = (window_slots(tokens, self._ext_merge_unit, self._ext_window_tokens),
                            max(self._ext_window_tokens or 0, self._ext_merge_unit))
        return GraphKey(tokens, variant=("bucket", BUCKET_SEQUENCES, max(tokens, 1)) + window_class)
    return GraphKey(tokens, variant=("class",) + layout_class(full, tokens) + layout_class(window, tokens))


# --- Run, replay, eager ---


def replay(self, graph_key, x_3d, position_embeddings=None, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None,
           output_indices=None, rows=None, stage_layout=None, out=None, agree=True):
    """The graph's first `rows` output rows (all by default; `output_indices`: those rows, in that order),
    in `out` or a new tensor the caller owns. Inputs shorter than the graph are padded with zero rows;
    `stage_layout()` writes the call's boundaries. Everything that can fail (inputs, boundaries, the
    output's allocation) runs first and is voted on: None when it failed on any rank of the tower's
    group (every rank then runs the call eager), so the graph's collectives run on all ranks or none.
    agree=False: a rank-local graph (the probe's), errors raised."""
    seq_len = graph_key.num_tokens if isinstance(graph_key, GraphKey) else int(graph_key)
    guard = self.__dict__.get("_ext_address_guard")
    if guard is not None and guard.enabled:  # a debug assertion: loud, never voted away
        guard.check(graph_key, self._ext_graph_tensors(graph_key))

    def stage():
        if stage_layout is not None:
            stage_layout()
        self._ext_fill_rotary(graph_key, seq_len, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
        fill_rows(self.block_input[graph_key], x_3d)
        if out is not None:
            return out
        # Owned result: the static output is rewritten by the next replay (of any graph sharing the pool).
        shape = self.block_output[graph_key].shape
        count = output_indices.shape[0] if output_indices is not None else shape[0] if rows is None else rows
        return self.block_output[graph_key].new_empty((count,) + tuple(shape[1:]))

    if agree:
        staged = agreed(self._ext_vote(), stage, "replay")
        if not staged.ok:
            logger.warning("ViT CUDA graph replay for %d tokens failed on %s; running eager: %s: %s", seq_len,
                           staged.where, type(staged.error).__name__, staged.error)
            return None
        result = staged.value
    else:
        result = stage()
    self.block_graphs[graph_key].replay()
    static_out = self.block_output[graph_key]
    if output_indices is not None:
        return torch.index_select(static_out, 0, output_indices, out=result)
    return result.copy_(static_out[:result.shape[0]])


def _ext_run_eager(self, x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos,
                   rotary_pos_emb_sin, output_indices, max_full_len, max_window_len):
    """The captured computation, run eagerly through the same blocks (same kernels, same result)."""
    self._ext_ensure_state()
    device = x_3d.device
    backend = self._attn_backend
    full_md = window_md = None
    if self._ext_blk_accepts_metadata:
        full_md = prepare_vision_attention_metadata(cu_seqlens, device=device, max_seqlen=max_full_len)
        if self._fullatt_block_indexes:
            window_md = prepare_vision_attention_metadata(cu_window_seqlens, device=device, max_seqlen=max_window_len)
    else:
        cu_full = cu_seqlens.to(device=device, dtype=torch.int32)
        if self._fullatt_block_indexes:
            cu_window = cu_window_seqlens.to(device=device, dtype=torch.int32)

    def block_kwargs(layer_num, y):
        full = self._ext_block_is_full(layer_num)
        if self._ext_blk_accepts_metadata:
            md = full_md if full else window_md
            return {"cu_seqlens": md.cu_seqlens, "forward_metadata": md}
        cu, bound = (cu_full, max_full_len) if full else (cu_window, max_window_len)
        seqlens = [cu, cu[1:] - cu[:-1], bound] if backend != "fa3" else [cu, bound]
        attn = self.vit.blocks[layer_num].attn
        output_ws = torch.empty(y.shape[0], attn.num_attention_heads_per_partition, attn.head_size,
                                device=device, dtype=self.dtype)
        return {"cu_seqlens": seqlens, "output_ws": output_ws}

    rotary = rotary_kwargs(position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    out = self._ext_tower(x_3d, block_kwargs, rotary)
    return out if output_indices is None else out.index_select(0, output_indices)


def run(self, x, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos=None,
        rotary_pos_emb_sin=None, output_indices=None, attention_layout_key=None):
    self._ext_ensure_state()
    x_3d = x.unsqueeze(1)  # [S, 1, H]
    num_tokens = int(x_3d.shape[0])
    eager_batch = (x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                   output_indices)
    graph_key = None
    if attention_layout_key is not None or not (is_device_tensor(cu_seqlens) or is_device_tensor(cu_window_seqlens)):
        graph_key = self._get_graph_key(x_3d, cu_seqlens, cu_window_seqlens, attention_layout_key)
    if not isinstance(graph_key, GraphKey):
        max_full_len = max_window_len = num_tokens  # upper bound: exact for the triton kernel, no sync
        reason = "no_cpu_layout"
        if not self._ext_fallbacks["no_cpu_layout"]:  # once per runner: it is the caller's choice, not a fault
            logger.warning("ViT CUDA graphs: cu_seqlens on %s without attention_layout_key; this runner runs such "
                           "batches eager (building a key would sync the device). Pass attention_layout_key=(full "
                           "cu_seqlens ints, window cu_seqlens ints or None) to use graphs",
                           getattr(cu_seqlens, "device", "a device"))
    else:
        max_full_len = max_len(graph_key.layout[0])
        max_window_len = max_len(graph_key.layout[1])
        layout_key = graph_key
        if self._ext_bucket_mode():
            if "_ext_sample" in self.__dict__:  # the load-time sample (_ext_precapture_at_load): keep, run nothing
                self._ext_sample = (x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
                return None
            if not self._ext_precaptured:
                self._ext_precapture(x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
            out = self._ext_run_budget(layout_key, x_3d, position_embeddings, rotary_pos_emb_cos,
                                       rotary_pos_emb_sin, output_indices)
            ext_graph_stats.maybe_log(logger, self._ext_stats_log_interval_s)
            ext_graph_stats.publish()
            return out
        graph_key = self._ext_graph_key_for(layout_key)
        reason = None
        if self._ext_cache.get(graph_key) is None:
            admission = self._ext_cache.admit(graph_key, expected_bytes=self._ext_expected_bytes(x_3d))
            if admission.capture:
                try:
                    self.create_graph(x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos,
                                      rotary_pos_emb_sin, attention_layout_key=layout_key.layout)
                except Exception as exc:  # noqa: BLE001 - the batch still gets a correct result
                    # create_graph quarantined the key on every rank (transient failures are retried).
                    retry = self._ext_cache.retry_in(graph_key)
                    logger.warning("ViT CUDA graph capture failed for %d tokens; running eager %s: %s: %s",
                                   num_tokens, "from now on for this layout" if retry is None else
                                   f"for this layout's next {retry} misses, then retrying", type(exc).__name__, exc)
                    reason = "capture_failed"
                else:
                    if graph_key not in self._ext_cache:  # exact policy: the capture did not fit the budget
                        reason = "capacity"
            else:
                reason = admission.name.lower().replace("eager_", "")
    ext_graph_stats.maybe_log(logger, self._ext_stats_log_interval_s)
    out = None
    if reason is None:
        # Class mode: this batch's boundaries into the shared graph.
        stage_layout = (lambda: self._ext_write_layout(graph_key, cu_seqlens, cu_window_seqlens)
                        ) if graph_key.variant else None
        out = self.replay(graph_key, x_3d, position_embeddings=position_embeddings,
                          rotary_pos_emb_cos=rotary_pos_emb_cos, rotary_pos_emb_sin=rotary_pos_emb_sin,
                          output_indices=output_indices, stage_layout=stage_layout)
        reason = None if out is not None else "replay_failed"
    if reason is not None:
        self._ext_fallbacks[reason] += 1
        out = self._ext_run_eager(*eager_batch, max_full_len, max_window_len)
    ext_graph_stats.publish()
    return out


METHODS = (
    _ext_ensure_state, _ext_graph_budget, _ext_graph_info, _get_graph_key, _ext_class_mode, _ext_bucket_mode,
    _ext_graph_key_for, replay, _ext_run_eager, run,
)


def check_runner_binding(module) -> None:
    """A model module must use the runner class this patch changed in place (parts for qwen2_5_vl, qwen3_vl)."""
    bound = getattr(module, "ViTCudaGraphRunner", None)
    if bound is not vit_cuda_graph_runner.ViTCudaGraphRunner:
        raise RuntimeError(f"{module.__name__}.ViTCudaGraphRunner is not "
                           "sglang.srt.multimodal.vit_cuda_graph_runner.ViTCudaGraphRunner (rebound by someone else)")


def patch_runner(ctx, module) -> None:
    cls = module.ViTCudaGraphRunner
    for fn in METHODS + capture.METHODS + budget.METHODS + tp.METHODS:
        ctx.setattr(cls, fn.__name__, fn)
    ctx.setattr(cls, "_retired_sin_cos_ws", property(capture.retired_sin_cos_ws))
