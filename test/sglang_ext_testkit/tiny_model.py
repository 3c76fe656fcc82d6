"""Tiny self-contained Qwen2 / Qwen2.5-VL / Qwen3-VL model folders, built offline and seeded.

    PYTHONPATH=test python -m sglang_ext_testkit.tiny_model {qwen2,qwen2_5_vl,qwen3_vl} DIR [--seed N] [--force]

A real-server test needs a model without a download, with outputs that depend on the input
(`--load-format dummy` weights are too small): a seeded random checkpoint at the scale of a Hugging
Face initialisation, a few MB. Real architectures and vision geometry; every width, depth and the
tokenizer small. The same seed writes the same bytes, so a second run changes nothing.
Exit status 0 when written or already there, 2 otherwise; every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
from typing import Dict, List, Optional, Tuple

from sglang_ext.tools.launcher import missing_message, missing_modules

KINDS = ("qwen2", "qwen2_5_vl", "qwen3_vl")
REQUIRED_MODULES = ("torch", "transformers", "tokenizers", "safetensors")
INIT_STD = 0.02
BPE_VOCAB = 384  # 256 byte symbols + merges
VOCAB_SIZE = 512  # model rows: BPE + special tokens, padded
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
# Qwen's pre-tokenisation: contractions, letters, single digits, punctuation runs, newlines, spaces.
_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_CORPUS = (
    "A photo of a cat sitting on a red chair next to the window.",
    "The robot arm picks up the blue cube and places it in the box.",
    "Describe the image in one sentence. What color is the car?",
    "There are two dogs playing in the park under a large tree.",
    "Count the objects on the table: 3 apples, 2 cups and 1 plate.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "user: What is shown in this picture?\nassistant: A small house with a garden.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ( ) [ ] { } , . ; : ! ? - + = / *",
)

# Hub-style config per kind; token ids are filled in from the tokenizer.
_TEXT = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
             hidden_act="silu", initializer_range=INIT_STD, tie_word_embeddings=False)
_VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=2, in_channels=3, spatial_merge_size=2,
               temporal_patch_size=2, out_hidden_size=_TEXT["hidden_size"], initializer_range=INIT_STD)
_MROPE_SECTION = [8, 12, 12]  # sums to head_dim / 2 = 32
_PROCESSING = dict(temporal_patch_size=2, merge_size=2, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
                   do_normalize=True, do_convert_rgb=True)  # both VL kinds' image and video processors


ALLOWED_FOLDERS = ("allowed: a new or empty folder, one holding this same model, or --force to overwrite "
                   "the model files")


class TinyModelError(ValueError):
    """Bad argument to ensure_tiny_model; the message is one line naming the field."""


def _token_ids(vocab: Dict[str, int]) -> Dict[str, int]:
    return {"bos_token_id": vocab["<|endoftext|>"], "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"]}


def _config(kind: str, vocab: Dict[str, int]) -> dict:
    ids = _token_ids(vocab)
    mm_ids = {"image_token_id": vocab["<|image_pad|>"], "video_token_id": vocab["<|video_pad|>"],
              "vision_start_token_id": vocab["<|vision_start|>"], "vision_end_token_id": vocab["<|vision_end|>"]}
    if kind == "qwen2":
        return dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1e6,
                    use_sliding_window=False, torch_dtype="bfloat16", **_TEXT, **ids)
    if kind == "qwen2_5_vl":
        vision = dict(_VISION, model_type="qwen2_5_vl", patch_size=14, hidden_act="silu", window_size=112,
                      fullatt_block_indexes=[1, 3], tokens_per_second=2)
        return dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", rope_theta=1e6,
                    rope_scaling={"type": "mrope", "mrope_section": _MROPE_SECTION}, use_sliding_window=False,
                    torch_dtype="bfloat16", vision_config=vision, **_TEXT, **ids, **mm_ids)
    text = dict(_TEXT, model_type="qwen3_vl_text", head_dim=64, attention_bias=False, rope_theta=5e6,
                rope_scaling={"rope_type": "default", "mrope_section": _MROPE_SECTION, "mrope_interleaved": True},
                torch_dtype="bfloat16", **ids)
    text.pop("tie_word_embeddings")
    vision = dict(_VISION, model_type="qwen3_vl", patch_size=16, hidden_act="gelu_pytorch_tanh",
                  num_position_embeddings=2304, deepstack_visual_indexes=[1, 2])
    return dict(architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl", tie_word_embeddings=False,
                torch_dtype="bfloat16", text_config=text, vision_config=vision, **mm_ids)


def _preprocessor_configs(kind: str) -> Dict[str, dict]:
    if kind == "qwen2_5_vl":
        common = dict(_PROCESSING, patch_size=14, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                      image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
        return {"preprocessor_config.json": dict(common, image_processor_type="Qwen2VLImageProcessor",
                                                 processor_class="Qwen2_5_VLProcessor"),
                "video_preprocessor_config.json": dict(common, video_processor_type="Qwen2VLVideoProcessor",
                                                       processor_class="Qwen2_5_VLProcessor")}
    common = dict(_PROCESSING, patch_size=16, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return {"preprocessor_config.json": dict(common, image_processor_type="Qwen2VLImageProcessor",
                                             processor_class="Qwen3VLProcessor",
                                             size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 1280}),
            "video_preprocessor_config.json": dict(common, video_processor_type="Qwen3VLVideoProcessor",
                                                   processor_class="Qwen3VLProcessor", fps=2,
                                                   size={"shortest_edge": 128 * 32 * 32,
                                                         "longest_edge": 768 * 32 * 32})}


# Our own Qwen-style chat template: <|im_start|>role\n...<|im_end|>\n, images and videos as
# <|vision_start|><|image_pad|><|vision_end|> (the processor expands the pad to the patch count).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] in ('video', 'video_url') %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_byte_level_bpe(leading_special_tokens=()):
    """A small deterministic byte-level BPE with Qwen's pre-tokenisation; `leading_special_tokens` get ids 0, 1."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=1, show_progress=False,
                                  special_tokens=list(leading_special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(_CORPUS) * 4, trainer=trainer)
    return tok


