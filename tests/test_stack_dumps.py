"""The stack dump of a notebook that runs out of time under ``hwlib reproduce``
(``hwlib.stacks.arm_stack_dump``): tests that mostly wait for a time limit, so ``make test`` runs
them beside the CPU-bound suites (test-unit-waits)."""

import json

import nbformat as nbf

from hwlib import cli, runs
from test_cli import make_nb, outputs  # noqa: F401  (the fixture: runs under a temporary outputs/)


def test_a_notebook_past_its_limit_leaves_its_kernels_stacks(tmp_path, outputs, capsys):
    """Before a notebook that runs past its time limit, or a cell past its own, is ended, its kernel
    (armed by ``notebook.setup``, here by ``arm_stack_dump`` alone) dumps every thread's Python stack
    into executed/<name>.stacks, and the failure's reason says where; a notebook that ends in time
    leaves none. The time limit ends the notebook's kernel, is reported among the failures, and the
    series goes on past it."""
    d = tmp_path / "hang_nbs"
    d.mkdir()
    make_nb(d / "01_hangs.ipynb", "from hwlib.stacks import arm_stack_dump\nassert arm_stack_dump()\n"
                                  "import os, time\n"
                                  "open(os.path.join(os.environ['HWLIB_RUN'], 'kernel.pid'), 'w').write(str(os.getpid()))"
                                  "\n\ndef stuck_here():\n    time.sleep(300)\n\nstuck_here()")
    make_nb(d / "02_quick.ipynb", "from hwlib.stacks import arm_stack_dump\nassert arm_stack_dump()")
    # the dump comes 3 s before the limit: the kernel has that long to start and arm on a busy machine
    assert cli.main(["reproduce", "--notebooks", str(d), "--run", "hang", "--profile", "smoke", "--device", "cpu",
                     "--timeout", "24", "--quiet"]) == 1
    assert "1 notebook(s) failed: 01_hangs" in capsys.readouterr().err
    run = outputs / "hang"
    state = json.loads((run / "state.json").read_text())
    assert state["02_quick"]["status"] == "ok" and not (run / "executed" / "02_quick.stacks").exists()
    stacks = run / "executed" / "01_hangs.stacks"
    assert state["01_hangs"]["status"] == "timeout" and str(stacks) in state["01_hangs"]["reason"]
    assert "exceeded the per-notebook limit of 24 s" in state["01_hangs"]["reason"]
    assert runs._stat(int((run / "kernel.pid").read_text())) is None   # the limit ended its kernel (gone or a zombie)
    text = stacks.read_text()
    assert "stuck_here" in text and "Thread" in text, text


def test_a_cell_past_its_limit_leaves_its_kernels_stacks(tmp_path, outputs):
    """Re-armed as each cell starts: a later cell stuck past the per-cell limit (papermill fails the
    notebook) leaves its stacks, named in the reason. The cell before it runs past its own dump time
    (5 s) but ends within the limit (8 s): armed only once, the file would hold that cell's stack and
    never the stuck one's; re-armed, the stuck cell's dump replaces it."""
    d = tmp_path / "cell_nbs"
    d.mkdir()
    make_nb(d / "00_cell.ipynb", "from hwlib.stacks import arm_stack_dump\nassert arm_stack_dump()")
    nb = nbf.read(d / "00_cell.ipynb", as_version=4)
    nb.cells.append(nbf.v4.new_code_cell("import time\n\ndef slow_but_in_time():\n    time.sleep(6.5)\n\nslow_but_in_time()"))
    nb.cells.append(nbf.v4.new_code_cell("def stuck_in_cell():\n    time.sleep(300)\n\nstuck_in_cell()"))
    nbf.write(nb, d / "00_cell.ipynb")
    assert cli.main(["reproduce", "--notebooks", str(d), "--run", "cell", "--profile", "smoke", "--device", "cpu",
                     "--timeout", "120", "--cell-timeout", "8", "--quiet"]) == 1
    run = outputs / "cell"
    state = json.loads((run / "state.json").read_text())
    stacks = run / "executed" / "00_cell.stacks"
    assert state["00_cell"]["status"] == "failed" and str(stacks) in state["00_cell"]["reason"], state["00_cell"]
    text = stacks.read_text()
    assert "stuck_in_cell" in text and "slow_but_in_time" not in text, text


def test_arming_needs_no_torch():
    """A kernel arms its stack dump within a second of starting: the module imports no torch (on a busy
    machine, importing torch alone outlasted an 8 s cell limit)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import sys, hwlib.stacks; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
