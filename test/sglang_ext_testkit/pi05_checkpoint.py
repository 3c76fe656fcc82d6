"""A random-weight Pi0.5 checkpoint folder that `sglang serve` loads, written on the GPU machine.

    python -m sglang_ext_testkit.pi05_checkpoint DIR [--seed N] [--device cuda]

sglang 0.5.17 serves Pi0.5 only from a checkpoint folder: its loader refuses any missing
tensor (no dummy load format), and its preprocessor loads the gated PaliGemma tokenizer by
name (`Pi05PipelineConfig.tokenizer_name`). This writes, without a download:

    DIR/model.safetensors       every tensor of sglang's own Pi05 core model (3.35 B, bf16,
                                6.7 GB), seeded random (sglang_ext_testkit.pi05_random), under
                                the names of the unpatched 0.5.17 model (separate q/k/v and
                                gate/up, as real checkpoints), which sglang-ext's merged
                                layers load through sglang's fused-weight mapping
    DIR/config.json             LeRobot-style policy config: LIBERO-like 2 cameras, state 8,
                                7 output action dims, horizon 50, 10 steps
    DIR/tokenizer/              a tiny Gemma-style tokenizer (<pad> 0, <eos> 1, <bos> 2, <unk> 3)
    DIR/pipeline_config.json    {"tokenizer_name": DIR/tokenizer}: pass it to the server as
                                --pipeline-config-path
    DIR/COMPLETE                written last: a folder without it is rewritten

DIR's name must contain "pi05": sglang picks the Pi0.5 pipeline from the model path.
Run it in a process without sglang-ext active, so the tensor names are upstream's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
from typing import Optional

def serve_attention_args() -> list:
    """`sglang serve` arguments for the attention backend: none (sglang's default, FA3 on Hopper) where
    sgl_kernel's FA3 imports, else `--attention-backend torch_sdpa` (the default would fail at the first
    request: multimodal_gen picks FA3 on SM90 whether or not it is installed)."""
    import importlib

    try:
        importlib.import_module("sgl_kernel.flash_ops")
    except Exception:  # noqa: BLE001 - absent, or its library fails to load
        return ["--attention-backend", "torch_sdpa"]
    return []


# Where the GPU tests and bench_pi05_server.py keep the checkpoint while the machine is held, and how
# long a Pi0.5 server may take to start.
CHECKPOINT_DIR = os.environ.get("SGLANG_EXT_TEST_PI05_CHECKPOINT", "/tmp/sgx-pi05-random")
SERVER_START_TIMEOUT = float(os.environ.get("SGLANG_EXT_TEST_SERVER_START_TIMEOUT", "480"))

GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
CAMERAS = ("base_0_rgb", "left_wrist_0_rgb")
STATE_DIM = 8
OUTPUT_ACTION_DIM = 7
ACTION_HORIZON = 50
ACTION_DIM = 32


def policy_config() -> dict:
    """The checkpoint's config.json (fields sglang's Pi05PolicyModel._apply_checkpoint_config reads)."""
    features = {f"observation.images.{name}": {"type": "VISUAL", "shape": [3, 224, 224]} for name in CAMERAS}
    features["observation.state"] = {"type": "STATE", "shape": [STATE_DIM]}
    return {
        "type": "pi05", "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m",
        "chunk_size": ACTION_HORIZON, "n_action_steps": ACTION_HORIZON, "max_action_dim": ACTION_DIM,
        "max_state_dim": 32, "num_inference_steps": 10, "tokenizer_max_length": 200,
        "image_resolution": [224, 224], "input_features": features,
        "output_features": {"action": {"type": "ACTION", "shape": [OUTPUT_ACTION_DIM]}},
    }


def write_tiny_gemma_tokenizer(path) -> pathlib.Path:
    """A byte-level BPE of a few hundred tokens with Gemma's special-token ids; adds <bos>."""
    from tokenizers import processors

    from sglang_ext_testkit.tiny_model import train_byte_level_bpe

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_byte_level_bpe(leading_special_tokens=GEMMA_SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 2)])
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
              "bos_token": "<bos>", "unk_token": "<unk>", "model_max_length": 200,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                               encoding="utf-8")
    return out


