# SPDX-License-Identifier: Apache-2.0
"""CUDA graph runners for VLA (Pi0.5) prefix encoding and action denoising.

Installed as `sglang.multimodal_gen.runtime.vla.cuda_graph` on sglang 0.5.17 (the
module upstream added in 0.5.18/0.5.19); 0.5.17's `vla.denoise_cuda_graph` name
is aliased to this module, so 0.5.17 code that imports it gets these runners.

Upstream names and behaviour (0.5.19): `VLAPrefixGraphRunner`,
`VLADenoiseGraphRunner`, `VLADenoiseGraphSignature` (with
`prefix_full_attention`), `VLAGraphCacheInfo`, `_BoundedCaptureCache`; exact mode
by default (a full cache runs new signatures eager), bucket mode with
`evict_on_miss=True` (LRU entry released with `CUDAGraph.reset()` before the new
capture). Differences from upstream, each a fix:

- The graphs live in `sglang_ext.graphs.cache.BoundedGraphCache`: anti-thrash
  admission (`--ext-pi05-graph-min-hits`), a bounded quarantine for signatures
  whose capture failed (upstream keeps an unbounded set), counters reach
  `sglang_ext.graphs.stats` (`sglang-ext doctor`).
- The action graph refreshes its static prefix K/V by a per-context generation
  number, not by `id(past_key_values)`: CPython reuses the address of a freed
  request's K/V container for the next one, and upstream then replays with the
  previous request's K/V.
- No host synchronisation after a prefix replay (consumers run on the same stream).
- `VLADenoiseGraphRunner.capture_or_run_loop`: one graph for every denoise step
  including the `x_t` update (opt-in, `--ext-pi05-fused-denoise`; with
  `--ext-pi05-fast` the fused-kernel loop, signature `kernels="fast"`).
- `--ext-debug-addresses`: each runner's `AddressGuard` records the addresses of
  every static tensor a graph reads or writes at capture, asserts them before
  each replay, and forgets them when the graph is released.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger
from sglang.multimodal_gen.runtime.vla.prefix_cache import (
    PrefixContext,
    VLADensePrefixCache,
)
from sglang.srt.distributed.device_communicators.pynccl_allocator import (
    set_graph_pool_id,
)
from sglang.srt.model_executor.runner_utils.pool import (
    get_or_create_global_graph_memory_pool,
)
from sglang_ext import knobs
from sglang_ext.graphs import stats as graph_stats
from sglang_ext.graphs.cache import Admission, BoundedGraphCache
from sglang_ext.graphs.capture import capture_stream, guarded_capture, pin_graph_pool
from sglang_ext.graphs.workspace import AddressGuard, GraphInputMovedError

logger = init_logger(__name__)


# --------------------------------------------------------------------------
# Signatures and captured entries
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class VLAPrefixGraphSignature:
    batch_size: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    static_layout: tuple[Any, ...]
    parallel_layout: str


@dataclass
class _CapturedPrefixGraph:
    graph: torch.cuda.CUDAGraph
    static_inputs: tuple[torch.Tensor, ...]
    static_output: PrefixContext


@dataclass(frozen=True)
class VLADenoiseGraphSignature:
    batch_size: int
    prefix_len: int
    prefix_full_attention: bool
    action_horizon: int
    action_dim: int
    dtype: str
    parallel_layout: str


@dataclass(frozen=True)
class VLADenoiseLoopGraphSignature:
    """One graph for all denoise steps of a request (sglang-ext, opt-in)."""

    step: VLADenoiseGraphSignature
    num_steps: int
    kernels: str = "exact"  # "fast": the fused-kernel loop of knob pi05_fast


@dataclass
class _CapturedDenoiseGraph:
    graph: torch.cuda.CUDAGraph
    static_prefix_context: PrefixContext
    static_x_t: torch.Tensor
    static_timestep: torch.Tensor
    static_output: torch.Tensor
    current_context_id: int | None = None  # upstream's constructor takes it; nothing reads it
    current_context_digest: str | None = None
    current_context_generation: int | None = None


@dataclass(frozen=True)
class VLAGraphCacheInfo:
    size: int
    max_entries: int
    hits: int
    misses: int
    captures: int
    evictions: int
    failures: int
    evict_on_miss: bool
    rejections: int = 0
    bytes_resident: int = 0
    policy: str = "exact"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------
# Prefix context identity
# --------------------------------------------------------------------------

_PREFIX_CONTEXT_GENERATIONS = itertools.count(1)
_GENERATION_ATTR = "_vla_context_generation"


def prefix_context_generation(prefix_context: Any) -> int:
    """A number naming this PrefixContext object for the lifetime of the process.

    Stamped when the context is created (`Pi05PolicyModel.encode_prefix`) or, for
    contexts built elsewhere, the first time a runner sees it. Unlike `id()`,
    which CPython hands to the next object allocated at a freed address, a
    generation is never reused, so a new request's context always differs from
    the one whose K/V a graph holds.
    """
    generation = getattr(prefix_context, _GENERATION_ATTR, None)
    if generation is None:
        generation = next(_PREFIX_CONTEXT_GENERATIONS)
        object.__setattr__(prefix_context, _GENERATION_ATTR, generation)
    return generation


# --------------------------------------------------------------------------
# Bounded cache (upstream interface over sglang_ext.graphs.cache)
# --------------------------------------------------------------------------


def _release_captured(entry: Any) -> None:
    reset = getattr(getattr(entry, "graph", None), "reset", None)
    if callable(reset):
        reset()


class _BoundedCaptureCache:
    """Bounded cache owning CUDA graphs and their static buffers.

    Upstream's interface (`get`, `can_admit`, `prepare_admission`, `put`,
    `discard`, `clear`, `mark_failure`, `info`, `entries`) on the shared core.
    `evict_on_miss=False` is exact mode (the first `max_entries` signatures stay,
    later ones run eager); `True` is LRU with release before the next capture.
    With an `address_guard`, every release (evict, discard, failure, clear)
    also drops the recorded addresses of signatures no longer resident.
    """

    def __init__(
        self,
        name: str,
        max_entries: int,
        *,
        evict_on_miss: bool,
        min_hits: int = 1,
        address_guard: AddressGuard | None = None,
    ):
        self.name = name
        self.max_entries = max(0, int(max_entries))
        self.evict_on_miss = bool(evict_on_miss)
        self.address_guard = address_guard
        self._graphs: BoundedGraphCache = BoundedGraphCache(
            f"vla.{name}",
            self.max_entries,
            policy="lru" if self.evict_on_miss else "exact",
            min_hits=min_hits,
            release=self._release_and_forget,
        )

    @staticmethod
    def _release(entry: Any) -> None:
        _release_captured(entry)

    def _release_and_forget(self, entry: Any) -> None:
        # The core releases entries without their signature; the core has already
        # dropped the released one, so forget every recorded signature not resident.
        try:
            _release_captured(entry)
        finally:
            guard = self.address_guard
            if guard is not None and guard.enabled:
                for signature in guard.keys():
                    if signature not in self._graphs:
                        guard.forget(signature)

    @property
    def entries(self):
        # The live OrderedDict (LRU order), not the core's read-only view:
        # upstream's tests seed resident entries by assigning into it.
        return self._graphs._entries

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, signature: Any) -> bool:
        return signature in self._graphs

    def get(self, signature: Any) -> Any | None:
        return self._graphs.get(signature)

    def can_admit(self, signature: Any) -> bool:
        return self.max_entries > 0 and (
            signature in self._graphs
            or len(self._graphs) < self.max_entries
            or self.evict_on_miss
        )

    def admit(self, signature: Any) -> Admission:
        """Decide on a miss, before capturing; LRU mode frees the oldest graph now."""
        return self._graphs.admit(signature)

    def prepare_admission(self, signature: Any) -> Admission:
        return self.admit(signature)

    def put(self, signature: Any, entry: Any, *, nbytes: int = 0) -> bool:
        if not self.can_admit(signature):
            self._release(entry)
            return False
        return self._graphs.put(signature, entry, nbytes=nbytes)

    def put_captured(
        self, signature: Any, entry: Any, static_tensors: Callable[[Any], dict], *, nbytes: int = 0
    ) -> bool:
        """`put` a fresh capture; if it stays, record its static tensors' addresses
        (`static_tensors(entry)` is only called with --ext-debug-addresses)."""
        stored = self.put(signature, entry, nbytes=nbytes)
        guard = self.address_guard
        if stored and guard is not None and guard.enabled:
            guard.record(signature, static_tensors(entry))
        return stored

    def check_addresses(self, signature: Any, entry: Any, static_tensors: Callable[[Any], dict]) -> None:
        """Before a replay: raise GraphInputMovedError if a recorded static tensor moved."""
        guard = self.address_guard
        if guard is not None and guard.enabled and signature in guard:
            guard.check(signature, static_tensors(entry))

    def discard(self, signature: Any) -> None:
        self._graphs.discard(signature)

    def clear(self) -> None:
        self._graphs.clear()

    def mark_failure(self, signature: Any = None, exc: BaseException | None = None) -> None:
        """Count a failure; with a signature, also quarantine it (eager from now on)."""
        if signature is None:
            self._graphs.failures += 1
        else:
            self._graphs.fail(signature, exc)

    def info(self) -> VLAGraphCacheInfo:
        core = self._graphs.info()
        return VLAGraphCacheInfo(
            size=len(self._graphs),
            max_entries=self.max_entries,
            hits=core.hits,
            misses=core.misses,
            captures=core.captures,
            evictions=core.evictions,
            failures=core.failures,
            evict_on_miss=self.evict_on_miss,
            rejections=core.rejections,
            bytes_resident=core.bytes_resident,
            policy=core.policy,
        )


# --------------------------------------------------------------------------
# Static prefix context helpers
# --------------------------------------------------------------------------


def _clone_past_key_values(past_key_values: Any) -> Any:
    return VLADensePrefixCache(
        tuple(
            (keys.detach().clone(), values.detach().clone(), sliding_window)
            for keys, values, sliding_window in past_key_values
        )
    )


def _copy_past_key_values_(dst: Any, src: Any) -> None:
    for (dst_keys, dst_values, _), (src_keys, src_values, _) in zip(
        dst, src, strict=True
    ):
        dst_keys.copy_(src_keys)
        dst_values.copy_(src_values)


def _clone_prefix_context(prefix_context: PrefixContext) -> PrefixContext:
    return PrefixContext(
        past_key_values=_clone_past_key_values(prefix_context.past_key_values),
        prefix_pad_masks=prefix_context.prefix_pad_masks.detach().clone(),
        prefix_len=prefix_context.prefix_len,
        layout=dict(prefix_context.layout),
        cache_key_digest=prefix_context.cache_key_digest,
    )


def _copy_prefix_context_(dst: PrefixContext, src: PrefixContext) -> None:
    dst.prefix_pad_masks.copy_(src.prefix_pad_masks)
    _copy_past_key_values_(dst.past_key_values, src.past_key_values)
    dst.cache_key_digest = src.cache_key_digest


def own_prefix_context(prefix_context: PrefixContext) -> PrefixContext:
    """An owned copy of a prefix-graph output (which the next replay overwrites).

    Needed whenever another prefix encoding can run before this context's
    action denoise (grouped execution of several requests).
    """
    if not prefix_context.layout.get("mutable_graph_output", False):
        return prefix_context
    owned = _clone_prefix_context(prefix_context)
    owned.layout.pop("mutable_graph_output", None)
    prefix_context_generation(owned)
    return owned


def _tensor_bytes(tensors: Any) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors if isinstance(t, torch.Tensor))


def _prefix_context_bytes(prefix_context: PrefixContext) -> int:
    kv = [t for keys, values, _ in prefix_context.past_key_values for t in (keys, values)]
    return _tensor_bytes(kv) + _tensor_bytes([prefix_context.prefix_pad_masks])


# --------------------------------------------------------------------------
# Static tensors of a captured graph (--ext-debug-addresses)
# --------------------------------------------------------------------------


def _prefix_context_static_tensors(name: str, prefix_context: PrefixContext) -> dict[str, torch.Tensor]:
    tensors = {f"{name}.prefix_pad_masks": prefix_context.prefix_pad_masks}
    for layer, (keys, values, _) in enumerate(prefix_context.past_key_values):
        tensors[f"{name}.past_key_values[{layer}].keys"] = keys
        tensors[f"{name}.past_key_values[{layer}].values"] = values
    return tensors


def _prefix_graph_static_tensors(captured: _CapturedPrefixGraph) -> dict[str, torch.Tensor]:
    """Every tensor a prefix graph reads (inputs) or writes (output K/V and masks), by name."""
    tensors = {f"static_inputs[{i}]": t for i, t in enumerate(captured.static_inputs)}
    tensors.update(_prefix_context_static_tensors("static_output", captured.static_output))
    return tensors


def _denoise_graph_static_tensors(captured: _CapturedDenoiseGraph) -> dict[str, torch.Tensor]:
    """Every tensor a denoise graph reads (prefix K/V, masks, x_t, timestep) or writes, by name."""
    tensors = _prefix_context_static_tensors("static_prefix_context", captured.static_prefix_context)
    tensors["static_x_t"] = captured.static_x_t
    tensors["static_timestep"] = captured.static_timestep
    tensors["static_output"] = captured.static_output  # the fused loop's output is static_x_t itself
    return tensors


# --------------------------------------------------------------------------
# Runners
# --------------------------------------------------------------------------


class _VLAGraphRunnerBase:
    _cache_name = "graph"

    def __init__(self, enabled: bool = True, max_entries: int = 1, *, evict_on_miss: bool = False):
        # --ext-debug-addresses (read now, from the environment): assert before every
        # replay that no static tensor of the graph moved since its capture.
        self._address_guard = AddressGuard()
        self._cache = _BoundedCaptureCache(
            self._cache_name,
            max_entries,
            evict_on_miss=evict_on_miss,
            min_hits=int(knobs.current("pi05_graph_min_hits")),
            address_guard=self._address_guard,
        )
        self.max_entries = self._cache.max_entries
        self.enabled = bool(enabled) and self.max_entries > 0
        self._capture_stream: Any = None
        self._graph_pool: Any = None
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

    def add_clear_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs after every clear(): state kept beside the graphs goes with them."""
        self._clear_hooks.append(hook)

    @staticmethod
    def _graph_device(tensor: Any) -> bool:
        """Graphs are captured for CUDA tensors only; anything else runs eager."""
        return tensor.device.type == "cuda"

    def _capture_resources(self, device: torch.device):
        device_module = torch.get_device_module(device)
        if self._capture_stream is None:
            # One capture stream per device (shared with every sglang-ext runner): the
            # allocator reuses an evicted graph's pool blocks only on the stream that
            # allocated them.
            self._capture_stream = capture_stream(device)
        if self._graph_pool is None:
            self._graph_pool = get_or_create_global_graph_memory_pool(device_module)
            set_graph_pool_id(self._graph_pool)
            # Evicting every graph must not empty the pool while an output is still alive.
            pin_graph_pool(self._graph_pool, device)
        return device_module

    def _admit(self, signature: Any) -> bool:
        """After a miss: may this signature be captured now? (LRU mode evicts here.)"""
        admission = self._cache.admit(signature)
        if admission is Admission.EAGER_CAPACITY and not self._capacity_warning_emitted:
            logger.info(
                "VLA %s CUDA graph capacity reached (%d); new signatures run eagerly",
                self._cache_name,
                self.max_entries,
            )
            self._capacity_warning_emitted = True
        return admission.capture

    def _capture_graph(self, device: torch.device, run: Callable[[], Any]):
        """Warm up `run` on the capture stream, then capture it. Returns (graph, output)."""
        device_module = self._capture_resources(device)
        device_module.synchronize()
        with device_module.stream(self._capture_stream), torch.inference_mode():
            run()
        self._capture_stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # guarded_capture: no automatic GC inside the capture (a collected graph's reset()
        # would invalidate it), and a failed capture leaves the pool, the CUDA generator
        # and the stream usable, so the signature can fall back to eager cleanly.
        with guarded_capture(graph, pool=self._graph_pool, stream=self._capture_stream), torch.inference_mode():
            output = run()
        self._capture_stream.synchronize()
        return graph, output

    def _fail(self, signature: Any, what: str) -> None:
        self._cache.mark_failure(signature)
        logger.warning(
            "VLA %s CUDA graph disabled for signature %s", what, signature, exc_info=True
        )


