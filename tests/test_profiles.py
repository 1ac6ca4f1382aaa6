"""Profiles: what ``auto`` picks for the GPU memory at hand (a faked device query: the tests run on a
CPU), the cap that plays a smaller GPU, the reasons printed and recorded, and that every table keyed
by profile knows ``mid``, whose models are full's at a smaller batch."""

import dataclasses
import json
import sys

import nbformat as nbf
import pytest
import torch

from hwlib import cli, profiles, query
from hwlib.device import ChoiceError
from hwlib.profiles import NEED_GIB, PEAK_GIB, choose_profile, gpu_sized, resolve_profile
from hwlib.workloads import WORKLOADS
from hwlib.workloads import polychromic as pc


class FakeProps:
    """What ``torch.cuda.get_device_properties`` returns, as far as the device query reads it."""

    def __init__(self, gib: float, name: str):
        self.total_memory, self.name = int(gib * 2**30), name


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu(gib)``: torch sees one CUDA GPU of ``gib`` GiB; returns the per-process memory
    fractions the cap sets on it."""
    monkeypatch.delenv("HWLIB_MEMORY_CAP_GIB", raising=False)
    fractions = []

    def install(gib: float, name: str = "Fake GPU"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: FakeProps(gib, name))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

        def set_fraction(fraction, device=None):
            # as torch: a device without an index ("cuda") is refused
            if not isinstance(device, int) and getattr(device, "index", None) is None:
                raise ValueError(f"Expected a cuda device with a specified index or an integer, but got:{device}")
            fractions.append(fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
        return fractions
    return install


def test_auto_on_a_cpu_is_smoke_with_the_reason():
    p, why = choose_profile("auto", "cpu")
    assert p == "smoke" and why.startswith("auto: no CUDA GPU (cpu)")
    assert resolve_profile("auto", "cpu") == "smoke"


@pytest.mark.parametrize("gib, expected", [(80, "full"), (79.18, "full"), (40, "full"), (24, "mid"), (23.65, "mid"),
                                           (16, "mid"), (14.75, "mid"), (12, "mid"), (8, "smoke")])
def test_auto_picks_the_largest_profile_that_fits(fake_gpu, gib, expected):
    fake_gpu(gib, "Fake GPU X")
    p, why = choose_profile("auto", "cuda")
    assert p == expected, why
    assert why.startswith(f"auto: Fake GPU X has {gib:.1f} GiB usable")
    if expected == "full":
        assert why.endswith(f"at least the {NEED_GIB['full']:g} GiB full needs")
    elif expected == "mid":
        assert f"less than the {NEED_GIB['full']:g} GiB full needs, at least the {NEED_GIB['mid']:g} GiB mid needs" in why
    else:   # too small even for mid: the message names the memory found and the memory needed
        assert f"less than the {NEED_GIB['mid']:g} GiB that even mid needs, so smoke" in why


def test_the_needs_are_the_thresholds(fake_gpu):
    for p, lower in (("full", "mid"), ("mid", "smoke")):
        fake_gpu(NEED_GIB[p] + 0.001)
        assert choose_profile("auto", "cuda")[0] == p
        fake_gpu(NEED_GIB[p] - 0.001)
        assert choose_profile("auto", "cuda")[0] == lower


@pytest.mark.parametrize("cap, expected, fraction", [("16", "mid", 0.2), ("40", "full", 0.5), ("8", "smoke", 0.1),
                                                     ("100", "full", 1.0)])
def test_the_memory_cap_is_respected(fake_gpu, monkeypatch, cap, expected, fraction):
    fractions = fake_gpu(80)
    monkeypatch.setenv("HWLIB_MEMORY_CAP_GIB", cap)
    p, why = choose_profile("auto", "cuda")
    assert p == expected, why
    assert fractions and fractions[-1] == pytest.approx(fraction)      # the allocator is capped too
    if float(cap) < 80:
        assert f"{float(cap):.1f} GiB usable (HWLIB_MEMORY_CAP_GIB={cap} of its 80.0 GiB)" in why
    else:
        assert "80.0 GiB usable:" in why                               # a cap above the GPU changes nothing


def test_a_named_profile_is_kept_and_a_shortfall_said(fake_gpu, monkeypatch):
    assert choose_profile("mid", "cpu") == ("mid", "parameter")
    monkeypatch.setenv("HWLIB_PROFILE", "MID ")
    assert choose_profile("auto", "cpu") == ("mid", "HWLIB_PROFILE")     # the variable beats the parameter
    monkeypatch.delenv("HWLIB_PROFILE")
    fake_gpu(16, "Small GPU")
    p, why = choose_profile("full", "cuda")
    assert p == "full" and why == ("parameter; Small GPU has 16.0 GiB usable, less than the 31.75 GiB full needs: "
                                   "each step that does not fit becomes a row skipped")
    assert choose_profile("mid", "cuda") == ("mid", "parameter")
    assert choose_profile("smoke", "cuda") == ("smoke", "parameter")


def test_an_unknown_profile_is_a_choice_error_naming_where_it_came_from(monkeypatch):
    with pytest.raises(ChoiceError, match=r"unknown profile \(parameter\) 'huge'; choose one of: auto, full, mid, smoke"):
        choose_profile("huge", "cpu")
    monkeypatch.setenv("HWLIB_PROFILE", "bogus")
    with pytest.raises(ChoiceError, match=r"profile \(HWLIB_PROFILE\) 'bogus'"):
        resolve_profile("full", "cpu")
    with pytest.raises(ChoiceError, match="unknown profile 'auto'"):
        profiles.plan("auto")                                            # plans are for resolved profiles


def test_gpu_sized_and_every_table_keyed_by_profile_knows_mid():
    from hwlib.distributed import request
    from hwlib.steps.s18_fp8 import study as fp8
    from hwlib.studies import ablation
    assert [gpu_sized(p) for p in ("full", "mid", "smoke", "auto")] == [True, True, False, False]
    for p in ("full", "mid", "smoke"):
        assert isinstance(profiles.plan(p), profiles.Plan) and p in ablation.WINDOWS and p in fp8.HEAD_SHAPE
        assert p in request.DEFAULT_PROFILE_STEPS
    assert profiles.plan("mid") == profiles.plan("full") and ablation.WINDOWS["mid"] == ablation.WINDOWS["full"]
    gpt_mid = WORKLOADS["gpt"].config("mid")
    assert fp8.HEAD_SHAPE["mid"] == (gpt_mid.batch * gpt_mid.context, 768, 50304)
    assert fp8.HEAD_SHAPE["full"] == (16384, 768, 50304)
    with pytest.raises(ChoiceError, match="unknown profile 'auto'"):
        fp8.head_matmuls("auto", "cpu")
    assert request.validate(request.Request(profile="mid", device="cpu"), 1)
    with pytest.raises(ChoiceError, match="profile \\(resolved\\) 'auto'; choose one of: full, mid, smoke"):
        request.validate(request.Request(profile="auto", device="cpu"), 1)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_mid_is_full_at_a_smaller_batch(name):
    full, mid = WORKLOADS[name].config("full"), WORKLOADS[name].config("mid")
    assert mid.batch < full.batch
    assert dataclasses.replace(mid, batch=full.batch) == full             # every other field, the model's too


def test_polychromic_mid_is_full():
    assert pc.config("mid") == pc.config("full") == pc.config("qwen3_0.6b")


def _peak(name):
    return sys.modules[type(WORKLOADS[name]).__module__].PEAK


def test_mids_peak_is_the_largest_estimate_of_the_workloads():
    est = {n: _peak(n).at(WORKLOADS[n].config("mid").batch) for n in WORKLOADS}
    assert PEAK_GIB["mid"] == round(max(est.values()), 2), est
    assert NEED_GIB["mid"] == round(PEAK_GIB["mid"] + profiles.HEADROOM_GIB, 2)
    # a 16 GB T4 shows torch 14.75 GiB: mid must fit it
    assert NEED_GIB["mid"] < 14.75 < NEED_GIB["full"]
    assert _peak("gpt").at(16) == pytest.approx(29.25) and _peak("gpt").at(4) == pytest.approx(8.70)


def test_the_peaks_estimated_from_are_the_reference_records():
    """Each workload's ``PEAK`` is its largest measured peak in the committed reference run, and
    full's ``PEAK_GIB`` the largest of all: the figures in the comments are the records' own."""
    recs = [r for r in query.load(_peak("gpt").run) if r.get("metric") == "peak_mem_gib" and r.get("status") == "ok"
            and r.get("profile") == "full" and isinstance(r.get("value"), (int, float))]
    if not recs:
        pytest.skip("no reference run with peak-memory records in this checkout")
    for name in WORKLOADS:
        mine = [r for r in recs if r["workload"] == name]
        top = max(mine, key=lambda r: r["value"])
        pk = _peak(name)
        assert round(top["value"], 2) == pk.measured_gib, name
        assert top["step"] == pk.step and top["params"]["config"]["batch"] == pk.batch, name
    assert round(max(r["value"] for r in recs), 2) == PEAK_GIB["full"]


def test_setup_prints_the_choice_its_reason_and_what_auto_picks(capsys, monkeypatch):
    from hwlib import notebook as nb
    assert nb.setup("auto", "cpu") == ("smoke", "cpu")
    out = capsys.readouterr().out
    assert "profile: smoke (auto: no CUDA GPU (cpu)" in out and "auto would pick" not in out
    monkeypatch.setenv("HWLIB_PROFILE", "mid")
    assert nb.setup("auto", "cpu") == ("mid", "cpu")
    out = capsys.readouterr().out
    assert "profile: mid (HWLIB_PROFILE)" in out and "auto would pick: smoke (no CUDA GPU (cpu)" in out


def test_reproduce_prints_and_records_the_choice(tmp_path, monkeypatch, capsys, fake_gpu):
    d = tmp_path / "nbs"
    d.mkdir()
    nb = nbf.v4.new_notebook()
    p = nbf.v4.new_code_cell('profile = "auto"\ndevice = "auto"')
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbf.write(nb, d / "00_only.ipynb")
    # the choice is reproduce's own, made in this process: the notebook is handed it without a kernel
    # started (what a run does with it is test_cli's)
    ran = []
    monkeypatch.setattr(cli, "_run_one", lambda nb, run, env, args, profile, device, *a: (
        ran.append((nb.stem, profile, device)), ("ok", ""))[1])
    assert cli.main(["reproduce", "--notebooks", str(d), "--run", "r", "--device", "cpu", "--quiet"]) == 0
    assert ran == [("00_only", "smoke", "cpu")]
    assert "profile=smoke (auto: no CUDA GPU (cpu)" in capsys.readouterr().out
    state = json.loads((tmp_path / "r" / "state.json").read_text())
    assert state["_profile"] == "smoke" and state["_profile_reason"].startswith("auto: no CUDA GPU (cpu)")
    # the same choice on a GPU, without running anything there
    fake_gpu(24, "Fake 24GB")
    args = cli.build_parser().parse_args(["reproduce"])
    prof, why = cli.profile_arg(args, torch.device("cuda:0"))
    assert prof == "mid" and why.startswith("auto: Fake 24GB has 24.0 GiB usable")
    args = cli.build_parser().parse_args(["reproduce", "--profile", "full"])
    fake_gpu(16, "Fake 16GB")
    assert cli.profile_arg(args, torch.device("cuda:0")) == (
        "full", "--profile; Fake 16GB has 16.0 GiB usable, less than the 31.75 GiB full needs: each step that "
                "does not fit becomes a row skipped")


def test_the_batch_finder_searches_within_the_cap(fake_gpu, monkeypatch):
    """The device's free memory knows nothing of the cap: the finder's capacity is the smaller."""
    from hwlib.memory.finder import FinderResult
    from hwlib.steps import settings_for
    from hwlib.studies import batch_finder
    fake_gpu(80)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * 2**30)
    seen = []

    def search(try_batch, capacity_gib, **kw):
        seen.append(capacity_gib)
        return FinderResult(1, 1.0, 1.0, capacity_gib, kw["margin"], capacity_gib * 0.9, (0.0, 1.0))
    monkeypatch.setattr(batch_finder, "search_batch", search)
    batch_finder.find_batch_size("gpt", settings_for("05_fused_optimizer"), "cuda", profile="mid")
    monkeypatch.setenv("HWLIB_MEMORY_CAP_GIB", "16")
    batch_finder.find_batch_size("gpt", settings_for("05_fused_optimizer"), "cuda", profile="mid")
    assert seen == [72.0, 16.0]
