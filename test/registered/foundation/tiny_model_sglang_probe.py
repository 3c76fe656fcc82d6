"""Run by test_tiny_model.py in a fresh process: sglang's own path (0.5.17 or 0.5.23) over tiny model folders.

    python tiny_model_sglang_probe.py [--make KIND=DIR ...] KIND=DIR [KIND=DIR ...]   -> JSON on stdout

`--make` first runs `python -m sglang_ext_testkit.tiny_model KIND DIR` (its main) here, so
the caller can compare it byte for byte with a folder its own process wrote.

Per folder: sglang's `get_config`, `ModelConfig`, `get_tokenizer`, `get_processor` and, for VL
kinds, the tokenizer manager's multimodal processor (`get_mm_processor`) on a 224x280 PNG
through the chat template (input ids, image grid, pixel rows, M-RoPE positions); then sglang's
real model class (`EntryClass` of sglang.srt.models.<kind>) built on the CPU in a
gloo world of one, every parameter set to NaN, and its own `load_weights` fed the folder's
model.safetensors: a parameter still NaN was not loaded (a name sglang does not map). The only
fakes: rotary embeddings and the fast image processor are told the platform is a CPU (sglang
otherwise imports vllm's CUDA rotary op off CUDA, and sends images to cuda:0). Own process
because it initialises sglang's parallel state.
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys


def _multimodal_processor(path, args, config) -> dict:
    import asyncio
    import base64
    import io
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.utils.hf_transformers_utils import get_processor

    processor = get_processor(path, trust_remote_code=False)
    import_processors("sglang.srt.multimodal.processors")
    mm_processor = get_mm_processor(config.hf_config, args, processor, "default", model_config=config)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 280, 3), dtype=np.uint8)).save(buf, "PNG")
    image = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}],
        tokenize=False, add_generation_prompt=True)
    request = SimpleNamespace(video_data=None, audio_data=None, rid="probe")
    out = asyncio.run(mm_processor.process_mm_data_async([image], prompt, request))
    item = out.mm_items[0]
    return {"processor": type(processor).__name__, "mm_processor": type(mm_processor).__name__,
            "image_tokens": sum(1 for t in out.input_ids if t == config.hf_config.image_token_id),
            "image_grid_thw": item.image_grid_thw.tolist(), "pixel_rows": int(item.feature.shape[0]),
            "mrope_positions": list(out.mrope_positions.shape), "input_len": len(out.input_ids)}


def probe(kind: str, path: str) -> dict:
    import torch
    from safetensors.torch import load_file

    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config, get_processor, get_tokenizer

    from sglang_ext_testkit.single_rank import init_single_rank_parallel_state

    report = {"architectures": list(get_config(path, trust_remote_code=False).architectures)}
    args = ServerArgs(model_path=path, device="cpu", mm_attention_backend="triton_attn")
    # 0.5.23 reads the parallel widths and this process's ranks from what is published
    rank = {"ranks": runtime_context.SpawnRanks(world_rank=0)} if hasattr(runtime_context, "SpawnRanks") else {}
    runtime_context.publish(args, role="test", **rank)
    init_single_rank_parallel_state()
    config = ModelConfig(path)
    initialize_dp_attention(*(args, config)[:len(inspect.signature(initialize_dp_attention).parameters)])  # 0.5.23: args
    report.update(is_multimodal=config.is_multimodal, dtype=str(config.dtype), head_dim=config.head_dim,
                  context_len=config.context_len, vocab_size=config.vocab_size,
                  tokenizer=type(get_tokenizer(path)).__name__)
    if config.is_multimodal:
        report.update(_multimodal_processor(path, args, config))

    entry = importlib.import_module("sglang.srt.models." + kind).EntryClass
    model_cls = entry[0] if isinstance(entry, list) else entry
    model = model_cls(config.hf_config)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    weights = load_file(f"{path}/model.safetensors")
    model.load_weights(list(weights.items()))
    params = dict(model.named_parameters())
    embed = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
    ckpt_embed = next(w for n, w in weights.items() if n.endswith("embed_tokens.weight"))
    report.update(
        model_class=model_cls.__name__,
        parameters=sum(p.numel() for p in params.values()),
        checkpoint_elements=sum(w.numel() for w in weights.values()),
        not_loaded=sorted(n for n, p in params.items() if torch.isnan(p).any()),
        embed_equal=bool(torch.equal(embed.to(ckpt_embed.dtype), ckpt_embed)),
    )
    return report


def main(argv) -> None:
    from sglang_ext_testkit import tiny_model

    specs = []
    while argv:
        arg = argv.pop(0)
        if arg == "--make":
            kind, path = argv.pop(0).split("=", 1)
            if tiny_model.main([kind, path]) != 0:
                raise SystemExit(f"tiny_model {kind} {path} failed")
        else:
            specs.append(arg)

    import sglang.srt.layers.rotary_embedding.base as rope_base
    import sglang.srt.multimodal.processors.base_processor as mm_base

    rope_base._is_cpu = True  # native rotary path; see the module docstring
    mm_base._is_cpu = True  # image preprocessing on the CPU
    reports = {}
    for spec in specs:
        kind, path = spec.split("=", 1)
        reports[kind] = probe(kind, path)
    sys.stdout.write("PROBE " + json.dumps(reports) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
