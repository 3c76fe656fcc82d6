"""Bidirectional attention of a few query tokens over the first rows of a K/V buffer (Pi0.5's actions, prefix K/V).

The G = H / KV query heads of a K/V head form one block of S * G rows; key rows are split over `splits` programs
(flash-decoding) and a second kernel combines them in a fixed order (deterministic; splits == 1 skips it).
Math: float32 scores and softmax, probabilities rounded to q's dtype for P @ V (as FlashAttention does),
float32 accumulation, one rounding of the output.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_ext.kernels.backend import (DOT_UPCAST, after_previous_kernel, block_size, runs_triton, tl, triton,
                                        uses_pdl)

_BLOCK_M = 64
_BLOCK_N = 64
STAGES = 2  # the split kernel's K/V loop: shared memory for head_dim 256 at 64 x 64 blocks


def _check(q, keys, values, used, key_rows=None):
    if q.dim() != 4 or keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(f"first_rows_attention: q {tuple(q.shape)}, keys {tuple(keys.shape)}, values "
                         f"{tuple(values.shape)}; allowed: q [B, S, H, D], keys = values [B, T, KV, D]")
    batch, seq, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    if keys.shape[0] != batch or keys.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"first_rows_attention: q {tuple(q.shape)} and keys {tuple(keys.shape)}; "
                         "allowed: same B and D, H a multiple of KV")
    if used is not None and (used.shape != (batch,) or used.dtype != torch.int32):
        raise ValueError(f"first_rows_attention: used {tuple(used.shape)} {used.dtype}; allowed: [{batch}] int32")
    if key_rows is not None and (used is None or key_rows.shape != keys.shape[:2] or key_rows.dtype != torch.int32):
        raise ValueError(f"first_rows_attention: key_rows {tuple(key_rows.shape)} {key_rows.dtype}; allowed: "
                         f"[{batch}, {keys.shape[1]}] int32, with used")
    return batch, seq, heads, head_dim, keys.shape[1], kv_heads


def key_splits(batch, seq, heads, kv_heads, total, sms):
    """A `splits` for first_rows_attention: fill the `sms` SMs, at least one key block each."""
    programs = batch * kv_heads * -(-seq * (heads // kv_heads) // _BLOCK_M)
    return max(1, min(sms // programs, -(-total // _BLOCK_N)))


def first_rows_attention_reference(q, keys, values, used=None, *, scale, splits=1, key_rows=None):
    batch, seq, heads, head_dim, total, kv_heads = _check(q, keys, values, used, key_rows)
    if key_rows is not None:
        index = key_rows.long()[:, :, None, None].expand(-1, -1, kv_heads, head_dim)
        keys, values = keys.gather(1, index), values.gather(1, index)
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=2).transpose(1, 2)  # [B, H, T, D]
    v = values.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (q.float().transpose(1, 2) @ k.transpose(-1, -2)) * scale  # [B, H, S, T]
    if used is not None:
        hidden = torch.arange(total, device=q.device)[None, :] >= used.to(q.device)[:, None].long()
        scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores - top)
    norm = probs.sum(dim=-1, keepdim=True)
    out = (probs.to(q.dtype).float() @ v) / norm
    return out.transpose(1, 2).to(q.dtype).contiguous()


if triton is not None:
    # finite row-max start: an empty split gives weight exp(-1e30 - m) = 0, never NaN
    _NEG = tl.constexpr(-1.0e30)

    @triton.jit
    def _split_attention_kernel(
        Q, K, V, USED, ROWS, OUT, ACC, STATS,
        seq, total, keys_per_split, scale,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, Q_BLOCKS: tl.constexpr,
        HAS_USED: tl.constexpr, HAS_ROWS: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        group: tl.constexpr = HEADS // KV_HEADS
        program = tl.program_id(0)
        split = tl.program_id(1)
        block = program % Q_BLOCKS
        head_group = program // Q_BLOCKS  # b * KV_HEADS + g
        b = head_group // KV_HEADS
        g = head_group % KV_HEADS
        rows = seq * group
        r = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        q_index = (b * seq + r // group) * HEADS + g * group + r % group
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + q_index[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        end = total
        if HAS_USED:
            end = tl.minimum(tl.load(USED + b), total)
        start = split * keys_per_split
        stop = tl.minimum(start + keys_per_split, end)
        m = tl.full((BLOCK_M,), _NEG, tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        for j in range(start, stop, BLOCK_N):
            n = j + tl.arange(0, BLOCK_N)
            n_ok = n < stop
            if HAS_ROWS:
                kv_index = (b * total + tl.load(ROWS + b * total + n, mask=n_ok, other=0)) * KV_HEADS + g
            else:
                kv_index = (b * total + n) * KV_HEADS + g
            k = tl.load(K + kv_index[:, None] * HEAD_DIM + d[None, :], mask=n_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp(scores - m_new[:, None])
            alpha = tl.exp(m - m_new)
            s = s * alpha + tl.sum(p, axis=1)
            v = tl.load(V + kv_index[:, None] * HEAD_DIM + d[None, :], mask=n_ok[:, None], other=0.0)
            p = p.to(V.dtype.element_ty)
            if UPCAST:
                p, v = p.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v)
            m = m_new
        if DIRECT:
            out = acc / s[:, None]
            tl.store(OUT + q_index[:, None] * HEAD_DIM + d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:
            row = (split * (tl.num_programs(0) // Q_BLOCKS) + head_group) * rows + r  # [split, b*KV+g, row]
            tl.store(ACC + row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
            tl.store(STATS + row * 2, m, mask=row_ok)
            tl.store(STATS + row * 2 + 1, s, mask=row_ok)

    @triton.jit
    def _combine_kernel(
        ACC, STATS, OUT, seq, all_rows,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        SPLITS: tl.constexpr, SPLITS_BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):
        after_previous_kernel(PDL)
        group: tl.constexpr = HEADS // KV_HEADS
        row = tl.program_id(0)  # over (b * KV + g) * S * G + r
        rows = seq * group
        head_group = row // rows
        r = row % rows
        b = head_group // KV_HEADS
        g = head_group % KV_HEADS
        splits = tl.arange(0, SPLITS_BLOCK)
        split_ok = splits < SPLITS
        at = splits * all_rows + row
        m = tl.load(STATS + at * 2, mask=split_ok, other=_NEG)
        s = tl.load(STATS + at * 2 + 1, mask=split_ok, other=0.0)
        weight = tl.exp(m - tl.max(m, axis=0))
        d = tl.arange(0, HEAD_DIM)
        acc = tl.load(ACC + at[:, None] * HEAD_DIM + d[None, :], mask=split_ok[:, None], other=0.0)
        out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(s * weight, axis=0)
        q_index = (b * seq + r // group) * HEADS + g * group + r % group
        tl.store(OUT + q_index * HEAD_DIM + d, out.to(OUT.dtype.element_ty))


def first_rows_attention(q, keys, values, used: Optional[torch.Tensor] = None, *, scale: float, splits: int = 1,
                         key_rows: Optional[torch.Tensor] = None, pdl: bool = True):
    """Attention of q [B, S, H, D] over the first used[b] rows (of `key_rows` [B, T] int32 if given: any subset,
    any order) of keys / values [B, T, KV, D], in q's dtype. used: [B] int32 (None: all T), each at least 1."""
    if not runs_triton(q):
        return first_rows_attention_reference(q, keys, values, used, scale=scale, splits=splits, key_rows=key_rows)
    batch, seq, heads, head_dim, total, kv_heads = _check(q, keys, values, used, key_rows)
    if head_dim != block_size(head_dim) or head_dim < 16:
        raise ValueError(f"first_rows_attention: head_dim={head_dim}; allowed: powers of two >= 16")
    for name, t in (("q", q), ("keys", keys), ("values", values), ("key_rows", key_rows)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"first_rows_attention: {name} must be contiguous")
    if splits < 1:
        raise ValueError(f"first_rows_attention: splits={splits}; allowed: >= 1")
    rows = seq * heads // kv_heads
    q_blocks = triton.cdiv(rows, _BLOCK_M)
    keys_per_split = triton.cdiv(triton.cdiv(total, splits), _BLOCK_N) * _BLOCK_N
    out = torch.empty_like(q)
    direct = splits == 1
    all_rows = batch * kv_heads * rows
    acc = out if direct else torch.empty(splits * all_rows, head_dim, dtype=torch.float32, device=q.device)
    stats = out if direct else torch.empty(splits * all_rows, 2, dtype=torch.float32, device=q.device)
    pdl = uses_pdl(q, pdl)
    _split_attention_kernel[(batch * kv_heads * q_blocks, splits)](
        q, keys, values, out if used is None else used, out if key_rows is None else key_rows, out, acc, stats,
        seq, total, keys_per_split, float(scale), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        Q_BLOCKS=q_blocks, HAS_USED=used is not None, HAS_ROWS=key_rows is not None, DIRECT=direct,
        UPCAST=DOT_UPCAST, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, PDL=pdl, launch_pdl=pdl,
        num_warps=8 if head_dim >= 128 else 4, num_stages=STAGES)
    if not direct:
        _combine_kernel[(all_rows,)](acc, stats, out, seq, all_rows, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                                     SPLITS=splits, SPLITS_BLOCK=block_size(splits), PDL=pdl, launch_pdl=pdl,
                                     num_warps=4)
    return out
