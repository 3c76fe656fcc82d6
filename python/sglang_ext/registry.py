"""The one declarative table of patches sglang-ext can apply.

Nothing here imports sglang or applies anything. Per patch: `targets` (sglang definitions whose
fingerprint must match before any part is applied), `parts` (trigger module -> adapter function,
run as `fn(ctx, module)` once it is imported), `upstream_since` / `upstream_equivalent` (an
equivalent upstream makes the patch "not needed"), `requires` (patches this one needs, perhaps only
while a knob is set).

Every name is written in the shape of the newest supported release; `RENAMES` is the shim that
gives an older release its own names (`resolve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from sglang_ext.versions import SUPPORTED_SGLANG, at_least

_MG = "sglang.multimodal_gen.runtime"

# (first release with the new name, new name, the name before it): a dotted module prefix, or
# "module:qualname" for a definition renamed in place.
RENAMES: Tuple[Tuple[str, str, str], ...] = (
    ("0.5.18", f"{_MG}.vla.cuda_graph", f"{_MG}.vla.denoise_cuda_graph"),
    ("0.5.18", f"{_MG}.entrypoints.action", f"{_MG}.entrypoints.vla"),
    ("0.5.20", "sglang.srt.layers.cp.utils:is_cp_active", "sglang.srt.layers.cp.utils:is_cp_v2_active"),
    ("0.5.23", "sglang.srt.layers.cp.bcg.bcg", "sglang.srt.layers.cp.bcg"),
)


def resolve(name: str, version: Optional[str]) -> str:
    """`name` (a module, or "module:qualname") as sglang `version` spells it (None: the newest shape)."""
    if version is None:
        return name
    for since, new, old in RENAMES:
        if at_least(version, since):
            continue
        if name == new or (":" not in new and (name.startswith(new + ".") or name.startswith(new + ":"))):
            name = old + name[len(new):]
    return name


@dataclass(frozen=True)
class Target:
    module: str
    qualname: str
    also: Tuple[str, ...] = ()  # releases between the supported ones read and found compatible: accepted too

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"

    def key_in(self, version: Optional[str]) -> str:
        return resolve(self.key, version)

    def reference_releases(self, supported: Tuple[str, ...], release: Optional[str]) -> Tuple[str, ...]:
        """The releases whose recorded fingerprint this target may have on `release`: a supported release its
        own; one between them any supported one, or one this target was reviewed on."""
        return (release,) if release in supported else tuple(supported) + self.also


@dataclass(frozen=True)
class Part:
    trigger_module: str
    function: str  # "sglang_ext.<module>:<function>"
    before: Optional[str] = None  # a backport: runs only on releases older than this one

    def runs_on(self, version: Optional[str]) -> bool:
        return self.before is None or version is None or not at_least(version, self.before)


@dataclass(frozen=True)
class Requirement:
    patch: str
    when_knobs: Tuple[str, ...] = ()  # needed only while one of these knobs differs from its default


@dataclass(frozen=True)
class PatchSpec:
    name: str
    summary: str
    targets: Tuple[Target, ...]
    parts: Tuple[Part, ...]
    upstream_pr: str
    retire_when: str
    supported: Tuple[str, ...] = SUPPORTED_SGLANG
    upstream_since: Optional[str] = None
    upstream_equivalent: bool = False
    process: str = "srt scheduler"  # where it matters (doctor says)
    requires: Tuple[Requirement, ...] = ()

    def parts_on(self, version: Optional[str]) -> Tuple[Part, ...]:
        return tuple(p for p in self.parts if p.runs_on(version))


def T(module: str, *qualnames: str) -> Tuple[Target, ...]:
    return tuple(Target(module, q) for q in qualnames)


_VIT_RUNNER = "sglang.srt.multimodal.vit_cuda_graph_runner"
_QWEN25 = "sglang.srt.models.qwen2_5_vl"
_QWEN3 = "sglang.srt.models.qwen3_vl"
_MODEL_RUNNER = "sglang.srt.model_executor.model_runner"
_MM_UTILS = "sglang.srt.managers.mm_utils"
_BCG = "sglang.srt.layers.cp.bcg.bcg"
_PREFILL = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner"
_BREAKABLE = "sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph"
_PI05_CORE = f"{_MG}.models.vlas.pi05_core"
_PI05_POLICY = f"{_MG}.models.vlas.pi05_policy"
_VLA_STAGES = f"{_MG}.pipelines_core.stages.vla"
_MG_LINEAR = f"{_MG}.layers.linear"
_MG_CONFIGS = "sglang.multimodal_gen.configs.pipeline_configs"
_PI05_CONFIG = f"{_MG_CONFIGS}.pi05"
_ACTION = f"{_MG}.entrypoints.action"
_VLA_PROTOCOL = f"{_ACTION}.protocol"
_VLA_API = f"{_ACTION}.api"
_VLA_WS = f"{_ACTION}.ws_utils"
_MG_SCHEDULER_CLIENT = f"{_MG}.scheduler_client"
_PI05_PREPROCESS = f"{_MG}.pipelines_core.stages.model_specific_stages.pi05_preprocess"

PATCHES: Tuple[PatchSpec, ...] = (
    PatchSpec(
        name="vit_cuda_graph",
        summary="ViT CUDA graphs keyed by attention layout, bounded (LRU + reset), "
        "stable rotary workspaces, eager fallback, owned outputs",
        targets=T(_VIT_RUNNER, "ViTCudaGraphRunner")
        + T(_QWEN25, "Qwen2_5_VisionTransformer.forward_with_cuda_graph", "Qwen2_5_VisionTransformer.get_window_index")
        + T(_QWEN3, "Qwen3VLMoeVisionModel.forward_with_cuda_graph", "Qwen3VLMoeVisionModel._prepare_graph_inputs",
            "graph_runners_dict")
        # Relied on, not replaced: metadata takes precedence over the graph path (eager fallback),
        # max_seqlen is only the triton kernel's grid bound (class mode), the shared graph pool.
        + T("sglang.srt.layers.attention.vision", "prepare_vision_attention_metadata",
            "VisionTritonAttention.forward", "VisionAttention.forward")
        + T("sglang.srt.layers.rotary_embedding.utils", "apply_rotary_pos_emb_native_eager")
        + T("sglang.kernels.ops.attention.prefill_attention", "context_attention_fwd", "_fwd_kernel")
        + T("sglang.srt.model_executor.runner_utils.pool", "get_or_create_global_graph_memory_pool")
        # Wrapped, not replaced: 0.5.21-0.5.22 differ from 0.5.23 only by a PD role switch's bookkeeping after
        # the captures.
        + (Target(_MODEL_RUNNER, "ModelRunner.init_cuda_graphs", also=("0.5.21", "0.5.22")),),
        parts=(
            Part(_VIT_RUNNER, "sglang_ext.vit.runner:patch_runner"),
            Part(_QWEN25, "sglang_ext.vit.qwen2_5:patch_qwen2_5_vl"),
            Part(_QWEN3, "sglang_ext.vit.qwen3:patch_qwen3_vl"),
            # bucket mode: capture the ladder when the model loads, after sglang's own graphs
            Part(_MODEL_RUNNER, "sglang_ext.vit.model_runner:patch_model_runner"),
            # vision rotary: one Triton kernel (knob vit_triton_rotary, default), else in bucket mode's
            # eager calls the compiled rotary graphs-off runs
            Part("sglang.srt.layers.attention.vision", "sglang_ext.vit.vision_rotary:patch_vision"),
        ),
        upstream_pr="sgl-project/sglang#37043",
        upstream_since="0.5.19",
        upstream_equivalent=False,  # upstream is unbounded, keeps retired workspaces, syncs on fallback
        retire_when="upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs",
    ),
    PatchSpec(
        name="mm_embedding_sync_free",
        summary="Multimodal embedding without device syncs: its length checked against a host-side token "
        "count after the vision tower (ViT graph replays then overlap the language model's launch), the "
        "placeholder ids copied to the device from pinned memory before it",
        targets=T(_MM_UTILS, "get_embedding_and_mask", "_adjust_embedding_length")
        # relied on: the extend ranges the host count mirrors, and the module-global calls it rebinds
        + T(_MM_UTILS, "get_embedding_chunk", "embed_mm_inputs"),
        parts=(Part(_MM_UTILS, "sglang_ext.vit.mm_embedding:patch_mm_utils"),),
        upstream_pr="(sglang 0.5.21: embedding length checked without a sync, placeholder ids from pinned memory)",
        upstream_since="0.5.21",
        upstream_equivalent=True,
        retire_when="upstream checks the multimodal embedding length without a device sync and copies the "
        "placeholder ids to the device without one",
    ),
    PatchSpec(
        name="prefill_cp_bucket",
        summary="Prefill CP (zigzag) graph bucket chosen by CP-local capacity, once per batch; "
        "CP graph-break inputs held strongly (#37606)",
        targets=T(_BCG, "PrefillCPBCGInput")
        + T(_PREFILL, "PrefillCudaGraphRunner.can_run_graph", "PrefillCudaGraphRunner.load_batch",
            "PrefillCudaGraphRunner.capture_one_shape", "_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR")
        # break inputs pass through _weak_ref_if_tensor, resolved as a module global at capture;
        # the replay closures live as long as the backend's per-bucket graph
        + T(_BREAKABLE, "_weak_ref_if_tensor", "eager_on_graph")
        + T("sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend",
            "BreakableCudaGraphBackend.capture_one")
        # the override of _pad_to_bucket delegates to the base staticmethod
        + T("sglang.srt.model_executor.runner.base_cuda_graph_runner", "BaseCudaGraphRunner._pad_to_bucket")
        # the closed-form requirement must equal the rows prepare() builds for the live layout
        + T("sglang.srt.layers.cp.utils", "is_cp_active", "prepare_cp_forward")
        + T("sglang.srt.layers.cp.zigzag", "ZigzagCPStrategy.build_metadata")
        + T("sglang.srt.layers.cp.padding", "pad_logical_token_to_physical"),
        parts=(
            Part(_BCG, "sglang_ext.prefill_cp.bucket:patch_bcg"),
            Part(_PREFILL, "sglang_ext.prefill_cp.bucket:patch_prefill_runner"),
            # patches _BREAKABLE, once the prefill runner (which imports it) is imported
            Part(_PREFILL, "sglang_ext.prefill_cp.bucket:patch_breakable_cuda_graph"),
        ),
        upstream_pr="sgl-project/sglang#33906",
        upstream_since="0.5.18",
        upstream_equivalent=False,  # upstream decides twice (admission and replay)
        retire_when="upstream stores the admitted bucket with the batch instead of recomputing it at replay "
        "and holds breakable-graph break inputs strongly (#37448)",
    ),
    PatchSpec(
        name="mg_worker_activation",
        summary="Apply sglang-ext inside spawned multimodal_gen GPU workers (0.5.17 loads no plugins there)",
        # launch_server() spawns the module global run_scheduler_process; the two pool-disagg
        # launchers spawn the module global _run_disagg_role_process, which calls it.
        targets=T(f"{_MG}.launch_server", "launch_server", "launch_pool_disagg_server", "launch_disagg_role",
                  "_run_disagg_role_process"),
        parts=(Part(f"{_MG}.launch_server", "sglang_ext.mg_worker.spawn:patch_launch_server"),),
        upstream_pr="(multimodal_gen plugin group, sglang 0.5.21)",
        upstream_since="0.5.21",
        upstream_equivalent=True,
        retire_when="the minimum supported sglang loads sglang.multimodal_gen.plugins in workers (>= 0.5.21)",
        process="multimodal_gen launcher",
    ),
    PatchSpec(
        name="pi05_graphs",
        summary="Pi0.5 prefix and action-denoise CUDA graphs with bounded caches (exact / bucket LRU), "
        "denoise layout hoisted, capturable masked prefixes, K/V refresh keyed by context generation, "
        "graphs captured at load (prompt buckets), opt-in fused denoise loop, opt-in fused-kernel denoise "
        "(pi05_fast). The policy's runners are ours on sglang_ext.graphs under upstream's names; on 0.5.17 "
        "they are also installed as 0.5.19's vla/cuda_graph.py and 0.5.19's core / stage changes backported",
        targets=T(f"{_MG}.vla.cuda_graph", "VLADenoiseGraphRunner", "VLADenoiseGraphSignature",
                  "_CapturedDenoiseGraph", "_copy_prefix_context_", "_clone_prefix_context")
        + T(f"{_MG}.vla.prefix_cache", "PrefixContext", "VLADensePrefixCache")
        + T(_PI05_CORE, "create_sinusoidal_pos_embedding", "make_att_2d_masks", "trim_trailing_padding_tokens",
            "Pi05CoreModel.prepare_attention_masks_4d", "Pi05CoreModel.embed_prefix",
            "Pi05CoreModel.embed_suffix", "Pi05CoreModel.encode_prefix", "Pi05CoreModel.denoise_step")
        + T(_PI05_POLICY, "Pi05ActionExpert.forward", "Pi05PolicyModel.__init__",
            "Pi05PolicyModel.build_prefix_cache_key", "Pi05PolicyModel.encode_prefix",
            "Pi05PolicyModel.denoise_step", "Pi05PolicyModel.sample_actions",
            "Pi05PolicyModel._prefix_language_model", "Pi05PolicyModel._materialize_prefix_kv_for_action")
        + T(_VLA_STAGES, "_grouped_fingerprint", "VLAPrefixEncodingStage.forward",
            "VLAPrefixEncodingStage.run_grouped_requests", "VLAPrefixEncodingStage.get_cached_context",
            "VLAPrefixEncodingStage._send_prefix_result"),
        parts=(
            # On the package: `vla.cuda_graph` (upstream's name, absent in 0.5.17) is importable as
            # soon as anything under vla is, before any Pi0.5 model module was imported.
            Part(f"{_MG}.vla", "sglang_ext.pi05.vla_cuda_graph:install", before="0.5.19"),
            Part(_PI05_CORE, "sglang_ext.pi05.core_graphs:patch_core"),
            Part(_PI05_CORE, "sglang_ext.pi05.core_graphs:backport_core", before="0.5.19"),
            Part(_PI05_POLICY, "sglang_ext.pi05.policy_graphs:patch_policy"),
            Part(_PI05_POLICY, "sglang_ext.pi05.policy_graphs:backport_policy", before="0.5.19"),
            Part(_VLA_STAGES, "sglang_ext.pi05.stage_graphs:patch_stages"),
            Part(_VLA_STAGES, "sglang_ext.pi05.stage_graphs:backport_stages", before="0.5.19"),
        ),
        upstream_pr="sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)",
        upstream_since="0.5.19",
        upstream_equivalent=False,  # upstream keys the K/V refresh on id(), syncs after prefix replay
        retire_when="upstream keys the action-graph K/V refresh on something id()-free and the minimum "
        "supported sglang has vla/cuda_graph.py (>= 0.5.19)",
        process="multimodal_gen worker",
        # Prompt-token buckets are a config field that pi05_config adds.
        requires=(Requirement("pi05_config", when_knobs=("pi05_prompt_token_buckets",)),),
    ),
    PatchSpec(
        name="pi05_merged_linear",
        summary="MergedReplicatedLinear (one packed weight, one GEMM, shard-aware weight_loader); "
        "non-TP PiGemma Q/K/V and gate/up use it (0.5.17's __init__ builds the layers, then the separate "
        "projections are replaced by the packed one); separate-tensor checkpoints still load",
        targets=T(_MG_LINEAR, "ReplicatedLinear", "adjust_scalar_to_fused_array")
        + T(_PI05_CORE, "PiGemmaMLP", "PiGemmaAttention", "linear_forward")
        # separate q/k/v and gate/up checkpoint tensors reach the packed shards through these
        + T(_PI05_POLICY, "Pi05PolicyModel._FUSED_WEIGHT_MAPPINGS", "Pi05PolicyModel._candidate_target_weights",
            "Pi05PolicyModel._resolve_target_weight", "Pi05PolicyModel._load_tensor_to_target"),
        parts=(
            Part(_MG_LINEAR, "sglang_ext.pi05.merged_linear:patch_linear"),
            Part(_PI05_CORE, "sglang_ext.pi05.gemma_projections:patch_pi05_core"),
        ),
        upstream_pr="sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)",
        upstream_since="0.5.19",
        upstream_equivalent=True,
        retire_when="the minimum supported sglang has MergedReplicatedLinear (>= 0.5.19)",
        process="multimodal_gen worker",
    ),
    PatchSpec(
        name="pi05_fused_norms",
        summary="PiGemma adaRMS norm on fused rms_norm + addcmul (same float32 math, ~5 kernels instead "
        "of ~13); gated_residual as one addcmul",
        # PiGemmaDecoderLayer.forward and compute_layer_complete call gated_residual through the
        # module globals, so rebinding the function reaches them.
        targets=T(_PI05_CORE, "PiGemmaRMSNorm", "gated_residual"),
        parts=(Part(_PI05_CORE, "sglang_ext.pi05.fused_norms:patch_pi05_core"),),
        upstream_pr="none (sglang-ext only)",
        retire_when="upstream PiGemmaRMSNorm uses a fused rms_norm and gated_residual is a single op",
        process="multimodal_gen worker",
    ),
    PatchSpec(
        name="pi05_config",
        summary="Pi0.5 graph config fields (prompt_token_buckets, prefix/action graph capacities) validated "
        "at start-up, misspelled graph keys rejected, --ext-pi05-* overrides; prompt_bucketing module; "
        "action metadata reports graph availability",
        targets=T(_PI05_CONFIG, "Pi05PipelineConfig")
        + T(f"{_MG_CONFIGS}.base", "PipelineConfig.update_pipeline_config", "PipelineConfig.check_pipeline_config")
        + T(_VLA_PROTOCOL, "action_metadata")
        + T(_VLA_API, "action_metadata_endpoint"),
        parts=(
            Part(_PI05_CONFIG, "sglang_ext.pi05.config:patch_pipeline_config"),
            Part(f"{_MG}.vla", "sglang_ext.pi05.config:install_prompt_bucketing", before="0.5.19"),
            Part(_VLA_PROTOCOL, "sglang_ext.pi05.action_metadata:patch_protocol"),
            Part(_VLA_API, "sglang_ext.pi05.action_metadata:rebind_action_metadata"),
            Part(_VLA_WS, "sglang_ext.pi05.action_metadata:rebind_action_metadata"),
        ),
        upstream_pr="sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)",
        upstream_since="0.5.19",
        upstream_equivalent=False,  # upstream ignores misspelled graph keys in update_pipeline_config
        retire_when="the minimum supported sglang has the graph config fields (>= 0.5.19) and rejects "
        "misspelled pipeline config keys",
        # The config is built in the launcher (ServerArgs) and pickled into the workers; the
        # metadata is served by the HTTP process.
        process="multimodal_gen launcher, HTTP server and worker",
    ),
    PatchSpec(
        name="mg_scheduler_client_reuse",
        summary="The multimodal_gen HTTP process keeps its ZMQ REQ sockets to the scheduler across requests "
        "(no TCP connect and ZMTP handshake per request); a socket whose round trip did not complete is closed",
        targets=T(_MG_SCHEDULER_CLIENT, "AsyncSchedulerClient.forward", "AsyncSchedulerClient.close",
                  "AsyncSchedulerClient.initialize", "_materialize_output_batch_file_refs"),
        parts=(Part(_MG_SCHEDULER_CLIENT, "sglang_ext.mg_worker.scheduler_client:patch_scheduler_client"),),
        upstream_pr="none (0.5.23 still opens a socket per request)",
        retire_when="upstream keeps its scheduler sockets across requests",
        process="multimodal_gen HTTP server",
    ),
    PatchSpec(
        name="pi05_action_transport",
        summary="Pi0.5 action requests: JSON bodies parsed with orjson (json.loads for what orjson refuses), "
        "camera frames base64-decoded with pybase64 (stdlib fallback) and decoded concurrently; same "
        "results and errors",
        targets=T(_VLA_API, "router", "create_action_generation")
        + T(_VLA_PROTOCOL, "_decode_b64_image", "_normalize_observation", "_normalize_image_value",
            "images_from_observation"),
        parts=(
            Part(_VLA_PROTOCOL, "sglang_ext.pi05.action_transport:patch_protocol"),
            Part(_VLA_API, "sglang_ext.pi05.action_transport:patch_api"),
        ),
        upstream_pr="none (0.5.23 parses and decodes the same way)",
        retire_when="upstream parses JSON fast, decodes cameras concurrently and sends number lists as arrays",
        process="multimodal_gen HTTP server",
    ),
    PatchSpec(
        name="pi05_observation_device",
        summary="Pi0.5 camera frames go to the GPU as uint8 and are scaled there (same float32 ops), the noise "
        "with them; the prompt tokenizer call goes to the Rust tokenizer (checked against transformers' call)",
        targets=T(_PI05_PREPROCESS, "_preprocess_image", "_tensor_from_image", "_resize_with_pad_image_tensor",
                  "Pi05Preprocessor")
        + T(_PI05_POLICY, "Pi05PolicyModel.encode_prefix", "Pi05PolicyModel.sample_actions"),
        parts=(Part(_PI05_PREPROCESS, "sglang_ext.pi05.observation_device:patch_preprocess"),),
        upstream_pr="none (0.5.23 preprocesses on the CPU)",
        retire_when="upstream preprocesses Pi0.5 observations on the device",
        process="multimodal_gen worker",
    ),
    PatchSpec(
        name="mg_worker_request_overhead",
        summary="The multimodal_gen worker around each request's pipeline: its memory snapshots (before and after "
        "each request) read the CUDA allocator's statistics once each instead of flattening them four times "
        "(same values); Pi0.5 action requests log their stages' start and finish at debug level, as sglang logs "
        "the action request itself, not as eight info lines per request",
        targets=T(f"{_MG}.utils.perf_logger", "capture_memory_snapshot", "MemorySnapshot", "StageProfiler")
        + T(f"{_MG}.pipelines_core.stages.base", "PipelineStage.__call__")
        # relied on: the per-request snapshots call the module global rebound here; sglang's own
        # action-request test and its debug-level action logs
        + T(f"{_MG}.managers.gpu_worker", "GPUWorker._execute_forward_common")
        + T(f"{_MG}.pipelines_core.schedule_batch", "Req.log"),
        parts=(
            Part(f"{_MG}.managers.gpu_worker", "sglang_ext.mg_worker.memory_snapshot:patch_gpu_worker"),
            Part(f"{_MG}.pipelines_core.stages.base", "sglang_ext.pi05.stage_logs:patch_stage_base"),
        ),
        upstream_pr="none (0.5.23 still reads the statistics four times per snapshot and logs every stage at info)",
        retire_when="upstream reads the allocator's statistics once per snapshot and logs the stages of action "
        "requests at debug level",
        process="multimodal_gen worker",
    ),
    PatchSpec(
        name="pi05_observation_checks",
        summary="Pi0.5 observations checked per request: a NaN or infinite state or noise, a badly shaped camera, "
        "a camera the checkpoint does not name and an observation without a usable camera are refused with one "
        "line naming the field (JSON: 400; the OpenPI and realtime websockets answer {\"error\": ...} and stay "
        "open); the HTTP process knows the checkpoint's cameras",
        targets=T(_VLA_PROTOCOL, "build_action_sampling_params", "images_from_observation", "_normalize_image_value",
                  "pack_msgpack")
        + T(_VLA_WS, "run_action_msgpack_ws")
        + T(f"{_ACTION}.openpi", "openpi_policy_ws")
        + T(_VLA_API, "action_realtime_ws")
        + T(_VLA_STAGES, "VLAObservationPreprocessStage.forward", "vla_state")
        # relied on: the checkpoint's cameras; the worker's observation dict
        + T(_PI05_POLICY, "Pi05PolicyModel._apply_checkpoint_config")
        + T("sglang.multimodal_gen.configs.sample.pi05", "Pi05SamplingParams.build_request_extra"),
        parts=(
            Part(_VLA_PROTOCOL, "sglang_ext.pi05.observation_checks:patch_protocol"),
            Part(_VLA_WS, "sglang_ext.pi05.observation_checks:patch_ws_utils"),
            Part(f"{_ACTION}.openpi", "sglang_ext.pi05.observation_checks:rebind_ws_loop"),
            Part(_VLA_API, "sglang_ext.pi05.observation_checks:rebind_ws_loop"),
            Part(_VLA_STAGES, "sglang_ext.pi05.observation_checks:patch_stages"),
        ),
        upstream_pr="none (0.5.23 checks neither values nor camera names)",
        retire_when="upstream refuses non-finite states and noise, badly shaped and unknown cameras and observations "
        "without a camera, per request, and its websockets answer a refused request without closing",
        process="multimodal_gen HTTP server and worker",
    ),
)

PATCH_NAMES: Tuple[str, ...] = tuple(p.name for p in PATCHES)
