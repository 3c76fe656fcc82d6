"""scripts/pi05_roofline.py on sglang's real Pi0.5 (one layer per Gemma tower, CPU): what the hooks count per
phase against the model's own parameters, the floor, and the table bench_pi05 and the doc print."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

import pi05_roofline  # noqa: E402


# Building the policy initialises sglang's process groups: done in a child process, so ranks that later
# tests fork from this one inherit none. It returns the counts and, from the model's own parameters, what
# they should be.
_MEASURE = r"""
import json, sys
import torch
sys.path[:0] = sys.argv[2:]
import pi05_roofline
from sglang_ext_testkit import pi05_random


def weight_bytes(*modules, skip=lambda name: False):
    return float(sum(m.weight.numel() * m.weight.element_size() for tower in modules for name, m in tower.named_modules()
                     if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() >= 2
                     and not isinstance(m, torch.nn.Embedding) and not skip(name)))


def run(policy, observation, noise, graph, num_steps, stamps):
    return pi05_random.run_request(policy, observation, noise, graph=graph, num_steps=num_steps, stamps=stamps)


policy = pi05_random.build_random_pi05(device="cpu", reduced=True, log=lambda _: None)
noise = pi05_random.make_noise(policy)
works = {f"{p},{s}": pi05_roofline.measure(policy, pi05_random.make_observation(policy, prompt_len=p), noise, s, run)
         for p, s in ((20, 2), (20, 4), (40, 2))}
pair, core = policy.core_model.paligemma_with_expert, policy.core_model
model = pair.paligemma.model
lm, ex = model.language_model.config, pair.gemma_expert.model.config
expected = {
    "prefix_bytes": weight_bytes(model.vision_tower, model.multi_modal_projector, model.language_model),
    "language_params": float(sum(m.weight.numel() for m in model.language_model.modules()
                                 if type(m).__name__.endswith("Linear"))),
    "step_bytes": weight_bytes(pair.gemma_expert.model, skip=lambda name: name.endswith(".dense"))
    + weight_bytes(core.action_in_proj, core.action_out_proj)
    + 2.0 * ex.num_hidden_layers * 532 * lm.num_key_value_heads * lm.head_dim * 2,
    "step_conditioning_bytes": weight_bytes(pair.gemma_expert.model, skip=lambda name: not name.endswith(".dense"))
    + weight_bytes(core.time_mlp_in, core.time_mlp_out),
}
with open(sys.argv[1], "w") as f:
    json.dump({"works": works, "expected": expected}, f)
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("roofline") / "work.json"
    paths = [os.path.join(REPO, "scripts"), os.path.join(REPO, "test"), os.path.join(REPO, "python")]
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(out), *paths], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    return {tuple(int(v) for v in key.split(",")): work for key, work in data["works"].items()}, data["expected"]


@pytest.fixture(scope="module")
def works(measured):
    return measured[0]


def test_prefix_reads_every_prefix_weight_once_and_sees_its_rows(measured):
    works, expected = measured
    work = works[(20, 2)]
    assert work["prefix"]["gb"] * 1e9 == expected["prefix_bytes"]
    assert work["rows"] == {"batch": 1, "vision_images": 2, "vision_patches": 256, "language": 512 + 20, "expert": 50}
    # the language model's matrix FLOPs grow with the prompt; SigLIP's do not
    matrix = {p: works[(p, 2)]["prefix"]["tflop"] - works[(p, 2)]["prefix"]["attention_tflop"] for p in (20, 40)}
    assert (matrix[40] - matrix[20]) * 1e12 == pytest.approx(2.0 * 20 * expected["language_params"], rel=1e-9)


def test_denoise_bytes_are_per_step_and_leave_the_time_conditioning_out(measured):
    works, expected = measured
    assert works[(20, 2)]["denoise"]["gb"] * 1e9 == pytest.approx(2 * expected["step_bytes"], rel=1e-12)
    assert works[(20, 4)]["denoise"]["gb"] == pytest.approx(2 * works[(20, 2)]["denoise"]["gb"], rel=1e-12)
    assert works[(20, 4)]["denoise"]["conditioning_gb"] * 1e9 == pytest.approx(
        4 * expected["step_conditioning_bytes"], rel=1e-12)
    assert expected["step_conditioning_bytes"] > 0


def test_floor_is_the_slower_of_compute_and_bandwidth_and_the_table_shows_each_mode(works):
    work = works[(20, 2)]
    for phase in ("prefix", "denoise"):
        p = work[phase]
        assert p["floor_ms"] == pytest.approx(max(p["tflop"] / pi05_roofline.PEAK_TFLOPS,
                                                  p["gb"] / (pi05_roofline.PEAK_TB_S * 1e3)) * 1e3, rel=1e-12)
    floor = work["prefix"]["floor_ms"] + work["denoise"]["floor_ms"]
    results = [{"impl": "0517-ext", "mode": "graph-fast", "prefix_p50_ms": 2 * work["prefix"]["floor_ms"],
                "denoise_p50_ms": 4 * work["denoise"]["floor_ms"], "p50_ms": 5 * floor},
               {"impl": "0517", "mode": "eager", "skipped": "no numbers"}]
    lines = pi05_roofline.table(work, results).splitlines()
    assert len(lines) == 3 and lines[2].split()[:2] == ["0517-ext", "graph-fast"]
    assert [cell for cell in lines[2].split() if cell.endswith("x")] == ["2.0x", "4.0x", "5.0x"]


def test_the_performance_doc_shows_the_table_once_a_run_carries_the_work(works):
    import gen_performance_doc

    work = {"layout": "full", "prompt_len": 20, **works[(20, 2)]}
    results = [{"impl": "0517", "mode": "eager", "prefix_p50_ms": 30.0, "denoise_p50_ms": 40.0, "p50_ms": 71.0}]
    assert gen_performance_doc._pi05_roofline([{"impl": "0517"}], results) == []
    lines = gen_performance_doc._pi05_roofline([{"impl": "0517"}, {"impl": "0517-ext", "work": work}], results)
    assert "prompt 20 tokens" in lines[1] and pi05_roofline.table(work, results) in lines
