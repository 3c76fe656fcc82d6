"""ViT bucket mode: one graph per token budget, the ladder probed and captured at load, calls padded or chunked.

Methods of sglang's `ViTCudaGraphRunner`, installed by `sglang_ext.vit.runner.patch_runner`.
"""

import logging
import math
import time

import torch

from sglang_ext.graphs.agreement import OK, PERMANENT, agreed, failure_vote
from sglang_ext.graphs.buckets import geometric_buckets, select_bucket
from sglang_ext.graphs.keys import GraphKey
from sglang_ext.graphs.packing import median_wall_ms, sequences_between, whole_sequence_chunks
from sglang_ext.vit.capture import max_len
from sglang_ext.vit.vision_rotary import compiled_rotary

logger = logging.getLogger("sglang_ext.vit_cuda_graph")

# The default token ladder, in multiples of one Qwen2.5-VL attention window (scripts/sim_vit_keys.py
# chose it: least padding among 16-size ladders).
DEFAULT_BUCKETS = dict(smallest=512, ratio=1.26, multiple=64)
# The ladder's top when nothing says how large a call can be (no server limits known).
DEFAULT_LARGEST = 16384
# Full-attention sequence slots of every budget graph; a call with more is split into chunks.
BUCKET_SEQUENCES = 36
# Window slots per budget token, 1 / (this * merge unit): a window holds at least 4 merge units for
# images of the processors' minimum size (56 px), and padding windows are window-sized.
TOKENS_PER_WINDOW_UNIT = 4
PROBE_REPEATS = 5  # runs per side of the load-time probe (median)
# The synthetic image that takes the tower's own graph path at load.
SAMPLE_GRID = (1, 16, 16)


def token_buckets(configured, unit, largest=None):
    """The candidate ladder (`configured`, else the default up to `largest` tokens): sizes the merge unit divides."""
    buckets = configured or geometric_buckets(
        largest=max(largest or DEFAULT_LARGEST, DEFAULT_BUCKETS["smallest"]), **DEFAULT_BUCKETS)
    return tuple(b for b in buckets if b % unit == 0)


def window_tokens(vit):
    """Tokens in one full attention window of a windowed tower (Qwen2.5-VL: 112 px -> 64), else None."""
    try:
        side = int(vit.window_size) // int(vit.spatial_merge_size) // int(vit.patch_size)
        return side * side * int(vit.spatial_merge_unit)
    except (AttributeError, TypeError, ValueError):
        return None


def window_slots(budget, unit, tokens_per_window):
    """Window-sequence slots of a `budget`-token graph (see TOKENS_PER_WINDOW_UNIT)."""
    smallest = min(TOKENS_PER_WINDOW_UNIT * unit, tokens_per_window or unit)
    return budget // max(smallest, unit) + 2


def padded_layout(layout, real_tokens, bucket, chunk):
    """`layout` plus padding sequences covering [real_tokens, bucket), none longer than `chunk`."""
    if layout is None:
        return None
    cuts = list(layout)
    end = real_tokens
    while end < bucket:
        end = min(end + chunk, bucket)
        cuts.append(end)
    return tuple(cuts)


