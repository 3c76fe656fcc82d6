"""ViT CUDA graphs keyed by attention layout, bounded, workspace-stable and never wrong.

Patch: vit_cuda_graph
Targets: sglang.srt.multimodal.vit_cuda_graph_runner:ViTCudaGraphRunner
Upstream PR: sgl-project/sglang#37043
Retire when: upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs

Releases: 0.5.17, 0.5.23 (the same subclass: of upstream it uses `__init__` and `run`'s signature).
Why: 0.5.17 keys ViT graphs by token count only (other image boundaries replay stale cu_seqlens) and
moves the rotary workspace under captured graphs; 0.5.23 captures every new layout while serving,
keeps retired workspaces and returns the graph's own output; neither ever frees a graph.
How: the module's ViTCudaGraphRunner becomes a subclass (one recorded swap) that hands `run` to one
ViTGraphEngine (engine.py): keys from CPU layouts, a bounded LRU cache with an eager fallback, owned outputs.
"""

from __future__ import annotations

import sglang.srt.multimodal.vit_cuda_graph_runner as vit_cuda_graph_runner
from sglang_ext.vit.engine import GraphOptions, ViTGraphEngine


class ViTGraphRunner(vit_cuda_graph_runner.ViTCudaGraphRunner):
    """sglang's runner, every call served by its engine (of upstream: `__init__` and `run`'s signature only)."""

    options: GraphOptions  # the activation's knobs, on the class patch_runner installs

    def __init__(self, vit, options: GraphOptions = None):
        super().__init__(vit)
        self.engine = ViTGraphEngine(vit, self._attn_backend, options or self.options)

    def run(self, *args, **kwargs):  # upstream's `run` arguments (ViTGraphEngine.run)
        return self.engine.run(*args, **kwargs)


def bind_runner(ctx, module) -> None:
    """A Qwen module's name for the runner (bound before or after the swap) is rebound to the patched class."""
    patched = vit_cuda_graph_runner.ViTCudaGraphRunner
    bound = getattr(module, "ViTCudaGraphRunner", None)
    if not issubclass(patched, ViTGraphRunner) or bound not in (patched, ViTGraphRunner.__base__):
        raise RuntimeError(f"{module.__name__}.ViTCudaGraphRunner is not "
                           "sglang.srt.multimodal.vit_cuda_graph_runner.ViTCudaGraphRunner (rebound by someone else)")
    ctx.setattr(module, "ViTCudaGraphRunner", patched)


def patch_runner(ctx, module) -> None:
    runner_cls = type("ViTCudaGraphRunner", (ViTGraphRunner,), {
        "options": GraphOptions.from_settings(ctx.settings), "__module__": __name__,
        "__qualname__": "ViTCudaGraphRunner"})
    ctx.setattr(module, "ViTCudaGraphRunner", runner_cls)
