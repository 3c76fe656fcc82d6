"""One ViT graph: its buffers, rotary leases, warm-up, capture, replay inputs and release.

Methods of sglang's `ViTCudaGraphRunner`, installed by `sglang_ext.vit.runner.patch_runner`.
docs/how-it-works.md (ViT CUDA graphs) says why each step is safe.
"""

import logging
import math

import torch

from sglang.srt.layers.attention.vision import VisionAttentionMetadata
from sglang.srt.model_executor.runner_utils.pool import get_or_create_global_graph_memory_pool
from sglang_ext.graphs.agreement import agreed_capture
from sglang_ext.graphs.capture import capture_stream, guarded_capture, pin_graph_pool
from sglang_ext.graphs.workspace import StableWorkspacePool

logger = logging.getLogger("sglang_ext.vit_cuda_graph")

# Vision attention backends whose kernels read max_seqlen only as a bound and skip zero-length
# sequences: the ones graphs are captured for, and on which class and bucket modes share a graph.
CLASS_BACKENDS = ("triton_attn", "fa3", "fa4")


def max_len(layout):
    """Longest sequence of a cumulative layout (0 for an empty one)."""
    if not layout or len(layout) < 2:
        return 0
    return max(b - a for a, b in zip(layout, layout[1:]))


def fill_rows(static, rows):
    """`rows` into the first rows of `static`, zeros after them (a bucket graph's padding): no allocation."""
    count = rows.shape[0]
    static[:count].copy_(rows)
    if count < static.shape[0]:
        static[count:].zero_()


