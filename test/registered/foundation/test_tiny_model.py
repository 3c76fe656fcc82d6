"""`python -m sglang_ext_testkit.tiny_model`: folders that load offline in transformers and sglang (0.5.17, 0.5.23).

For each kind: files written, weights at init scale, the same seed byte-identical (across
processes, through its command line), config / tokenizer / processor load offline and process
a real image through the chat template, and sglang's own config, tokenizer-manager image
processor and model class accept it, the model loading every parameter from the checkpoint
(tiny_model_sglang_probe.py, own process).
Bad arguments, folders it cannot write and missing packages: one line naming the field, exit status 2,
nothing written. The same command run again on its own folder writes nothing and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_ext_testkit import tiny_model
from sglang_ext_testkit.tiny_model import KINDS, PROG, SPECIAL_TOKENS, ensure_tiny_model, written_files

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
VL_KINDS = ("qwen2_5_vl", "qwen3_vl")
# A 224x280 (h x w) image: Qwen2.5-VL (patch 14, merge 2) keeps 224x280 -> 16x20 patches;
# Qwen3-VL (patch 16, merge 2) rounds to multiples of 32: 224x288 -> 14x18.
IMAGE_GRID = {"qwen2_5_vl": [1, 16, 20], "qwen3_vl": [1, 14, 18]}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: ensure_tiny_model(kind, root / kind, seed=0)[0] for kind in KINDS}


@pytest.fixture
def offline(monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)


def _files(path):
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


def test_every_file_gets_the_same_mode_from_the_umask(models):
    umask = os.umask(0)
    os.umask(umask)
    for kind, path in models.items():
        modes = {name: oct((path / name).stat().st_mode & 0o777) for name in os.listdir(path)}
        assert set(modes.values()) == {oct(0o666 & ~umask)}, (kind, modes)  # model.safetensors too


@pytest.mark.parametrize("kind", KINDS)
def test_files_and_weight_scale(models, kind):
    from safetensors.torch import load_file

    path = models[kind]
    assert sorted(os.listdir(path)) == written_files(kind)
    size = (path / "model.safetensors").stat().st_size
    assert 1 << 20 < size < 16 << 20, size
    weights = load_file(str(path / "model.safetensors"))
    matrices = [w.float() for w in weights.values() if w.dim() >= 2]
    assert all(w.isfinite().all() for w in weights.values())
    for w in matrices:
        assert 0.015 < w.std().item() < 0.025, w.std().item()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [{"qwen2": "Qwen2ForCausalLM",
                                        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                        "qwen3_vl": "Qwen3VLForConditionalGeneration"}[kind]]


def test_other_seed_changes_only_the_weights(models, tmp_path):
    other = ensure_tiny_model("qwen2", tmp_path / "seed1", seed=1)[0]
    same, changed = _files(models["qwen2"]), _files(other)
    assert [n for n in same if same[n] != changed[n]] == ["model.safetensors"]


@pytest.mark.parametrize("kind", KINDS)
def test_config_and_tokenizer_load_offline(models, kind, offline):
    from transformers import AutoConfig, AutoTokenizer

    path = str(models[kind])
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    assert (text.hidden_size // text.num_attention_heads, text.num_hidden_layers) == (64, 2)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(tok).__name__ in ("Qwen2Tokenizer", "Qwen2TokenizerFast")
    assert len(tok) <= text.vocab_size
    ids = {t: tok.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == len(SPECIAL_TOKENS)
    sentence = "The robot puts 3 red cubes in a box, then stops!"
    assert tok.decode(tok.encode(sentence, add_special_tokens=False)) == sentence
    assert len(tok.encode(sentence, add_special_tokens=False)) < len(sentence.encode())  # merges are used
    assert text.eos_token_id == ids["<|im_end|>"][0]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n")
    if kind in VL_KINDS:
        for field, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                             ("vision_start_token_id", "<|vision_start|>"),
                             ("vision_end_token_id", "<|vision_end|>")):
            assert getattr(config, field) == ids[token][0], field


@pytest.mark.parametrize("kind", VL_KINDS)
def test_processor_loads_offline_and_processes_an_image(models, kind, offline):
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    path = str(models[kind])
    config = AutoConfig.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    vision = config.vision_config
    assert processor.image_processor.patch_size == vision.patch_size == {"qwen2_5_vl": 14, "qwen3_vl": 16}[kind]
    assert processor.image_processor.merge_size == vision.spatial_merge_size == 2
    assert vision.temporal_patch_size == 2 and vision.hidden_size // vision.num_heads == 64
    if kind == "qwen2_5_vl":
        assert vision.fullatt_block_indexes and len(vision.fullatt_block_indexes) < vision.depth
    else:
        assert vision.deepstack_visual_indexes
    image = Image.fromarray((np.random.default_rng(0).random((224, 280, 3)) * 255).astype("uint8"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = processor(text=[prompt], images=[image], return_tensors="pt")
    grid = batch["image_grid_thw"].tolist()
    assert grid == [IMAGE_GRID[kind]]
    t, h, w = grid[0]
    patch_dim = 3 * vision.temporal_patch_size * vision.patch_size ** 2
    assert tuple(batch["pixel_values"].shape) == (t * h * w, patch_dim)
    assert int((batch["input_ids"] == config.image_token_id).sum()) == t * h * w // 4


def test_sglang_loads_every_weight_and_same_seed_gives_same_bytes_in_another_process(models, tmp_path):
    again = tmp_path / "again"
    specs = [f"{kind}={models[kind]}" for kind in KINDS]
    env = dict(os.environ, **OFFLINE, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, os.path.join(HERE, "tiny_model_sglang_probe.py"),
                          "--make", f"qwen2_5_vl={again}", *specs],
                         env=env, capture_output=True, text=True, timeout=240)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    assert _files(again) == _files(models["qwen2_5_vl"])
    reports = json.loads(lines[-1][len("PROBE "):])
    for kind in KINDS:
        rep = reports[kind]
        assert rep["not_loaded"] == [], (kind, rep["not_loaded"][:10])
        assert rep["parameters"] == rep["checkpoint_elements"], (kind, rep)
        assert rep["embed_equal"], kind
        assert rep["is_multimodal"] == (kind in VL_KINDS), kind
        assert rep["dtype"] == "torch.bfloat16" and rep["head_dim"] == 64 and rep["context_len"] == 32768, rep
        assert rep["tokenizer"] in ("Qwen2Tokenizer", "Qwen2TokenizerFast")
        if kind in VL_KINDS:
            assert rep["processor"] == {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[kind]
            assert rep["mm_processor"] == "QwenVLImageProcessor"
            t, h, w = IMAGE_GRID[kind]
            assert rep["image_grid_thw"] == [IMAGE_GRID[kind]] and rep["pixel_rows"] == t * h * w
            assert rep["image_tokens"] == t * h * w // 4
            assert rep["mrope_positions"] == [3, rep["input_len"]]


def _cli(argv, capsys):
    code = tiny_model.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv, field", [
    (["llama", "{dir}"], "kind must be one of qwen2, qwen2_5_vl, qwen3_vl"),
    (["qwen2", "{dir}", "--seed", "x"], "--seed must be an integer"),
    (["qwen2", "{dir}", "--seed", "-1"], "--seed must be an integer"),
    (["qwen2", "{full}"], "DIR '{full}' exists and holds other files (keep.txt)"),
])
def test_bad_arguments_one_line_exit_2_nothing_written(tmp_path, capsys, argv, field):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    target = tmp_path / "new"
    code, out, err = _cli([a.format(dir=target, full=full) for a in argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and field.format(full=full) in err and "Traceback" not in err, err
    assert not target.exists() and os.listdir(full) == ["keep.txt"]


def test_usage_error_is_one_line_exit_2_from_the_command_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "sglang_ext_testkit.tiny_model", "qwen2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"{PROG}: error: the following arguments are required: DIR"), proc.stderr
    assert proc.stderr.endswith(" --help)\n") and os.listdir(tmp_path) == []


def test_missing_packages_are_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tiny_model, "missing_modules", lambda names: ["tokenizers", "safetensors"])
    code, out, err = _cli(["qwen2", str(tmp_path / "tiny")], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"{PROG}: tokenizers and safetensors are not installed in ") and "install_cpu_env.sh" in err
    assert os.listdir(tmp_path) == []


def test_force_writes_into_a_non_empty_folder(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    code, out, _ = _cli(["qwen2", str(tmp_path), "--force", "--seed", "7"], capsys)
    assert code == 0 and out.strip() == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == sorted(written_files("qwen2") + ["keep.txt"])


@pytest.mark.parametrize("where, reason", [
    ("{file}/tiny", "'{file}' is a file, not a folder"),
    ("{file}", "is a file"),
    ("/proc/sglang-ext-tiny", "cannot create '/proc/sglang-ext-tiny'"),
    ("/proc/sglang-ext-tiny/deeper", "cannot create '/proc/sglang-ext-tiny'"),
])
def test_folder_it_cannot_write_is_one_line_and_exit_2_from_the_command_line(tmp_path, where, reason):
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    target = where.format(file=a_file)
    proc = subprocess.run([sys.executable, "-m", "sglang_ext_testkit.tiny_model", "qwen2_5_vl", target],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"{PROG}: DIR {target!r}") and "; allowed: " in proc.stderr
    assert reason.format(file=a_file) in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["a-file"] and a_file.read_text() == "mine"


def _mtimes(path):
    return {name: (path / name).stat().st_mtime_ns for name in sorted(os.listdir(path))}


def test_same_command_again_writes_nothing_and_another_model_needs_force(tmp_path, capsys):
    folder = tmp_path / "tiny"
    assert _cli(["qwen2", str(folder), "--seed", "3"], capsys) == (0, f"{folder}\n", "")
    before, first = _mtimes(folder), _files(folder)
    code, out, err = _cli(["qwen2", str(folder), "--seed", "3"], capsys)
    assert (code, out) == (0, f"{folder}\n")
    assert err == f"{PROG}: '{folder}' already holds this model (qwen2, seed 3); nothing written\n"
    assert _mtimes(folder) == before
    code, out, err = _cli(["qwen2", str(folder), "--seed", "4"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "holds another model (differs in model.safetensors)" in err and "--force" in err
    assert _files(folder) == first  # nothing half-written
    (folder / "config.json").unlink()  # an interrupted folder of our own files: completed, not refused
    assert _cli(["qwen2", str(folder), "--seed", "3"], capsys)[0] == 0
    assert _files(folder) == first


def test_unwritable_file_in_the_folder_leaves_every_file_as_it_was(tmp_path, capsys):
    (tmp_path / "config.json").mkdir()  # a folder where a file must go: the rename fails
    code, out, err = _cli(["qwen2", str(tmp_path), "--force"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and "cannot write" in err, err
    assert sorted(os.listdir(tmp_path)) == ["config.json"]  # no temporary or partial file left
