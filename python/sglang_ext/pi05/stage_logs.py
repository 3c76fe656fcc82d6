"""Pi0.5 action requests log their stages' start and finish at debug level, as sglang's other action logs.

Patch: mg_worker_request_overhead
Targets: sglang.multimodal_gen.runtime.pipelines_core.stages.base:PipelineStage.__call__,
sglang.multimodal_gen.runtime.utils.perf_logger:StageProfiler
Upstream PR: none (0.5.23 still reads the statistics four times per snapshot and logs every stage at info)
Retire when: upstream reads the allocator's statistics once per snapshot and logs the stages of action requests at
debug level

Why: sglang already logs an action request and its stage list at debug level only, yet each of
its four stages still writes a "started" and a "finished" line at info level: eight log records
per request of a robot's control loop.
How: while a stage runs an action request, the StageProfiler it builds writes those two lines
through `logger.debug`; errors, timings and every other request are sglang's.
"""

from __future__ import annotations

import contextvars

from sglang.multimodal_gen.configs.sample.sampling_params import DataType
from sglang.multimodal_gen.runtime.utils.perf_logger import StageProfiler

# True while a stage runs an action request.
_ACTION_STAGE = contextvars.ContextVar("sglang_ext_action_stage", default=False)


class _InfoAtDebug:
    """A logger whose info lines go out at debug level (everything else is the logger's)."""

    def __init__(self, logger) -> None:
        self._logger = logger

    def __getattr__(self, name):
        return getattr(self._logger, name)

    def info(self, msg, *args, **kwargs):
        return self._logger.debug(msg, *args, **kwargs)


class ActionStageProfiler(StageProfiler):
    """sglang's StageProfiler; for an action request its start/finish lines are debug lines."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if _ACTION_STAGE.get():
            self.logger = _InfoAtDebug(self.logger)


def _wrap_call(original):
    def __call__(self, batch, server_args):
        data_type = getattr(getattr(batch, "sampling_params", None), "data_type", None)
        token = _ACTION_STAGE.set(data_type == DataType.ACTION)
        try:
            return original(self, batch, server_args)
        finally:
            _ACTION_STAGE.reset(token)

    __call__.__wrapped__ = original
    __call__.__doc__ = original.__doc__
    return __call__


def patch_stage_base(ctx, module) -> None:
    """Part for pipelines_core.stages.base: PipelineStage.__call__ marks action requests, its
    StageProfiler (module global) is ours."""
    ctx.setattr(module, "StageProfiler", ActionStageProfiler)
    cls = module.PipelineStage
    ctx.setattr(cls, "__call__", _wrap_call(cls.__dict__["__call__"]))
