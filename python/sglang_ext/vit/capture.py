"""The graphs of one ViT tower: buffers, leased workspaces, warm-up, capture, release, and the eager twin."""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from sglang.srt.layers.attention.vision import VisionAttentionMetadata, prepare_vision_attention_metadata
from sglang.srt.model_executor.runner_utils.pool import get_or_create_global_graph_memory_pool
from sglang_ext.graphs.capture import capture_stream, guarded_capture, pin_graph_pool
from sglang_ext.graphs.workspace import StableWorkspacePool
from sglang_ext.vit.strategy import CLASS_BACKENDS

logger = logging.getLogger("sglang_ext.vit_cuda_graph")


def fill_rows(static, rows):
    """`rows` into the first rows of `static`, zeros after them (a budget graph's padding): no allocation."""
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


@dataclass(eq=False)
class CapturedGraph:
    """One graph and every static tensor it reads or writes (their addresses are baked into it)."""

    key: Any
    input: Optional[torch.Tensor] = None
    workspace: Optional[torch.Tensor] = None
    cu_full: Optional[torch.Tensor] = None
    full_lengths: Optional[torch.Tensor] = None
    cu_window: Optional[torch.Tensor] = None
    window_lengths: Optional[torch.Tensor] = None
    rotary: Tuple[torch.Tensor, ...] = ()  # (cos, sin) leased from the tower's rotary pool
    graph: Any = None
    output: Optional[torch.Tensor] = None
    nbytes: int = 0
    leases: List[Any] = field(default_factory=list)


