"""Figures leave the plotting backend alone and show in a notebook: the ladder figure is made with
matplotlib's object-oriented API, and notebook.show_figure hands IPython its PNG."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, matplotlib
before = matplotlib.get_backend()
from hwlib.report.tables import ladder_figure
row = dict(step="01_baseline_fp32", throughput=1000.0, unit="tokens/s", ms_per_step=10.0, ms_p20=9.0, ms_p80=11.0,
           speedup_vs_baseline=1.0, device="Test GPU", profile="full", model_tflops=1.0)
rows = [row, dict(row, step="02_tf32", throughput=2000.0, ms_per_step=5.0, ms_p20=4.5, ms_p80=5.5, speedup_vs_baseline=2.0)]
ceil = {"matmul_tflops": {"bf16": 800.0}}
fig = ladder_figure(rows, "gpt", ceil, path=sys.argv[1])    # saved: the path that used to switch to Agg
fig2 = ladder_figure(rows, "gpt", ceil)                     # shown in a notebook
print(json.dumps({"before": before, "after": matplotlib.get_backend(), "pyplot": "matplotlib.pyplot" in sys.modules,
                  "axes": len(fig.axes), "axes2": len(fig2.axes), "type": type(fig).__module__ + "." + type(fig).__name__}))
"""


def test_the_ladder_figure_leaves_the_backend_as_it_was(tmp_path):
    # svg: a backend that is not Agg and needs no display; the old code switched it to Agg
    import os
    out = tmp_path / "gpt_ladder.png"
    p = subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MPLBACKEND": "svg"})
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["before"] == "svg" and got["after"] == "svg", got
    assert got["pyplot"] is False, "the figure went through pyplot's global state"
    assert got["type"] == "matplotlib.figure.Figure" and got["axes"] == got["axes2"] == 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_library_code_switches_the_plotting_backend():
    switch = re.compile(r"matplotlib\.use\(|switch_backend\(|%matplotlib")
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in (ROOT / "hwlib").rglob("*.py")
           for i, line in enumerate(p.read_text().splitlines(), 1) if switch.search(line.split("#")[0])]
    assert bad == []


def test_show_figure_displays_a_png(monkeypatch):
    import IPython.display
    from matplotlib.figure import Figure

    from hwlib import notebook as nb
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    fig = Figure(figsize=(2, 1))
    fig.subplots().plot([0, 1], [1, 0])
    nb.show_figure(fig)
    (img,) = shown
    assert isinstance(img, IPython.display.Image) and img.data[:8] == b"\x89PNG\r\n\x1a\n"
    assert "image/png" in img._repr_mimebundle_()[0]


def test_the_floor_is_inside_the_log_axis():
    """Every step's floor bar starts below the axis' bottom edge and ends above it: on a log axis a bar
    from 0 is drawn only where the axis begins under the bar's top."""
    from hwlib.report.tables import ladder_figure
    row = dict(step="01_baseline_fp32", throughput=1000.0, unit="tokens/s", ms_per_step=400.0, ms_p20=390.0,
               ms_p80=410.0, speedup_vs_baseline=1.0, device="Test GPU", profile="full", model_tflops=0.04)
    rows = [row, dict(row, step="02_tf32", throughput=12000.0, ms_per_step=33.0, ms_p20=32.0, ms_p80=34.0,
                      speedup_vs_baseline=12.0, model_tflops=0.49)]
    fig = ladder_figure(rows, "gpt", {"matmul_tflops": {"bf16": 800.0}})
    ax2 = fig.axes[1]
    floors = [r["model_tflops"] * r["ms_per_step"] / 800.0 for r in rows]   # 0.02 ms of model work each
    bottom, top = ax2.get_ylim()
    assert ax2.get_yscale() == "log" and bottom < min(floors) and top > max(r["ms_per_step"] for r in rows)


def test_the_notebook_s_own_step_stands_out_and_branches_are_named():
    from hwlib.report.tables import HIGHLIGHT, ladder_figure
    from matplotlib.colors import to_hex
    base = dict(unit="tokens/s", ms_p20=9.0, ms_p80=11.0, device="Test GPU", profile="full", model_tflops=1.0)
    steps = ["09_cuda_graphs", "17_fused_lm_head", "18_fp8", "21_fused_layernorm", "22_gelu_epilogue",
             "23_branch_bias", "24_qkv_grad", "25_bias_column", "26_fp8_head", "27_bf16_stream", "29_shared_qk_attention"]
    rows = [dict(base, step=s, throughput=1000.0 + i, ms_per_step=10.0, speedup_vs_baseline=1.0)
            for i, s in enumerate(steps)]
    fig = ladder_figure(rows, "gpt", {"matmul_tflops": {"bf16": 800.0}}, highlight="25_bias_column")
    ax, ax2 = fig.axes
    colors = [to_hex(p.get_facecolor()) for p in ax.patches]
    assert colors.count(HIGHLIGHT) == 1 and colors.index(HIGHLIGHT) == steps.index("25_bias_column")
    labels = [t.get_text() for t in ax.get_xticklabels()]
    # 21 builds on 17, not on the FP8 branch drawn before it; 29 (another workload's) on 10, not on 27.
    assert labels[3] == "21 fused layernorm (on 17)" and labels[10] == "29 shared qk attention (on 10)"
    assert [lab for i, lab in enumerate(labels) if i not in (3, 10)] == [
        "09 cuda graphs", "17 fused lm head", "18 fp8", "22 gelu epilogue", "23 branch bias", "24 qkv grad",
        "25 bias column", "26 fp8 head", "27 bf16 stream"]
    # 27 builds on 26: its chain runs in FP8 too.
    assert [bool(p.get_hatch()) for p in ax.patches] == [s in ("18_fp8", "26_fp8_head", "27_bf16_stream")
                                                         for s in steps]
    bold = [t.get_text() for t in ax2.get_xticklabels() if t.get_fontweight() == "bold"]
    assert bold == ["25 bias column"]
