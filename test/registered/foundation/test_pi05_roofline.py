"""scripts/pi05_roofline.py on sglang's real Pi0.5 (one layer per Gemma tower, CPU): what the hooks count per
phase against the model's own parameters, the floor, and the table bench_pi05 and the doc print (issue 29)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import pi05_roofline  # noqa: E402
from sglang_ext_testkit import pi05_random  # noqa: E402


def _run(policy, observation, noise, graph, num_steps, stamps):
    return pi05_random.run_request(policy, observation, noise, graph=graph, num_steps=num_steps, stamps=stamps)


def _weight_bytes(*modules, skip=lambda name: False) -> float:
    return float(sum(m.weight.numel() * m.weight.element_size() for tower in modules for name, m in tower.named_modules()
                     if isinstance(getattr(m, "weight", None), torch.nn.Parameter) and m.weight.dim() >= 2
                     and not isinstance(m, torch.nn.Embedding) and not skip(name)))


@pytest.fixture(scope="module")
def policy():
    return pi05_random.build_random_pi05(device="cpu", reduced=True, log=lambda _: None)


@pytest.fixture(scope="module")
def works(policy):
    noise = pi05_random.make_noise(policy)
    return {(prompt, steps): pi05_roofline.measure(policy, pi05_random.make_observation(policy, prompt_len=prompt),
                                                   noise, steps, _run)
            for prompt, steps in ((20, 2), (20, 4), (40, 2))}


def test_prefix_reads_every_prefix_weight_once_and_sees_its_rows(policy, works):
    pair = policy.core_model.paligemma_with_expert
    model = pair.paligemma.model
    work = works[(20, 2)]
    assert work["prefix"]["gb"] * 1e9 == _weight_bytes(model.vision_tower, model.multi_modal_projector,
                                                       model.language_model)
    assert work["rows"] == {"vision_images": 2, "vision_patches": 256, "language": 512 + 20, "expert": 50}
    # the language model's matrix FLOPs grow with the prompt; SigLIP's do not
    language = sum(m.weight.numel() for m in model.language_model.modules()
                   if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear"))
    matrix = {p: works[(p, 2)]["prefix"]["tflop"] - works[(p, 2)]["prefix"]["attention_tflop"] for p in (20, 40)}
    assert (matrix[40] - matrix[20]) * 1e12 == pytest.approx(2.0 * 20 * language, rel=1e-9)


def test_denoise_bytes_are_per_step_and_leave_the_time_conditioning_out(policy, works):
    pair = policy.core_model.paligemma_with_expert
    core = policy.core_model
    lm, expert = pair.paligemma.model.language_model.config, pair.gemma_expert.model.config
    per_step = (_weight_bytes(pair.gemma_expert.model, skip=lambda name: name.endswith(".dense"))
                + _weight_bytes(core.action_in_proj, core.action_out_proj)
                + 2.0 * expert.num_hidden_layers * 532 * lm.num_key_value_heads * lm.head_dim * 2)
    assert works[(20, 2)]["denoise"]["gb"] * 1e9 == pytest.approx(2 * per_step, rel=1e-12)
    assert works[(20, 4)]["denoise"]["gb"] == pytest.approx(2 * works[(20, 2)]["denoise"]["gb"], rel=1e-12)
    conditioning = _weight_bytes(pair.gemma_expert.model, skip=lambda name: not name.endswith(".dense")) \
        + _weight_bytes(core.time_mlp_in, core.time_mlp_out)
    assert works[(20, 4)]["denoise"]["conditioning_gb"] * 1e9 == pytest.approx(4 * conditioning, rel=1e-12)


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