class VLAPrefixGraphRunner(_VLAGraphRunnerBase):
    """CUDA graphs for VLA prefix encoding (vision + language prefix K/V)."""

    _cache_name = "prefix"

    def _capture(
        self,
        signature: VLAPrefixGraphSignature,
        step_fn: Callable[[tuple[torch.Tensor, ...]], PrefixContext],
        inputs: tuple[torch.Tensor, ...],
    ) -> _CapturedPrefixGraph:
        static_inputs = tuple(tensor.detach().clone() for tensor in inputs)
        graph, static_output = self._capture_graph(
            inputs[0].device, lambda: step_fn(static_inputs)
        )
        # The same object is returned for every replay: consumers must copy it
        # (the action graph does) or own it (own_prefix_context).
        static_output.layout["mutable_graph_output"] = True
        logger.info(
            "Captured VLA prefix CUDA graph: batch=%d inputs=%s (capacity=%d, %s)",
            signature.batch_size,
            signature.input_shapes,
            self.max_entries,
            "lru" if self._cache.evict_on_miss else "exact",
        )
        return _CapturedPrefixGraph(
            graph=graph, static_inputs=static_inputs, static_output=static_output
        )

    def capture_or_run(
        self,
        signature: VLAPrefixGraphSignature,
        step_fn: Callable[[tuple[torch.Tensor, ...]], PrefixContext],
        inputs: tuple[torch.Tensor, ...],
    ) -> PrefixContext:
        if (
            not self.enabled
            or not inputs
            or not self._graph_device(inputs[0])
        ):
            return step_fn(inputs)
        captured = self._cache.get(signature)
        if captured is None and not self._admit(signature):
            return step_fn(inputs)
        try:
            if captured is None:
                captured = self._capture(signature, step_fn, inputs)
                self._cache.put_captured(
                    signature,
                    captured,
                    _prefix_graph_static_tensors,
                    nbytes=_tensor_bytes(captured.static_inputs)
                    + _prefix_context_bytes(captured.static_output),
                )
            else:
                for static_input, current_input in zip(
                    captured.static_inputs, inputs, strict=True
                ):
                    static_input.copy_(current_input)
            self._cache.check_addresses(signature, captured, _prefix_graph_static_tensors)
            captured.graph.replay()
            return captured.static_output
        except GraphInputMovedError:
            raise  # a bug to report, not a capture failure to hide behind eager
        except Exception:
            self._fail(signature, "prefix")
            return step_fn(inputs)


