"""CPU tests of the pure parts of the real-server tests: request stream, signatures, /metrics
parsing, and the server process handle (on a stand-in HTTP server process)."""

from __future__ import annotations

import base64
import io

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

from sglang_ext_testkit import vl_stream as vs  # noqa: E402


@pytest.mark.parametrize("unit", [28, 32])
def test_stream_layouts_sizes_and_unique_images(unit):
    stream = vs.build_stream(unit, 200, seed=0)
    assert len(stream) == 200 and [s.index for s in stream] == list(range(200))
    assert stream == vs.build_stream(unit, 200, seed=0) and stream != vs.build_stream(unit, 200, seed=1)
    assert all(1 <= s.units <= 4 and len(s.seeds) == s.units for s in stream)
    assert all(w % unit == 0 and h % unit == 0 for s in stream for w, h in s.sizes)
    layouts = {tuple((w // unit, h // unit) for w, h in s.sizes) for s in stream}
    assert layouts == set(vs.LAYOUTS)
    seeds = [x for s in stream + vs.warmup_stream(unit) for x in s.seeds]
    assert len(seeds) == len(set(seeds)), "an image repeats: the embedding cache would skip the ViT"


def test_stream_keeps_equal_patch_count_pair_adjacent():
    unit = 28
    stream = vs.build_stream(unit, 200)
    wide, pair = [tuple((w * unit, h * unit) for w, h in lay) for lay in vs.EQUAL_PATCH_PAIR]
    assert wide == ((448, 224),) and pair == ((224, 224), (224, 224))
    assert vs.patch_count(wide, 14) == vs.patch_count(pair, 14) == 512
    adjacent = sum(a.sizes == wide and b.sizes == pair for a, b in zip(stream, stream[1:]))
    assert adjacent >= 200 // (len(vs.LAYOUTS) - 1) - 1
    assert {tuple(s.sizes) for s in vs.warmup_stream(unit)} >= {tuple(s.sizes) for s in stream}


def test_images_are_seeded_sized_pngs():
    from PIL import Image

    a, b = vs.image_data_uri(224, 448, 3), vs.image_data_uri(224, 448, 4)
    assert a == vs.image_data_uri(224, 448, 3) and a != b
    img = Image.open(io.BytesIO(base64.b64decode(a.split(",", 1)[1])))
    assert img.format == "PNG" and img.size == (224, 448)
    spec = vs.build_stream(28, 1)[0]
    changed = vs.with_image_changed(spec)
    assert changed.sizes == spec.sizes and vs.images_of(changed)[0] != vs.images_of(spec)[0]
    assert vs.images_of(changed)[1:] == vs.images_of(spec)[1:]


def test_request_bodies():
    spec = next(s for s in vs.build_stream(32, 30) if s.units == 3)
    body = vs.generate_body(spec)
    assert body["text"].count(vs.IMAGE_TOKEN) == 3 == len(body["image_data"])
    assert body["return_logprob"] is True and body["logprob_start_len"] == 0
    assert body["sampling_params"]["temperature"] == 0.0
    chat = vs.chat_body(spec, "/models/tiny")
    parts = chat["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image_url"] * 3 + ["text"]
    assert [p["image_url"]["url"] for p in parts[:3]] == body["image_data"]
    assert chat["logprobs"] is True and chat["temperature"] == 0.0


def test_signatures_from_responses():
    gen = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-5.5, 2, None], [-6.25, 3, None]],
                         "output_token_logprobs": [[-0.5, 9, None]]}}
    assert vs.generate_signature(gen) == [-5.5, -6.25, -0.5]
    with pytest.raises(ValueError, match="no logprobs"):
        vs.generate_signature({"meta_info": {"input_token_logprobs": [[None, 1, None]],
                                             "output_token_logprobs": []}})
    chat = {"choices": [{"logprobs": {"content": [{"token": "a", "logprob": -1.0, "top_logprobs": []},
                                                  {"token": "b", "logprob": -2.5, "top_logprobs": []}]}}]}
    assert vs.chat_signature(chat) == [-1.0, -2.5]


def test_compare_counts_bitwise_tolerance_and_length():
    ref = [[-1.0, -2.0], [-3.0], [-4.0, -5.0], [-6.0]]
    got = [[-1.0, -2.0], [-3.004], [-4.0, -5.5], [-6.0, -7.0]]
    cmp = vs.compare(got, ref, atol=0.01)
    assert (cmp.n, cmp.bitwise, cmp.within, cmp.mismatches) == (4, 1, 2, 2)
    assert cmp.max_diff == float("inf") and cmp.worst == 3
    assert "2 beyond atol=0.01" in cmp.line("x")
    assert vs.compare(ref, ref, 0.0).mismatches == 0
    with pytest.raises(ValueError):
        vs.compare(got[:2], ref, 0.01)


def test_metrics_summed_over_pids_from_real_exposition():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    reg = CollectorRegistry()
    hits = Counter("sglang_ext_graph_hits_total", "h", ["cache", "pid"], registry=reg)
    hits.labels("vit_cuda_graph", "11").inc(3)
    hits.labels("vit_cuda_graph", "12").inc(4)
    hits.labels("pi05_action_graph", "11").inc(100)
    res = Gauge("sglang_ext_graph_resident", "r", ["cache", "pid"], registry=reg)
    res.labels("vit_cuda_graph", "11").set(5)
    Gauge("sglang_ext_cuda_memory_reserved_bytes", "m", ["pid"], registry=reg).labels("11").set(2**30)
    m = vs.vit_graph_counters(generate_latest(reg).decode())
    assert m["hits"] == 7 and m["resident"] == 5 and m["reserved_bytes"] == 2**30
    assert m["captures"] is None and m["capacity"] is None  # absent is not zero


def test_the_random_size_stream_is_seeded_and_its_patch_counts_are_not_all_multiples_of_64():
    stream = vs.random_size_stream(28, 200, seed=7)
    assert stream == vs.random_size_stream(28, 200, seed=7) and stream != vs.random_size_stream(28, 200, seed=8)
    assert {s.units for s in stream} == {1, 2} and [s.index for s in stream] == list(range(200))
    assert all(224 <= side <= 896 and side % 28 == 0 for s in stream for size in s.sizes for side in size)
    counts = [vs.patch_count(s.sizes, 14) for s in stream]
    assert any(c % 64 for c in counts) and all(c % 4 == 0 for c in counts)
    assert all(vs.patch_count(tuple((w * 28, h * 28) for w, h in lay), 14) % 64 == 0 for lay in vs.LAYOUTS)
    seeds = [seed for s in stream for seed in s.seeds]
    assert len(seeds) == len(set(seeds))  # no two images alike
