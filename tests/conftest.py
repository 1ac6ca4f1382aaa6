import os

import pytest
import torch

# Triton picks its interpreter when it is first imported, and `import hwlib` already imports it
# (through torch._dynamo): so choose here, before any test module is collected. Without a CUDA GPU
# the Triton kernels run interpreted on CPU tensors; with one they compile as usual.
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


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
