"""Notebook 99 opened on its own (its run has no ladder rows) shows the committed reference instead of
failing, and writes nothing into it. (nbval runs 99 after the ladder notebooks: the other case.)"""

import json
from pathlib import Path

import pytest

from hwlib import notebook as nb
from hwlib import query, results

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def said(monkeypatch):
    out = []
    monkeypatch.setattr(nb, "markdown", lambda text: out.append(text))
    return out


def test_a_run_without_ladder_rows_shows_the_reference(isolated_run, said):
    outputs = isolated_run.parent
    assert query.workloads_in(query.load(nb.REFERENCE)), "the reference h100 is committed with ladder rows"
    assert nb.run_or_reference(None) == nb.REFERENCE
    assert "has no ladder rows yet" in said[-1] and f"outputs/{nb.REFERENCE}" in said[-1]
    rows = nb.show_ladder("gpt", nb.REFERENCE, figure=False)
    assert rows and rows[0]["device"].startswith("NVIDIA H100")
    assert "run `h100`" in said[-1]
    assert not (outputs / "reference").exists(), "reading the reference made a folder for it"


def test_a_run_with_ladder_rows_shows_itself(isolated_run, said):
    common = dict(notebook="01_baseline_fp32", workload="gpt", step="01_baseline_fp32", profile="smoke",
                  device={"name": "x86_64", "kind": "cpu"})
    results.append([results.make_record(metric="ms_per_step", value=5.0, p20=4.9, p80=5.1, unit="ms", **common)])
    assert nb.run_or_reference(None) is None and said == []


def test_no_rows_and_no_reference_is_a_clear_error(isolated_run, said):
    with pytest.raises(FileNotFoundError, match=r"no ladder rows.*run the ladder notebooks \(01-11\)"):
        nb.run_or_reference(None, reference="reference/no-such-machine")


def test_notebook_99_asks_for_the_reference_before_it_reads_its_run():
    book = json.loads((ROOT / "notebooks" / "99_speedup_tables.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code")
    asked = code.find("run = nb.run_or_reference(run)")
    assert 0 <= asked < code.find("report.write_all(run)") and asked < code.find('"summary.json"')
    assert "if not hwlib.paths.is_reference(run):" in code   # a committed reference is never rewritten
    assert "no ladder rows in this run: run the ladder notebooks first" not in code


def test_notebook_99_shows_retired_steps_apart_from_the_ladders(said):
    """The reference holds records of step 28, since retired: 99's ladders leave them out and its
    "Retired steps" block shows them (``report.retired_block``), as the README does."""
    from hwlib.report import tables as report
    from hwlib.steps import RETIRED_NAMES
    book = json.loads((ROOT / "notebooks" / "99_speedup_tables.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in book["cells"] if c["cell_type"] == "code")
    assert "nb.markdown(report.retired_block(run))" in code and "RETIRED_NAMES" in code
    rows = nb.show_ladder("gpt", nb.REFERENCE, figure=False)
    assert rows and not {r["step"] for r in rows} & set(RETIRED_NAMES)
    assert "| 28_gemm_workspace | gpt | 31.8 (31.6-32.7)" in report.retired_block(nb.REFERENCE)
