"""Every user-facing setting of sglang-ext, declared once.

Each knob has a flag (`--ext-<name>`, for `python -m sglang_ext.launch_server`) and an environment
spelling (`SGLANG_EXT_<NAME>`, inherited by child processes); every process reads the environment
through `load_settings()`, which raises `ExtConfigError` naming the knob and the allowed values. The
master switch `SGLANG_EXT` takes 1 or 0 (unset or empty: 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from sglang_ext.errors import ExtConfigError

MASTER_ENV = "SGLANG_EXT"  # 1 or 0: sglang-ext on / off in this process and its children
MASTER_VALUES = {"1": True, "0": False, "": False}  # "" (set but empty) reads as unset
ENV_PREFIX = "SGLANG_EXT_"
FLAG_PREFIX = "--ext-"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "bool" | "int" | "str" | "choice" | "int_list" | "name_list"
    default: Any
    help: str
    choices: Sequence[str] = ()
    minimum: Optional[int] = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return FLAG_PREFIX + self.name.replace("_", "-")

    def error(self, problem: str) -> ExtConfigError:
        return ExtConfigError(f"{self.flag} / {self.env}: {problem}")

    @property
    def allowed(self) -> str:
        """What a value may be, as every error about this knob names it."""
        if self.kind == "bool":
            return "allowed: 1/0, true/false, yes/no, on/off"
        if self.kind == "int":
            return "allowed: integers" + ("" if self.minimum is None else f" >= {self.minimum}")
        if self.choices:
            return "allowed: " + ", ".join(self.choices)
        if self.kind == "name_list":
            from sglang_ext.registry import PATCH_NAMES

            return "allowed: comma-separated patch names from " + ", ".join(PATCH_NAMES)
        if self.kind == "int_list":
            return "allowed: comma-separated positive integers, strictly increasing"
        return "allowed: a string"

    def parse(self, raw: str) -> Any:
        """Parse a raw string (flag or env value). Raises ExtConfigError."""
        text = raw.strip()
        if self.kind == "bool":
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise self.error(f"{raw!r} is not a boolean; {self.allowed}")
        if self.kind == "int":
            try:
                value = int(text, 10)
            except ValueError:
                raise self.error(f"{raw!r} is not an integer; {self.allowed}") from None
            if self.minimum is not None and value < self.minimum:
                raise self.error(f"{value} is below the minimum; {self.allowed}")
            return value
        if self.kind == "choice":
            if text not in self.choices:
                raise self.error(f"{raw!r} is not allowed; {self.allowed}")
            return text
        if self.kind == "int_list":
            values = []
            for part in text.split(",") if text else ():
                try:
                    values.append(int(part.strip(), 10))
                except ValueError:
                    raise self.error(f"{part.strip()!r} in {raw!r} is not an integer; {self.allowed}") from None
            if any(v <= 0 for v in values):
                raise self.error(f"{raw!r}: every value must be positive")
            if any(b <= a for a, b in zip(values, values[1:])):
                raise self.error(f"{raw!r} must be strictly increasing and unique")
            return tuple(values)
        if self.kind == "name_list":
            return tuple(p.strip() for p in text.split(",") if p.strip())  # load_settings checks the names
        return text  # "str"


# Order is the order of `--help`.
KNOBS: tuple[Knob, ...] = (
    Knob("strict", "bool", False,
         "Abort start-up (an exception sglang's plugin loader cannot swallow) when a "
         "requested patch cannot be applied. Default: warn once per patch and apply nothing of it."),
    Knob("disable", "name_list", (), "Comma-separated patch names to leave unapplied."),
    Knob("assume_sglang", "str", "",
         "Treat the installed sglang as this version (source builds carry dev versions). "
         "Fingerprints are still checked."),
    Knob("activation_dir", "str", "",
         "If set, every process writes <dir>/<role>-<pid>.json with its patch statuses."),
    # --- ViT graphs (patch vit_cuda_graph) ---
    Knob("vit_graph_max_entries", "int", 32,
         "Most ViT CUDA graphs resident at once (0 disables ViT graphs: every batch runs eager).",
         minimum=0),
    Knob("vit_graph_max_bytes", "int", -1,
         "Byte budget for resident ViT graphs, counted from their static buffers (the same on every TP rank, "
         "so ranks evict in lockstep). -1 = a quarter of the device memory free when the ViT first runs "
         "(256 MiB to 4 GiB, the minimum over TP ranks); 0 = no byte limit; N > 0 = N bytes.",
         minimum=-1),
    Knob("vit_graph_policy", "choice", "lru",
         "When full: 'lru' evicts the least recently used graph (reset() before capture); "
         "'exact' keeps the first graphs and runs new layouts eager.",
         choices=("lru", "exact")),
    Knob("vit_graph_min_hits", "int", 1,
         "Anti-thrash admission: capture a layout only once it has been seen this many times.",
         minimum=1),
    Knob("vit_graph_mode", "choice", "bucket",
         "'bucket' (the fastest): one graph per token budget, captured when the model loads, each call padded to "
         "the smallest budget that fits, equal to eager within bf16 rounding; 'class': one graph per token count, "
         "sequence-count class and longest-sequence class, captured on first use, bitwise equal to eager (for "
         "answers that must not change with graphs on); 'layout': one graph per exact attention layout, the "
         "kernels given eager's own max_seqlen (to check class mode against). Graphs need vision attention "
         "triton_attn, fa3 or fa4 (sdpa runs eager).",
         choices=("layout", "class", "bucket")),
    Knob("vit_graph_token_buckets", "int_list", (),
         "Bucket mode only: the token budgets (patches before merging, multiples of the merge unit 4) to "
         "capture. Empty = 512 growing by 26 % in multiples of 64 up to the largest call the server's prefill "
         "limits allow (16384 without a server)."),
    Knob("vit_graph_replay_max_tokens", "int", -1,
         "Bucket mode only: the largest call (tokens) that replays a graph. -1 = measured at load (the ladder "
         "ends at the first budget whose graph is slower than eager, agreed by every TP rank); N = the budgets "
         "up to N tokens, larger calls split into chunks of whole images that replay.",
         minimum=-1),
    Knob("vit_graph_above_ladder", "choice", "eager",
         "Bucket mode only, ladder measured at load: a call above the ladder runs as one eager call ('eager', "
         "for a busy server) or is split into chunks of whole images that replay ('split', for a lightly loaded "
         "one: fewer host launches, more device time spent on padding).",
         choices=("eager", "split")),
    Knob("vit_triton_rotary", "bool", True,
         "ViT graphs on: every vision attention call, eager and captured, rotates q and k with one Triton "
         "kernel rounded as sglang's eager rotary (bitwise equal to it on the GPU). Off, or without Triton: "
         "sglang's own rotary functions."),
    # --- Pi0.5 graphs (patches pi05_*) ---
    Knob("pi05_prefix_graph_max_entries", "int", -1,
         "Override prefix_cuda_graph_max_entries of the Pi0.5 pipeline config (-1 = keep config).",
         minimum=-1),
    Knob("pi05_action_graph_max_entries", "int", -1,
         "Override action_cuda_graph_max_entries of the Pi0.5 pipeline config (-1 = keep config).",
         minimum=-1),
    Knob("pi05_prompt_token_buckets", "int_list", (),
         "Override prompt_token_buckets of the Pi0.5 pipeline config. Empty = the config's; with graph capture "
         "at load and none configured, 32 growing by 25 % in multiples of 16 up to max_token_len."),
    Knob("pi05_graph_capture", "choice", "load",
         "'load': before the server reports healthy, capture a prefix and an action graph for every prompt token "
         "bucket, and nothing while serving (a prompt no bucket holds runs eager). 'lazy': upstream's behaviour, "
         "capture on first use within the config's capacities.",
         choices=("load", "lazy")),
    Knob("pi05_graph_max_bytes", "int", 4 << 30,
         "Byte budget of each Pi0.5 graph cache, counted from its graphs' static buffers (prefix K/V, inputs); "
         "load-time capture stops at the first bucket that would exceed it. 0 = no byte limit.",
         minimum=0),
    Knob("pi05_graph_min_hits", "int", 1,
         "Anti-thrash admission for Pi0.5 graphs: capture a signature after this many sightings.",
         minimum=1),
    Knob("pi05_fused_denoise", "bool", False,
         "Opt-in: capture all denoise steps of a Pi0.5 request (including the x_t update) as "
         "one CUDA graph: one replay per request instead of one per step."),
    Knob("pi05_fast", "bool", False,
         "Opt-in: Pi0.5's denoise steps (implies pi05_fused_denoise) and the prefix's SigLIP and language "
         "model layers on fused kernels, equal to the exact path within bf16 tolerance, not bitwise. Action "
         "sequence parallelism and a tensor-parallel prefix take the exact path."),
)

_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


def knob(name: str) -> Knob:
    return _BY_NAME[name]


@dataclass(frozen=True)
class Settings:
    """Validated knob values of this process (plus the master switch)."""

    enabled: bool
    values: Mapping[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def load_settings(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read and validate every knob from the environment. Raises ExtConfigError."""
    env = os.environ if environ is None else environ
    enabled = knob_enabled(env)
    typos = unknown_env_names(env)
    if typos:
        raise ExtConfigError(f"unknown sglang-ext environment variable(s) {', '.join(typos)}; allowed: "
                             + ", ".join(k.env for k in KNOBS))
    values: dict[str, Any] = {k.name: k.default if env.get(k.env) is None else k.parse(env[k.env]) for k in KNOBS}
    if values["disable"]:
        from sglang_ext.registry import PATCHES  # read now: tests extend the registry

        names = tuple(p.name for p in PATCHES)
        unknown = [n for n in values["disable"] if n not in names]
        if unknown:
            raise knob("disable").error(f"unknown patch name(s) {', '.join(unknown)}; allowed: {', '.join(names)}")
    _check_vit_bucket_only(values)
    _check_vit_token_buckets(values)
    return Settings(enabled=enabled, values=values)


