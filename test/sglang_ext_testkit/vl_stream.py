"""Image request streams, numeric signatures and /metrics reading for the real-server VL tests.

Pure Python + PIL: no sglang, no GPU (unit-tested on CPU). A request's signature is the list of
its input-token logprobs (`return_logprob`, `logprob_start_len: 0`) followed by its output-token
logprobs; two servers agree on a request when the signatures have equal length and their max
absolute difference is within a tolerance.
"""

from __future__ import annotations

import base64
import functools
import io
import math
import random
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# Image sizes in units of the merged patch (patch_size * spatial_merge_size pixels):
# 8x8 is 224x224 on Qwen2.5-VL (28 px) and 256x256 on Qwen3-VL (32 px).
SQ, WIDE, TALL, BIG, ODD = (8, 8), (16, 8), (8, 16), (12, 12), (10, 8)
# Request layouts (1-4 images). (WIDE,) and (SQ, SQ) have equal patch counts but other image
# boundaries; so have (WIDE, WIDE) and (SQ,)*4, and (TALL,) and (SQ, SQ).
LAYOUTS: Tuple[Tuple[Tuple[int, int], ...], ...] = (
    (SQ,), (WIDE,), (TALL,), (BIG,), (ODD,),
    (SQ, SQ), (SQ, TALL), (ODD, BIG),
    (SQ, WIDE, ODD), (TALL, SQ, SQ),
    (SQ, SQ, SQ, SQ), (WIDE, WIDE), (ODD, SQ, TALL, SQ),
)
# Kept adjacent in every block of the stream: the case 0.5.17's token-count key gets wrong.
EQUAL_PATCH_PAIR = ((WIDE,), (SQ, SQ))

IMAGE_TOKEN = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class RequestSpec:
    index: int
    sizes: Tuple[Tuple[int, int], ...]  # (width, height) in pixels per image
    seeds: Tuple[int, ...]  # one image seed per image

    @property
    def units(self) -> int:
        return len(self.sizes)