def zero_rows(tensor, rows):
    """Zeros shaped like `tensor` with `rows` rows (None stays None)."""
    return None if tensor is None else torch.zeros((rows,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                                                   device=tensor.device)


def _now_ms():
    return time.perf_counter() * 1e3


def device_layout(layout, device):
    """A CPU layout as an int32 tensor on `device`, copied without a sync (None stays None)."""
    return None if layout is None else torch.tensor(layout, dtype=torch.int32).to(device, non_blocking=True)


def _ext_budget_fits(self, padded_key, graph_key):
    """Whether a padded layout fits its budget graph's sequence slots and window bound."""
    _, full_slots, _, slots, window_bound = graph_key.variant
    full, window = padded_key.layout
    if full is None or len(full) - 1 > full_slots:
        return False
    return window is None or (len(window) - 1 <= slots and max_len(window) <= window_bound)


def _ext_synthetic_call(self, sample, tokens):
    """A call of `tokens` zero rows shaped like `sample`: one image, window-sized windows."""
    x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin = sample
    chunk = max(self._ext_window_tokens or 0, self._ext_merge_unit)
    window = padded_layout((0,), 0, tokens, chunk) if self._fullatt_block_indexes else None
    pos = None if position_embeddings is None else tuple(zero_rows(t, tokens) for t in position_embeddings)
    return (GraphKey(tokens, layout=((0, tokens), window)), zero_rows(x_3d, tokens), pos,
            zero_rows(rotary_pos_emb_cos, tokens), zero_rows(rotary_pos_emb_sin, tokens))


def _ext_capture_budget(self, sample, budget):
    """Capture the graph of one budget (agreed by every TP rank, its inputs too: raises on all of them or none)."""

    def synthetic_inputs():
        layout_key, x, pos, cos, sin = self._ext_synthetic_call(sample, budget)
        full, window = layout_key.layout
        return (x, torch.tensor(full, dtype=torch.int32), device_layout(window, "cpu"), pos, cos, sin), (full, window)

    inputs = agreed(self._ext_vote(), synthetic_inputs, "inputs")
    if not inputs.ok:
        raise inputs.error
    args, layout = inputs.value
    return self.create_graph(*args, attention_layout_key=layout)


def _on_cuda(runner) -> bool:
    return isinstance(runner.device, torch.device) and runner.device.type == "cuda"


def _ext_probe_ladder(self, sample, ladder):
    """The budgets whose graph beats eager on this GPU and model, agreed by every rank: smallest
    first, a replay of the smallest call each serves against its eager run, up to the first loss."""
    sync = torch.cuda.synchronize if _on_cuda(self) else None
    kept, previous = [], 0
    for budget in ladder:
        try:
            with self._ext_warm_up_context():
                graph_key = self._ext_capture_budget(sample, budget)
        except Exception:  # noqa: BLE001 - agreed on every rank; create_graph logged nothing, so say it here
            logger.warning("ViT CUDA graph probe: capture of the %d-token budget failed; the ladder ends below it",
                           budget, exc_info=True)
            break
        tokens = previous + self._ext_merge_unit
        error = None
        try:  # rank-local (graphs captured with local stand-ins for the collectives), voted below
            call = self._ext_synthetic_call(sample, tokens)
            with torch.no_grad(), self._ext_warm_up_context():
                graph_ms = median_wall_ms(lambda: self._ext_replay_budget(*call, counted=False),
                                          repeats=PROBE_REPEATS, synchronize=sync)
                eager_ms = median_wall_ms(lambda: self._ext_run_eager_call(*call), repeats=PROBE_REPEATS,
                                          synchronize=sync)
        except Exception as exc:  # noqa: BLE001 - voted on below
            error, graph_ms, eager_ms = exc, math.inf, 0.0
        self._ext_cache.discard(graph_key)
        wins = self._ext_vote()(OK if error is None and graph_ms < eager_ms else PERMANENT) == OK
        self._ext_gate.append({"budget": budget, "tokens": tokens, "graph_ms": round(graph_ms, 3),
                               "eager_ms": round(eager_ms, 3), "replay": wins})
        if error is not None:
            logger.warning("ViT CUDA graph probe of the %d-token budget failed: %s: %s", budget,
                           type(error).__name__, error)
        if not wins:
            break
        kept.append(budget)
        previous = budget
    return kept


def _ext_precapture(self, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin):
    """Decide the replay ladder and capture it (at load, else at the first run); nothing is captured later."""
    self._ext_precaptured = True
    if not self._ext_bucket_mode():
        return
    started = _now_ms()
    reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
    sample = (x_3d[:1], position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin)
    limit = self._ext_replay_max_tokens
    ladder = self._ext_token_buckets
    kept = [b for b in ladder if b <= limit] if limit >= 0 else self._ext_probe_ladder(sample, ladder)
    probed = list(kept)
    cache = self._ext_cache
    kept = kept[:cache.capacity]
    while kept and cache.max_bytes > 0 and self._ext_expected_bytes(x_3d, rows=kept[-1]) > cache.max_bytes:
        kept.pop()
    captured = []
    for budget in reversed(kept):
        try:
            captured.append(self._ext_capture_budget(sample, budget))
        except Exception as exc:  # noqa: BLE001 - agreed on every rank: all stay eager
            logger.warning("ViT CUDA graph pre-capture of the %d-token budget failed, so ViT graphs stay off: %s: %s",
                           budget, type(exc).__name__, exc)
            for graph_key in captured:
                cache.discard(graph_key)
            captured = []
            break
    self._ext_token_buckets = tuple(sorted(k.num_tokens for k in captured))
    self._ext_replay_limit = self._ext_token_buckets[-1] if captured else 0
    # Above the probe's break-even a call runs as one eager call (unless knob vit_graph_above_ladder says
    # split); above a limit set by the knob or by the capacity / byte cut graphs still win, so it is
    # split into chunks that replay.
    self._ext_split_above_limit = limit >= 0 or len(captured) < len(probed) or self._ext_above_ladder == "split"
    info = self._ext_precapture_info
    info["precapture_graphs"] = len(captured)
    info["precapture_ms"] = int(_now_ms() - started)
    if torch.cuda.is_available():
        info["precapture_reserved_bytes"] = int(torch.cuda.memory_reserved() - reserved)
    logger.info("ViT CUDA graphs: captured %d budgets (%s tokens) in %d ms, %d MiB reserved; calls up to %d tokens "
                "replay; probe: %s", len(captured), ",".join(map(str, self._ext_token_buckets)),
                info["precapture_ms"], info["precapture_reserved_bytes"] >> 20, self._ext_replay_limit,
                self._ext_gate or "skipped (--ext-vit-graph-replay-max-tokens)")


def _ext_precapture_at_load(self, vit, server_tokens):
    """At server start: run a synthetic image through the tower's graph path, keep what reaches the
    runner as the sample, and pre-capture from it (the sample stage is voted on first).
    `server_tokens` bounds the ladder."""
    self._ext_server_tokens = server_tokens
    self._ext_ensure_state()
    if self._ext_precaptured or not (self._ext_bucket_mode() and self._ext_precapture_enabled):
        return
    error = None
    self._ext_sample = None  # run() keeps the sample here while this attribute exists
    try:
        t, h, w = SAMPLE_GRID
        proj = vit.patch_embed.proj.weight
        pixels = torch.zeros(t * h * w, proj[0].numel(), dtype=vit.dtype, device=vit.device)
        with torch.no_grad():
            vit.forward_with_cuda_graph(pixels, torch.tensor([[t, h, w]], dtype=torch.int64))
        if self._ext_sample is None:
            raise RuntimeError("the tower's graph path did not reach the runner")
    except Exception as exc:  # noqa: BLE001 - voted on below
        error = exc
    finally:
        sample = self.__dict__.pop("_ext_sample", None)
    if self._ext_vote()(failure_vote(error)) != OK:
        self._ext_precaptured = True
        self._ext_replay_limit = 0
        logger.warning("ViT CUDA graphs stay off: the load-time sample failed on %s: %s",
                       "this rank" if error else "another rank", error)
        return
    with torch.no_grad():
        self._ext_precapture(*sample)


def _ext_budget_plan(self, layout_key):
    """(graph key, padded key) of the captured budget this call fits, or None: from its CPU layout alone.
    Padding rows are zeros in sequences of their own, so the merger's first rows are the real output."""
    tokens = layout_key.num_tokens
    unit = self._ext_merge_unit
    if tokens % unit or tokens > self._ext_replay_limit:
        return None
    bucket = select_bucket(tokens, self._ext_token_buckets, max_padding_factor=math.inf).bucket
    if bucket is None:
        return None
    full, window = layout_key.layout
    full = padded_layout(full, tokens, bucket, bucket)
    window = padded_layout(window, tokens, bucket, max(self._ext_window_tokens or 0, unit))
    padded_key = GraphKey(bucket, layout=(full, window))
    graph_key = self._ext_graph_key_for(padded_key)
    return (graph_key, padded_key) if self._ext_budget_fits(padded_key, graph_key) else None


def _ext_replay_budget(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                       counted=True, output_indices=None, out=None):
    """(the call's merger rows from its budget graph, None), else (None, why it runs eager): "gate" (above
    the replay limit), "no_fit" (no budget graph serves it) or "replay_failed" (a rank could not stage the
    replay; every rank then runs it eager). The rows go to `out` if given, in `output_indices` order if
    given. counted=False: the probe, no counters and no vote (its graphs hold local stand-ins for collectives)."""
    tokens = layout_key.num_tokens
    plan = self._ext_budget_plan(layout_key)
    if plan is None:
        return None, "gate" if tokens > self._ext_replay_limit else "no_fit"
    graph_key, padded_key = plan
    if (self._ext_cache.get(graph_key) if counted else self._ext_cache.entries.get(graph_key)) is None:
        return None, "no_fit"
    if counted:
        self._ext_padding["real_tokens"] += tokens
        if graph_key.num_tokens > tokens:
            self._ext_padding["padded_batches"] += 1
            self._ext_padding["padding_tokens"] += graph_key.num_tokens - tokens
    full, window = padded_key.layout

    def stage_layout():
        self._ext_write_layout(graph_key, device_layout(full, self.device), device_layout(window, self.device))

    rows = self.replay(graph_key, x_3d, position_embeddings=position_embeddings, rotary_pos_emb_cos=rotary_pos_emb_cos,
                       rotary_pos_emb_sin=rotary_pos_emb_sin, output_indices=output_indices,
                       rows=tokens // self._ext_merge_unit, stage_layout=stage_layout, out=out,
                       agree=counted)
    return rows, None if rows is not None else "replay_failed"


def _ext_run_eager_call(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                        output_indices=None):
    """The sync-free eager run of one call given by its CPU layout, rotary on graphs-off's compiled kernel."""
    full, window = layout_key.layout
    with compiled_rotary():
        return self._ext_run_eager(x_3d, device_layout(full, x_3d.device), device_layout(window, x_3d.device),
                                   position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin, output_indices,
                                   max_len(full), max_len(window))


def _ext_call_output(self, rows, output_indices):
    """A chunked call's output rows, and their `output_indices` reordering (or None), allocated on every
    rank of the tower's group or on none (None): replays then write into them, allocating nothing."""
    template = next(iter(self.block_output.values()), None)
    if template is None:
        return None

    def allocate():
        row_shape = tuple(template.shape[1:])
        reordered = None if output_indices is None else template.new_empty((output_indices.shape[0],) + row_shape)
        return template.new_empty((rows,) + row_shape), reordered

    outcome = agreed(self._ext_vote(), allocate, "output")
    if not outcome.ok:
        logger.warning("ViT CUDA graphs: a chunked call runs eager (its output could not be allocated on %s): %s",
                       outcome.where, outcome.error)
        return None
    return outcome.value


def _ext_run_budget(self, layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin,
                    output_indices):
    """Replay the call, or its whole-image chunks, where a captured budget serves them; else eager."""
    tokens = layout_key.num_tokens
    full, window = layout_key.layout
    limit = self._ext_replay_limit
    ranges = [(0, tokens)]
    if limit and tokens > limit and not self._ext_split_above_limit:
        limit = 0  # above the probe's break-even: one eager call
    elif limit and tokens > limit:
        ranges = whole_sequence_chunks((full, window), tokens, limit, BUCKET_SEQUENCES - 1)
        self._ext_chunking["chunked_calls"] += 1
        self._ext_chunking["chunks"] += len(ranges)

    def call_of(start, end):
        if (start, end) == (0, tokens):
            return layout_key, x_3d, position_embeddings, rotary_pos_emb_cos, rotary_pos_emb_sin
        return (GraphKey(end - start, layout=(sequences_between(full, start, end),
                                              None if window is None else sequences_between(window, start, end))),
                x_3d[start:end],
                None if position_embeddings is None else tuple(t[start:end] for t in position_embeddings),
                None if rotary_pos_emb_cos is None else rotary_pos_emb_cos[start:end],
                None if rotary_pos_emb_sin is None else rotary_pos_emb_sin[start:end])

    if len(ranges) == 1:  # one call: its replay writes the output, reordered
        out, reason = (self._ext_replay_budget(*call_of(0, tokens), output_indices=output_indices) if limit
                       else (None, "gate"))
        if out is None:
            self._ext_fallbacks[reason] += 1
            out = self._ext_run_eager_call(*call_of(0, tokens), output_indices)
        return out
    # Chunks write into one output allocated first, so nothing allocates after a replay's collectives.
    unit = self._ext_merge_unit
    outputs = self._ext_call_output(tokens // unit, output_indices)
    if outputs is None:
        self._ext_fallbacks["replay_failed"] += 1
        return self._ext_run_eager_call(*call_of(0, tokens), output_indices)
    rows, reordered = outputs
    # Adjacent chunks no graph serves run as ONE eager call (eager host time hardly depends on size).
    eager_from = None
    for start, end in ranges:
        out, reason = self._ext_replay_budget(*call_of(start, end), out=rows[start // unit:end // unit])
        if out is None:
            self._ext_fallbacks[reason] += 1
            eager_from = start if eager_from is None else eager_from
            continue
        if eager_from is not None:
            rows[eager_from // unit:start // unit].copy_(self._ext_run_eager_call(*call_of(eager_from, start)))
            eager_from = None
    if eager_from is not None:
        rows[eager_from // unit:].copy_(self._ext_run_eager_call(*call_of(eager_from, tokens)))
    return rows if reordered is None else torch.index_select(rows, 0, output_indices, out=reordered)


METHODS = (
    _ext_budget_fits, _ext_synthetic_call, _ext_capture_budget, _ext_probe_ladder, _ext_precapture,
    _ext_precapture_at_load, _ext_budget_plan, _ext_replay_budget, _ext_run_eager_call, _ext_call_output,
    _ext_run_budget,
)
