"""Non-TP `PiGemmaAttention` on one packed Q/K/V weight (one GEMM + split).

Target symbols:
    sglang.multimodal_gen.runtime.models.vlas.pi05_core.PiGemmaAttention
        .__init__ (non-TP branch: `qkv_proj = MergedReplicatedLinear(hidden,
        [q_size, kv_size, kv_size], bias=attention_bias)`),
        .project_qkv (always one GEMM, then split),
        .projection_dtype (property: dtype of the packed weight)
sglang versions: 0.5.17 (fingerprint-gated; 0.5.19 has this upstream).
Upstream PR: the Pi0.5 bounded-graph PR released in 0.5.19 (supersedes #34588).

Why: 0.5.17 runs `q_proj`, `k_proj`, `v_proj` as three GEMMs per layer and step.
How: upstream's non-TP branch. The TP branch (QKVParallelLinear) is unchanged;
`q_proj/k_proj/v_proj` are None in both branches. Checkpoint
`self_attn.{q,k,v}_proj` tensors reach `qkv_proj` shards "q"/"k"/"v" through
0.5.17's `Pi05PolicyModel._FUSED_WEIGHT_MAPPINGS`. The `__init__` body after
the projections (LocalAttention, optional USPAttention) is 0.5.17's, unchanged.

Retire when: the minimum supported sglang is >= 0.5.19.
"""

from __future__ import annotations

from sglang_ext.pi05.merged_linear import MergedReplicatedLinear


def __init__(
    self,
    config: GemmaConfig,
    layer_idx: int,
    *,
    tensor_parallel: bool = False,
):
    nn.Module.__init__(self)  # module-level def: no zero-argument super()
    self.config = config
    self.layer_idx = layer_idx
    self.tensor_parallel = tensor_parallel
    self.head_dim = getattr(
        config,
        "head_dim",
        config.hidden_size // config.num_attention_heads,
    )
    self.scaling = self.head_dim**-0.5
    self.attention_dropout = config.attention_dropout
    self.is_causal = not getattr(config, "use_bidirectional_attention", False)

    if tensor_parallel:
        self.total_num_heads = config.num_attention_heads
        self.total_num_key_value_heads = config.num_key_value_heads
        self.qkv_proj = QKVParallelLinear(
            hidden_size=config.hidden_size,
            head_size=self.head_dim,
            total_num_heads=self.total_num_heads,
            total_num_kv_heads=self.total_num_key_value_heads,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_key_value_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_key_value_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            input_size=self.total_num_heads * self.head_dim,
            output_size=config.hidden_size,
            bias=config.attention_bias,
        )
    else:
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_key_value_heads * self.head_dim
        self.qkv_proj = MergedReplicatedLinear(
            input_size=config.hidden_size,
            output_sizes=[self.q_size, self.kv_size, self.kv_size],
            bias=config.attention_bias,
        )
        self.o_proj = nn.Linear(
            self.num_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
        )
    self.q_proj = None
    self.k_proj = None
    self.v_proj = None
    self.num_key_value_groups = self.num_heads // self.num_key_value_heads
    self.attn = LocalAttention(
        num_heads=self.num_heads,
        head_size=self.head_dim,
        num_kv_heads=self.num_key_value_heads,
        softmax_scale=self.scaling,
        causal=self.is_causal,
        supported_attention_backends={
            AttentionBackendEnum.FA,
            AttentionBackendEnum.FA2,
            AttentionBackendEnum.TORCH_SDPA,
        },
        compute_dtype=config_compute_dtype(config),
        allow_cudnn_sdp=True,
    )
    self.sp_attn = (
        USPAttention(
            num_heads=config.num_attention_heads,
            head_size=self.head_dim,
            num_kv_heads=config.num_attention_heads,
            softmax_scale=self.scaling,
            causal=self.is_causal,
            supported_attention_backends={
                AttentionBackendEnum.FA,
                AttentionBackendEnum.FA2,
                AttentionBackendEnum.TORCH_SDPA,
            },
            allow_cudnn_sdp=True,
        )
        if _use_ulysses_action_attention(config.num_attention_heads)
        and not tensor_parallel
        else None
    )


def projection_dtype(self) -> torch.dtype:
    return self.qkv_proj.weight.dtype


def project_qkv(
    self,
    hidden_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_shape = hidden_states.shape[:-1]
    query_shape = (*input_shape, self.num_heads, self.head_dim)
    kv_shape = (*input_shape, self.num_key_value_heads, self.head_dim)

    qkv = linear_forward(self.qkv_proj, hidden_states)
    query_states, key_states, value_states = qkv.split(
        [self.q_size, self.kv_size, self.kv_size],
        dim=-1,
    )
    return (
        query_states.view(query_shape).transpose(1, 2),
        key_states.view(kv_shape).transpose(1, 2),
        value_states.view(kv_shape).transpose(1, 2),
    )


def patch_pi05_core(ctx, module) -> None:
    """Part for `...models.vlas.pi05_core`: PiGemmaAttention uses the packed layer."""
    cls = module.PiGemmaAttention
    ctx.transplant_method(cls, __init__)
    ctx.transplant_method(cls, project_qkv)
    ctx.transplant_method(cls, projection_dtype, kind="property")
