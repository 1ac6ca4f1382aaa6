import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# nbformat (the notebook-writing tests import it) imports jsonschema, whose iri format checkers import
# rfc3987_syntax where it is installed: that module builds an Earley parser of RFC 3987 as it is imported,
# seconds of CPU in each pytest process. No schema read here checks an iri format; the notebooks' papermill
# leaves the module out the same way (hwlib.cli.PAPERMILL). Where the nbval plugin is loaded (every pytest
# run without -p no:nbval) it has imported nbformat before this file, and this line changes nothing.
sys.modules.setdefault("rfc3987_syntax", None)

# Triton picks its interpreter when it is first imported, and `import hwlib` already imports it
# (through torch._dynamo): so choose here, before any test module is collected. Without a CUDA GPU
# the Triton kernels run interpreted on CPU tensors; with one they compile as usual.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if os.environ.get("TRITON_INTERPRET") == "1":   # without its repeated patching (about half its time)
    from triton_interpreter import install as _install_interpreter_speedup  # noqa: E402
    _install_interpreter_speedup()

# Compiled graphs go to a cache per version of hwlib's code, as a run's do (hwlib.paths.compile_cache_env):
# inductor keys a cached graph on the graph, not on a custom op's Python, so a graph compiled against
# an op's earlier fake implementation would be reused after the op changed.
from hwlib.paths import apply_compile_cache_env, compile_cache_env  # noqa: E402
from hwlib.results import code_digest  # noqa: E402
from forked import can_fork, run_forked  # noqa: E402

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
    """``compile_for_sm90(script)``: runs ``script`` without Triton's interpreter (which skips the compiler),
    from the repository root with its own Triton cache, and asserts that it exited cleanly having printed
    "compiled": the kernels' real TTIR -> PTX -> cubin pipeline for sm_90, checked on a machine without a GPU.

    The script runs in a child forked from this process, with every Triton module imported afresh there
    with the interpreter off (Triton picks it when it is imported): a fresh Python importing torch again,
    which every kernel module does, cost about 5 s of CPU per call on a 2-core machine. Where forking is
    not safe (no fork, or CUDA initialised in this process) a fresh Python runs it."""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent

    def run(script: str) -> None:
        if can_fork():
            rc, out = _run_forked(script, root, tmp_path)
        else:
            env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
            env.pop("TRITON_INTERPRET", None)
            r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                               timeout=300)
            rc, out = r.returncode, r.stdout + r.stderr
        assert rc == 0 and "compiled" in out, out[-3000:]
    return run


def _run_forked(script: str, root: Path, cache: Path, timeout_s: float = 300.0) -> tuple[int, str]:
    """(exit code, stdout and stderr) of ``script`` run in a forked child without Triton's interpreter."""
    def child():
        os.chdir(root)
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["TRITON_CACHE_DIR"] = str(cache)
        # Triton's Python (its library decorated for the interpreter) and the kernel modules loaded
        # under it go; its compiled extension stays, as it holds no interpreter state
        for name in [m for m in sys.modules if m == "triton" or m.startswith(("triton.", "hwlib._kernels."))
                     and not m.startswith("triton._C")]:
            del sys.modules[name]
        exec(compile(script, "<compile_for_sm90 script>", "exec"), {"__name__": "__main__"})
    return run_forked(child, timeout_s)


def gpt_with(*step_names: str, cfg=None, attention: str = "sdpa", seed: int = 0, **kw):
    """The GPT of ``cfg`` (the smoke one by default) initialised from ``seed``, with the ``apply`` of each
    step in ``step_names`` run on it in that order (``hwlib.steps``)."""
    from hwlib.steps import get_step
    from hwlib.workloads import get_workload
    from hwlib.workloads.gpt import GPT
    model = GPT(cfg or get_workload("gpt").config("smoke"), attention=attention, **kw).init_weights(seed)
    for name in step_names:
        get_step(name).apply(model)
    return model


@pytest.fixture
def gpt_grads_match():
    """``check(base, changed, biases=(), scale=0.5)``: the smoke GPT built from one seed with the steps
    named in ``base`` applied and with those in ``changed`` (fp32, on a CPU), the biases named in ``biases``
    (per block, e.g. "attn.c_proj") drawn nonzero and the same in both, so that a bias gradient left
    out or added twice shows; asserts the same loss and the same gradient for every parameter, to fp32
    rounding, and returns the changed model's gradients by name."""
    from hwlib.workloads import get_workload

    def check(base: tuple, changed: tuple, biases: tuple[str, ...] = (), scale: float = 0.5) -> dict:
        cfg = get_workload("gpt").config("smoke")
        idx = torch.randint(0, cfg.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
        out = []
        for names in (base, changed):
            model = gpt_with(*names, cfg=cfg)
            gen = torch.Generator().manual_seed(2)
            with torch.no_grad():
                for blk in model.blocks:
                    for name in biases:
                        p = blk.get_submodule(name).bias
                        p.copy_(scale * torch.randn(p.shape, generator=gen))
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (loss0, g0), (loss1, g1) = out
        assert torch.allclose(loss1, loss0, rtol=1e-6)
        assert g1.keys() == g0.keys()
        for n, g in g0.items():
            assert float((g1[n].double() - g.double()).norm() / g.double().norm()) < 1e-4, n
        return g1

    return check


# --- `make test-gpu`: the tests a GPU changes -------------------------------------------------------
#
# CI has no GPU, so the tests that need one skip there and nobody would run them. The marker ``gpu``
# names every test that needs a GPU or behaves differently with one: `make test-gpu` runs exactly
# those (`pytest -m gpu`) on a GPU machine. It is put on a test here, from what the test says of
# itself, so that a new GPU test cannot be forgotten: a ``skipif`` whose reason names a GPU or CUDA,
# a test that takes the ``triton_device`` fixture (real Triton compiles on a GPU, the interpreter
# without one) or ``cpu_only``, or an explicit ``@pytest.mark.gpu``. ``compile_for_sm90`` tests are not
# among them: they compile the same way with or without a GPU (and took 29 s of an H100's run).
GPU_WORDS = ("gpu", "cuda", "cublas", "cudnn")
GPU_FIXTURES = ("triton_device", "cpu_only")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU or behaves differently with one (make test-gpu runs "
                                       "these on a GPU machine)")


def _gpu_test(item) -> bool:
    if item.get_closest_marker("gpu"):
        return True
    if "compile_for_sm90" in getattr(item, "fixturenames", ()):
        return False   # its skipif-free name says "without a GPU": the same compile either way
    if any(f in getattr(item, "fixturenames", ()) for f in GPU_FIXTURES):
        return True
    for m in item.iter_markers("skipif"):
        reason = str(m.kwargs.get("reason", "")).lower()
        if any(w in reason for w in GPU_WORDS):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _gpu_test(item):
            item.add_marker(pytest.mark.gpu)