def patch_count(sizes: Iterable[Tuple[int, int]], patch: int) -> int:
    return sum((w // patch) * (h // patch) for w, h in sizes)


def build_stream(unit: int, n: int, seed: int = 0) -> List[RequestSpec]:
    """`n` requests: blocks of every layout in a seeded order, EQUAL_PATCH_PAIR kept adjacent.

    Every image has its own seed, so no two requests carry the same image.
    """
    rng = random.Random(seed)
    others = [lay for lay in LAYOUTS if lay not in EQUAL_PATCH_PAIR]
    layouts: List[Tuple[Tuple[int, int], ...]] = []
    while len(layouts) < n:
        block: List[object] = list(others) + [EQUAL_PATCH_PAIR]
        rng.shuffle(block)
        for item in block:
            layouts.extend(item if item is EQUAL_PATCH_PAIR else [item])  # type: ignore[list-item]
    return _numbered([tuple((w * unit, h * unit) for w, h in lay) for lay in layouts[:n]], seed)


def random_size_stream(unit: int, n: int, seed: int = 0, units: Tuple[int, int] = (8, 32),
                       max_images: int = 2) -> List[RequestSpec]:
    """`n` requests of 1-`max_images` images, each side a random multiple of `unit` in `units` (8-32: 224-896 px
    on Qwen2.5-VL): the sizes a server meets, where LAYOUTS have 9 patch counts, all multiples of 64."""
    rng = random.Random(seed)
    return _numbered([tuple((rng.randint(*units) * unit, rng.randint(*units) * unit)
                            for _ in range(rng.randint(1, max_images))) for _ in range(n)], seed)


def _numbered(requests: List[Tuple[Tuple[int, int], ...]], seed: int) -> List[RequestSpec]:
    """Requests 0, 1, ... with these image sizes; every image its own seed, counted from seed * 1_000_003."""
    specs, next_seed = [], seed * 1_000_003
    for i, sizes in enumerate(requests):
        specs.append(RequestSpec(i, sizes, tuple(range(next_seed, next_seed + len(sizes)))))
        next_seed += len(sizes)
    return specs


def warmup_stream(unit: int, seed: int = 10_000) -> List[RequestSpec]:
    """One request per layout (captures every graph the stream needs), images unlike the stream's."""
    return [RequestSpec(-1 - i, tuple((w * unit, h * unit) for w, h in lay),
                        tuple(seed * 1_000_003 + 10 * i + j for j in range(len(lay))))
            for i, lay in enumerate(LAYOUTS)]


def with_image_changed(spec: RequestSpec, which: int = 0) -> RequestSpec:
    """The same request with image `which` replaced by another seed (same size)."""
    seeds = list(spec.seeds)
    seeds[which] += 7_777_777
    return RequestSpec(spec.index, spec.sizes, tuple(seeds))


@functools.lru_cache(maxsize=4096)  # every server of a test gets the same images: encode once
def image_data_uri(width: int, height: int, seed: int) -> str:
    """A PNG data URI: seeded random colour blocks of 8x8 px (compresses well, differs per seed)."""
    from PIL import Image

    rng = random.Random(seed)
    bw, bh = max(1, width // 8), max(1, height // 8)
    small = Image.frombytes("RGB", (bw, bh), bytes(rng.randrange(256) for _ in range(bw * bh * 3)))
    buf = io.BytesIO()
    small.resize((width, height), Image.NEAREST).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def images_of(spec: RequestSpec) -> List[str]:
    return [image_data_uri(w, h, s) for (w, h), s in zip(spec.sizes, spec.seeds)]


def prompt_text(n_images: int) -> str:
    return ("<|im_start|>user\n" + IMAGE_TOKEN * n_images
            + "What is in the pictures?<|im_end|>\n<|im_start|>assistant\n")


def generate_body(spec: RequestSpec, max_new_tokens: int = 4) -> dict:
    return {"text": prompt_text(spec.units), "image_data": images_of(spec),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            "return_logprob": True, "logprob_start_len": 0}


def chat_body(spec: RequestSpec, model: str, max_tokens: int = 4) -> dict:
    content = [{"type": "image_url", "image_url": {"url": uri}} for uri in images_of(spec)]
    content.append({"type": "text", "text": "What is in the pictures?"})
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "temperature": 0.0, "max_tokens": max_tokens, "seed": 0,
            "logprobs": True, "top_logprobs": 0}


def generate_signature(response: dict) -> List[float]:
    """Input-token then output-token logprobs of a /generate response (the first input token has none)."""
    meta = response["meta_info"]
    values = [entry[0] for entry in meta["input_token_logprobs"]] + [
        entry[0] for entry in meta["output_token_logprobs"]]
    out = [float(v) for v in values if v is not None]
    if not out:
        # e.g. a request the server aborted still answers 200: say why it finished
        raise ValueError("response carries no logprobs (was return_logprob honoured?); finish_reason: "
                         f"{meta.get('finish_reason')!r}")
    return out


def chat_signature(response: dict) -> List[float]:
    """Output-token logprobs of a /v1/chat/completions response (chat has no input logprobs)."""
    content = response["choices"][0]["logprobs"]["content"]
    if not content:
        raise ValueError("chat response carries no logprobs")
    return [float(item["logprob"]) for item in content]


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


@dataclass
class Comparison:
    n: int
    bitwise: int  # requests whose signatures are exactly equal
    within: int  # requests within the tolerance (bitwise ones included)
    max_diff: float
    worst: Optional[int]  # position of the request with the largest difference
    atol: float

    @property
    def mismatches(self) -> int:
        return self.n - self.within

    def line(self, label: str) -> str:
        return (f"{label}: {self.n} requests, {self.bitwise} bitwise equal, {self.mismatches} beyond "
                f"atol={self.atol:g}, max |diff|={self.max_diff:.6g} (request #{self.worst})")


def compare(signatures: Sequence[Sequence[float]], reference: Sequence[Sequence[float]],
            atol: float) -> Comparison:
    if len(signatures) != len(reference):
        raise ValueError(f"{len(signatures)} signatures vs {len(reference)} reference signatures")
    diffs = [max_abs_diff(s, r) for s, r in zip(signatures, reference)]
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    return Comparison(n=len(diffs), bitwise=sum(list(s) == list(r) for s, r in zip(signatures, reference)),
                      within=sum(d <= atol for d in diffs), max_diff=max(diffs, default=0.0),
                      worst=worst, atol=atol)


def metric_sum(text: str, name: str, **labels: str) -> Optional[float]:
    """Sum of every sample `name` in Prometheus text whose labels include `labels` (e.g. over pid).

    None when no sample matched (the metric is not exported), so callers can tell 0 from absent.
    """
    from prometheus_client.parser import text_string_to_metric_families

    total, seen = 0.0, False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                seen = True
    return total if seen else None


def vit_graph_counters(metrics_text: str) -> Dict[str, Optional[float]]:
    """The ViT graph cache numbers of a server's /metrics, summed over processes."""
    cache = {"cache": "vit_cuda_graph"}
    return {
        "captures": metric_sum(metrics_text, "sglang_ext_graph_captures_total", **cache),
        "hits": metric_sum(metrics_text, "sglang_ext_graph_hits_total", **cache),
        "misses": metric_sum(metrics_text, "sglang_ext_graph_misses_total", **cache),
        "evictions": metric_sum(metrics_text, "sglang_ext_graph_evictions_total", **cache),
        "eager_fallbacks": metric_sum(metrics_text, "sglang_ext_graph_eager_fallbacks_total", **cache),
        "resident": metric_sum(metrics_text, "sglang_ext_graph_resident", **cache),
        "capacity": metric_sum(metrics_text, "sglang_ext_graph_capacity", **cache),
        "reserved_bytes": metric_sum(metrics_text, "sglang_ext_cuda_memory_reserved_bytes"),
    }
