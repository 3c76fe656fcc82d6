"""The Pi0.5 fast path of one core model (knob pi05_fast; docs/how-it-works.md, "Pi0.5") and its registry."""

from __future__ import annotations

import contextlib
import copy
import logging
import weakref
from collections import OrderedDict

import torch

from sglang_ext.pi05 import fast_loop, fast_prefix, fast_support

logger = logging.getLogger(__name__)

TIME_TABLE_ENTRIES = 4  # (steps, batch, device, dtype) tables kept per model; a server uses one
PATHS = {"denoise": "fast loop", "prefix": "fast prefix", "vision": "fused vision layers"}  # as logs name them


class Pi05FastPath:
    """The fused-kernel paths of `core` in one mode (fused_vision: SigLIP layers in 7 kernels, not 13; pdl:
    programmatic dependent launch). Modes share verdicts, tables and packed weights."""

    def __init__(self, core, registry, mode):
        self._core, self._registry = weakref.ref(core), registry
        self.fused_vision, self.pdl = mode
        self._reasons = {}  # path -> why it is not used ("": it is)
        self._verified, self._prepared = set(), set()  # _prepared: "vision", done until a reset
        self._tables = OrderedDict()
        self.packing = weakref.WeakKeyDictionary()  # SigLIP attention -> its packed q/k/v (fast_prefix)

    def unsupported_reason(self, path: str = "denoise"):
        """None when the fast `path` ("denoise", "prefix", "vision") can run this model, else why not."""
        if path not in self._reasons:
            self._reasons[path] = getattr(fast_support, f"{path}_unsupported")(self._core()) or ""
            if self._reasons[path]:
                logger.info("Pi05 %s not used (%s): the exact path runs", PATHS[path], self._reasons[path])
        return self._reasons[path] or None

    def serves(self, path: str = "denoise") -> bool:
        return (path != "vision" or self.fused_vision) and self.unsupported_reason(path) is None

    def verified(self, path: str = "denoise") -> bool:
        """True once the fast `path` ran on this model (its kernels build and run here)."""
        return path in self._verified

    def run(self, path: str, run):
        """`run()`; on the path's first use a raise disables it for the model (logged, None: the exact path)."""
        if path in self._verified:
            return run()
        try:
            result = run()
        except Exception as exc:  # noqa: BLE001 - logged, then the exact path runs
            what, first_line = PATHS[path], (str(exc).splitlines() or [""])[0]
            self._reasons[path] = reason = f"{what} failed on first use: {type(exc).__name__}: {first_line}"
            logger.warning("Pi05 %s disabled (%s): the exact path runs", what, reason, exc_info=exc)
            return None
        self._verified.add(path)
        return result

    def time_conditioning(self, num_steps: int, batch_size: int, device) -> torch.Tensor:
        """fast_loop.build_time_conditioning's table, kept for the last TIME_TABLE_ENTRIES keys."""
        dtype = fast_support.expert(self._core()).layers[0].self_attn.projection_dtype
        key = (int(num_steps), int(batch_size), str(torch.device(device)), str(dtype))
        table = self._tables.pop(key, None)  # put back last: the newest
        if table is None:
            table = fast_loop.build_time_conditioning(self._core(), num_steps, batch_size, torch.device(device), dtype)
        self._tables[key] = table
        while len(self._tables) > TIME_TABLE_ENTRIES:
            self._tables.popitem(last=False)
        return table

    def reset_action(self) -> None:
        """Drop the time tables (with the action graphs, or after new weights)."""
        self._tables.clear()

    def denoise(self, prefix_context, state, table, **layout):
        return fast_loop.denoise(self._core(), prefix_context, state, table, **layout, pdl=self.pdl)

    def encode_prefix_layers(self, inputs_embeds, attention_mask, position_ids, pad_masks):
        """The prefix K/V (fast_prefix.prefix_layers), or None (the exact path) after a first use that raised."""
        return self.run("prefix", lambda: fast_prefix.prefix_layers(self._core(), inputs_embeds, attention_mask,
                                                                    position_ids, pad_masks, pdl=self.pdl))

    def prepare_vision(self) -> None:
        """Pack every layer's q/k/v before prefix captures, once until reset_prefix: checking 27 layers per
        request cost 0.4-0.5 ms of host time before each H200 replay."""
        if "vision" not in self._prepared and self.serves("vision"):
            for layer in fast_support.vision_encoder(self._core()).layers:
                fast_prefix.packed_qkv(self.packing, layer.self_attn)
            self._prepared.add("vision")

    def reset_prefix(self) -> None:
        """prepare_vision checks every layer again (new prefix graphs or weights); stale packed copies go now."""
        if "vision" in self._prepared:
            self._prepared.discard("vision")
            for attn in [a for a in self.packing if fast_prefix.current_packing(self.packing, a) is None]:
                del self.packing[attn]

    def vision(self):
        """While open, the SigLIP encoder runs the fused layers where they serve (one request at a time per process)."""
        if not self.serves("vision"):
            return contextlib.nullcontext()
        return self._registry.running(fast_support.vision_encoder(self._core()), self)


class FastPaths:
    """Each core model's fast paths by mode (held weakly); SigLIP's forward is wrapped once to run the open path."""

    def __init__(self, ctx):
        self._ctx = ctx
        self._paths = weakref.WeakKeyDictionary()  # core -> {(fused_vision, pdl): Pi05FastPath}
        self._open = weakref.WeakKeyDictionary()  # wrapped encoder -> the path running it, or None

    def path(self, core, *, fused_vision=True, pdl=True) -> Pi05FastPath:
        """`core`'s path in this mode, on the state of its other modes (graphs of each read the same weights)."""
        modes, mode = self._paths.setdefault(core, {}), (bool(fused_vision), bool(pdl))
        if mode not in modes:
            known = next(iter(modes.values()), None)
            modes[mode] = copy.copy(known) if known else Pi05FastPath(core, self, mode)
            modes[mode].fused_vision, modes[mode].pdl = mode
        return modes[mode]

    def reset(self, core, reset: str) -> None:
        """`reset` ("reset_action", "reset_prefix") of `core`'s fast path state (its modes share it), if any."""
        for path in list(self._paths.get(core, {}).values())[:1]:
            getattr(path, reset)()

    @contextlib.contextmanager
    def running(self, encoder, path):
        if encoder not in self._open:
            self._ctx.setattr(encoder, "forward", self._wrapped(encoder, encoder.forward))
        self._open[encoder] = path
        try:
            yield
        finally:
            self._open[encoder] = None

    def _wrapped(self, encoder, exact):
        def forward(inputs_embeds, attention_mask=None, **kwargs):
            path = self._open.get(encoder)
            if path is None or attention_mask is not None or kwargs:
                return exact(inputs_embeds, attention_mask, **kwargs)
            out = path.run("vision", lambda: fast_prefix.vision_layers(encoder, inputs_embeds, path.packing,
                                                                       pdl=path.pdl))
            return exact(inputs_embeds) if out is None else out

        return forward