def rotary_kwargs(position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """The block kwargs that pass a call's rotary inputs (Qwen2.5's pair or Qwen3's cos / sin)."""
    if position_embeddings is not None:
        return {"position_embeddings": position_embeddings}
    if rotary_pos_emb_cos is not None and rotary_pos_emb_sin is not None:
        return {"rotary_pos_emb_cos": rotary_pos_emb_cos, "rotary_pos_emb_sin": rotary_pos_emb_sin}
    return {}


def create_graph(self, x_3d, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos=None,
                 rotary_pos_emb_sin=None, attention_layout_key=None):
    """Capture one graph for this batch's key, agreed by all TP ranks (`run` decides admission); a
    failure on any rank quarantines the key on every rank and raises here. Returns the key."""
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
        shared = {id(lease.tensor) for lease in self._ext_buffer_leases.get(graph_key, ())}  # counted once
        self._ext_graph_bytes[graph_key] = sum(t.numel() * t.element_size() for t in tensors if id(t) not in shared)

    outcome = agreed_capture(self._ext_vote(), prepare, capture, lambda: self._ext_drop_graph_state(graph_key))
    if not outcome.ok:
        self._ext_cache.fail(graph_key, outcome.error, transient=outcome.transient)
        raise outcome.error
    # False (exact policy, over budget): the cache has already released the entry.
    self._ext_cache.put(graph_key, (graph_key, self.block_graphs[graph_key]), nbytes=self._ext_graph_bytes[graph_key])
    return graph_key


def _ext_prepare_graph(self, graph_key, layout_key, x_3d, cu_seqlens, cu_window_seqlens, rotary):
    """Rank-local stage of a capture: backend check, buffers, rotary slices, warm-up. Returns rotary kwargs."""
    backend = self._attn_backend
    if backend not in CLASS_BACKENDS:  # before anything is allocated
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
        self._ext_write_layout(graph_key, cu_seqlens, cu_window_seqlens)
        self._ext_max_lens[graph_key] = (full_max, window_max)
    else:
        cu_full = cu_seqlens.to(device=device, dtype=torch.int32).clone()
        self.cu_full_len[graph_key] = cu_full
        self.cu_full_len_kk[graph_key] = cu_full[1:] - cu_full[:-1]
        if self._fullatt_block_indexes:
            cu_window = cu_window_seqlens.to(device=device, dtype=torch.int32).clone()
            self.cu_window_len[graph_key] = cu_window
            self.cu_window_len_kk[graph_key] = cu_window[1:] - cu_window[:-1]
        self._ext_max_lens[graph_key] = (max_len(full_layout), max_len(window_layout))
    self.block_input[graph_key].copy_(x_3d)
    kwargs = self._ext_fill_rotary(graph_key, seq_len, *rotary)
    # Warm-up, one block per attention kind: kernels that compile on first use must not compile inside
    # the capture. Local stand-ins for the TP collectives; the sync surfaces async errors before the vote.
    warm_layers = {}
    for layer_num in range(len(self.vit.blocks)):
        warm_layers.setdefault(self._ext_block_is_full(layer_num), layer_num)
    with torch.no_grad(), self._ext_warm_up_context():
        for layer_num in sorted(warm_layers.values()):
            self.vit.blocks[layer_num](self.block_input[graph_key], **self._ext_block_kwargs(graph_key, layer_num),
                                       **kwargs)
    torch.cuda.synchronize()
    return kwargs


def _create_graph(self, graph_key, position_embeddings=None, rotary_pos_emb_cos=None, rotary_pos_emb_sin=None):
    """Capture the tower for `graph_key` from its prepared buffers, outside 0.5.17's
    `_capture_context()` (its custom all-reduce registrations are never freed)."""
    graph = torch.cuda.CUDAGraph()
    kwargs = rotary_kwargs(position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    self.block_graphs[graph_key] = graph  # registered before capture: a failed capture is reset too
    pool = self._ext_graph_pool()
    with guarded_capture(graph, pool=pool, stream=capture_stream()):
        self.block_output[graph_key] = self._ext_tower(
            self.block_input[graph_key], lambda layer_num, y: self._ext_block_kwargs(graph_key, layer_num), kwargs)


def _ext_tower(self, y, block_kwargs, rotary):
    """The blocks (attention kwargs `block_kwargs(layer_num, y)`, rotary kwargs `rotary`), deepstack
    mergers and merger on `y`: what a graph captures and the eager path runs."""
    deepstack_outs = []
    for layer_num, blk in enumerate(self.vit.blocks):
        y = blk(y, **block_kwargs(layer_num, y), **rotary)
        if self._deepstack_visual_indexes and layer_num in self._deepstack_visual_indexes:
            if self._deepstack_merger_list is None:
                raise RuntimeError("deepstack_visual_indexes exists but deepstack_merger_list is missing.")
            deepstack_outs.append(self._deepstack_merger_list[len(deepstack_outs)](y))
    out = self.vit.merger(y)
    return torch.cat([out] + deepstack_outs, dim=1) if deepstack_outs else out


def _ext_graph_pool(self):
    """sglang's process-wide graph pool, pinned so that evicting every ViT graph never empties it."""
    pool = get_or_create_global_graph_memory_pool(torch.cuda)
    pin_graph_pool(pool)
    return pool


def _ext_shared_rows(self, name, graph_key, rows, row_shape, dtype):
    """`rows` rows of the runner's shared `name` buffer, leased by `graph_key` until its release
    (budget graphs are captured largest first: the ladder's buffers cost one graph's)."""
    pool_key = (name, tuple(row_shape), dtype)
    pool = self._ext_buffer_pools.get(pool_key)
    if pool is None:
        pool = self._ext_buffer_pools[pool_key] = StableWorkspacePool(f"vit_{name}", dtype=dtype, device=self.device)
    lease = pool.lease(graph_key, rows, tuple(row_shape))
    self._ext_buffer_leases.setdefault(graph_key, []).append(lease)
    return lease.tensor


def _get_sin_cos_ws(self, graph_key, seq_len, head_dim, dtype=None):
    """The stable rotary buffers of one graph (leased until its release), in the dtype of the cos/sin
    the tower computed (Qwen3-VL's are float32)."""
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


def retired_sin_cos_ws(self):
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


def _ext_fill_rotary(self, graph_key, seq_len, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """Copy this call's cos/sin into the graph's rotary buffers; returns the block kwargs passing them."""
    cos, sin = position_embeddings if position_embeddings is not None else (rotary_pos_emb_cos, rotary_pos_emb_sin)
    if cos is None or sin is None:
        return {}
    cos_ws, sin_ws = self._get_sin_cos_ws(graph_key, seq_len, cos.shape[1], cos.dtype)
    fill_rows(cos_ws, cos)
    fill_rows(sin_ws, sin)
    return rotary_kwargs(None if position_embeddings is None else (cos_ws, sin_ws), cos_ws, sin_ws)


def _ext_write_layout(self, graph_key, cu_seqlens, cu_window_seqlens):
    """Class mode: this batch's boundaries into the graph's buffers (no sync); unused sequences get length 0."""
    tokens = graph_key.num_tokens
    pairs = [(self.cu_full_len[graph_key], self.cu_full_len_kk[graph_key], cu_seqlens)]
    if self._fullatt_block_indexes:
        pairs.append((self.cu_window_len[graph_key], self.cu_window_len_kk[graph_key], cu_window_seqlens))
    for buffer, lengths, source in pairs:
        source = source.to(device=self.device, dtype=torch.int32)
        count = source.shape[0]
        buffer[:count].copy_(source, non_blocking=True)
        buffer[count:].fill_(tokens)
        torch.sub(buffer[1:], buffer[:-1], out=lengths)


def _ext_attention_kwargs(self, graph_key, cu, seq_lens, max_seqlen):
    """Block kwargs for one attention kind of a graph, per backend; fa4 has no graph-mode branch in
    0.5.17, so it gets `forward_metadata` built on the graph's own buffers."""
    backend = self._attn_backend
    if backend == "fa4":
        metadata = VisionAttentionMetadata(cu_seqlens=cu, seq_lens=seq_lens, max_seqlen=max_seqlen)
        return {"cu_seqlens": cu, "forward_metadata": metadata}
    seqlens = [cu, seq_lens, max_seqlen] if backend == "triton_attn" else [cu, max_seqlen]
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


def _ext_graph_tensors(self, graph_key):
    """Every static tensor a captured graph reads or writes: their addresses are baked into it."""
    tensors = [self.block_input[graph_key], self.block_ws[graph_key], self.block_output[graph_key],
               self.cu_full_len[graph_key], self.cu_full_len_kk[graph_key]]
    if self._fullatt_block_indexes:
        tensors += [self.cu_window_len[graph_key], self.cu_window_len_kk[graph_key]]
    tensors += list(self._sin_cos_ws_by_graph.get(graph_key, ()))
    return tuple(tensors)


def _ext_expected_bytes(self, x_3d, rows=None):
    """Input + attention workspace bytes of a graph for x_3d, or for `rows` rows shaped like it (known
    before capturing)."""
    attn = getattr(self.vit.blocks[0], "attn", None)
    heads = getattr(attn, "num_attention_heads_per_partition", 0)
    head_size = getattr(attn, "head_size", 0)
    rows = int(x_3d.shape[0]) if rows is None else int(rows)
    return rows * (math.prod(x_3d.shape[1:]) + heads * head_size) * x_3d.element_size()


def _ext_release_graph(self, entry):
    """Cache release callback of `(graph_key, graph)`; a stale entry (key re-captured) only resets its graph."""
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
            logger.debug("reset of ViT graph %s failed: %s", graph_key, exc)
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


METHODS = (
    create_graph, _ext_prepare_graph, _create_graph, _ext_tower, _ext_graph_pool, _ext_shared_rows, _get_sin_cos_ws,
    _ext_fill_rotary, _ext_write_layout, _ext_attention_kwargs, _ext_block_is_full, _ext_block_kwargs,
    _ext_graph_tensors, _ext_expected_bytes, _ext_release_graph, _ext_drop_graph_state,
)
