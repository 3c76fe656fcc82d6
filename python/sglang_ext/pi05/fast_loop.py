"""The Pi0.5 fast denoise loop: its time table, its GEMM plans and every step of one request on fused kernels."""

from __future__ import annotations

import torch

from sglang_ext.pi05.fast_support import adaptive_norms, expert, plain_weight, sm_count, visible_first


def build_time_conditioning(core, num_steps, batch_size, device, dtype):
    """[steps, norms, 3 (scale, shift, gate), batch, width] float32, built with the model's own layers
    (gate rounded to the activation dtype first, as the exact path does)."""
    timesteps = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float32, device=device)
    steps = timesteps.repeat_interleave(batch_size)
    no_actions = torch.zeros(steps.shape[0], 1, core.config.action_dim, dtype=torch.float32, device=device)
    table = []
    with torch.no_grad():
        _, adarms_cond = core.embed_suffix(no_actions, steps)
        for norm in adaptive_norms(expert(core)):
            scale, shift, gate = norm.dense(adarms_cond.to(dtype=norm.dense.weight.dtype)).chunk(3, dim=-1)
            table.append(torch.stack((scale.float(), shift.float(), gate.to(dtype).float())))
        # [norms, 3, steps * batch, width] -> [steps, norms, 3, batch, width]
        return torch.stack(table).unflatten(2, (num_steps, batch_size)).permute(2, 0, 1, 3, 4).contiguous()


_MAX_PARTS = 8  # partial products cost their consumer a read each