def action_request(seed: int, *, num_inference_steps: int = 10) -> dict:
    """A JSON body for POST /v1/actions/generations matching policy_config(): PNG cameras
    (base64) and explicit noise from `seed` (so two servers get the same request), a fixed
    prompt and state (so every request has the same prompt length, i.e. the same graph
    layout), graphs on."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)

    def png(size=224) -> dict:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
        return {"b64_json": base64.b64encode(buf.getvalue()).decode()}

    return {
        "prompt": "pick up the red block and put it in the basket",
        "images": {name: png() for name in CAMERAS},
        "camera_order": list(CAMERAS),
        "state": [round(-0.8 + 0.2 * i, 3) for i in range(STATE_DIM)],
        "noise": rng.standard_normal((ACTION_HORIZON, ACTION_DIM)).astype("float32").tolist(),
        "num_inference_steps": num_inference_steps,
        "runtime": {"cuda_graph": True, "prefix_cache": False, "return_timing": True},
    }


def write_pi05_assets(path) -> pathlib.Path:
    """Everything but the weights: config.json, tokenizer/, pipeline_config.json."""
    out = pathlib.Path(path).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(policy_config(), indent=2, sort_keys=True) + "\n")
    tokenizer = write_tiny_gemma_tokenizer(out / "tokenizer")
    (out / "pipeline_config.json").write_text(json.dumps({"tokenizer_name": str(tokenizer)}, indent=2) + "\n")
    return out


def serve_args(folder, port: int, scheduler_port: int):
    """`sglang serve`'s own ServerArgs for the assets folder `folder` (weights are never read), with the
    checkpoint's config applied and set as the process's global server args."""
    import argparse

    from sglang.multimodal_gen.runtime.entrypoints.cli.serve import add_multimodal_gen_serve_args
    from sglang.multimodal_gen.runtime.models.vlas.pi05_policy import Pi05PolicyModel
    from sglang.multimodal_gen.runtime.server_args import ServerArgs, set_global_server_args

    folder = str(folder)
    argv = ["--model-path", folder, "--pipeline-config-path", f"{folder}/pipeline_config.json", "--num-gpus", "1",
            "--warmup-mode", "off", "--host", "127.0.0.1", "--port", str(port)]
    saved = sys.argv
    sys.argv = ["sglang", "serve", *argv]
    try:
        parser = argparse.ArgumentParser()
        add_multimodal_gen_serve_args(parser)
        parsed, rest = parser.parse_known_args(argv)
        args = ServerArgs.from_cli_args(parsed, rest, default_args={"warmup_mode": "server"})
    finally:
        sys.argv = saved
    args.scheduler_port = scheduler_port
    args.broker_port  # noqa: B018 - property; settles the broker port now
    Pi05PolicyModel._apply_checkpoint_config(folder, args.pipeline_config)
    set_global_server_args(args)
    return args


def _checkpoint_tensors(policy) -> dict:
    """The core model's state dict on the CPU, every name its own contiguous tensor."""
    seen = {}
    tensors = {}
    for name, tensor in policy.core_model.state_dict().items():
        cpu = tensor.detach().to("cpu")
        key = (tensor.data_ptr(), tensor.shape, tensor.stride())
        tensors[name] = cpu.clone().contiguous() if key in seen else cpu.contiguous()
        seen[key] = name
    return tensors


def write_random_pi05_checkpoint(path, *, seed: int = 0, device: str = "cuda",
                                 log=print) -> pathlib.Path:
    """Write (or reuse, when COMPLETE records the same seed and sglang release) the folder described above."""
    import sglang
    import torch
    from safetensors.torch import save_file

    from sglang_ext_testkit.pi05_random import build_random_pi05

    out = pathlib.Path(path).resolve()
    if "pi05" not in out.name.lower():
        raise ValueError(f"path: {str(out)!r} is not allowed; allowed: a folder whose name contains 'pi05' "
                         "(sglang selects the Pi0.5 pipeline from the model path)")
    marker = out / "COMPLETE"
    # The layout (tensor names) is the writing release's: another sglang writes its own.
    written_by = f"seed={seed} sglang={sglang.__version__}"
    if marker.exists() and marker.read_text().strip() == written_by:
        log(f"[pi05_checkpoint] reusing {out}")
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    policy = build_random_pi05(device=device, dtype=torch.bfloat16, seed=seed, native_custom_ops=False, log=log)
    tensors = _checkpoint_tensors(policy)
    del policy
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_pi05_assets(out)
    marker.write_text(written_by + "\n")
    size = (out / "model.safetensors").stat().st_size
    log(f"[pi05_checkpoint] wrote {out}: {len(tensors)} tensors, {size / 2**30:.2f} GiB")
    return out


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ext_testkit.pi05_checkpoint",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    write_random_pi05_checkpoint(args.dir, seed=args.seed, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
