"""Non-TP `PiGemmaMLP` on one packed gate/up weight (one GEMM, no `torch.cat`).

Target symbols:
    sglang.multimodal_gen.runtime.models.vlas.pi05_core.PiGemmaMLP
        .__init__ (non-TP branch: `gate_up_proj = MergedReplicatedLinear(...)`),
        .forward (always `linear_forward(self.gate_up_proj, x)`),
        .projection_dtype (property: dtype of the packed weight)
sglang versions: 0.5.17 (fingerprint-gated; 0.5.19 has this upstream).
Upstream PR: the Pi0.5 bounded-graph PR released in 0.5.19 (supersedes #34588).

Why: 0.5.17 runs `gate_proj(x)` and `up_proj(x)` as two GEMMs and concatenates.
How: upstream's non-TP branch; `gate_proj`/`up_proj` stay None in both branches.
Checkpoint `mlp.gate_proj`/`mlp.up_proj` tensors reach `gate_up_proj` shards 0/1
through 0.5.17's `Pi05PolicyModel._FUSED_WEIGHT_MAPPINGS`. Applied when pi05_core
is imported, i.e. before any Pi0.5 model is constructed; modules built before
activation keep their separate layers and must not be used after it.

Retire when: the minimum supported sglang is >= 0.5.19.
"""

from __future__ import annotations

from sglang_ext.pi05.merged_linear import MergedReplicatedLinear


def __init__(self, config: GemmaConfig, *, tensor_parallel: bool = False):
    nn.Module.__init__(self)  # module-level def: no zero-argument super()
    self.hidden_size = config.hidden_size
    self.intermediate_size = config.intermediate_size
    self.tensor_parallel = tensor_parallel
    if tensor_parallel:
        self.gate_up_proj = MergedColumnParallelLinear(
            input_size=self.hidden_size,
            output_sizes=[self.intermediate_size] * 2,
            bias=False,
        )
        self.down_proj = RowParallelLinear(
            input_size=self.intermediate_size,
            output_size=self.hidden_size,
            bias=False,
        )
    else:
        self.gate_up_proj = MergedReplicatedLinear(
            input_size=self.hidden_size,
            output_sizes=[self.intermediate_size] * 2,
            bias=False,
        )
        self.down_proj = nn.Linear(
            self.intermediate_size, self.hidden_size, bias=False
        )
    self.gate_proj = None
    self.up_proj = None
    if config.hidden_act != "gelu_pytorch_tanh":
        raise ValueError(f"Unsupported PiGemma activation: {config.hidden_act}")
    self.act_fn = GeluAndMul(approximate="tanh")


def projection_dtype(self) -> torch.dtype:
    return self.gate_up_proj.weight.dtype


def forward(self, x: torch.Tensor) -> torch.Tensor:
    gate_up = linear_forward(self.gate_up_proj, x)
    return linear_forward(self.down_proj, self.act_fn(gate_up))


def patch_pi05_core(ctx, module) -> None:
    """Part for `...models.vlas.pi05_core`: PiGemmaMLP uses the packed layer."""
    cls = module.PiGemmaMLP
    ctx.transplant_method(cls, __init__)
    ctx.transplant_method(cls, forward)
    ctx.transplant_method(cls, projection_dtype, kind="property")
