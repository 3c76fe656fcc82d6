"""What one Pi0.5 request asks of the GPU, phase by phase, and how far a measured time is from its floor.

Counted, not assumed: one eager request runs with a forward hook on every module that holds a weight
matrix (linear layers, SigLIP's patch convolution; embedding tables are gathered, not read, and are
left out). Per phase (prefix: SigLIP, projector, the Gemma 2B prefix; denoise: every step of the action
expert), from what the hooks saw:
  matrix FLOPs     2 x rows x weight elements, per call (a convolution: per output position)
  attention FLOPs  4 x query rows x key rows x heads x head_dim per layer (the towers' own configs):
                   SigLIP per image, the prefix over its own rows, each step's action rows over prefix + action
  bytes            every weight once per call, and per denoise step the prefix K/V of every expert layer:
                   what no kernel can avoid reading from HBM (activations, a few MB, are left out)
Calls without a sequence dimension in the denoise (the time MLP and the adaptive norms' dense layers on
the step's time embedding) depend on the step only, not on the request: the fast path caches their
output across requests, so they are reported apart (`conditioning_gb`) and left out of the floor.
floor = max(FLOPs / peak rate, bytes / peak bandwidth) per phase, at the H200 datasheet's dense bf16
990 TFLOP/s and 4.8 TB/s (.library/device: a bf16 product measured 770-800 TFLOP/s there, a copy 4.3 TB/s).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

PEAK_TFLOPS, PEAK_TB_S = 990.0, 4.8


class _PhaseSwitch:
    """Passed where run_request takes its three stamps: before the prefix, between the phases, at the end."""

    def __init__(self, state: dict, phase):
        self.state, self.phase = state, phase

    def record(self):
        self.state["phase"] = self.phase


def _towers(policy):
    pair = policy.core_model.paligemma_with_expert
    return pair.paligemma.model.vision_tower, pair.paligemma.model.language_model, pair.gemma_expert.model


def measure(policy, observation, noise, num_steps: int, run_request: Callable) -> Dict[str, object]:
    """Run one eager request under the hooks; {"prefix": {...}, "denoise": {...}, "rows": {...}, ...}."""
    vision, language, expert = _towers(policy)
    tower_of = {}
    for name, tower in (("vision", vision), ("language", language), ("expert", expert)):
        for module in tower.modules():
            tower_of[id(module)] = name
    state = {"phase": None}
    totals = {phase: {"matrix_flop": 0.0, "bytes": 0.0, "conditioning_bytes": 0.0} for phase in ("prefix", "denoise")}
    # per sequence (attention is per sequence); `batch` sequences per call
    rows: Dict[str, int] = {"batch": 0, "vision_images": 0, "vision_patches": 0, "language": 0, "expert": 0}
    activation_bytes = [0]

    def hook(module, inputs, output):
        phase = state["phase"]
        if phase is None or not inputs or not torch.is_tensor(inputs[0]):
            return
        weight, x = module.weight, inputs[0]
        out = output[0] if isinstance(output, tuple) else output
        if phase == "denoise" and x.dim() == 2:  # the step's time conditioning: the same for every request
            totals[phase]["conditioning_bytes"] += float(weight.numel() * weight.element_size())
            return
        positions = out.numel() // out.shape[1] if isinstance(module, torch.nn.Conv2d) else x.numel() // x.shape[-1]
        totals[phase]["matrix_flop"] += 2.0 * positions * weight.numel()
        totals[phase]["bytes"] += float(weight.numel() * weight.element_size())
        tower = tower_of.get(id(module))
        if tower == "vision" and x.dim() == 3:
            rows["vision_images"], rows["vision_patches"] = max(rows["vision_images"], x.shape[0]), x.shape[1]
        elif tower in ("language", "expert") and x.dim() == 3:
            rows[tower], rows["batch"] = max(rows[tower], x.shape[1]), max(rows["batch"], x.shape[0])
            if tower == "language":
                activation_bytes[0] = x.element_size()  # the prefix K/V's element size

    handles = [m.register_forward_hook(hook) for m in policy.modules()
               if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() >= 2
               and not isinstance(m, torch.nn.Embedding)]
    try:
        stamps = (_PhaseSwitch(state, "prefix"), _PhaseSwitch(state, "denoise"), _PhaseSwitch(state, None))
        run_request(policy, observation, noise, False, num_steps, stamps)
    finally:
        for handle in handles:
            handle.remove()
    if not rows["language"] or not rows["expert"]:
        raise RuntimeError("pi05_roofline: no language-model or action-expert projection ran through a module "
                           "(a fused path?); measure the exact eager path")
    v, lm, ex, batch = vision.config, language.config, expert.config, rows["batch"]
    prefix_attention = (4.0 * v.num_hidden_layers * rows["vision_images"] * rows["vision_patches"] ** 2 * v.hidden_size
                        + 4.0 * lm.num_hidden_layers * batch * rows["language"] ** 2 * lm.num_attention_heads
                        * lm.head_dim)
    keys = rows["language"] + rows["expert"]
    step_attention = 4.0 * ex.num_hidden_layers * batch * rows["expert"] * keys * ex.num_attention_heads * ex.head_dim
    step_kv_bytes = (2.0 * ex.num_hidden_layers * batch * rows["language"] * lm.num_key_value_heads * lm.head_dim
                     * activation_bytes[0])
    totals["prefix"]["attention_flop"] = prefix_attention
    totals["denoise"]["attention_flop"] = num_steps * step_attention
    totals["prefix"]["kv_bytes"], totals["denoise"]["kv_bytes"] = 0.0, num_steps * step_kv_bytes
    out = {"rows": rows, "steps": num_steps, "peak_tflops": PEAK_TFLOPS, "peak_tb_s": PEAK_TB_S}
    for phase, t in totals.items():
        flop = t["matrix_flop"] + t["attention_flop"]
        t["bytes"] += t["kv_bytes"]
        out[phase] = {"tflop": flop / 1e12, "gb": t["bytes"] / 1e9, "attention_tflop": t["attention_flop"] / 1e12,
                      "matrix_tflop": t["matrix_flop"] / 1e12, "kv_gb": t["kv_bytes"] / 1e9,
                      "conditioning_gb": t["conditioning_bytes"] / 1e9,
                      "floor_ms": max(flop / (PEAK_TFLOPS * 1e12), t["bytes"] / (PEAK_TB_S * 1e12)) * 1e3}
    return out


def table(work: dict, results: List[dict]) -> str:
    """Per mode with phase times: achieved rates against the peaks and each phase's distance to its floor."""
    prefix, denoise = work["prefix"], work["denoise"]
    lines = [f"work per request (rows: {work['rows']}, {work['steps']} steps): prefix {prefix['tflop']:.2f} TFLOP "
             f"({prefix['attention_tflop']:.2f} in attention), {prefix['gb']:.2f} GB, floor {prefix['floor_ms']:.2f} ms; "
             f"denoise {denoise['tflop']:.2f} TFLOP, {denoise['gb']:.2f} GB (+{denoise['conditioning_gb']:.2f} GB of "
             f"time conditioning an eager step reads), floor {denoise['floor_ms']:.2f} ms; "
             f"peaks {work['peak_tflops']:.0f} TFLOP/s, {work['peak_tb_s']} TB/s",
             f"{'impl':<9} {'mode':<13} {'prefix ms':>9} {'TFLOP/s':>8} {'% peak':>7} {'x floor':>8} "
             f"{'denoise ms':>10} {'GB/s':>7} {'% peak':>7} {'x floor':>8} {'p50 ms':>7} {'x floor':>8}"]
    floor = prefix["floor_ms"] + denoise["floor_ms"]
    for r in results:
        p_ms, d_ms = r.get("prefix_p50_ms"), r.get("denoise_p50_ms")
        if not p_ms or not d_ms:
            continue
        p_rate, d_rate = prefix["tflop"] / p_ms * 1e3, denoise["gb"] / d_ms * 1e3
        lines.append(f"{r['impl']:<9} {r['mode']:<13} {p_ms:>9.2f} {p_rate:>8.0f} {p_rate / work['peak_tflops']:>7.1%} "
                     f"{p_ms / prefix['floor_ms']:>7.1f}x {d_ms:>10.2f} {d_rate:>7.0f} "
                     f"{d_rate / (work['peak_tb_s'] * 1e3):>7.1%} {d_ms / denoise['floor_ms']:>7.1f}x "
                     f"{r['p50_ms']:>7.2f} {r['p50_ms'] / floor:>7.1f}x")
    return "\n".join(lines)


