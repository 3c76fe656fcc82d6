"""Pi0.5 at its real size with random weights, for GPU tests and benchmarks.

No checkpoint is downloaded: the architecture comes from sglang's own
`Pi05PipelineConfig` / `Pi05PolicyModel` (gemma_2b prefix VLM + SigLIP tower +
gemma_300m action expert, about 3.35 B parameters), and the weight loader is
replaced by a seeded random fill. Works for sglang 0.5.17 (with or without
sglang-ext) and 0.5.19.

On a machine where sglang's CUDA kernel packages are stand-ins (sgl_kernel,
flashinfer), every sglang custom op (activations, norms, rotary) is switched to
its plain-torch `forward_native`, and attention uses torch SDPA; both eager and
graph runs use the same kernels, so their outputs are comparable.

Importable without sglang (imports happen inside the functions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import zlib
from types import SimpleNamespace
from typing import Any, Callable, Dict, Optional, Sequence

import torch

LIBERO_CAMERAS = ("base_0_rgb", "left_wrist_0_rgb")


class Pi05BuildError(RuntimeError):
    """A step of building the random Pi0.5 failed; the message names the step."""


def _step(name: str):
    @contextlib.contextmanager
    def guard():
        try:
            yield
        except Pi05BuildError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised with the step's name
            raise Pi05BuildError(f"building random Pi0.5: step '{name}' failed: {type(exc).__name__}: {exc}") from exc

    return guard()


def unit_server_args(attention_backend: Optional[str]) -> SimpleNamespace:
    """The multimodal_gen server-args fields Pi0.5 model construction reads (tests, benchmarks):
    the attention backend, every switch off, no models loaded."""
    switches = ("comfyui_mode", "disable_autocast", "enable_cfg_parallel", "enable_breakable_cuda_graph",
                "enable_layerwise_nvtx_marker", "enable_torch_compile")
    return SimpleNamespace(attention_backend=attention_backend, attention_backend_config=None, model_loaded={},
                           model_paths={}, pipeline_config=SimpleNamespace(), **dict.fromkeys(switches, False))


def _publish_srt_context() -> None:
    """0.5.19's SigLIP tower reads sglang's runtime settings, which sglang's GPU worker
    publishes; publish test settings for the rest of the process (forward passes read
    them too). 0.5.17 has no runtime context: nothing to do."""
    try:
        from sglang.srt.runtime_context import get_context
    except ImportError:
        return
    context = get_context()
    if getattr(context, "_server_args", None) is None:
        context.override_server_args().install()
    # 0.5.19's SigLIP embeddings are vocab-parallel layers: they need a TP group.
    from sglang_ext_testkit.single_rank import init_single_rank_parallel_state

    init_single_rank_parallel_state()


def _custom_op_bases() -> tuple:
    bases = []
    with contextlib.suppress(ImportError):
        from sglang.multimodal_gen.runtime.layers.custom_op import CustomOp

        bases.append(CustomOp)
    with contextlib.suppress(ImportError):
        from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

        bases.append(MultiPlatformOp)
    return tuple(bases)


def use_native_custom_ops(model: torch.nn.Module) -> int:
    """Route every sglang custom op to its plain-torch forward; returns how many."""
    bases = _custom_op_bases()
    swapped = 0
    for module in model.modules():
        if not hasattr(module, "_forward_method"):
            continue
        native = getattr(type(module), "forward_native", None)
        if native is None or any(native is getattr(base, "forward_native", None) for base in bases):
            continue  # no own native implementation: keep what it dispatched to
        module._forward_method = module.forward_native
        swapped += 1
    return swapped


def _name_seed(seed: int, name: str) -> int:
    return (zlib.crc32(name.encode()) + seed * 0x9E3779B1) % 2**63


def _packed_shards(name: str, module: torch.nn.Module, fused_mappings) -> list:
    """[(checkpoint name, rows)] of a packed weight (one GEMM for q/k/v or gate/up), in output
    order, through the model's own checkpoint mapping; [] for an ordinary parameter."""
    sizes = list(getattr(module, "output_sizes", None) or ())
    shards = [(name.replace(target, source), shard) for target, source, shard in fused_mappings if target in name]
    if len(sizes) < 2 or len(shards) != len(sizes):
        return []
    order = {"q": 0, "k": 1, "v": 2}
    shards.sort(key=lambda item: order.get(item[1], item[1]))
    return [(shard_name, rows) for (shard_name, _), rows in zip(shards, sizes)]


