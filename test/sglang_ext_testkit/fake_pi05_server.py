"""sglang's real Pi0.5 server on a machine without a GPU: every process, hop and stage is
sglang 0.5.17's own, except the 3.35 B policy model, which a small stand-in replaces.

    python -m sglang_ext_testkit.fake_pi05_server [--ext] <sglang serve arguments>

Used by the CPU tests of the transport patches and by `scripts/bench_pi05_server.py
--cpu-logic-check`. What is real: `sglang serve`'s argument parsing, the multimodal_gen
launcher, the HTTP process (FastAPI app, `/v1/actions/generations`, the `/openpi/policy`
websocket, JSON and msgpack parsing, image decoding), the ZMQ hop to the scheduler, the
scheduler's event loop, the worker (`CPUWorker`, sglang's GPU worker class), the Pi0.5
pipeline and its four stages with the real preprocessor (tokenizer, image conversion) and
postprocessor, and the way back. What is not: `Pi05PolicyModel.from_pretrained` returns a
`StandInPi05Policy`, whose actions are a fixed function of the observation (see
`expected_actions`), so a client can check every answer belongs to its own request.

`--ext` switches sglang-ext on first (as `python -m sglang_ext.serve` does; that launcher
refuses to start without a GPU). The stand-in reaches the spawned worker like sglang-ext
does (`sglang_ext.mg_worker.entries`): the worker target is rebound to a `StandInEntry`, which
pickles as a call into this module, so the child installs the stand-in while unpickling its
target and then runs the target it wrapped (sglang's, or sglang-ext's worker entry).
"""

from __future__ import annotations

import sys
from typing import Any, List

import numpy as np
import torch

# Actions of the stand-in: noise (or zeros) + mean pixel of the first camera / 255 + state (padded).
IMAGE_WEIGHT = 1.0 / 255.0


def expected_actions(first_image_uint8, state, noise, horizon: int, action_dim: int, output_dim: int):
    """What StandInPi05Policy answers for a request with these raw inputs ([horizon, output_dim])."""
    base = np.zeros((horizon, action_dim), np.float32) if noise is None else np.asarray(noise, np.float32).copy()
    base += np.float32(float(np.asarray(first_image_uint8, np.float64).mean()) * IMAGE_WEIGHT)
    if state is not None:
        padded = np.zeros(action_dim, np.float32)
        flat = np.asarray(state, np.float32).reshape(-1)
        padded[: flat.shape[0]] = flat
        base += padded[None, :]
    return base[:, :output_dim]


class StandInPi05Policy(torch.nn.Module):
    """What the Pi0.5 stages call on the policy, with a few tensor ops instead of the model."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("_anchor", torch.zeros(1))
        self.calls = {"encode_prefix": 0, "sample_actions": 0}

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def encode_prefix(self, observation, **_graph_options):
        from sglang.multimodal_gen.runtime.vla.prefix_cache import PrefixContext

        self.calls["encode_prefix"] += 1
        camera_order = tuple(observation.metadata.get("camera_order", ()))
        first = observation.images[camera_order[0]].to(self.device, torch.float32)
        # the preprocessor maps uint8 x to x / 255 * 2 - 1: undo it for the mean pixel value
        pixel_mean = ((first.double() + 1.0) * 0.5 * 255.0).mean().reshape(1, 1)
        masks = observation.token_masks.to(self.device)
        return PrefixContext(past_key_values=pixel_mean, prefix_pad_masks=masks, prefix_len=int(masks.shape[1]),
                             layout={"full_attention": True, "cuda_graph_eligible": False})

    def build_prefix_cache_key(self, observation, **_options) -> str:
        return f"stand-in:{id(observation)}"  # never equal: the prefix cache never hits

    def should_run_action_denoise(self, prefix_context) -> bool:
        return True

    def action_parallel_info(self, prefix_context) -> dict:
        return {"mode": "stand-in"}

    def warmup_actions(self, batch_size: int = 1) -> torch.Tensor:
        return torch.zeros(batch_size, self.config.action_horizon, self.config.action_dim, device=self.device)

    def sample_actions(self, observation, prefix_context, *, noise, num_steps, use_cuda_graph=True,
                       generator=None) -> torch.Tensor:
        self.calls["sample_actions"] += 1
        shape = (observation.batch_size, self.config.action_horizon, self.config.action_dim)
        x_t = torch.zeros(shape, device=self.device) if noise is None else noise.to(self.device, torch.float32).clone()
        x_t += (prefix_context.past_key_values * IMAGE_WEIGHT).to(torch.float32)
        if observation.state is not None:
            state = observation.state.to(self.device, torch.float32)
            x_t[..., : state.shape[-1]] += state[:, None, :]
        return x_t


def _stand_in_from_pretrained(cls, model_path, config, *, dtype=None):
    cls._apply_checkpoint_config(model_path, config)  # sglang's own: cameras, dims, horizon
    return StandInPi05Policy(config)


def _cpu_device_module(device=None):
    return torch.cpu if device is None else _torch_get_device_module(device)


_torch_get_device_module = torch.get_device_module


def install_stand_in() -> None:
    """Make `Pi05PolicyModel.from_pretrained` build the stand-in, in this process. Without CUDA,
    sglang's worker calls `torch.get_device_module()` (torch.cuda on a CPU build of torch) to
    pick its device: it gets `torch.cpu`, the device sglang's CPU platform runs on."""
    from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel

    Pi05PolicyModel.from_pretrained = classmethod(_stand_in_from_pretrained)
    if not torch.cuda.is_available():
        torch.get_device_module = _cpu_device_module


class StandInEntry:
    """Worker target: installs the stand-in in the spawned child, then runs `inner`."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.__name__ = getattr(inner, "__name__", "run_scheduler_process")

    def __call__(self, *args, **kwargs):
        install_stand_in()
        return self.inner(*args, **kwargs)

    def __reduce__(self):
        return (stand_in_entry, (self.inner,))


def stand_in_entry(inner) -> StandInEntry:
    """Called by pickle in the spawned child (after `inner` was unpickled: sglang-ext, if on, is active)."""
    install_stand_in()
    return StandInEntry(inner)


def main(argv: List[str]) -> Any:
    ext = "--ext" in argv
    argv = [a for a in argv if a != "--ext"]
    if ext:
        from sglang_ext.activation import activate

        activate(force=True)
    from sglang.multimodal_gen.runtime import launch_server

    install_stand_in()
    # the worker entry launch_server spawns: 0.5.17's run_scheduler_process, 0.5.23's bootstrap_scheduler_process
    entry = "run_scheduler_process" if hasattr(launch_server, "run_scheduler_process") else "bootstrap_scheduler_process"
    setattr(launch_server, entry, StandInEntry(getattr(launch_server, entry)))
    from sglang.cli.main import main as sglang_main

    sys.argv = ["sglang", "serve", *argv]
    return sglang_main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