class GraphStore:
    """The graphs of one tower by key, and the workspaces they lease (stable addresses, freed with them)."""

    def __init__(self, vit, backend):
        self.vit = vit
        self.backend = backend
        self.full_blocks = set(getattr(vit, "fullatt_block_indexes", ()) or ())
        self.deepstack = list(getattr(vit, "deepstack_visual_indexes", []) or [])
        self.accepts_metadata = "forward_metadata" in inspect.signature(vit.blocks[0].forward).parameters
        attn = vit.blocks[0].attn
        self.workspace_row = (attn.num_attention_heads_per_partition, attn.head_size)  # attention output per token
        self.graphs: Dict[Any, CapturedGraph] = {}
        self.rotary_pools: Dict[tuple, StableWorkspacePool] = {}
        self.shared_pools: Dict[tuple, StableWorkspacePool] = {}  # bucket mode: input and attention workspace

    def is_full(self, layer_num):
        return not self.full_blocks or layer_num in self.full_blocks

    def _lease(self, graph, pools, name, dtype, rows, row_shape, count=1):
        """`count` tensors of `rows` rows from the tower's pool `name`, held by `graph` until its release."""
        pool = pools.get((name, dtype))
        if pool is None:
            pool = pools[name, dtype] = StableWorkspacePool(name, dtype=dtype, device=self.vit.device)
        lease = pool.lease(graph.key, rows, row_shape, count=count)
        graph.leases.append(lease)
        return lease.tensors

    def prepare(self, key, layout, x_3d, rotary, *, shared, warm_up):
        """Rank-local stage of a capture (buffers, boundaries, rotary, warm-up); returns the rotary kwargs.
        `shared`: slices of buffers all the tower's graphs share (budgets captured largest first)."""
        if self.backend not in CLASS_BACKENDS:  # before anything is allocated
            raise RuntimeError(f"ViT CUDA graph does not support attention backend: {self.backend}")
        graph = self.graphs[key] = CapturedGraph(key)
        device, dtype, tokens, ws_row = self.vit.device, self.vit.dtype, key.num_tokens, self.workspace_row
        if shared:
            row = tuple(x_3d.shape[1:])
            (graph.input,) = self._lease(graph, self.shared_pools, "vit_input", x_3d.dtype, tokens, row)
            (graph.workspace,) = self._lease(graph, self.shared_pools, "vit_attention_ws", dtype, tokens, ws_row)
        else:
            graph.input = torch.empty_like(x_3d, device=device).contiguous()
            graph.workspace = torch.empty((tokens,) + ws_row, device=device, dtype=dtype)
        # Graph-owned boundaries, room for the key's sequence slots; unused slots are empty sequences.
        graph.cu_full = torch.empty(key.full_slots + 1, dtype=torch.int32, device=device)
        graph.full_lengths = torch.empty(key.full_slots, dtype=torch.int32, device=device)
        if self.full_blocks:
            graph.cu_window = torch.empty(key.window_slots + 1, dtype=torch.int32, device=device)
            graph.window_lengths = torch.empty(key.window_slots, dtype=torch.int32, device=device)
        self.write_layout(graph, layout.full, layout.window)
        graph.input.copy_(x_3d)
        kwargs = self.fill_rotary(graph, *rotary)
        # Warm-up, one block per attention kind: kernels that compile on first use must not compile inside
        # the capture. Local stand-ins for the TP collectives; the sync surfaces async errors before the vote.
        first_of_kind = {self.is_full(layer_num): layer_num for layer_num in reversed(range(len(self.vit.blocks)))}
        with torch.no_grad(), warm_up():
            for layer_num in sorted(first_of_kind.values()):
                self.vit.blocks[layer_num](graph.input, **self.block_kwargs(graph, layer_num), **kwargs)
        torch.cuda.synchronize()
        return kwargs

    def capture(self, key, rotary):
        """Capture the tower for `key` from its prepared buffers, outside upstream's `_capture_context()`
        (its custom all-reduce registrations are never freed); record its addresses and bytes."""
        graph = self.graphs[key]
        graph.graph = torch.cuda.CUDAGraph()  # held before capture: a failed capture is reset too
        pool = get_or_create_global_graph_memory_pool(torch.cuda)
        pin_graph_pool(pool)  # evicting every ViT graph must never empty sglang's shared pool
        with guarded_capture(graph.graph, pool=pool, stream=capture_stream()):
            graph.output = self.tower(graph.input, lambda layer_num, y: self.block_kwargs(graph, layer_num), rotary)
        leased = {id(t) for lease in graph.leases for t in lease.tensors}  # shared buffers: counted once
        own = [t for t in (graph.input, graph.workspace, graph.output, graph.cu_full, graph.full_lengths,
                           graph.cu_window, graph.window_lengths) if t is not None and id(t) not in leased]
        graph.nbytes = sum(t.numel() * t.element_size() for t in own + list(graph.rotary))

    def tower(self, y, block_kwargs, rotary):
        """Blocks, deepstack mergers and merger on `y`: what a graph captures and the eager path runs."""
        deepstack_outs = []
        for layer_num, blk in enumerate(self.vit.blocks):
            y = blk(y, **block_kwargs(layer_num, y), **rotary)
            if layer_num in self.deepstack:
                deepstack_outs.append(self.vit.deepstack_merger_list[len(deepstack_outs)](y))
        out = self.vit.merger(y)
        return torch.cat([out] + deepstack_outs, dim=1) if deepstack_outs else out

    def fill_rotary(self, graph, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
        """This call's cos/sin into the graph's rotary buffers (in the tower's dtype: Qwen3-VL's are float32)."""
        cos, sin = position_embeddings if position_embeddings is not None else (rotary_pos_emb_cos, rotary_pos_emb_sin)
        if cos is None or sin is None:
            return {}
        if not graph.rotary:
            head_dim, dtype = cos.shape[1], cos.dtype
            name = f"vit_rotary_hd{head_dim}" + ("" if dtype == self.vit.dtype else f"_{str(dtype).split('.')[-1]}")
            graph.rotary = self._lease(graph, self.rotary_pools, name, dtype, graph.key.num_tokens, (head_dim,), 2)
        cos_ws, sin_ws = graph.rotary
        fill_rows(cos_ws, cos)
        fill_rows(sin_ws, sin)
        return rotary_kwargs(None if position_embeddings is None else (cos_ws, sin_ws), cos_ws, sin_ws)

    def write_layout(self, graph, full, window):
        """A call's CPU boundaries into the graph's buffers without a sync; unused slots get length 0."""
        pairs = [(graph.cu_full, graph.full_lengths, full)]
        if self.full_blocks:
            pairs.append((graph.cu_window, graph.window_lengths, window))
        for buffer, lengths, layout in pairs:
            buffer[:len(layout)].copy_(torch.tensor(layout, dtype=torch.int32), non_blocking=True)
            buffer[len(layout):].fill_(graph.key.num_tokens)
            torch.sub(buffer[1:], buffer[:-1], out=lengths)

    def block_kwargs(self, graph, layer_num):
        """Attention kwargs of block `layer_num` in `graph`, from its own buffers, per backend; fa4 has no
        graph-mode branch in 0.5.17, so it gets `forward_metadata` built on them."""
        key = graph.key
        if self.is_full(layer_num):
            cu, lengths, bound = graph.cu_full, graph.full_lengths, key.full_bound
        else:
            cu, lengths, bound = graph.cu_window, graph.window_lengths, key.window_bound
        if self.backend == "fa4":
            return {"cu_seqlens": cu, "forward_metadata": VisionAttentionMetadata(cu_seqlens=cu, seq_lens=lengths,
                                                                                  max_seqlen=bound)}
        seqlens = [cu, lengths, bound] if self.backend == "triton_attn" else [cu, bound]
        return {"cu_seqlens": seqlens, "output_ws": graph.workspace}

    def release(self, graph):
        """Cache release callback; a stale entry (key captured again since) only resets its own graph."""
        if self.graphs.get(graph.key) is graph:
            self.drop(graph.key)
        elif graph.graph is not None:
            graph.graph.reset()

    def drop(self, key):
        graph = self.graphs.pop(key, None)
        if graph is None:
            return
        if graph.graph is not None:
            try:
                graph.graph.reset()
            except Exception as exc:  # noqa: BLE001 - a half-captured graph must not mask the capture error
                logger.debug("reset of ViT graph %s failed: %s", key, exc)
        for lease in graph.leases:
            lease.release()

    def run_eager(self, x_3d, cu_seqlens, cu_window_seqlens, rotary, output_indices, max_full_len, max_window_len):
        """The captured computation, run eagerly through the same blocks (same kernels, same result)."""
        device = x_3d.device
        full_md = window_md = None
        if self.accepts_metadata:
            full_md = prepare_vision_attention_metadata(cu_seqlens, device=device, max_seqlen=max_full_len)
            if self.full_blocks:
                window_md = prepare_vision_attention_metadata(cu_window_seqlens, device=device,
                                                              max_seqlen=max_window_len)
        else:
            cu_full = cu_seqlens.to(device=device, dtype=torch.int32)
            cu_window = cu_window_seqlens.to(device=device, dtype=torch.int32) if self.full_blocks else None

        def block_kwargs(layer_num, y):
            full = self.is_full(layer_num)
            if self.accepts_metadata:
                md = full_md if full else window_md
                return {"cu_seqlens": md.cu_seqlens, "forward_metadata": md}
            cu, bound = (cu_full, max_full_len) if full else (cu_window, max_window_len)
            seqlens = [cu, cu[1:] - cu[:-1], bound] if self.backend != "fa3" else [cu, bound]
            attn = self.vit.blocks[layer_num].attn
            output_ws = torch.empty(y.shape[0], attn.num_attention_heads_per_partition, attn.head_size,
                                    device=device, dtype=self.vit.dtype)
            return {"cu_seqlens": seqlens, "output_ws": output_ws}

        out = self.tower(x_3d, block_kwargs, rotary_kwargs(*rotary))
        return out if output_indices is None else out.index_select(0, output_indices)

    def expected_bytes(self, x_3d, rows=None):
        """Input + attention workspace bytes of a graph for x_3d, or for `rows` rows shaped like it."""
        row_elements = math.prod(x_3d.shape[1:]) + math.prod(self.workspace_row)
        return (int(x_3d.shape[0]) if rows is None else int(rows)) * row_elements * x_3d.element_size()

    def retired_rotary_buffers(self):
        """Rotary backings that grew out of date but are still leased by a live graph."""
        return sum(max(0, pool.backing_buffers - 1) for pool in self.rotary_pools.values())
