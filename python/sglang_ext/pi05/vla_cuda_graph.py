"""Pi0.5 prefix and action-denoise graph runners behind sglang 0.5.19's `vla.cuda_graph` names.

Patch: pi05_graphs
Targets: sglang.multimodal_gen.runtime.vla.cuda_graph:VLADenoiseGraphRunner,
sglang.multimodal_gen.runtime.vla.cuda_graph:VLADenoiseGraphSignature,
sglang.multimodal_gen.runtime.vla.cuda_graph:_CapturedDenoiseGraph,
sglang.multimodal_gen.runtime.vla.cuda_graph:_copy_prefix_context_,
sglang.multimodal_gen.runtime.vla.cuda_graph:_clone_prefix_context
Upstream PR: sgl-project/sglang Pi0.5 bounded CUDA graph cache PR (0.5.19, supersedes #34588)
Retire when: upstream keys the action-graph K/V refresh on something id()-free and the minimum supported sglang has
vla/cuda_graph.py (>= 0.5.19)

Why: 0.5.17 keeps one action graph per signature without bound, never graphs the prefix, and
refreshes a graph's prefix K/V by id(), which CPython hands to the next request's K/V.
How: our runners on sglang_ext.graphs, K/V refresh keyed by context generation, no host sync after a
prefix replay. Releases: 0.5.23 (upstream's runners, same API); 0.5.17 (installed under both module names).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger
from sglang.multimodal_gen.runtime.vla.prefix_cache import PrefixContext
from sglang.srt.distributed.device_communicators.pynccl_allocator import set_graph_pool_id
from sglang.srt.model_executor.runner_utils.pool import get_or_create_global_graph_memory_pool
from sglang_ext import knobs
from sglang_ext.graphs import stats as graph_stats
from sglang_ext.graphs.cache import Admission, BoundedGraphCache, CacheInfo
from sglang_ext.graphs.capture import capture_stream, guarded_capture, pin_graph_pool
from sglang_ext.patching import install_module

try:  # upstream's helpers (the same in 0.5.17 and 0.5.23) under each release's module name
    from sglang.multimodal_gen.runtime.vla import cuda_graph as _upstream
except ImportError:  # 0.5.17
    from sglang.multimodal_gen.runtime.vla import denoise_cuda_graph as _upstream
_CapturedStepGraph, _clone_prefix_context = _upstream._CapturedDenoiseGraph, _upstream._clone_prefix_context
_copy_prefix_context_ = _upstream._copy_prefix_context_

logger = init_logger(__name__)


@dataclass(frozen=True)
class VLAPrefixGraphSignature:
    """Input shapes and dtypes plus the control flow they cannot show (cameras, hint, prompt bucket, fused layers)."""

    batch_size: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    static_layout: tuple[Any, ...]
    parallel_layout: str


@dataclass(frozen=True)
class VLADenoiseGraphSignature:
    """One denoise step's graph: 0.5.17's key plus whether the prefix is masked (0.5.19)."""

    batch_size: int
    prefix_len: int
    prefix_full_attention: bool
    action_horizon: int
    action_dim: int
    dtype: str
    parallel_layout: str


@dataclass(frozen=True)
class VLADenoiseLoopGraphSignature:
    """Every denoise step of a request in one graph (sglang-ext; knobs pi05_fused_denoise, pi05_fast)."""

    step: VLADenoiseGraphSignature
    num_steps: int
    kernels: str = "exact"  # "fast": the fused-kernel loop of knob pi05_fast


@dataclass
class _CapturedPrefixGraph:
    graph: Any
    static_inputs: tuple[torch.Tensor, ...]
    static_output: PrefixContext  # rewritten in place by every replay


@dataclass
class _CapturedDenoiseGraph(_CapturedStepGraph):
    """0.5.17's captured step, plus the generation of the context whose K/V the graph holds."""

    current_context_generation: int | None = None


@dataclass(frozen=True)
class VLAGraphCacheInfo(CacheInfo):
    """The core's cache counters under upstream's names (`max_entries`, `evict_on_miss`)."""

    evict_on_miss: bool = False

    @property
    def max_entries(self) -> int:
        return self.capacity


_GENERATIONS = itertools.count(1)
_GENERATION_OF = WeakIdKeyDictionary()  # PrefixContext -> its number, held weakly by identity (nothing set on it)


def prefix_context_generation(prefix_context: Any) -> int:
    """A number naming this PrefixContext while it lives (given on first use); unlike id(), never reused."""
    generation = _GENERATION_OF.get(prefix_context)
    if generation is None:
        generation = _GENERATION_OF[prefix_context] = next(_GENERATIONS)
    return generation


def own_prefix_context(prefix_context: PrefixContext) -> PrefixContext:
    """An owned copy of a prefix-graph output (which the next replay overwrites)."""
    if not prefix_context.layout.get("mutable_graph_output", False):
        return prefix_context
    owned = _clone_prefix_context(prefix_context)
    owned.layout.pop("mutable_graph_output", None)
    prefix_context_generation(owned)
    return owned


