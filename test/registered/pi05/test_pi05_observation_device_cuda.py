"""Patch pi05_observation_device on the GPU: camera frames scaled on the device give sglang 0.5.17's
CPU preprocessing bit for bit, and the patched preprocessor hands the worker device tensors (frames
and noise) equal to sglang's CPU ones. The CPU half: test_pi05_observation_device.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sglang.test.ci.ci_register import register_cuda_ci

from conftest import plugin_only
from sglang_ext_testkit import pi05_checkpoint as pc
from test_pi05_observation_device import assert_frames_equal_sglangs_preprocessing

register_cuda_ci(est_time=60, stage="base-b", runner_config="1-gpu-small")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_frames_scaled_on_the_gpu_equal_sglangs_cpu_preprocessing():
    assert_frames_equal_sglangs_preprocessing(torch.device("cuda"))


@plugin_only
def test_patched_preprocessor_gives_the_worker_device_tensors(ext_patches, tmp_path, monkeypatch):
    from sglang.multimodal_gen.configs.pipeline_configs.pi05 import Pi05PipelineConfig
    from sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages import pi05_preprocess
    from sglang_ext_testkit import pi05_clients as clients

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.cuda.init()
    config = Pi05PipelineConfig(tokenizer_name=str(pc.write_tiny_gemma_tokenizer(tmp_path / "tok")))
    obs = clients.make_observation(5, pc.CAMERAS)
    raw = {"prompt": clients.PROMPT, "images": dict(obs.images), "state": obs.state, "noise": obs.noise}
    want = pi05_preprocess.Pi05Preprocessor(config)(dict(raw))
    ext_patches()
    got = pi05_preprocess.Pi05Preprocessor(config)(dict(raw))
    device = torch.device("cuda", torch.cuda.current_device())
    for name in pc.CAMERAS:
        assert got.images[name].device == device
        assert torch.equal(got.images[name].cpu(), want.images[name])
    assert got.noise.device == device and torch.equal(got.noise.cpu(), want.noise)
    assert got.tokens.device.type == "cpu" and torch.equal(got.tokens, want.tokens)  # host-side decisions
    assert np.isfinite(got.images[pc.CAMERAS[0]].cpu().numpy()).all()
