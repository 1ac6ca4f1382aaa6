import os

import pytest


@pytest.fixture(autouse=True)
def isolated_run(tmp_path, monkeypatch):
    """Every test writes its run and generated data under its own temporary folder."""
    monkeypatch.setenv("HWLIB_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("HWLIB_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("HWLIB_PROFILE", raising=False)
    return tmp_path / "run"


@pytest.fixture(scope="session")
def cpu_only():
    import torch
    if torch.cuda.is_available():
        pytest.skip("checks CPU-only behaviour")
