"""scripts/gpu_env.sh on the CPU: unpacking a base, keeping FA3 parts across calls whose carried
folders are replaced, refusing a corrupt part, joining + verifying once all parts are there, and
installing this checkout so that its sglang plugin entry point is visible.

The carry here is small and synthetic, in the layout scripts/gpu_carry.sh writes (base.tar.xz +
base.sha256; fa3-N/fa3.xz.partN + fa3.sha256); the shell script under test is the real one.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile

import pytest
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=150, suite="base-a-test-cpu")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KERNEL = "sglang_kernel-9.9.9"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tar_xz(files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return lzma.compress(buf.getvalue())


def build_carry():
    """A base with an empty sgl_kernel package and its dist-info; a 'library' xz'd and split in 3."""
    base = tar_xz({"site/sgl_kernel/__init__.py": b"", f"site/{KERNEL}.dist-info/METADATA": b"x",
                   "sgl0517/marker.txt": b"0517"})
    library = os.urandom(300_000)
    packed = lzma.compress(library)
    third = -(-len(packed) // 3)
    parts = [packed[i * third:(i + 1) * third] for i in range(3)]
    manifest = f"# {KERNEL}\n" + "".join(f"{sha(p)}  fa3.xz.part{i + 1}\n" for i, p in enumerate(parts)) \
        + f"{sha(packed)}  fa3.xz\n{sha(library)}  flash_ops.abi3.so\n"
    return base, parts, manifest, library


def place(tree, base=None, parts=(), manifest="", sgl0519=None, sgl0523=None):
    """What one call carries: .carry/ holds only the named parts (the others are gone)."""
    carry = tree / ".carry"
    shutil.rmtree(carry, ignore_errors=True)
    for name, data in (("base", base), ("sgl0519", sgl0519), ("sgl0523", sgl0523)):
        if data is not None:
            (carry / name).mkdir(parents=True)
            (carry / name / f"{name}.tar.xz").write_bytes(data)
            (carry / name / f"{name}.sha256").write_text(f"{sha(data)}  {name}.tar.xz\n")
    for i, data in parts:
        d = carry / f"fa3-{i}"
        d.mkdir(parents=True)
        (d / f"fa3.xz.part{i}").write_bytes(data)
        (d / "fa3.sha256").write_text(manifest)


def source(tree, root, extra=""):
    script = f"source scripts/gpu_env.sh; rc=$?; {extra} echo \"rc=$rc\"; echo \"PYTHONPATH=$PYTHONPATH\""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGX_") and k != "PYTHONPATH"}
    env.update(SGX_ROOT=str(root), SGX_PYTHON=sys.executable)
    proc = subprocess.run(["bash", "-c", script], cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    return proc.stdout + proc.stderr


@pytest.fixture()
def tree(tmp_path):
    t = tmp_path / "checkout"
    (t / "scripts").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "gpu_env.sh"), t / "scripts")
    shutil.copy(os.path.join(REPO, "setup.py"), t)
    shutil.copytree(os.path.join(REPO, "python"), t / "python",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (t / "test" / "sglang_ext_testkit").mkdir(parents=True)
    for name in ("__init__.py", "stand_ins.py"):
        shutil.copy(os.path.join(REPO, "test", "sglang_ext_testkit", name), t / "test" / "sglang_ext_testkit")
    return t


def test_parts_survive_calls_and_join_verified(tree, tmp_path):
    root = tmp_path / "sgx"
    base, parts, manifest, library = build_carry()

    place(tree, base=base, parts=[(1, parts[0])], manifest=manifest)
    out = source(tree, root)
    assert "rc=0" in out, out
    assert "sgx: unpacked base" in out and (root / "sgl0517" / "marker.txt").read_text() == "0517"
    assert "FA3=no (parts 1/3 here)" in out and "plugin=yes" in out, out
    assert f"PYTHONPATH={root}/ext:{tree}/test:{root}/sgl0517:{root}/site" in out

    bad = bytearray(parts[2])
    bad[10] ^= 0xFF
    place(tree, parts=[(2, parts[1]), (3, bytes(bad))], manifest=manifest)
    out = source(tree, root)
    assert "rc=0" in out and ".carry/fa3-3/fa3.xz.part3 fails its sha256" in out, out
    assert "sgx: unpacked base" not in out and "FA3=no (parts 2/3 here)" in out, out

    place(tree, parts=[(3, parts[2])], manifest=manifest, sgl0519=tar_xz({"sgl0519/marker.txt": b"0519"}))
    out = source(tree, root, extra='SGX_SGLANG=0519 source scripts/gpu_env.sh >/dev/null;')
    assert "rc=0" in out and "sgx: joined and verified FA3 (3 parts)" in out, out
    assert (root / "site" / "sgl_kernel" / "flash_ops.abi3.so").read_bytes() == library
    assert (root / "sgl0519" / "marker.txt").read_text() == "0519" and (root / "sgl0517").is_dir()
    assert "FA3=present (not loaded: no CUDA here)" in out, out
    # a second source in the same shell rebuilds PYTHONPATH instead of growing it
    assert f"PYTHONPATH={root}/ext:{tree}/test:{root}/sgl0519:{root}/site\n" in out, out


def test_bad_version_and_missing_parts(tree, tmp_path):
    out = source(tree, tmp_path / "sgx", extra="")
    assert "sgx: ERROR: no base in" in out and "rc=1" in out, out
    place(tree, base=build_carry()[0])
    out = source(tree, tmp_path / "sgx", extra='SGX_SGLANG=0519 source scripts/gpu_env.sh; echo "rc2=$?";')
    assert "rc=0" in out and "but no sgl0519" in out and "rc2=1" in out, out
    env_out = subprocess.run(["bash", "-c", "SGX_SGLANG=0520 source scripts/gpu_env.sh; echo rc=$?"], cwd=tree,
                             env=dict(os.environ, SGX_ROOT=str(tmp_path / "sgx")), capture_output=True, text=True)
    assert "SGX_SGLANG=0520: allowed 0517, 0519, 0523" in env_out.stderr and "rc=2" in env_out.stdout


def test_sglang_0523_tree_arrives_in_a_later_call_and_gets_its_kernel_settings(tree, tmp_path):
    """0.5.23 runs on 0.5.17's kernels: only its environment skips the kernel version check."""
    root = tmp_path / "sgx"
    place(tree, base=build_carry()[0])
    probe = 'echo "skip=${SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK:-unset} fa3=${SGLANG_USE_SGL_FA3_KERNEL:-unset}";'
    out = source(tree, root, extra=probe)
    assert "rc=0" in out and "skip=unset fa3=unset" in out, out
    place(tree, sgl0523=tar_xz({"sgl0523/marker.txt": b"0523"}))  # the base is not carried again
    out = source(tree, root, extra=f"SGX_SGLANG=0523 source scripts/gpu_env.sh >/dev/null; {probe}")
    assert "rc=0" in out and "skip=1 fa3=1" in out, out
    assert (root / "sgl0523" / "marker.txt").read_text() == "0523" and (root / "sgl0517").is_dir()
    assert f"PYTHONPATH={root}/ext:{tree}/test:{root}/sgl0523:{root}/site\n" in out, out


# Imported the way sglang 0.5.23's CuTe DSL kernel module imports the CUTLASS DSL at module level, in a
# process started with no help (as sglang spawns its schedulers): plain `python`, the environment only.
DSL_LIKE = """
probe = {"__name__": "flashinfer.cute_dsl"}  # flashinfer probes the DSL with try/import, before sglang imports it
exec("try:\\n    import cutlass\\n    seen = cutlass\\nexcept ImportError as e:\\n    seen = e", probe)
print("flashinfer sees:", repr(probe["seen"]))
import cutlass, cutlass.cute as cute
from cutlass.cute import experimental as cute_ext
from cutlass.utils import blackwell_helpers as sm100_utils
@cute.experimental.jit
def wrapper(x):
    return x
class Kernel:
    @cute.experimental.kernel
    def kernel(self):
        pass
import imageio_ffmpeg
try:
    wrapper(1)
except RuntimeError as e:
    print("call:", e)
print("stubs:", cutlass.__sgl_stub__, imageio_ffmpeg.__sgl_stub__, cute_ext, Kernel.kernel)
print("annotation:", cute.Type[cute.Numeric])
"""


def test_stand_ins_reach_every_process_started_after_the_source(tree, tmp_path):
    """SGX_STANDINS=cutlass,imageio_ffmpeg: what a 0.5.23 server imports at start is a stand-in in a plain
    child process (sglang's spawned servers), its decorators apply at import time and its calls raise."""
    root = tmp_path / "sgx"
    place(tree, base=build_carry()[0], sgl0523=tar_xz({"sgl0523/marker.txt": b"0523"}))
    probe = f"{sys.executable} -c '{DSL_LIKE}';"
    out = source(tree, root, extra=f"SGX_STANDINS=cutlass,imageio_ffmpeg SGX_SGLANG=0523 source scripts/gpu_env.sh; {probe}")
    assert "rc=0" in out and "stand-ins: cutlass,imageio_ffmpeg (every process)" in out, out
    assert "0523 needs cutlass=stand-in imageio_ffmpeg=stand-in" in out, out
    assert "call: stand-in: cutlass.cute.experimental.jit(wrapper) is not available" in out, out
    assert "stubs: True True <stand-in cutlass.cute.experimental>" in out, out
    assert "flashinfer sees: ModuleNotFoundError(\"No module named 'cutlass' (a stand-in, hidden" in out, out
    assert "annotation: <stand-in cutlass.cute.Type>" in out, out
    assert f"PYTHONPATH={root}/stand-ins/cutlass:{root}/stand-ins/imageio_ffmpeg:{root}/ext:" in out, out
    # without them the summary says what a 0.5.23 server would die of; a bad name is refused
    out = source(tree, root, extra="SGX_SGLANG=0523 source scripts/gpu_env.sh;")
    assert "0523 needs cutlass=NO: its server dies at start" in out and "stand-ins: none" in out, out
    out = source(tree, root, extra="SGX_STANDINS=cuda.bindings source scripts/gpu_env.sh; echo rc2=$?;")
    assert "'cuda.bindings' is not a top-level package name" in out and "rc2=2" in out, out


SM90_DUAL_GEMM = """
import sys, torch
import sglang.srt.utils.common as common
import sglang.srt.layers.dual_gemm as dual_gemm
from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
dual_gemm.is_cuda = common.is_cuda = lambda: True
common.get_device_sm = lambda: int(sys.argv[1])
common.is_sm100_supported.cache_clear()
class GateUp:  # what DualGemm._select_mode reads of Qwen2MLP's gate_up_proj (bf16, unquantized)
    quant_method, params_dtype, output_partition_sizes = UnquantizedLinearMethod(), torch.bfloat16, [11008, 11008]
gemm = dual_gemm.DualGemm.__new__(dual_gemm.DualGemm)
gemm.down_proj, gemm.max_tokens = None, 0
print("mode", gemm._select_mode(GateUp(), 2048), "max_tokens", gemm.max_tokens)
import sglang.multimodal_gen.runtime.entrypoints.action.openpi, sglang.multimodal_gen.runtime.entrypoints.http_server
from sglang.multimodal_gen.runtime.entrypoints import utils
try:
    utils._resolve_ffmpeg_exe()
except RuntimeError as e:
    print("video:", e)
"""


def test_sglang_0523_server_imports_take_the_sm90_path_with_the_stand_ins(tmp_path):
    """sglang 0.5.23's Qwen2 MLP (Qwen2.5-VL / Qwen3-VL text models) builds a DualGemm whose mode check imports
    the CUTLASS DSL on any CUDA device; the kernel is sm100-only (can_use_dual_gemm checks is_sm100_supported
    first). With the stand-in, a device reporting sm90 gets no dual GEMM (sglang's gate_up + SiluAndMul path,
    as with the real package); sm100 would pick it, and its first call would raise. The action API imports
    imageio_ffmpeg for video encoding only."""
    pytest.importorskip("sglang.srt.layers.dual_gemm", reason="sglang 0.5.23's DualGemm")
    folders = []
    for name in ("cutlass", "imageio_ffmpeg"):  # as scripts/gpu_env.sh writes them
        (tmp_path / name / name).mkdir(parents=True)
        (tmp_path / name / name / "__init__.py").write_text(
            "import sys\nfrom sglang_ext_testkit.stand_ins import stand_in_package\n"
            "sys.modules[__name__] = stand_in_package(__name__)\n")
        folders.append(str(tmp_path / name))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(folders + [os.path.join(REPO, "test"), os.path.join(REPO, "python")]))
    run = lambda sm: subprocess.run([sys.executable, "-c", SM90_DUAL_GEMM, sm], env=env, capture_output=True,
                                    text=True, timeout=600)
    sm90 = run("90")
    assert sm90.returncode == 0 and "mode None max_tokens 0" in sm90.stdout, sm90.stdout + sm90.stderr[-3000:]
    assert "video: stand-in: imageio_ffmpeg.get_ffmpeg_exe is not available" in sm90.stdout, sm90.stdout
    sm100 = run("100")
    assert "mode 4 max_tokens 16" in sm100.stdout, sm100.stdout + sm100.stderr[-3000:]  # DualGemmQuantMode.UNQUANT