# The work each kernel class is charged with in phase_table (None: no rate shown): GEMMs the matrix FLOPs
# and the weights, attention its FLOPs and the prefix K/V the denoise reads.
_CLASS_WORK = {"gemm": ("matrix_tflop", "weight_gb"), "attention": ("attention_tflop", "kv_gb")}


def phase_table(work: dict, result: dict) -> str:
    """Per phase of one mode: each kernel class's kernels and device time per request (torch.profiler),
    its achieved rate against the peaks where the class has counted work, the copies, the device's idle
    gaps (short: launches; long: waits for the host) and the rest (phase p50 minus all rows: the p50 is
    of timed requests, the rows of profiled ones; with PDL a kernel's time includes its wait for the one
    before, so the rows can sum above the phase)."""
    phases = result.get("phase_kernels_per_request") or {}
    lines = [f"{'phase':<8} {'class':<15} {'count':>7} {'ms':>7} {'share':>6} {'TFLOP/s':>8} {'% peak':>7} "
             f"{'GB/s':>7} {'% peak':>7}"]
    for phase in ("prefix", "denoise"):
        classes, phase_ms = phases.get(phase, {}), result.get(f"{phase}_p50_ms") or 0.0
        amounts = dict(work[phase], weight_gb=work[phase]["gb"] - work[phase].get("kv_gb", 0.0))

        def order(item):  # kernel classes by time, then copies, then idle
            label, (_, us) = item
            return (label.startswith("idle"), label == "copy", -us)

        for label, (count, us) in sorted(classes.items(), key=order):
            ms, rates = us / 1e3, ""
            flop_key, byte_key = _CLASS_WORK.get(label, (None, None))
            if flop_key and ms > 0:
                tflops, gbs = amounts.get(flop_key, 0.0) / ms * 1e3, amounts.get(byte_key, 0.0) / ms * 1e3
                rates = (f"{tflops:>8.0f} {tflops / work['peak_tflops']:>7.1%} {gbs:>7.0f} "
                         f"{gbs / (work['peak_tb_s'] * 1e3):>7.1%}")
            lines.append(f"{phase:<8} {label:<15} {count:>7.1f} {ms:>7.2f} {ms / phase_ms if phase_ms else 0:>6.1%} "
                         f"{rates}".rstrip())
        rest = phase_ms - sum(us for _, us in classes.values()) / 1e3
        lines.append(f"{phase:<8} {'rest':<15} {'':>7} {rest:>7.2f} {rest / phase_ms if phase_ms else 0:>6.1%}")
    return "\n".join(lines)