class _BoundedCaptureCache(BoundedGraphCache):
    """Upstream's graph cache interface on the shared core."""

    def __init__(self, name: str, max_entries: int, *, evict_on_miss: bool, min_hits: int = 1, max_bytes: int = 0):
        self.evict_on_miss = bool(evict_on_miss)
        super().__init__(f"vla.{name}", max(0, int(max_entries)), policy="lru" if evict_on_miss else "exact",
                         min_hits=min_hits, max_bytes=max_bytes)

    @property
    def entries(self):
        """The live LRU dict (upstream's tests seed resident entries by assigning into it)."""
        return self._entries

    def prepare_admission(self, signature: Any) -> Admission:
        return self.admit(signature)

    def mark_failure(self, signature: Any = None) -> None:
        """Count a failure; with a signature, quarantine it too (eager from now on)."""
        if signature is None:
            self.failures += 1
        else:
            self.fail(signature)

    def info(self) -> VLAGraphCacheInfo:
        return VLAGraphCacheInfo(**dataclasses.asdict(super().info()), evict_on_miss=self.evict_on_miss)


def _resident_bytes(captured: Any) -> int:
    """Bytes of the static tensors a captured entry holds, each tensor counted once."""
    sizes = {}
    for value in vars(captured).values():
        if isinstance(value, PrefixContext):
            value = [value.prefix_pad_masks, *(t for keys, values, _ in value.past_key_values for t in (keys, values))]
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor):
                sizes[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(sizes.values())


class _VLAGraphRunnerBase:
    _cache_name = "graph"

    def __init__(self, enabled: bool = True, max_entries: int = 1, *, evict_on_miss: bool = False,
                 max_bytes: int = 0):
        self._cache = _BoundedCaptureCache(self._cache_name, max_entries, evict_on_miss=evict_on_miss,
                                           min_hits=int(knobs.current("pi05_graph_min_hits")),
                                           max_bytes=max_bytes)
        self.max_entries = self._cache.capacity
        self.enabled = bool(enabled) and self.max_entries > 0
        self._capture_stream = self._graph_pool = None
        self._capacity_warning_emitted = False
        self._clear_hooks: list[Callable[[], None]] = []
        graph_stats.register(f"vla.{self._cache_name}", self.cache_info)

    def cache_info(self) -> VLAGraphCacheInfo:
        return self._cache.info()

    def clear(self) -> None:
        """Release every graph (reset()) and forget failures; then run the clear hooks."""
        self._cache.clear()
        self._capacity_warning_emitted = False
        for hook in self._clear_hooks:
            hook()

    def seal(self) -> None:
        """Capture nothing from now on (graphs were captured at load): a miss runs eager, counted."""
        self._cache.seal()

    def add_clear_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs after every clear(): state kept beside the graphs goes with them."""
        self._clear_hooks.append(hook)

    @staticmethod
    def device_captures(device: Any) -> bool:
        kind = getattr(device, "type", None)  # a torch.device, or anything shaped like one
        return (torch.device(device).type if kind is None else kind) == "cuda"

    def _capture_graph(self, device: torch.device, run: Callable[[], Any]):
        """Warm `run` up on the capture stream, then capture it; returns (graph, output)."""
        device_module = torch.get_device_module(device)
        if self._capture_stream is None:
            self._capture_stream = capture_stream(device)
        if self._graph_pool is None:
            self._graph_pool = get_or_create_global_graph_memory_pool(device_module)
            set_graph_pool_id(self._graph_pool)
            pin_graph_pool(self._graph_pool, device)  # evicting every graph must not empty the pool
        device_module.synchronize()
        with device_module.stream(self._capture_stream), torch.inference_mode():
            run()
        self._capture_stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with guarded_capture(graph, pool=self._graph_pool, stream=self._capture_stream), torch.inference_mode():
            output = run()
        self._capture_stream.synchronize()
        return graph, output

    def _run(self, signature: Any, eager: Callable[[], Any], capture: Callable[[], Any],
             load: Callable[[Any], None], result: Callable[[Any], Any]) -> Any:
        """Replay `signature`'s graph (captured first when admitted), else `eager()` (also on a failure)."""
        captured = self._cache.get(signature)
        if captured is None and not self._admit(signature):
            return eager()
        try:
            if captured is None:
                captured = capture()
                self._cache.put(signature, captured, nbytes=_resident_bytes(captured))
                logger.info("Captured VLA %s CUDA graph for %s (capacity %d, %s)", self._cache_name, signature,
                            self.max_entries, self._cache.policy)
            load(captured)
            captured.graph.replay()
            return result(captured)
        except Exception:
            self._cache.mark_failure(signature)
            logger.warning("VLA %s CUDA graph disabled for signature %s", self._cache_name, signature, exc_info=True)
            return eager()

    def _admit(self, signature: Any) -> bool:
        """After a miss: may this signature be captured now? (LRU mode evicts here.)"""
        admission = self._cache.admit(signature)
        misses = self._cache.sealed_misses
        if admission is Admission.EAGER_SEALED and misses & (misses - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
            logger.info("VLA %s CUDA graphs were captured at load: %d requests ran eager since (no graph for %s)",
                        self._cache_name, misses, signature)
        if admission is Admission.EAGER_CAPACITY and not self._capacity_warning_emitted:
            logger.info("VLA %s CUDA graph capacity reached (%d); new signatures run eagerly",
                        self._cache_name, self.max_entries)
            self._capacity_warning_emitted = True
        return admission.capture


class VLAPrefixGraphRunner(_VLAGraphRunnerBase):
    """CUDA graphs of the prefix encoding (vision + language prefix K/V)."""

    _cache_name = "prefix"

    def capture_or_run(self, signature: VLAPrefixGraphSignature,
                       step_fn: Callable[[tuple[torch.Tensor, ...]], PrefixContext],
                       inputs: tuple[torch.Tensor, ...]) -> PrefixContext:
        """The prefix context; on the graph path the graph's own, rewritten by its next replay (own_prefix_context)."""
        if not self.enabled or not inputs or not self.device_captures(inputs[0].device):
            return step_fn(inputs)

        def capture() -> _CapturedPrefixGraph:
            static_inputs = tuple(tensor.detach().clone() for tensor in inputs)
            graph, output = self._capture_graph(inputs[0].device, lambda: step_fn(static_inputs))
            output.layout["mutable_graph_output"] = True
            return _CapturedPrefixGraph(graph, static_inputs, output)

        def load(captured: _CapturedPrefixGraph) -> None:
            for static_input, current_input in zip(captured.static_inputs, inputs, strict=True):
                static_input.copy_(current_input)

        return self._run(signature, lambda: step_fn(inputs), capture, load, lambda captured: captured.static_output)


class VLADenoiseGraphRunner(_VLAGraphRunnerBase):
    """CUDA graphs of the action denoise: one step per graph, or all steps (`capture_or_run_loop`)."""

    _cache_name = "action-denoise"

    def _sync_context_if_needed(self, captured: _CapturedDenoiseGraph, prefix_context: PrefixContext) -> None:
        """Copy the prefix K/V in unless its context or cache entry is there already (a graph output: always)."""
        generation = prefix_context_generation(prefix_context)
        digest = prefix_context.cache_key_digest
        if not prefix_context.layout.get("mutable_graph_output", False) and (
            captured.current_context_generation == generation
            or (digest is not None and captured.current_context_digest == digest)
        ):
            captured.current_context_generation = generation
            return
        _copy_prefix_context_(captured.static_prefix_context, prefix_context)
        captured.current_context_digest = digest
        captured.current_context_generation = generation

    def capture_or_run(self, signature: VLADenoiseGraphSignature, step_fn: Callable[..., torch.Tensor],
                       prefix_context: PrefixContext, x_t: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """Velocity of one denoise step (the graph's own tensor on the graph path)."""
        return self._denoise(signature, step_fn, prefix_context, x_t, timestep, loop=False)

    def capture_or_run_loop(self, signature: VLADenoiseLoopGraphSignature,
                            loop_fn: Callable[[PrefixContext, torch.Tensor, torch.Tensor], torch.Tensor],
                            prefix_context: PrefixContext, x_t: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Every denoise step of one request as one replay of `loop_fn` (updates x_t in place)."""
        return self._denoise(signature, loop_fn, prefix_context, x_t, timesteps, loop=True)

    def _denoise(self, signature: Any, run: Callable[..., torch.Tensor], prefix_context: PrefixContext,
                 x_t: torch.Tensor, steps: torch.Tensor, *, loop: bool) -> torch.Tensor:
        if not self.enabled or not self.device_captures(x_t.device):
            return run(prefix_context, x_t, steps)

        def capture() -> _CapturedDenoiseGraph:
            context, state, static_steps = _clone_prefix_context(prefix_context), x_t.detach().clone(), steps.clone()
            graph, output = self._capture_graph(x_t.device, lambda: run(context, state, static_steps))
            return _CapturedDenoiseGraph(
                graph=graph, static_prefix_context=context, static_x_t=state, static_timestep=static_steps,
                static_output=state if loop else output, current_context_digest=prefix_context.cache_key_digest,
                current_context_generation=prefix_context_generation(prefix_context))

        def load(captured: _CapturedDenoiseGraph) -> None:
            self._sync_context_if_needed(captured, prefix_context)
            captured.static_x_t.copy_(x_t)
            captured.static_timestep.copy_(steps)

        def result(captured: _CapturedDenoiseGraph) -> torch.Tensor:  # a loop's output is its state
            return x_t.copy_(captured.static_output) if loop else captured.static_output

        return self._run(signature, lambda: run(prefix_context, x_t, steps), capture, load, result)


def install(ctx, module) -> None:
    """This module as `vla.cuda_graph` (0.5.19's name) and as 0.5.17's `vla.denoise_cuda_graph`."""
    this = sys.modules[__name__]
    install_module(ctx, f"{module.__name__}.cuda_graph", this)
    install_module(ctx, f"{module.__name__}.denoise_cuda_graph", this)
