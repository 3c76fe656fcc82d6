"""The installed sglang's objects under the registry's names (the newest supported release's shape).

`upstream("sglang.multimodal_gen.runtime.entrypoints.action.protocol")` is `entrypoints.vla.protocol` on
0.5.17; "module:attribute" gives the attribute. The renames are `sglang_ext.registry.RENAMES`.
"""

from __future__ import annotations

import importlib

from sglang_ext.registry import resolve
from sglang_ext.versions import installed_sglang_version

ACTION = "sglang.multimodal_gen.runtime.entrypoints.action"


def upstream(name: str):
    module, _, attr = resolve(name, installed_sglang_version()).partition(":")
    out = importlib.import_module(module)
    return getattr(out, attr) if attr else out
