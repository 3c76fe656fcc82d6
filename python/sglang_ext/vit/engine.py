"""The ViT graph engine, one per runner: keys a call (its strategy), admits, captures, replays or runs eager.
Every decision that leads to a collective or to a graph being used is voted on by the tower's TP group first.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, fields

import torch

from sglang_ext.graphs import stats as ext_graph_stats
from sglang_ext.graphs.agreement import OK, PERMANENT, agreed, agreed_capture, cpu_group_min, failure_vote
from sglang_ext.graphs.cache import BoundedGraphCache
from sglang_ext.graphs.packing import median_wall_ms, whole_sequence_chunks
from sglang_ext.vit import strategy, tp
from sglang_ext.vit.capture import GraphStore, fill_rows
from sglang_ext.vit.strategy import BUCKET_SEQUENCES, BudgetLadder, layout_key, token_buckets
from sglang_ext.vit.vision_rotary import compiled_rotary

logger = logging.getLogger("sglang_ext.vit_cuda_graph")

FALLBACK_REASONS = ("capacity", "warming", "quarantined", "disabled", "no_cpu_layout", "capture_failed", "no_fit",
                    "gate", "replay_failed")
# Default byte budget (knob -1): this fraction of the free device memory, clamped to [floor, cap].
AUTO_BUDGET = dict(fraction=0.25, floor=256 << 20, cap=4 << 30)
PROBE_REPEATS = 5  # runs per side of the load-time probe (median)
SAMPLE_GRID = (1, 16, 16)  # the synthetic image that takes the tower's own graph path at load


@dataclass(frozen=True)
class GraphOptions:
    """The knobs a ViT graph runner reads (docs/settings.md), taken from the activation's settings."""

    mode: str
    max_entries: int
    max_bytes: int
    policy: str
    min_hits: int
    token_buckets: tuple
    replay_max_tokens: int
    above_ladder: str

    @classmethod
    def from_settings(cls, settings):
        return cls(**{f.name: settings.values[f"vit_graph_{f.name}"] for f in fields(cls)})


def on_device(value):
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def map_tensors(fn, value):
    """`fn` of a tensor, or of each one in a (nested) tuple; None stays None."""
    if isinstance(value, tuple):
        return tuple(map_tensors(fn, v) for v in value)
    return None if value is None else fn(value)


