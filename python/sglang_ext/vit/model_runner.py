"""Bucket mode at load: the ViT graph ladder captured after sglang's own graphs, before the server is healthy.

Patch: vit_cuda_graph
Targets: sglang.srt.model_executor.model_runner:ModelRunner.init_cuda_graphs
Upstream PR: sgl-project/sglang#37043
Retire when: upstream bounds the ViT graph count, frees retired workspaces and returns owned outputs

Why: otherwise the probe and the captures run inside the first image request; after sglang's own graphs, no
later capture into the shared pool keeps an output a ViT replay could overwrite. Releases: 0.5.17, 0.5.23.
How: wraps init_cuda_graphs: sglang's captures, then `capture_at_load` on every ViT graph runner's engine.
"""

from __future__ import annotations

import functools


def precapture_vit_graphs(model_runner):
    """The bucket ladder of every ViT graph runner of the model, up to a prefill chunk times the merge unit."""
    # Imported here: a server without a vision model never imports the ViT runner.
    from sglang_ext.vit.runner import ViTGraphRunner

    args = getattr(model_runner, "server_args", None)
    chunk = getattr(args, "chunked_prefill_size", None) or 0
    prefill = chunk if chunk > 0 else (getattr(args, "max_prefill_tokens", None) or 0)
    for tower in model_runner.model.modules():
        for name in ("cuda_graph_runner", "graph_runners"):  # Qwen2.5-VL's attribute, Qwen3-VL's
            runner = tower.__dict__.get(name)
            if isinstance(runner, ViTGraphRunner):
                runner.engine.capture_at_load(tower, prefill * runner.engine.merge_unit if prefill > 0 else None)


def _then_vit_graphs(original):
    @functools.wraps(original)  # `__wrapped__`: sglang's own init_cuda_graphs, looked up at each call
    def init_cuda_graphs(self, *args, **kwargs):  # sglang's own captures, then the ViT graphs
        result = init_cuda_graphs.__wrapped__(self, *args, **kwargs)
        precapture_vit_graphs(self)
        return result

    return init_cuda_graphs


def patch_model_runner(ctx, module) -> None:
    cls = module.ModelRunner
    ctx.setattr(cls, "init_cuda_graphs", _then_vit_graphs(cls.__dict__["init_cuda_graphs"]))
