import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Triton picks its interpreter when it is first imported, and `import hwlib` already imports it
# (through torch._dynamo): so choose here, before any test module is collected. Without a CUDA GPU
# the Triton kernels run interpreted on CPU tensors; with one they compile as usual.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Compiled graphs go to a cache per version of hwlib's code, as a run's do (hwlib.paths.compile_cache_env):
# inductor keys a cached graph on the graph, not on a custom op's Python, so a graph compiled against
# an op's earlier fake implementation would be reused after the op changed.
from hwlib.paths import apply_compile_cache_env, compile_cache_env  # noqa: E402
from hwlib.results import code_digest  # noqa: E402

apply_compile_cache_env(compile_cache_env(Path(tempfile.gettempdir()) / "hwlib-tests", code_digest()))


@pytest.fixture(autouse=True)
def isolated_run(tmp_path, monkeypatch):
    """Every test writes its runs and generated data under its own temporary folder, which is its
    outputs/ (run names must stay inside outputs/)."""
    monkeypatch.setenv("HWLIB_OUTPUTS", str(tmp_path))
    monkeypatch.setenv("HWLIB_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("HWLIB_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("HWLIB_PROFILE", raising=False)
    return tmp_path / "run"


@pytest.fixture(scope="session")
def cpu_only():
    import torch
    if torch.cuda.is_available():
        pytest.skip("checks CPU-only behaviour")


@pytest.fixture(scope="module")
def triton_device():
    """The device Triton runs on here: CUDA when visible, else CPU under the interpreter, which this
    file selects before triton is first imported."""
    pytest.importorskip("triton")
    from hwlib.ops.sources import triton_interpreted, triton_interpreter_mismatch
    if torch.cuda.is_available() and not triton_interpreted():
        return "cuda"
    why = triton_interpreter_mismatch()
    if why or not triton_interpreted():
        pytest.skip(why or "no GPU and TRITON_INTERPRET is not set")
    return "cpu"


@pytest.fixture
def compile_for_sm90(tmp_path):
    """``compile_for_sm90(script)``: runs ``script`` in a fresh process without Triton's interpreter
    (which skips the compiler), from the repository root with its own Triton cache, and asserts that it
    exited cleanly having printed "compiled": the kernels' real TTIR -> PTX -> cubin pipeline for sm_90,
    checked on a machine without a GPU."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent

    def run(script: str) -> None:
        env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
        env.pop("TRITON_INTERPRET", None)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                           timeout=300)
        assert r.returncode == 0 and "compiled" in r.stdout, (r.stdout + r.stderr)[-3000:]
    return run
