"""sglang's own `PiGemmaRMSNorm.forward` and `gated_residual` (the installed release's): the reference that
the pi05_fused_norms tests compare the patch with.

Nothing is copied: both definitions are compiled from a pristine `pi05_core.py`, and that file's
fingerprints of them must equal the ones recorded for its release. With the plugin, the
installed sglang's file is pristine (patches swap objects, never files); the patched tree has
the patch in that file, so there it is the released 0.5.17 wheel's (downloaded once, cached).
"""

from __future__ import annotations

import __future__
import ast

import torch

from conftest import PATCHED_TREE, released_source_root
from sglang_ext import fingerprint
from sglang_ext.versions import installed_sglang_version

MODULE = "sglang.multimodal_gen.runtime.models.vlas.pi05_core"


def _pristine(qualname: str, recorded: str):
    root = released_source_root("0.5.17") if PATCHED_TREE else None
    path = fingerprint.module_source_path(MODULE, root)
    got = fingerprint.fingerprint(MODULE, recorded, root)
    release = "0.5.17" if PATCHED_TREE else installed_sglang_version()
    want = fingerprint.reference_table(release)[f"{MODULE}:{recorded}"]
    assert got == want, f"{path}: {recorded} is not {release}'s (fingerprint {got}, recorded {want})"
    node = fingerprint._find_definition(fingerprint._parse(path), qualname)
    code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace = {"torch": torch, "__name__": "pristine_pi05_core"}
    exec(code, namespace)
    return namespace[node.name]


# forward(norm, x, cond=None): the method, called with the module as `self`
reference_forward = _pristine("PiGemmaRMSNorm.forward", recorded="PiGemmaRMSNorm")
reference_gated_residual = _pristine("gated_residual", recorded="gated_residual")
