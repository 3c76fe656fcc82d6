"""The cameras a Pi0.5 checkpoint names, known to the HTTP process too (sglang applies a checkpoint's config.json
in the worker only): sglang's own reader runs on a copy of the config. Read by pi05_observation_checks and by
pi05_config's action metadata (a module of its own: neither patch's adapter imports the other's).
"""

from __future__ import annotations

import copy
import logging
import os
import weakref

logger = logging.getLogger("sglang_ext")

# (weak reference to the last pipeline config asked about, its cameras): a server asks about one config.
_LAST: tuple = (None, ())


def checkpoint_cameras(server_args) -> tuple:
    """The checkpoint's cameras (the pipeline config's when the model path holds no config.json)."""
    global _LAST
    config = server_args.pipeline_config
    ref, cameras = _LAST
    if ref is None or ref() is not config:
        cameras = tuple(config.image_keys)
        path = getattr(server_args, "model_path", None)
        if path and os.path.isfile(os.path.join(path, "config.json")):
            from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel

            probe = copy.deepcopy(config)
            try:
                Pi05PolicyModel._apply_checkpoint_config(path, probe)
                cameras = tuple(probe.image_keys)
            except Exception:  # noqa: BLE001 - a config.json sglang cannot read fails in the worker, as before
                logger.warning("sglang-ext: could not read the cameras of %s", path, exc_info=True)
        _LAST = (weakref.ref(config), cameras)
    return cameras