class ViTGraphEngine:
    """The graphs of one vision tower: caches, workspaces, counters and metrics."""

    def __init__(self, vit, attention_backend, options: GraphOptions):
        self.vit = vit
        # Merger rows: `spatial_merge_unit` input tokens make one output row (1 for towers without merging).
        self.merge_unit = int(getattr(vit, "spatial_merge_unit", 1) or 1)
        self.strategy = strategy.resolve(options, attention_backend, self.merge_unit, strategy.window_tokens(vit))
        self.ladder = self.strategy if isinstance(self.strategy, BudgetLadder) else None
        self.store = GraphStore(vit, attention_backend)
        self.cache = BoundedGraphCache("vit_cuda_graph", options.max_entries, policy=options.policy,
                                       max_bytes=max(options.max_bytes, 0), min_hits=options.min_hits,
                                       release=self.store.release)
        self.budget_agreed = options.max_bytes >= 0  # -1: agreed at first use (the free memory then)
        self.fallbacks = dict.fromkeys(FALLBACK_REASONS, 0)
        self.counts = dict(padded_batches=0, padding_tokens=0, real_tokens=0, precapture_graphs=0, precapture_ms=0,
                           precapture_reserved_bytes=0, chunked_calls=0, chunks=0)
        self._sampling = None  # while capture_at_load runs the tower: the calls that reached run()
        self.stats_name = ext_graph_stats.register(f"vit_cuda_graph:{type(vit).__name__}@{id(self):x}", self.info)

    @functools.cached_property
    def group(self):
        """The tower's TP group when its ranks must agree, else None (resolved at first use)."""
        return tp.agreeing_group(self.vit)

    def vote(self, value):
        """`value` agreed by the tower's group: a MIN vote over its CPU group (gloo); alone, the value itself."""
        return value if self.group is None else cpu_group_min(self.group.cpu_group, value)

    def agree_budget(self):
        """Knob vit_graph_max_bytes -1: sized from free memory at first use, MIN over TP ranks (same evictions)."""
        if self.budget_agreed:
            return
        self.budget_agreed, free, auto = True, None, 0  # no device: no limit
        device = getattr(self.vit, "device", None)
        if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
            free = int(torch.cuda.mem_get_info(device)[0])
            auto = int(min(AUTO_BUDGET["cap"], max(AUTO_BUDGET["floor"], free * AUTO_BUDGET["fraction"])))
        self.cache.max_bytes = auto if self.group is None else cpu_group_min(self.group.cpu_group, auto, bits=64)
        logger.info("ViT CUDA graph byte budget: %d MiB (%s)", self.cache.max_bytes >> 20,
                    "no device: no limit" if free is None else f"{free >> 20} MiB free at first use")

    def run(self, x, cu_seqlens, cu_window_seqlens, position_embeddings, rotary_pos_emb_cos=None,
            rotary_pos_emb_sin=None, output_indices=None, attention_layout_key=None):
        """One tower call (upstream's `run` arguments): replayed where a graph serves it, else eager."""
        self.agree_budget()
        x_3d = x.unsqueeze(1)  # [S, 1, H]
        rotary = (position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
        cpu_layout = attention_layout_key is not None or not (on_device(cu_seqlens) or on_device(cu_window_seqlens))
        layout = layout_key(x_3d.shape[0], cu_seqlens, cu_window_seqlens, attention_layout_key) if cpu_layout else None
        if layout is None:
            if not self.fallbacks["no_cpu_layout"]:  # once per runner: it is the caller's choice, not a fault
                logger.warning("ViT CUDA graphs: cu_seqlens on %s without attention_layout_key; this runner runs "
                               "such batches eager (building a key would sync the device). Pass attention_layout_key"
                               "=(full cu_seqlens ints, window cu_seqlens ints or None) to use graphs",
                               getattr(cu_seqlens, "device", "a device"))
            self.fallbacks["no_cpu_layout"] += 1
            tokens = x_3d.shape[0]  # an upper bound of max_seqlen: exact for the triton kernel, no sync
            out = self.store.run_eager(x_3d, cu_seqlens, cu_window_seqlens, rotary, output_indices, tokens, tokens)
        elif self._sampling is not None:  # capture_at_load's sample (bucket mode): kept, not run
            self._sampling.append((x_3d, rotary))
            return None
        elif self.ladder is not None:
            if not self.ladder.decided:
                self._capture_ladder(x_3d, rotary)
            out = self._run_budget(layout, x_3d, rotary, output_indices)
        else:
            out = self._run_keyed(layout, x_3d, cu_seqlens, cu_window_seqlens, rotary, output_indices)
        ext_graph_stats.publish()
        return out

    def _run_keyed(self, layout, x_3d, cu_seqlens, cu_window_seqlens, rotary, output_indices):
        """Layout and class modes: replay the call's graph, captured on first use where admitted."""
        key = self.strategy.key(layout)
        reason = None
        if self.cache.get(key) is None:
            admission = self.cache.admit(key, expected_bytes=self.store.expected_bytes(x_3d))
            if not admission.capture:
                reason = admission.name.lower().replace("eager_", "")
            else:
                try:
                    self.capture(key, layout, x_3d, rotary)
                    reason = None if key in self.cache else "capacity"  # the exact policy's budget had no room
                except Exception as exc:  # noqa: BLE001 - the batch still gets a correct result
                    retry = self.cache.retry_in(key)  # quarantined on every rank (transient: retried)
                    logger.warning("ViT CUDA graph capture failed for %d tokens; running eager %s: %s: %s",
                                   layout.num_tokens, "from now on for this layout" if retry is None else
                                   f"for this layout's next {retry} misses, then retrying", type(exc).__name__, exc)
                    reason = "capture_failed"
        out = None if reason else self.replay(key, x_3d, rotary, output_indices=output_indices,
                                              layout=None if self.strategy.name == "layout" else layout)
        if out is None:
            self.fallbacks[reason or "replay_failed"] += 1
            out = self.store.run_eager(x_3d, cu_seqlens, cu_window_seqlens, rotary, output_indices,
                                       layout.full_bound, layout.window_bound)
        return out

    def capture(self, key, layout, x_3d, rotary):
        """Capture `key`'s graph, agreed by all TP ranks: a failure on any rank quarantines it on all and raises."""
        prepared = {}

        def prepare():
            prepared.update(self.store.prepare(key, layout, x_3d, rotary, shared=self.ladder is not None,
                                               warm_up=functools.partial(tp.warm_up_context, self.group)))

        outcome = agreed_capture(self.vote, prepare, lambda: self.store.capture(key, prepared),
                                 lambda: self.store.drop(key))
        if not outcome.ok:
            self.cache.fail(key, outcome.error, transient=outcome.transient)
            raise outcome.error
        # False (exact policy, over budget): the cache has already released the graph.
        self.cache.put(key, self.store.graphs[key], nbytes=self.store.graphs[key].nbytes)

    def replay(self, key, x_3d, rotary, *, output_indices=None, rows=None, layout=None, out=None, agree=True):
        """The graph's first `rows` output rows (or `output_indices`' rows) in `out` or a new tensor. Staging is
        voted on first: None when it failed on a rank, so collectives run on all ranks or none (agree=False: probe)."""
        graph = self.store.graphs[key]

        def stage():
            if layout is not None:
                self.store.write_layout(graph, layout.full, layout.window)
            self.store.fill_rotary(graph, *rotary)
            fill_rows(graph.input, x_3d)
            if out is not None:
                return out
            # Owned result: the static output is rewritten by the next replay (of any graph sharing the pool).
            shape = graph.output.shape
            count = output_indices.shape[0] if output_indices is not None else shape[0] if rows is None else rows
            return graph.output.new_empty((count,) + tuple(shape[1:]))

        if agree:
            staged = agreed(self.vote, stage, "replay")
            if not staged.ok:
                logger.warning("ViT CUDA graph replay for %d tokens failed on %s; running eager: %s: %s",
                               key.num_tokens, staged.where, type(staged.error).__name__, staged.error)
                return None
            result = staged.value
        else:
            result = stage()
        graph.graph.replay()
        if output_indices is not None:
            return torch.index_select(graph.output, 0, output_indices, out=result)
        return result.copy_(graph.output[:result.shape[0]])

    def eager_call(self, layout, x_3d, rotary, output_indices=None):
        """The sync-free eager run of one call given by its CPU layout, rotary on graphs-off's compiled kernel."""
        full, window = (None if bounds is None else torch.tensor(bounds, dtype=torch.int32).to(
            x_3d.device, non_blocking=True) for bounds in (layout.full, layout.window))
        with compiled_rotary():
            return self.store.run_eager(x_3d, full, window, rotary, output_indices, layout.full_bound,
                                        layout.window_bound)

    def _replay_budget(self, layout, x_3d, rotary, counted=True, output_indices=None, out=None):
        """(merger rows, None) from the call's budget graph, else (None, the fallback reason).
        counted=False: the probe, no counters and no vote (its graphs hold local stand-ins for collectives)."""
        tokens, limit = layout.num_tokens, self.ladder.replay_limit
        plan = self.ladder.plan(layout)
        if plan is None:  # gate: no ladder, or a call above it
            return None, "gate" if tokens > limit or not limit else "no_fit"
        key, padded = plan
        if (self.cache.get(key) if counted else self.cache.entries.get(key)) is None:
            return None, "no_fit"
        if counted:
            self.counts["real_tokens"] += tokens
            self.counts["padded_batches"] += key.num_tokens > tokens
            self.counts["padding_tokens"] += key.num_tokens - tokens
        rows = self.replay(key, x_3d, rotary, output_indices=output_indices, rows=tokens // self.merge_unit,
                           layout=padded, out=out, agree=counted)
        return rows, None if rows is not None else "replay_failed"

    def _run_budget(self, layout, x_3d, rotary, output_indices):
        """Replay the call, or its whole-image chunks, where a captured budget serves them; else eager."""
        tokens, limit, unit = layout.num_tokens, self.ladder.replay_limit, self.merge_unit
        ranges = [(0, tokens)]  # above the probe's break-even (split_above_limit False): one eager call
        if limit and tokens > limit and self.ladder.split_above_limit:
            ranges = whole_sequence_chunks((layout.full, layout.window), tokens, limit, BUCKET_SEQUENCES - 1)
            self.counts["chunked_calls"] += 1
            self.counts["chunks"] += len(ranges)

        def call_of(start, end):
            if (start, end) == (0, tokens):
                return layout, x_3d, rotary
            return layout.between(start, end), x_3d[start:end], map_tensors(lambda t: t[start:end], rotary)

        if len(ranges) == 1:  # one call: its replay writes the output, reordered
            out, reason = self._replay_budget(layout, x_3d, rotary, output_indices=output_indices)
            if out is None:
                self.fallbacks[reason] += 1
                out = self.eager_call(layout, x_3d, rotary, output_indices)
            return out
        # One output allocated first on every rank (or none: eager): nothing allocates after a replay's collectives.
        template = next((g.output for g in self.store.graphs.values() if g.output is not None), None)
        outputs = None if template is None else agreed(self.vote, lambda: (
            template.new_empty((tokens // unit,) + tuple(template.shape[1:])),
            None if output_indices is None else template.new_empty((len(output_indices),) + tuple(template.shape[1:]))),
            "output")
        if outputs is None or not outputs.ok:
            if outputs is not None:
                logger.warning("ViT CUDA graphs: a chunked call runs eager (its output could not be allocated on "
                               "%s): %s", outputs.where, outputs.error)
            self.fallbacks["replay_failed"] += 1
            return self.eager_call(layout, x_3d, rotary, output_indices)
        rows, reordered = outputs.value
        # Adjacent chunks no graph serves run as ONE eager call (eager host time hardly depends on size).
        eager_from = None
        for start, end in ranges:
            out, reason = self._replay_budget(*call_of(start, end), out=rows[start // unit:end // unit])
            if out is None:
                self.fallbacks[reason] += 1
                eager_from = start if eager_from is None else eager_from
                continue
            if eager_from is not None:
                rows[eager_from // unit:start // unit].copy_(self.eager_call(*call_of(eager_from, start)))
                eager_from = None
        if eager_from is not None:
            rows[eager_from // unit:].copy_(self.eager_call(*call_of(eager_from, tokens)))
        return rows if reordered is None else torch.index_select(rows, 0, output_indices, out=reordered)

    def capture_at_load(self, vit, server_tokens):
        """At server start: decide and capture the ladder up to `server_tokens` from a synthetic image's call."""
        ladder = self.ladder
        if ladder is None or ladder.decided:
            return
        self.agree_budget()
        ladder.budgets = token_buckets(ladder.configured, self.merge_unit, server_tokens)
        error, self._sampling = None, []
        try:
            pixels = torch.zeros(math.prod(SAMPLE_GRID), vit.patch_embed.proj.weight[0].numel(), dtype=vit.dtype,
                                 device=vit.device)
            with torch.no_grad():
                vit.forward_with_cuda_graph(pixels, torch.tensor([SAMPLE_GRID], dtype=torch.int64))
            if not self._sampling:
                raise RuntimeError("the tower's graph path did not reach the runner")
        except Exception as exc:  # noqa: BLE001 - voted on below
            error = exc
        finally:
            sample, self._sampling = self._sampling, None
        if self.vote(failure_vote(error)) != OK:
            ladder.decide((), ())
            logger.warning("ViT CUDA graphs stay off: the load-time sample failed on %s: %s",
                           "this rank" if error else "another rank", error)
            return
        self._capture_ladder(*sample[0])

    @torch.no_grad()
    def _capture_ladder(self, x_3d, rotary):
        """Decide the replay ladder and capture it (at load, else at the first call); nothing is captured later."""
        ladder, cache = self.ladder, self.cache
        ladder.decided = True
        started = time.perf_counter()
        reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        sample = (x_3d[:1], rotary)
        limit = ladder.replay_max_tokens
        probed = [b for b in ladder.budgets if b <= limit] if limit >= 0 else self._probe(sample)
        kept = probed[:cache.capacity]
        while kept and cache.max_bytes > 0 and self.store.expected_bytes(x_3d, rows=kept[-1]) > cache.max_bytes:
            kept.pop()
        captured = []
        for budget in reversed(kept):
            try:
                captured.append(self.capture_budget(sample, budget))
            except Exception as exc:  # noqa: BLE001 - agreed on every rank: all stay eager
                logger.warning("ViT CUDA graph pre-capture of the %d-token budget failed, so ViT graphs stay off: "
                               "%s: %s", budget, type(exc).__name__, exc)
                for key in captured:
                    cache.discard(key)
                captured = []
                break
        ladder.decide([key.num_tokens for key in captured], probed)
        info = self.counts
        info.update(precapture_graphs=len(captured), precapture_ms=int((time.perf_counter() - started) * 1e3))
        if torch.cuda.is_available():
            info["precapture_reserved_bytes"] = int(torch.cuda.memory_reserved() - reserved)
        logger.info("ViT CUDA graphs: captured %d budgets (%s tokens) in %d ms, %d MiB reserved; calls up to %d "
                    "tokens replay; probe: %s", len(captured), ",".join(map(str, ladder.budgets)),
                    info["precapture_ms"], info["precapture_reserved_bytes"] >> 20, ladder.replay_limit,
                    ladder.gate or "skipped (--ext-vit-graph-replay-max-tokens)")

    def _synthetic_call(self, sample, tokens):
        """A call of `tokens` zero rows shaped like `sample`: one image, window-sized windows."""
        zeros = map_tensors(lambda t: t.new_zeros((tokens,) + tuple(t.shape[1:])), sample)
        return (self.ladder.synthetic(tokens, bool(self.store.full_blocks)),) + zeros

    def capture_budget(self, sample, budget):
        """Capture the graph of one budget (agreed by every TP rank, its inputs too: raises on all or none)."""
        inputs = agreed(self.vote, lambda: self._synthetic_call(sample, budget), "inputs")
        if not inputs.ok:
            raise inputs.error
        layout, x_3d, rotary = inputs.value
        key = self.ladder.key(layout)
        self.capture(key, layout, x_3d, rotary)
        return key

    def _probe(self, sample):
        """Budgets whose graph beats eager on the smallest call each serves (all ranks agree), to the first loss."""
        sync = torch.cuda.synchronize if getattr(self.vit.device, "type", None) == "cuda" else None
        kept = []
        for budget in self.ladder.budgets:
            try:
                with tp.warm_up_context(self.group):
                    key = self.capture_budget(sample, budget)
            except Exception:  # noqa: BLE001 - agreed on every rank; the capture logged nothing, so say it here
                logger.warning("ViT CUDA graph probe: capture of the %d-token budget failed; the ladder ends below it",
                               budget, exc_info=True)
                break
            tokens = (kept[-1] if kept else 0) + self.merge_unit  # the smallest call this budget serves
            try:  # rank-local (graphs captured with local stand-ins for the collectives), voted below
                call = self._synthetic_call(sample, tokens)
                with tp.warm_up_context(self.group):
                    graph_ms = median_wall_ms(lambda: self._replay_budget(*call, counted=False),
                                              repeats=PROBE_REPEATS, synchronize=sync)
                    eager_ms = median_wall_ms(lambda: self.eager_call(*call), repeats=PROBE_REPEATS, synchronize=sync)
            except Exception as exc:  # noqa: BLE001 - voted on below
                logger.warning("ViT CUDA graph probe of the %d-token budget failed: %s: %s", budget,
                               type(exc).__name__, exc)
                graph_ms, eager_ms = math.inf, 0.0
            self.cache.discard(key)
            wins = self.vote(OK if graph_ms < eager_ms else PERMANENT) == OK
            self.ladder.gate.append({"budget": budget, "tokens": tokens, "graph_ms": round(graph_ms, 3),
                                     "eager_ms": round(eager_ms, 3), "replay": wins})
            if not wins:
                break
            kept.append(budget)
        return kept

    def info(self):
        """Counters for `sglang-ext doctor` and the metrics."""
        info = self.cache.info().as_dict()
        shared_bytes = sum(p.bytes_allocated for p in self.store.shared_pools.values())
        info["bytes_resident"] += shared_bytes
        rotary_pools = self.store.rotary_pools.values()
        info.update(mode=self.strategy.name, attention_backend=self.store.backend, **self.counts,
                    resident_graphs=len(self.cache), fallbacks=sum(self.fallbacks.values()),
                    **{f"fallback_{reason}": count for reason, count in self.fallbacks.items()},
                    rotary_backing_buffers=sum(p.backing_buffers for p in rotary_pools),
                    rotary_bytes=sum(p.bytes_allocated for p in rotary_pools), shared_buffer_bytes=shared_bytes,
                    replay_limit_tokens=self.ladder.replay_limit if self.ladder else 0,
                    budgets=len(self.ladder.budgets) if self.ladder else 0)
        return info
