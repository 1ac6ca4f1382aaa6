"""The kernel sources ship inside the wheel, and an installed copy of hwlib, run outside the clone,
finds and uses them (Colab installs hwlib; a clone is not there).

The wheel is built from a copy of what the build reads, so the build never writes ``build/`` or
``*.egg-info`` into the clone that other processes may be using."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from hwlib.ops import sources
from hwlib.paths import KERNELS_DIR

ROOT = Path(__file__).resolve().parent.parent
KERNEL_FILES = ("21_add_layernorm_triton.py", "12_bk_core.cu", "12_bk_core.h", "12_bk_core_triton.py", "17_ce_rows.cu", "17_ce_rows.h",
                "26_ce_grad_fp8_triton.py", "26_ce_target_fp8_triton.py", "14_diversity_triton.py", "26_fp8_cast_triton.py", "22_gelu_epilogue.cpp", "22_gelu_epilogue.h",
                "17_linear_ce_triton.py",
                "24_qkv_grad_triton.py", "14_decode_matvec_triton.py", "14_decode_top_p_triton.py")


def _pip(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """hwlib's wheel, built offline (no index, no build isolation: the running setuptools builds it)."""
    # Asked of the installed metadata, not of the import system: setuptools' distutils shim reacts
    # to a find_spec("pip") in this process and breaks inductor's later import of distutils.
    missing = [m for m in ("pip", "setuptools") if not _installed(m)]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed here: `pip wheel --no-build-isolation` cannot "
                    f"build offline (install them, or build with network access)")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for d in ("hwlib", "kernels"):
        shutil.copytree(ROOT / d, src / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o"))
    for f in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / f, src / f)
    # The PEP 517 hook pip wheel --no-build-isolation calls, called directly: the same wheel, without
    # pip's own start and its second process (seconds of CPU).
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                        "build_meta.build_wheel(sys.argv[1])", str(tmp / "dist")], capture_output=True, text=True,
                       cwd=src, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (whl,) = (tmp / "dist").glob("hwlib-*.whl")
    return whl