def _random_fill(core_model: torch.nn.Module, seed: int, std: float, fused_mappings=()) -> None:
    """Seeded random weights that do not depend on how projections are packed: every checkpoint
    tensor (q_proj, k_proj, ... as a real checkpoint names them) draws from its own generator,
    seeded from its name, so 0.5.17 (separate q/k/v) and sglang-ext / 0.5.19 (one packed qkv_proj)
    get the same weights and their actions can be compared across processes."""
    owners = {name: module for name, module in core_model.named_modules()}

    def normal(name: str, shape, like: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator(device=like.device).manual_seed(_name_seed(seed, name))
        return torch.empty(shape, device=like.device, dtype=like.dtype).normal_(0.0, std, generator=generator)

    with torch.no_grad():
        layer_norm_params = set()
        for module in core_model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                if module.weight is not None:
                    module.weight.fill_(1.0)
                    layer_norm_params.add(id(module.weight))
                if module.bias is not None:
                    module.bias.zero_()
                    layer_norm_params.add(id(module.bias))
        for name, parameter in core_model.named_parameters():
            if id(parameter) in layer_norm_params:
                continue
            if name.endswith("bias"):
                parameter.zero_()
                continue
            shards = _packed_shards(name, owners.get(name.rpartition(".")[0]), fused_mappings)
            if not shards:
                parameter.copy_(normal(name, parameter.shape, parameter))
                continue
            offset = 0
            for shard_name, rows in shards:
                parameter.narrow(0, offset, rows).copy_(normal(shard_name, (rows, *parameter.shape[1:]), parameter))
                offset += rows


def weights_digest(model: torch.nn.Module) -> list:
    """[count, sum, sum of squares] of every parameter value, in float64: equal for models holding
    the same values however their projections are packed."""
    count, total, squares = 0, 0.0, 0.0
    with torch.no_grad():
        for parameter in model.parameters():
            count += parameter.numel()
            for chunk in parameter.detach().reshape(-1).split(2**24):
                chunk = chunk.double()
                total += float(chunk.sum())
                squares += float(chunk.square().sum())
    return [count, total, squares]


def build_random_pi05(
    *,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    config_overrides: Optional[Dict[str, Any]] = None,
    attention_backend: str = "torch_sdpa",
    native_custom_ops: bool = True,
    reduced: bool = False,
    log: Callable[[str], None] = print,
):
    """Build sglang's Pi05PolicyModel at full size with random weights on `device`.

    `reduced=True` (CPU logic checks only): one transformer layer per tower and
    small MLPs; widths stay (the projector fixes the prefix width at 2048).
    """
    with _step("import sglang Pi0.5 modules"):
        from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
        from sglang.multimodal_gen.runtime.models.vlas import pi05_core, pi05_policy
        from sglang.multimodal_gen.runtime.server_args import set_global_server_args

    with _step("publish multimodal_gen server args (attention backend)"):
        set_global_server_args(unit_server_args(attention_backend))

    with _step("pipeline config"):
        config = Pi05PipelineConfig()
        for key, value in (config_overrides or {}).items():
            if not hasattr(config, key):
                log(f"[pi05_random] config has no field {key!r} on this sglang; ignored")
                continue
            setattr(config, key, value)

    policy_cls = pi05_policy.Pi05PolicyModel
    original_load = policy_cls.__dict__["_load_weights"]

    def random_weights(self):
        _random_fill(self.core_model, seed, std, getattr(policy_cls, "_FUSED_WEIGHT_MAPPINGS", ()))

    policy_cls._load_weights = random_weights  # restored below
    original_variants = pi05_core.get_gemma_variant_config
    if reduced:
        def reduced_variant(variant):
            full = original_variants(variant)
            return type(full)(width=full.width, depth=1, mlp_dim=256, num_heads=full.num_heads,
                              num_kv_heads=full.num_kv_heads, head_dim=full.head_dim)

        pi05_core.get_gemma_variant_config = reduced_variant
    try:
        with _step("publish sglang runtime settings (0.5.19)"):
            _publish_srt_context()
        with _step("construct Pi05PolicyModel (random weights)"):
            policy = policy_cls(
                config,
                model_path="random-pi05",
                device=torch.device(device),
                dtype=dtype,
                manifest=pi05_policy.Pi05CheckpointManifest(model_path="random-pi05"),
            )
    finally:
        policy_cls._load_weights = original_load
        pi05_core.get_gemma_variant_config = original_variants
    if native_custom_ops:
        with _step("switch sglang custom ops to plain torch"):
            swapped = use_native_custom_ops(policy)
            log(f"[pi05_random] {swapped} custom ops use forward_native")
    parameters = sum(p.numel() for p in policy.parameters())
    log(f"[pi05_random] built Pi0.5: {parameters / 1e9:.2f} B parameters, {dtype}, {device}")
    return policy


def make_observation(
    policy,
    *,
    prompt_len: int,
    masked_camera: bool = False,
    seed: int = 0,
    cameras: Sequence[str] = LIBERO_CAMERAS,
    image_size: int = 224,
    state_dim: int = 8,
):
    """A LIBERO-like observation after preprocessing: two 224x224 cameras in [-1, 1],
    prompt token ids padded to max_token_len, optional empty (masked) camera."""
    from sglang.multimodal_gen.runtime.vla.observation import VLAObservationBatch

    config = policy.config
    generator = torch.Generator().manual_seed(seed)
    images = {
        name: torch.rand(1, 3, image_size, image_size, generator=generator) * 2 - 1 for name in cameras
    }
    image_masks = {name: torch.ones(1, dtype=torch.bool) for name in cameras}
    if masked_camera:
        image_masks[cameras[-1]] = torch.zeros(1, dtype=torch.bool)
        images[cameras[-1]] = torch.full_like(images[cameras[-1]], -1.0)
    max_len = int(config.max_token_len)
    if not 0 < prompt_len <= max_len:
        raise ValueError(f"prompt_len: {prompt_len} is not allowed; allowed: 1..{max_len}")
    tokens = torch.zeros(1, max_len, dtype=torch.long)
    tokens[0, :prompt_len] = torch.randint(2, 250_000, (prompt_len,), generator=generator)
    token_masks = torch.zeros(1, max_len, dtype=torch.bool)
    token_masks[0, :prompt_len] = True
    return VLAObservationBatch(
        prompt=["random prompt"],
        images=images,
        image_masks=image_masks,
        state=torch.rand(1, state_dim, generator=generator) * 2 - 1,
        noise=None,
        tokens=tokens,
        token_masks=token_masks,
        batch_size=1,
        metadata={"camera_order": tuple(cameras)},
    )


def make_noise(policy, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    config = policy.config
    return torch.randn(1, config.action_horizon, config.action_dim, generator=generator).to(policy.device)


def encode_prefix_accepts_graph_flag(policy) -> bool:
    return "use_cuda_graph" in inspect.signature(policy.encode_prefix).parameters


def run_request(policy, observation, noise: torch.Tensor, *, graph: bool, num_steps: int = 10, stamps=None):
    """One Pi0.5 request as the pipeline stages run it: prefix, then action denoise.
    `stamps`: three objects with .record() (CUDA events), recorded before the prefix, between the
    phases and after the denoise loop."""
    record = (lambda i: stamps[i].record()) if stamps else (lambda i: None)
    with torch.inference_mode():
        record(0)
        if encode_prefix_accepts_graph_flag(policy):
            prefix_context = policy.encode_prefix(observation, use_cuda_graph=graph)
        else:  # 0.5.17: no prefix graph
            prefix_context = policy.encode_prefix(observation)
        record(1)
        actions = policy.sample_actions(
            observation,
            prefix_context,
            noise=noise,
            num_steps=num_steps,
            use_cuda_graph=graph,
        )
        record(2)
        return actions


def pi05_state(policy):
    """The pi05_graphs state of `policy` (PolicyState: its options and graph plan), from the __init__ the patch
    installed on its class (the plugin's or the patched tree's); None when sglang-ext is not active."""
    graphs = getattr(type(policy).__init__, "graphs", None)
    return None if graphs is None else graphs.state(policy)


@contextlib.contextmanager
def pi05_knobs(policy, **values):
    """The sglang-ext options a policy read when it was built (Pi05Options: knobs pi05_fast, pi05_fused_denoise,
    ...; the fast path's fused_vision and pdl) set to `values` for the block, as a policy built with them would
    have them; restored after."""
    state = pi05_state(policy)
    saved = state.options
    state.options = dataclasses.replace(saved, **values)
    try:
        yield policy
    finally:
        state.options = saved


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.float().abs().max())
    return max_abs_diff(a, b) / max(scale, 1e-6)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of the two tensors flattened, in float64 (1.0 for two zero tensors)."""
    x, y = a.double().reshape(-1), b.double().reshape(-1)
    norms = float(x.norm() * y.norm())
    if norms == 0.0:
        return 1.0 if float(x.norm()) == float(y.norm()) else 0.0
    return max(-1.0, min(1.0, float(x @ y) / norms))


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) and not math.isnan(float(t.float().abs().max()))


def unrelated_patches() -> list:
    """Patches outside Pi0.5 (ViT, prefill CP, worker activation): left off in Pi0.5
    GPU runs, so a problem there cannot abort them and their modules are not imported."""
    from sglang_ext.registry import PATCHES

    return [spec.name for spec in PATCHES if not spec.name.startswith("pi05")]


def activate_sglang_ext(knob_values: Optional[Dict[str, Any]] = None, *, strict: bool = True):
    """Switch sglang-ext on in this process (strict) with the given knobs; returns statuses.

    On an unpacked sglang source tree (no installed distribution) the tree's
    version is assumed, as `--ext-assume-sglang` would.
    """
    import os

    from sglang_ext import activation
    from sglang_ext.versions import installed_sglang_version, source_tree_version

    os.environ["SGLANG_EXT"] = "1"
    os.environ["SGLANG_EXT_STRICT"] = "1" if strict else "0"
    os.environ.setdefault("SGLANG_EXT_DISABLE", ",".join(unrelated_patches()))
    # Module-level runs (bench_pi05, the GPU tests) set their own prompt buckets and capacities and measure
    # graphs captured on first use; the server's load-time capture is measured through the server.
    os.environ.setdefault("SGLANG_EXT_PI05_GRAPH_CAPTURE", "lazy")
    for name, value in (knob_values or {}).items():
        os.environ["SGLANG_EXT_" + name.upper()] = str(value)
    if installed_sglang_version() is None and "SGLANG_EXT_ASSUME_SGLANG" not in os.environ:
        import sglang

        version = source_tree_version(os.path.dirname(os.path.dirname(sglang.__file__)))
        if version:
            os.environ["SGLANG_EXT_ASSUME_SGLANG"] = version
    activation.deactivate()
    return activation.activate(eager=True)