def skinny_plan(weight, sms, *, splittable=True, gated=False):
    """(weight, parts, block_n, block_k) for skinny_linear, or None: most programs in one wave, then fewest parts."""
    n, k = weight.shape
    width = n // 2 if gated else n
    block_k = _block_k(k)
    if block_k < 16:
        return None
    scored = []
    for block_n in (32, 64):
        parts = 1
        while (splittable and parts < _MAX_PARTS and k % (parts * 2 * block_k) == 0
               and k // (parts * 2) >= 2 * block_k and -(-width // block_n) * parts * 2 <= sms):
            parts *= 2
        programs = -(-width // block_n) * parts
        scored.append(((programs <= sms, programs if programs <= sms else -programs, -parts), parts, block_n))
    _, parts, block_n = max(scored, key=lambda entry: entry[0])  # the first of equals
    return weight, parts, block_n, block_k


def rope_plan(weight, head_dim, sms):
    """(weight, block_n, block_k) for linear_rope_qkv, or None: the narrowest block in one wave, else the widest."""
    block_k = _block_k(weight.shape[1])
    fitting = [b for b in (16, 32, 64) if (head_dim // 2) % b == 0]
    if block_k < 16 or not fitting:
        return None
    one_wave = [b for b in fitting if weight.shape[0] // 2 // b <= sms]
    return weight, (one_wave or fitting[::-1])[0], block_k


def expert_projections(expert_model, state, dtype):
    """Per layer {GEMM: plan}, or None (not plain bias-free GEMMs, too many rows, no Triton): qkv's rope_plan;
    o, gate_up (gelu-and-mul epilogue) and down's skinny_plan."""
    from sglang_ext.kernels import runs_triton
    from sglang_ext.kernels.skinny_gemm import MAX_ROWS

    if not runs_triton(state) or state.shape[0] * state.shape[1] > MAX_ROWS:
        return None
    sms = sm_count(state.device)
    plans = []
    for layer in expert_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        plain = [plain_weight(m, dtype) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if None in plain:
            return None
        qkv, o, gate_up, down = (weight for weight, _ in plain)  # bias-free: plain_weight declines a bias
        plan = {"qkv": rope_plan(qkv, attn.head_dim, sms), "o": skinny_plan(o, sms),
                "gate_up": skinny_plan(gate_up, sms, splittable=False, gated=True), "down": skinny_plan(down, sms)}
        if None in plan.values():
            return None
        plans.append(plan)
    return plans


def action_projections(core):
    """(weight, bias, block_k) of action_in_proj and action_out_proj when skinny_linear takes both, else None."""
    plain = [plain_weight(m, torch.float32, bias_ok=True) for m in (core.action_in_proj, core.action_out_proj)]
    if None in plain or any(_block_k(weight.shape[1]) < 16 for weight, _ in plain):
        return None
    return tuple((weight, bias, _block_k(weight.shape[1])) for weight, bias in plain)


def _block_k(k: int) -> int:
    """The widest power-of-two K block (at most 128) that divides K."""
    return min(128, k & -k)


def _request_layout(expert_model, prefix_context, state, full_attention, action_position_offset, dtype):
    """(cos_sin, kv, kv_start, used): cos/sin of the action positions and the K/V buffers. Full
    prefix: rows [prefix | actions], used None. Masked prefix (it hides key rows only): rows
    [actions | visible | hidden], attention reads the first `used[b]` rows, no mask."""
    batch, seq = state.shape[:2]
    prefix_masks = prefix_context.prefix_pad_masks
    prefix_len = prefix_masks.shape[1]
    positions = (prefix_masks.sum(dim=-1, keepdim=True) + action_position_offset
                 + torch.arange(seq, device=state.device)[None, :])
    expert_model.rotary_emb._ensure_cache(state)
    cos_sin = expert_model.rotary_emb.rope.cos_sin_cache.index_select(0, positions.reshape(-1))

    attn = expert_model.layers[0].self_attn
    kv = torch.empty(len(expert_model.layers), 2, batch, prefix_len + seq, attn.num_key_value_heads, attn.head_dim,
                     dtype=dtype, device=state.device)
    kv_start = prefix_len if full_attention else 0
    used = None if full_attention else (prefix_masks.sum(dim=-1) + seq).to(torch.int32)
    gather = None if full_attention else visible_first(prefix_masks)[:, :, None, None].expand(-1, -1, *kv.shape[-2:])
    for index, (keys, values, _) in zip(range(len(expert_model.layers)), prefix_context.past_key_values):
        for slot, prefix in enumerate((keys.transpose(1, 2), values.transpose(1, 2))):  # [B, P, KV, D]
            if full_attention:
                kv[index, slot, :, :prefix_len].copy_(prefix)
            else:
                kv[index, slot, :, seq:].copy_(torch.gather(prefix, 1, gather))
    return cos_sin, kv, kv_start, used


def denoise(core, prefix_context, state, table, *, dt, full_attention, action_position_offset=0, pdl=True):
    """Every denoise step of one request; `state` (x_t, float32) is updated in place."""
    from sglang.multimodal_gen.runtime.managers.forward_context import set_forward_context
    from sglang.multimodal_gen.runtime.models.vlas.pi05_core import linear_forward

    from sglang_ext.kernels import (ada_rms_norm, first_rows_attention, gelu_tanh_and_mul, linear_rope_qkv, rope_qkv,
                                    skinny_linear)
    from sglang_ext.kernels.attention import key_splits

    model = expert(core)
    attn0 = model.layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_key_value_heads, attn0.head_dim
    dtype = attn0.projection_dtype
    batch, seq = state.shape[:2]
    norms = adaptive_norms(model)
    projections = expert_projections(model, state, dtype)
    actions = action_projections(core) if projections is not None else None  # the same rows and Triton

    def gemm(index, name, module, x):
        if projections is None:
            out = linear_forward(module, x)
            return gelu_tanh_and_mul(out, pdl=pdl) if name == "gate_up" else out
        weight, parts, block_n, block_k = projections[index][name]
        return skinny_linear(x, weight, parts=parts, block_n=block_n, block_k=block_k, gated=name == "gate_up",
                             pdl=pdl)

    def qkv_rope(index, module, x, keys, values):  # q -> q, k / v -> the K/V buffer's action rows
        shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, kv_start=kv_start, pdl=pdl)
        if projections is None:
            return rope_qkv(linear_forward(module, x), cos_sin, q, keys, values, **shape)
        weight, block_n, block_k = projections[index]["qkv"]
        return linear_rope_qkv(x, weight, cos_sin, q, keys, values, block_n=block_n, block_k=block_k, **shape)

    def action_in(x_t):
        if actions is None:
            return core.action_in_proj(x_t.to(core.action_in_proj.weight.dtype)).to(dtype).contiguous()
        (weight, bias, block_k), _ = actions
        return skinny_linear(x_t, weight, bias=bias, out_dtype=dtype, block_k=block_k, pdl=pdl)

    def action_out(normed, x_t):  # x_t += dt * velocity
        if actions is None:
            velocity = core.action_out_proj(normed.to(core.action_out_proj.weight.dtype))
            return x_t.add_(velocity.to(torch.float32), alpha=dt)
        _, (weight, bias, block_k) = actions
        return skinny_linear(normed, weight, bias=bias, add_to=x_t, alpha=dt, block_n=16, block_k=block_k, pdl=pdl)

    with torch.no_grad(), set_forward_context(current_timestep=0, attn_metadata=None):
        cos_sin, kv, kv_start, used = _request_layout(model, prefix_context, state, full_attention,
                                                      action_position_offset, dtype)
        splits = key_splits(batch, seq, heads, kv_heads, kv.shape[3], sm_count(state.device))
        q = torch.empty(batch, seq, heads, head_dim, dtype=dtype, device=state.device)
        for cond in table:  # a step's [norms, 3, batch, width]
            hidden = action_in(state)
            normed = ada_rms_norm(hidden, cond[0, 0], cond[0, 1], eps=norms[0].eps, pdl=pdl)
            for index, layer in enumerate(model.layers):
                attn = layer.self_attn
                keys, values = kv[index, 0], kv[index, 1]
                qkv_rope(index, attn.qkv_proj, normed, keys, values)
                out = first_rows_attention(q, keys, values, used, scale=attn.scaling, splits=splits, pdl=pdl)
                out = out.view(batch, seq, heads * head_dim)
                post = 2 * index + 1
                normed = ada_rms_norm(hidden, cond[post, 0], cond[post, 1], eps=norms[post].eps,
                                      add=gemm(index, "o", attn.o_proj, out), gate=cond[post - 1, 2], pdl=pdl)
                out = gemm(index, "gate_up", layer.mlp.gate_up_proj, normed)
                following = post + 1  # next layer's input norm, or the final norm
                final = following == len(norms) - 1  # the float32 action_out_proj reads the final norm unrounded
                normed = ada_rms_norm(hidden, cond[following, 0], cond[following, 1], eps=norms[following].eps,
                                      add=gemm(index, "down", layer.mlp.down_proj, out), gate=cond[post, 2],
                                      out_dtype=torch.float32 if final and actions is not None else None, pdl=pdl)
            action_out(normed, state)
    return state
