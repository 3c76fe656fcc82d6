"""Results files of the benchmark scripts (docs/bench/*.json): what they may hold, and writing one.

Each bench script declares `SCHEMA`, the keys it writes per level: `{key: None}` a value,
`{key: {...}}` an object, `{key: [{...}]}` a list of objects, `{key: ANY}` an object whose
keys are data (patch names, counter names). `write()` refuses a report with keys its schema
lacks, so the schema is the one the script really uses; `gen_performance_doc.py --check` fails
on a committed file carrying keys no script writes (a hand edit).

Every file records where its numbers come from: `run_id` (one per invocation of the script, or
the SGX_BENCH_RUN_ID a driver such as `gpu_steps.sh bench-pi05` gives the processes it runs one
after another: rows sharing it were measured in one run), `kernels` (the CUDA kernel packages the measuring
process loaded) and `attention` (the attention backend).
"""

from __future__ import annotations

import json
import os
import sys
import time

ANY = "any"
RUN_ID = os.environ.get("SGX_BENCH_RUN_ID") or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
KERNELS_SCHEMA = {"sgl_kernel": None, "flashinfer": None}


def kernels() -> dict:
    """Per kernel package: its version, "stand-in" (sglang_ext_testkit.stand_ins), or "not loaded"."""
    out = {}
    for name in KERNELS_SCHEMA:
        module = sys.modules.get(name)
        if module is None:
            out[name] = "not loaded"
        elif getattr(module, "__sgl_stub__", False):
            out[name] = "stand-in"
        else:
            out[name] = str(getattr(module, "__version__", "version unknown"))
    return out


def undeclared(value, schema, where: str = "") -> list:
    """Paths of keys in `value` that `schema` does not declare (list items as `[]`)."""
    if schema is None or schema == ANY or value is None:
        return []
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where} (a list in the schema)"]
        return sorted({p for item in value for p in undeclared(item, schema[0], where + "[]")})
    if not isinstance(value, dict):
        return [f"{where} (an object in the schema)"]
    out = []
    for key, item in value.items():
        path = f"{where}.{key}" if where else key
        out += [path] if key not in schema else undeclared(item, schema[key], path)
    return out


def write(path: str, report: dict, schema: dict, **dump) -> None:
    extra = undeclared(report, schema)
    if extra:
        raise SystemExit(f"{path}: not written, keys missing from the script's SCHEMA: {', '.join(extra)}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, **dump)
    print(f"wrote {path}")