# The spatial merge unit (2x2 patches) of every ViT tower the vit_cuda_graph patch serves.
VIT_MERGE_UNIT = 4


# Knobs that only bucket mode reads: set in another mode they would be ignored silently.
VIT_BUCKET_ONLY = ("vit_graph_token_buckets", "vit_graph_replay_max_tokens", "vit_graph_above_ladder")


def _check_vit_bucket_only(values: dict) -> None:
    mode = values["vit_graph_mode"]
    if mode == "bucket":
        return
    for name in VIT_BUCKET_ONLY:
        k = knob(name)
        if values[name] != k.default:
            unset = "leave it empty" if k.default == () else f"leave it at {k.default}"
            raise k.error(f"only used with {knob('vit_graph_mode').flag} bucket (mode is {mode!r}); "
                          f"allowed: {unset}, or set the mode to bucket")


def _check_vit_token_buckets(values: dict) -> None:
    buckets = values["vit_graph_token_buckets"]
    bad = [b for b in buckets if b % VIT_MERGE_UNIT]
    if bad:
        raise knob("vit_graph_token_buckets").error(
            f"{', '.join(map(str, bad))} not a multiple of {VIT_MERGE_UNIT}; allowed: comma-separated positive "
            f"multiples of {VIT_MERGE_UNIT} (the ViT spatial merge unit), strictly increasing")


def knob_enabled(env: Mapping[str, str]) -> bool:
    raw = env.get(MASTER_ENV, "")
    value = MASTER_VALUES.get(raw.strip())
    if value is None:
        raise ExtConfigError(f"{MASTER_ENV}: {raw!r} is not allowed; allowed: 1 or 0")
    return value


def unknown_env_names(env: Mapping[str, str]) -> list[str]:
    """SGLANG_EXT_* variables that name no knob (typos would otherwise be ignored)."""
    known = {k.env for k in KNOBS}
    return sorted(n for n in env if n.startswith(ENV_PREFIX) and n not in known)


# The settings activation built, read by current(); None while sglang-ext is not active.
_active: Optional[Settings] = None


def use(settings: Optional[Settings]) -> None:
    """Activation hands over the settings it validated (None when it is undone)."""
    global _active
    _active = settings


def current(name: str) -> Any:
    """Value of one knob: the one activation validated, else parsed from the environment now."""
    if _active is not None:
        return _active.values[name]
    k = _BY_NAME[name]
    raw = os.environ.get(k.env)
    return k.default if raw is None else k.parse(raw)
