"""The cameras a Pi0.5 checkpoint names, known to the HTTP process too (sglang applies a checkpoint's config.json
in the worker only): upstream's own reader runs on a copy of the config, once per server.
"""

from __future__ import annotations

import copy
import logging
import os
import weakref

logger = logging.getLogger("sglang_ext")

# id(pipeline config) -> (weak reference, cameras); the reference tells a live config from one reusing the id.
_CAMERAS: dict = {}


def checkpoint_cameras(server_args) -> tuple:
    """The checkpoint's cameras (the pipeline config's when the model path holds no config.json)."""
    config = server_args.pipeline_config
    ref, cameras = _CAMERAS.get(id(config), (None, None))
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
        for key in [key for key, (dead, _) in _CAMERAS.items() if dead() is None]:
            del _CAMERAS[key]
        _CAMERAS[id(config)] = (weakref.ref(config), cameras)
    return cameras