class VLADenoiseGraphRunner(_VLAGraphRunnerBase):
    """CUDA graphs for VLA action denoising: one step per graph (upstream), or
    every step of a request in one graph (`capture_or_run_loop`)."""

    _cache_name = "action-denoise"

    def _sync_context_if_needed(
        self,
        captured: _CapturedDenoiseGraph,
        prefix_context: PrefixContext,
    ) -> None:
        """Copy the request's prefix K/V and masks into the graph's static context
        unless they are already there."""
        generation = prefix_context_generation(prefix_context)
        context_digest = prefix_context.cache_key_digest
        mutable_graph_output = bool(
            prefix_context.layout.get("mutable_graph_output", False)
        )
        if not mutable_graph_output:
            same_cache_entry = (
                context_digest is not None
                and captured.current_context_digest == context_digest
            )
            if same_cache_entry or captured.current_context_generation == generation:
                captured.current_context_generation = generation
                return
        _copy_prefix_context_(captured.static_prefix_context, prefix_context)
        captured.current_context_digest = context_digest
        captured.current_context_generation = generation

    def _new_static_state(
        self,
        prefix_context: PrefixContext,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
    ) -> tuple[PrefixContext, torch.Tensor, torch.Tensor]:
        return (
            _clone_prefix_context(prefix_context),
            x_t.detach().clone(),
            timestep.detach().clone(),
        )

    def _entry(
        self,
        graph: Any,
        static_context: PrefixContext,
        static_x_t: torch.Tensor,
        static_timestep: torch.Tensor,
        static_output: torch.Tensor,
        prefix_context: PrefixContext,
    ) -> _CapturedDenoiseGraph:
        return _CapturedDenoiseGraph(
            graph=graph,
            static_prefix_context=static_context,
            static_x_t=static_x_t,
            static_timestep=static_timestep,
            static_output=static_output,
            current_context_digest=prefix_context.cache_key_digest,
            current_context_generation=prefix_context_generation(prefix_context),
        )

    @staticmethod
    def _entry_bytes(captured: _CapturedDenoiseGraph) -> int:
        return _prefix_context_bytes(captured.static_prefix_context) + _tensor_bytes(
            (captured.static_x_t, captured.static_timestep, captured.static_output)
        )

    def _capture(
        self,
        signature: VLADenoiseGraphSignature,
        step_fn: Callable[..., torch.Tensor],
        prefix_context: PrefixContext,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
    ) -> _CapturedDenoiseGraph:
        static_context, static_x_t, static_timestep = self._new_static_state(
            prefix_context, x_t, timestep
        )
        graph, static_output = self._capture_graph(
            x_t.device, lambda: step_fn(static_context, static_x_t, static_timestep)
        )
        logger.info(
            "Captured VLA denoise CUDA graph: batch=%d prefix=%d (%s) action=%dx%d "
            "dtype=%s (capacity=%d, %s)",
            signature.batch_size,
            signature.prefix_len,
            "full" if signature.prefix_full_attention else "masked",
            signature.action_horizon,
            signature.action_dim,
            signature.dtype,
            self.max_entries,
            "lru" if self._cache.evict_on_miss else "exact",
        )
        return self._entry(
            graph, static_context, static_x_t, static_timestep, static_output, prefix_context
        )

    def capture_or_run(
        self,
        signature: VLADenoiseGraphSignature,
        step_fn: Callable[..., torch.Tensor],
        prefix_context: PrefixContext,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
    ) -> torch.Tensor:
        """Velocity for one denoise step (graph-owned output on the graph path)."""
        if not self.enabled or not self._graph_device(x_t):
            return step_fn(prefix_context, x_t, timestep)
        captured = self._cache.get(signature)
        if captured is None and not self._admit(signature):
            return step_fn(prefix_context, x_t, timestep)
        try:
            if captured is None:
                captured = self._capture(signature, step_fn, prefix_context, x_t, timestep)
                self._cache.put_captured(
                    signature, captured, _denoise_graph_static_tensors, nbytes=self._entry_bytes(captured)
                )
            else:
                self._sync_context_if_needed(captured, prefix_context)
                captured.static_x_t.copy_(x_t)
                captured.static_timestep.copy_(timestep)
            self._cache.check_addresses(signature, captured, _denoise_graph_static_tensors)
            captured.graph.replay()
            return captured.static_output
        except GraphInputMovedError:
            raise  # a bug to report, not a capture failure to hide behind eager
        except Exception:
            self._fail(signature, "denoise")
            return step_fn(prefix_context, x_t, timestep)

    def capture_or_run_loop(
        self,
        signature: VLADenoiseLoopGraphSignature,
        loop_fn: Callable[[PrefixContext, torch.Tensor, torch.Tensor], torch.Tensor],
        prefix_context: PrefixContext,
        x_t: torch.Tensor,
        timesteps: torch.Tensor,
    ) -> torch.Tensor:
        """Every denoise step of one request as one replay; returns x_t (updated in place).

        `loop_fn(context, x_t, timesteps)` runs all steps, updating `x_t` in place.
        The graph holds the same kernels as the eager loop, in the same order.
        """
        if not self.enabled or not self._graph_device(x_t):
            return loop_fn(prefix_context, x_t, timesteps)
        captured = self._cache.get(signature)
        if captured is None and not self._admit(signature):
            return loop_fn(prefix_context, x_t, timesteps)
        try:
            if captured is None:
                static_context, static_x_t, static_steps = self._new_static_state(
                    prefix_context, x_t, timesteps
                )
                # Warm-up advances the static state; the copies below set the
                # real inputs before the first replay.
                graph, _ = self._capture_graph(
                    x_t.device, lambda: loop_fn(static_context, static_x_t, static_steps)
                )
                captured = self._entry(
                    graph, static_context, static_x_t, static_steps, static_x_t, prefix_context
                )
                self._cache.put_captured(
                    signature, captured, _denoise_graph_static_tensors, nbytes=self._entry_bytes(captured)
                )
                logger.info(
                    "Captured VLA fused denoise CUDA graph: %d steps, prefix=%d (%s)",
                    signature.num_steps,
                    signature.step.prefix_len,
                    "full" if signature.step.prefix_full_attention else "masked",
                )
            else:
                self._sync_context_if_needed(captured, prefix_context)
            captured.static_x_t.copy_(x_t)
            captured.static_timestep.copy_(timesteps)
            self._cache.check_addresses(signature, captured, _denoise_graph_static_tensors)
            captured.graph.replay()
            x_t.copy_(captured.static_x_t)
            return x_t
        except GraphInputMovedError:
            raise  # a bug to report, not a capture failure to hide behind eager
        except Exception:
            self._fail(signature, "fused denoise")
            return loop_fn(prefix_context, x_t, timesteps)


__all__ = [
    "VLADenoiseGraphRunner",
    "VLADenoiseGraphSignature",
    "VLADenoiseLoopGraphSignature",
    "VLAGraphCacheInfo",
    "VLAPrefixGraphRunner",
    "VLAPrefixGraphSignature",
    "own_prefix_context",
    "prefix_context_generation",
]