def _tokenizer_files(kind: str) -> Tuple[Dict[str, str], Dict[str, int]]:
    """{file name: text} and the vocabulary (special tokens included)."""
    tok = train_byte_level_bpe()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    vocab = tok.get_vocab(with_added_tokens=True)
    assert len(vocab) <= VOCAB_SIZE, len(vocab)
    config = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": _TEXT["max_position_embeddings"],
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False, "errors": "replace",
              "split_special_tokens": False,
              "added_tokens_decoder": {str(vocab[t]): {"content": t, "lstrip": False, "normalized": False,
                                                       "rstrip": False, "single_word": False, "special": True}
                                       for t in SPECIAL_TOKENS}}
    if kind != "qwen2":
        config.update(image_token="<|image_pad|>", video_token="<|video_pad|>",
                      vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>")
    # chat_template.jinja: read by the tokenizer and, for VL kinds, by the processor
    files = {"tokenizer.json": tok.to_str(pretty=True) + "\n", "tokenizer_config.json": _dumps(config),
             "chat_template.jinja": CHAT_TEMPLATE + "\n"}
    return files, vocab


def checkpoint_name(kind: str, hf_name: str) -> str:
    """The checkpoint name of a transformers 5 state-dict entry."""
    if kind == "qwen2_5_vl":
        for new, old in (("model.visual.", "visual."), ("model.language_model.", "model.")):
            if hf_name.startswith(new):
                return old + hf_name[len(new):]
    return hf_name


def parameter_shapes(kind: str, config: dict) -> Dict[str, Tuple[int, ...]]:
    """{checkpoint name: shape} of the transformers model class for `config` (built on meta)."""
    import torch
    import transformers

    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration)}[kind]
    hf_config = config_cls(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = model_cls(hf_config)
    return {checkpoint_name(kind, name): tuple(t.shape) for name, t in model.state_dict().items()}


def random_weights(shapes: Dict[str, Tuple[int, ...]], seed: int):
    """Hugging Face-style init from one seeded generator, in name order, as bfloat16."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith(".bias"):
            value = torch.zeros(shape)
        elif len(shape) == 1:  # RMSNorm / LayerNorm scales
            value = torch.ones(shape)
        else:
            value = torch.empty(shape).normal_(0.0, INIT_STD, generator=gen)
        tensors[name] = value.to(torch.bfloat16).contiguous()
    return tensors


def _dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _check_args(kind, path, seed, force) -> pathlib.Path:
    if kind not in KINDS:
        raise TinyModelError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise TinyModelError(f"--seed must be an integer in [0, 2**63); got {seed!r}")
    out = pathlib.Path(path)
    for parent in out.parents:  # the nearest existing one must be a folder (mkdir would say ENOTDIR)
        if parent.exists():
            if not parent.is_dir():
                raise TinyModelError(f"DIR {str(out)!r}: {str(parent)!r} is a file, not a "
                                     "folder; allowed: a path whose existing parts are folders")
            break
    if out.exists() and not out.is_dir():
        raise TinyModelError(f"DIR {str(out)!r} is a file, not a folder; {ALLOWED_FOLDERS}")
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):  # say so before seconds of generating
        raise TinyModelError(f"DIR {str(out)!r} is not writable by this user; "
                             "allowed: a folder this user can write")
    if out.is_dir() and not force:
        foreign = sorted(set(os.listdir(out)) - set(written_files(kind)))
        if foreign:  # known at once; a folder of only our names is compared after generating
            raise TinyModelError(f"DIR {str(out)!r} exists and holds other files "
                                 f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); {ALLOWED_FOLDERS}")
    return out


def _create_folder(out: pathlib.Path) -> List[pathlib.Path]:
    """mkdir -p `out`; returns the folders created (outermost first). Raises TinyModelError."""
    missing = []
    for folder in (out, *out.parents):
        if folder.exists():
            break
        missing.append(folder)
    created: List[pathlib.Path] = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError as exc:
            _remove_folders(created)
            raise TinyModelError(f"DIR {str(out)!r}: cannot create {str(folder)!r} "
                                 f"({exc.strerror}); allowed: a folder in a location this user can write") from None
        created.append(folder)
    return created


def _remove_folders(created: List[pathlib.Path]) -> None:
    for folder in reversed(created):
        with contextlib.suppress(OSError):  # not empty any more: someone else wrote there; leave it
            folder.rmdir()


def _model_files(kind: str, seed: int) -> Dict[str, bytes]:
    """{file name: content} of the `kind` folder."""
    from safetensors.torch import save

    tokenizer_files, vocab = _tokenizer_files(kind)
    config = _config(kind, vocab)
    texts: Dict[str, str] = {"config.json": _dumps(config), **tokenizer_files}
    texts["generation_config.json"] = _dumps(dict(_token_ids(vocab), do_sample=False,
                                                  eos_token_id=[vocab["<|im_end|>"], vocab["<|endoftext|>"]]))
    if kind != "qwen2":
        texts.update({name: _dumps(body) for name, body in _preprocessor_configs(kind).items()})
    files = {name: text.encode("utf-8") for name, text in texts.items()}
    files["model.safetensors"] = save(random_weights(parameter_shapes(kind, config), seed), metadata={"format": "pt"})
    return files


def _write_files(out: pathlib.Path, files: Dict[str, bytes]) -> None:
    """Write each file beside its place, then rename: a failure changes none and leaves no partial file."""
    temporary = {name: out / f".{name}.tmp-{os.getpid()}" for name in files}
    try:
        for name, data in files.items():
            with open(temporary[name], "wb") as f:
                f.write(data)
        for name in files:
            os.replace(temporary[name], out / name)
    except OSError as exc:
        for tmp in temporary.values():
            with contextlib.suppress(OSError):
                tmp.unlink()
        where = exc.filename or out
        raise TinyModelError(f"DIR {str(out)!r}: cannot write {str(where)!r} ({exc.strerror}); "
                             "allowed: a folder this user can write, with room for a few MB") from None


def ensure_tiny_model(kind: str, path, seed: int = 0, *, force: bool = False) -> Tuple[pathlib.Path, bool]:
    """Make `path` hold the `kind` model of `seed`; returns (the folder, whether anything was written).
    A non-empty folder holding anything else needs `force` (which overwrites our files only)."""
    out = _check_args(kind, path, seed, force)
    missing = missing_modules(REQUIRED_MODULES)
    if missing:
        raise TinyModelError(missing_message(missing))
    created = _create_folder(out)  # before the seconds of generating, so a bad place fails at once
    try:
        files = _model_files(kind, seed)
        if not force:
            present = {name: out / name for name in os.listdir(out)}  # only names of ours (_check_args)
            differ = sorted(name for name, path in present.items() if not path.is_file()
                            or path.read_bytes() != files[name])
            if differ:
                raise TinyModelError(f"DIR {str(out)!r} holds another model (differs in "
                                     f"{', '.join(differ)}); {ALLOWED_FOLDERS}")
            # what is there is this model: write only what is missing (an interrupted run), if anything
            files = {name: data for name, data in files.items() if name not in present}
            if not files:
                return out, False
        _write_files(out, files)
    except BaseException:
        _remove_folders(created)
        raise
    return out, True


def written_files(kind: str) -> List[str]:
    """Names of the files ensure_tiny_model writes for `kind`."""
    names = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
             "tokenizer_config.json"]
    if kind != "qwen2":
        names += ["preprocessor_config.json", "video_preprocessor_config.json"]
    return sorted(names)


PROG = "python -m sglang_ext_testkit.tiny_model"


def main(argv: Optional[List[str]] = None) -> int:
    from sglang_ext.tools.cli import OneLineParser
    from sglang_ext.tools.launcher import USAGE_EXIT

    ap = OneLineParser(
        prog=PROG, description="Write a self-contained model folder (config, tokenizer with Qwen special tokens and "
        "a chat template, processor files, a few MB of seeded random weights) that sglang serves without a "
        "download. The same seed writes byte-identical files.")
    # kind and seed are checked by ensure_tiny_model itself, so a bad value gets its one-line error
    ap.add_argument("kind", metavar="KIND", help="one of: " + ", ".join(KINDS))
    ap.add_argument("dir", metavar="DIR", help="output folder: new or empty (or use --force)")
    ap.add_argument("--seed", default="0", help="weight seed, an integer >= 0 (default 0)")
    ap.add_argument("--force", action="store_true", help="write into a non-empty folder, overwriting the model files")
    args = ap.parse_args(argv)
    try:
        seed = int(args.seed)
    except ValueError:
        seed = args.seed  # ensure_tiny_model names the field and the allowed values
    try:
        out, written = ensure_tiny_model(args.kind, args.dir, seed, force=args.force)
    except TinyModelError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return USAGE_EXIT
    if not written:
        sys.stderr.write(f"{PROG}: {str(out)!r} already holds this model ({args.kind}, seed {seed}); nothing written\n")
    sys.stdout.write(f"{out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