def test_the_wheel_holds_the_kernel_sources(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for f in KERNEL_FILES:
            assert f"hwlib/kernels/{f}" in names, sorted(n for n in names if "kernels" in n)
            assert z.read(f"hwlib/kernels/{f}") == (KERNELS_DIR / f).read_bytes(), f
    assert {p.name for p in KERNELS_DIR.iterdir() if p.suffix in (".cu", ".cpp", ".h", ".py")} <= set(KERNEL_FILES), \
        "a new kernel file: add it to KERNEL_FILES (and check pyproject's package data takes it)"


INSTALLED = r"""
import json, os, sys
import torch
import hwlib
from hwlib.ops import bk_cuda, resolvent_diagonal, resolvent_diagonal_dense, sources
from hwlib.paths import KERNELS_DIR
tk = sources.load_python_kernel("12_bk_core_triton.py")
gpu = torch.cuda.is_available()     # Triton compiles for CUDA tensors, interprets CPU ones elsewhere
a = torch.rand(3, 7, dtype=torch.float64) - 2
b = torch.rand(3, 6, dtype=torch.float64) + 0.5
ref = resolvent_diagonal_dense(a, b, b, 0.3 + 0.5j)
err = {}
for backend in ("triton", "cuda") if gpu else ("triton",):   # cuda: built from the installed .cu and .h
    x = [t.cuda() if gpu else t for t in (a, b)]
    err[backend] = float((resolvent_diagonal(x[0], x[1], x[1], 0.3 + 0.5j, backend=backend).cpu() - ref).abs().max())
print(json.dumps({"hwlib": hwlib.__file__, "kernels_dir": str(KERNELS_DIR), "cu": str(sources.kernel_path("12_bk_core.cu")),
                  "triton": tk.__file__, "prototypes": len(bk_cuda.prototypes()), "err": err, "cwd": os.getcwd()}))
"""


def test_an_installed_copy_outside_the_clone_finds_its_kernels(wheel, tmp_path):
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    # --no-compile: the child compiles only what it imports, not every module of the package
    r = _pip("install", "--no-deps", "--no-index", "--no-compile", "-q", "--target", str(site), str(wheel),
             cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    env = {k: v for k, v in os.environ.items()
           if k not in ("HWLIB_KERNELS", "PYTHONPATH", "TRITON_INTERPRET", "TORCH_EXTENSIONS_DIR")}
    env.update(PYTHONPATH=str(site), HWLIB_OUTPUTS=str(tmp_path / "outputs"))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-c", INSTALLED], capture_output=True, text=True, cwd=elsewhere, env=env,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    import json
    got = json.loads(r.stdout.strip().splitlines()[-1])
    inside = site.resolve() / "hwlib"
    for key in ("hwlib", "kernels_dir", "cu", "triton"):
        assert Path(got[key]).resolve().is_relative_to(inside), (key, got[key])
    assert not Path(got["cwd"]).resolve().is_relative_to(ROOT)
    assert got["prototypes"] == 11 and got["err"] and all(e < 1e-10 for e in got["err"].values()), got
    if torch.cuda.is_available():
        assert set(got["err"]) == {"triton", "cuda"}, got


def test_hwlib_kernels_still_overrides(monkeypatch, tmp_path):
    (tmp_path / "12_bk_core.cu").write_text("// a kernel under development\n")
    monkeypatch.setenv("HWLIB_KERNELS", str(tmp_path))
    assert sources.kernel_path("12_bk_core.cu") == tmp_path / "12_bk_core.cu"
    with pytest.raises(sources.Unavailable, match=r"bk_core\.h not found .*HWLIB_KERNELS="):
        sources.kernel_path("12_bk_core.h")
    monkeypatch.delenv("HWLIB_KERNELS")
    assert sources.kernels_dir() == KERNELS_DIR == ROOT / "kernels"


def test_kernel_sources_stay_free_of_torch_headers():
    """The .cu and .cpp files and their headers build without torch (the .cu with plain nvcc, make
    test-kernels): no torch, no ATen."""
    files = sorted(KERNELS_DIR.glob("*.cu")) + sorted(KERNELS_DIR.glob("*.cpp")) + sorted(KERNELS_DIR.glob("*.h"))
    assert len(files) >= 2
    for f in files:
        text = f.read_text()
        assert "torch/" not in text and "ATen" not in text and "c10/" not in text, f.name


def test_constant_result_marks_a_function_as_torch_does():
    """``sources.constant_result`` sets the attribute torch.compiler.assume_constant_result sets (and
    only it), so torch.compile keeps each op's backend choice as a constant without hwlib importing
    the compiler."""
    def ours():
        return 1

    def torchs():
        return 1
    base = set(vars(torchs))
    torch.compiler.assume_constant_result(torchs)
    assert sources.constant_result(ours) is ours
    assert set(vars(ours)) - base == set(vars(torchs)) - base == {"_dynamo_marked_constant"}
    assert vars(ours)["_dynamo_marked_constant"] == vars(torchs)["_dynamo_marked_constant"]


# One child process answers both tests below (each start of Python with torch costs seconds of CPU):
# first what the imports alone brought in, then what ``notebook.setup`` added; a module setup imported
# after the imports shows in the second list whatever the first held.
NOTEBOOK_IMPORTS = """
import sys
import hwlib.notebook, hwlib.steps.s26_fp8_head.op, hwlib.steps.s22_gelu_epilogue.op, hwlib.steps.s24_qkv_grad.op
print('imports:', sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))
import hwlib.notebook as nb, hwlib.paths as p
nb.setup('smoke', 'cpu', 'setup-imports')
print('setup:', sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))
print('folder:', p._inductor_default_cache_dir())
"""


@pytest.fixture(scope="module")
def notebook_imports(tmp_path_factory) -> tuple[str, str, str]:
    """(modules the notebook helpers' imports loaded, modules after ``notebook.setup``, the cache folder
    setup read) from one fresh process."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "HWLIB_OUTPUTS": str(tmp_path_factory.mktemp("nb-imports") / "outputs")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", NOTEBOOK_IMPORTS], capture_output=True, text=True, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    said = dict(line.split(": ", 1) for line in out.stdout.splitlines()
                if line.startswith(("imports: ", "setup: ", "folder: ")))
    assert len(said) == 3, out.stdout + out.stderr
    return said["imports"], said["setup"], said["folder"]


def test_importing_the_notebook_helpers_imports_no_compiler(notebook_imports):
    """``from hwlib import notebook`` (every notebook's first import) stays clear of torch._dynamo and
    triton: about a second of import per process, and Triton's interpreter mode must be settable
    after it (``sources.triton_interpreter_mismatch``)."""
    assert notebook_imports[0] == "[]", notebook_imports


def test_a_notebooks_set_up_imports_no_compiler_and_knows_inductors_cache_folder(notebook_imports):
    """``notebook.setup`` reads inductor's default cache folder without importing inductor (4 s a
    notebook on a small CPU): its rule gives the folder inductor's own function gives."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    _, imported, folder = notebook_imports
    assert imported == "[]", notebook_imports
    assert folder == default_cache_dir()
