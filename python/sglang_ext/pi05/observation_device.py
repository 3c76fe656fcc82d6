"""Pi0.5 camera frames go to the GPU once, as uint8, and are scaled there; the prompt goes to the Rust tokenizer.

Patch: pi05_observation_device
Targets: sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess:_preprocess_image,
sglang.multimodal_gen.runtime.pipelines_core.stages.model_specific_stages.pi05_preprocess:Pi05Preprocessor
Upstream PR: none (0.5.23 preprocesses on the CPU)
Retire when: upstream preprocesses Pi0.5 observations on the device

Why: the worker scales every frame in float32 on the CPU and copies 4x its bytes to the GPU
synchronously; the tokenizer call spends most of its time in transformers' Python wrappers.
How: a uint8 frame at the model's size is copied as uint8 and mapped on the GPU through a 256-entry
table of sglang's float32 values (same bits), the noise with it; the tokenizer call goes to the Rust
tokenizer, checked against transformers' call on its first answers.
"""

from __future__ import annotations

import functools
import logging
import threading

import numpy as np
import torch

logger = logging.getLogger("sglang_ext")

# Tokenizer answers compared with transformers' own call before the Rust path is trusted alone.
_EXT_TOKENIZER_CHECKS = 16


@functools.cache
def _levels_on(device):
    """uint8 level -> sglang's float32 value, computed on the CPU with sglang's ops and kept per device. Scaling
    on the GPU would not give the same bits: CUDA divides by a scalar as a multiply by its reciprocal."""
    return (torch.arange(256, dtype=torch.float32) / 255.0 * 2.0 - 1.0).to(device)


def _ext_observation_device():
    """The worker's current CUDA device, or None (CPU worker, CUDA not initialized yet)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _ext_uint8_frame(value):
    """(uint8 numpy array, is_pil) when sglang's path treats the frame as bytes, else None."""
    from PIL import Image  # sglang's preprocessor module imports it too

    if isinstance(value, Image.Image):
        # sglang: np.asarray(value.convert("RGB"), float32) / 255, always HWC -> CHW
        return np.asarray(value.convert("RGB")), True
    if isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 3:
        return value, False
    return None


def preprocess_frame_on(arr: np.ndarray, size, device: torch.device, *, hwc: bool = False):
    """sglang's `_preprocess_image` of a uint8 frame on `device`; None when it needs a resize or has
    no channel axis (sglang's path then)."""
    tensor = torch.from_numpy(np.ascontiguousarray(arr))
    if hwc:
        chw = tensor.permute(2, 0, 1)
    # _tensor_from_image's rule for arrays: channels first if the first dim looks like channels
    elif tensor.shape[0] in (1, 3, 4):
        chw = tensor[:3]
    elif tensor.shape[-1] in (1, 3, 4):
        chw = tensor[..., :3].permute(2, 0, 1)
    else:
        return None  # sglang raises its own ValueError for this shape
    if tuple(chw.shape[-2:]) != tuple(size):
        return None
    return _levels_on(device)[chw.to(device).long()]


def _wrap_preprocess_image(original):
    def _preprocess_image(value, size):
        device = _ext_observation_device()
        frame = _ext_uint8_frame(value) if device is not None else None
        out = preprocess_frame_on(frame[0], size, device, hwc=frame[1]) if frame is not None else None
        return original(value, size) if out is None else out

    _preprocess_image.__wrapped__ = original
    return _preprocess_image


def _wrap_call(original):
    def __call__(self, raw_observation):
        observation = original(self, raw_observation)
        device = _ext_observation_device()
        if device is not None and observation.noise is not None and observation.noise.device != device:
            observation.noise = observation.noise.to(device)
        return observation

    __call__.__wrapped__ = original
    return __call__


class RustTokenizerFront:
    """The preprocessor's tokenizer: sglang's one call goes to the Rust tokenizer, all else to transformers'."""

    def __init__(self, tokenizer) -> None:
        self._ext_tokenizer = tokenizer
        self._ext_backends = {}  # max_length -> configured copy of the Rust tokenizer
        self._ext_checks_left = _EXT_TOKENIZER_CHECKS
        self._ext_disabled = getattr(tokenizer, "_tokenizer", None) is None
        self._ext_lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.__dict__["_ext_tokenizer"], name)

    def __setattr__(self, name, value):
        if name.startswith("_ext_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._ext_tokenizer, name, value)

    def _ext_backend(self, max_length: int):
        backend = self._ext_backends.get(max_length)
        if backend is None:
            from tokenizers import Tokenizer

            tok = self._ext_tokenizer
            backend = Tokenizer.from_str(tok._tokenizer.to_str())
            backend.enable_truncation(max_length=max_length, stride=0, strategy="longest_first",
                                      direction=tok.truncation_side)
            backend.enable_padding(length=max_length, direction=tok.padding_side, pad_id=tok.pad_token_id,
                                   pad_token=tok.pad_token, pad_type_id=tok.pad_token_type_id)
            self._ext_backends[max_length] = backend
        return backend

    def __call__(self, text=None, *args, **kwargs):
        tok = self._ext_tokenizer
        sglang_call = (not args and isinstance(text, list) and all(isinstance(t, str) for t in text)
                       and set(kwargs) == {"max_length", "padding", "truncation", "return_tensors"}
                       and kwargs["padding"] == "max_length" and kwargs["truncation"] is True
                       and kwargs["return_tensors"] == "pt" and isinstance(kwargs["max_length"], int))
        if self._ext_disabled or not sglang_call:
            return tok(text, *args, **kwargs)
        encodings = self._ext_backend(kwargs["max_length"]).encode_batch(text, add_special_tokens=True)
        fast = {"input_ids": torch.tensor([e.ids for e in encodings], dtype=torch.long),
                "attention_mask": torch.tensor([e.attention_mask for e in encodings], dtype=torch.long)}
        if self._ext_checks_left > 0:
            reference = tok(text, **kwargs)
            same = all(torch.equal(fast[key], reference[key].to(torch.long)) for key in fast)
            with self._ext_lock:
                if not same:
                    self._ext_disabled = True
                    logger.warning("sglang-ext: the Rust tokenizer path differs from transformers' call for %r; "
                                   "tokenizing through transformers from now on", text)
                    return reference
                self._ext_checks_left -= 1
        return fast


def _wrap_init(original):
    def __init__(self, config):
        original(self, config)
        self.tokenizer = RustTokenizerFront(self.tokenizer)

    __init__.__wrapped__ = original
    return __init__


def patch_preprocess(ctx, module) -> None:
    ctx.setattr(module, "_preprocess_image", _wrap_preprocess_image(module._preprocess_image))
    cls = module.Pi05Preprocessor
    ctx.setattr(cls, "__init__", _wrap_init(cls.__dict__["__init__"]))
    ctx.setattr(cls, "__call__", _wrap_call(cls.__dict__["__call__"]))
