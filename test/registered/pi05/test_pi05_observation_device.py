"""Patch pi05_observation_device on sglang 0.5.17's real Pi0.5 preprocessor, CPU only.

The device path's math (`preprocess_frame_on`) is run on the CPU here and must give sglang's
`_preprocess_image` bit for bit for every frame kind it takes over (numpy HWC / CHW / RGBA, PIL RGB /
L / RGBA, read-only msgpack arrays); frames needing a resize, float frames and torch tensors are
left to sglang. Without CUDA the patched preprocessor is sglang's. The Rust tokenizer front answers
sglang's tokenizer call exactly as transformers does (long prompts truncated, batches), hands any
other call to transformers, and gives up for good on a difference. The same math on the GPU:
test_pi05_observation_device_cuda.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from conftest import plugin_only
from sglang_ext_testkit import pi05_checkpoint as pc

register_cpu_ci(est_time=25, suite="base-a-test-cpu")

SIZE = (224, 224)


def _frames():
    from PIL import Image

    rng = np.random.default_rng(7)
    hwc = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    readonly = np.frombuffer(hwc.tobytes(), dtype=np.uint8).reshape(224, 224, 3)  # as msgpack gives it
    return {
        "numpy hwc": hwc, "numpy hwc read-only": readonly,
        "numpy chw": np.ascontiguousarray(hwc.transpose(2, 0, 1)),
        "numpy rgba": rng.integers(0, 256, (224, 224, 4), dtype=np.uint8),
        "pil rgb": Image.fromarray(hwc), "pil l": Image.fromarray(hwc[..., 0]),
        "pil rgba": Image.fromarray(rng.integers(0, 256, (224, 224, 4), dtype=np.uint8)),
    }


def _sglang_preprocess():
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages import pi05_preprocess

    return pi05_preprocess._preprocess_image


def assert_frames_equal_sglangs_preprocessing(device):
    """Every test frame scaled on `device` equals sglang 0.5.17's CPU preprocessing bit for bit."""
    from sglang_ext.pi05.observation_device import _ext_uint8_frame, preprocess_frame_on

    original = _sglang_preprocess()
    for name, frame in _frames().items():
        arr, hwc = _ext_uint8_frame(frame)
        ours = preprocess_frame_on(arr, SIZE, device, hwc=hwc)
        theirs = original(frame, SIZE)
        assert ours is not None and ours.device.type == device.type, name
        ours = ours.cpu()
        assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape == (3, 224, 224), name
        assert torch.equal(ours, theirs), f"{name}: max diff {float((ours - theirs).abs().max())}"


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_device_math_equals_sglangs_preprocessing_bit_for_bit():
    assert_frames_equal_sglangs_preprocessing(torch.device("cpu"))


def test_frames_sglang_must_handle_are_left_to_it():
    from sglang_ext.pi05.observation_device import _ext_uint8_frame, preprocess_frame_on

    small = np.zeros((100, 160, 3), np.uint8)  # needs sglang's resize-with-pad
    assert preprocess_frame_on(small, SIZE, torch.device("cpu")) is None
    assert preprocess_frame_on(np.zeros((224, 224, 7), np.uint8), SIZE, torch.device("cpu")) is None
    assert _ext_uint8_frame(np.zeros((224, 224, 3), np.float32)) is None
    assert _ext_uint8_frame(torch.zeros(3, 224, 224, dtype=torch.uint8)) is None
    assert _ext_uint8_frame(np.zeros((224, 224), np.uint8)) is None


@plugin_only
def test_without_cuda_the_patched_preprocessor_is_sglangs(ext_patches, tmp_path, monkeypatch):
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages import pi05_preprocess
    from sglang_ext_testkit import pi05_clients as clients

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = Pi05PipelineConfig(tokenizer_name=str(pc.write_tiny_gemma_tokenizer(tmp_path / "tok")))
    obs = clients.make_observation(3, pc.CAMERAS)
    raw = {"prompt": clients.PROMPT, "images": dict(obs.images), "state": obs.state, "noise": obs.noise}
    want = pi05_preprocess.Pi05Preprocessor(config)(dict(raw))
    statuses = ext_patches()
    assert str(statuses["pi05_observation_device"]) == "applied"
    assert pi05_preprocess._preprocess_image.__wrapped__ is not None
    preprocessor = pi05_preprocess.Pi05Preprocessor(config)
    got = preprocessor(dict(raw))
    assert type(preprocessor.tokenizer).__name__ == "RustTokenizerFront"
    for name in pc.CAMERAS:
        assert got.images[name].device.type == "cpu" and torch.equal(got.images[name], want.images[name])
    assert got.noise.device.type == "cpu" and torch.equal(got.noise, want.noise)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.token_masks, want.token_masks)
    assert torch.equal(got.state, want.state)


def _tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pc.write_tiny_gemma_tokenizer(tmp_path / "tok")))
    tok.padding_side = "right"
    return tok


def test_rust_tokenizer_front_answers_sglangs_call_as_transformers(tmp_path, monkeypatch):
    from sglang_ext.pi05.observation_device import _EXT_TOKENIZER_CHECKS, RustTokenizerFront

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = _tokenizer(tmp_path)
    front = RustTokenizerFront(tok)
    assert front.pad_token_id == tok.pad_token_id and front.padding_side == "right"
    prompts = [["Task: pick up the cube, State: 1 2 3;\nAction: "], ["word " * 400], ["a", "bb cc dd"]]
    for _ in range(_EXT_TOKENIZER_CHECKS):  # beyond the checked calls too
        for prompt in prompts:
            kwargs = dict(max_length=48, padding="max_length", truncation=True, return_tensors="pt")
            ours, theirs = front(prompt, **kwargs), tok(prompt, **kwargs)
            for key in ("input_ids", "attention_mask"):
                assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), (prompt, key)
    assert front._ext_checks_left == 0 and not front._ext_disabled
    # any other call is transformers'
    assert front("hello world")["input_ids"] == tok("hello world")["input_ids"]
    front.padding_side = "left"  # attributes are the tokenizer's
    assert tok.padding_side == "left"


def test_rust_tokenizer_front_gives_up_on_a_difference(tmp_path, monkeypatch, caplog):
    from sglang_ext.pi05.observation_device import RustTokenizerFront

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = _tokenizer(tmp_path)
    front = RustTokenizerFront(tok)
    kwargs = dict(max_length=32, padding="max_length", truncation=True, return_tensors="pt")
    backend = front._ext_backend(32)
    backend.enable_padding(length=32, pad_id=3, pad_token="<unk>")  # now differs from transformers' padding
    got = front(["short"], **kwargs)
    assert front._ext_disabled and "differs from transformers" in caplog.text
    assert torch.equal(got["input_ids"], tok(["short"], **kwargs)["input_ids"])
    assert torch.equal(front(["short"], **kwargs)["input_ids"], tok(["short"], **kwargs)["input_ids"])
