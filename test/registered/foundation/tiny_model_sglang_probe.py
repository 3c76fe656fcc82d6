"""Run by test_tiny_model.py in a fresh process: sglang 0.5.17's own path over tiny model folders.

    python tiny_model_sglang_probe.py [--make KIND=DIR ...] KIND=DIR [KIND=DIR ...]   -> JSON on stdout

`--make` first runs `sglang-ext make-tiny-model KIND DIR` (the console entry's main) here, so
the caller can compare it byte for byte with a folder its own process wrote.

Per folder: sglang's `get_config`, `ModelConfig`, `get_tokenizer`, `get_processor` (VL kinds),
then sglang's real model class (`EntryClass` of sglang.srt.models.<kind>) built on the CPU in a
gloo world of one, every parameter set to NaN, and its own `load_weights` fed the folder's
model.safetensors: a parameter still NaN was not loaded (a name sglang does not map). The only
fake: rotary embeddings are told the platform is a CPU (sglang otherwise imports vllm's CUDA op
for them off CUDA). Own process because it initialises sglang's parallel state.
"""

from __future__ import annotations

import importlib
import json
import sys


def probe(kind: str, path: str) -> dict:
    import torch
    from safetensors.torch import load_file

    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config, get_processor, get_tokenizer

    report = {"architectures": list(get_config(path, trust_remote_code=False).architectures)}
    args = ServerArgs(model_path=path, device="cpu", mm_attention_backend="triton_attn")
    runtime_context.publish(args, role="test")
    config = ModelConfig(path)
    initialize_dp_attention(args, config)
    report.update(is_multimodal=config.is_multimodal, dtype=str(config.dtype), head_dim=config.head_dim,
                  context_len=config.context_len, vocab_size=config.vocab_size,
                  tokenizer=type(get_tokenizer(path)).__name__)
    if config.is_multimodal:
        report["processor"] = type(get_processor(path, trust_remote_code=False)).__name__

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
    from sglang_ext import cli

    specs = []
    while argv:
        arg = argv.pop(0)
        if arg == "--make":
            kind, path = argv.pop(0).split("=", 1)
            if cli.main(["make-tiny-model", kind, path]) != 0:
                raise SystemExit(f"make-tiny-model {kind} {path} failed")
        else:
            specs.append(arg)

    import sglang.srt.layers.rotary_embedding.base as rope_base

    from sglang_ext.testing.single_rank import init_single_rank_parallel_state

    rope_base._is_cpu = True  # native rotary path; see the module docstring
    init_single_rank_parallel_state()
    reports = {}
    for spec in specs:
        kind, path = spec.split("=", 1)
        reports[kind] = probe(kind, path)
    sys.stdout.write("PROBE " + json.dumps(reports) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
