"""The dashboards in a real browser: JupyterLab on a free local port, Debian's Chromium driven by
Playwright, notebook 98 run cell by cell as a person would (Run > Run All Cells) in the smoke
profile.

It asserts that every code cell ran without an error output, that the monitor's and the
explorer's widget views rendered (not "Loading widget...", not a widget error), and that changing
the explorer's metric changes its table and its plot. Screenshots go under the run's outputs
(``<outputs>/dashboard/screenshots/``) for a person to look at. The server is stopped by its PID
(its process group: the kernels go with it) whatever happens.

Playwright's own browser download cannot work on the lab's machines; it launches Debian's
``chromium`` by path (``HWLIB_CHROMIUM``, else /usr/lib/chromium/chromium, else ``chromium`` on
PATH). Without a Chromium, Playwright or JupyterLab the test is skipped, saying which is missing.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hwlib.report.screenshots import chromium, free_port, stop, wait_up

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "98_dashboard.ipynb"
RUN = "dashboard"
BUDGET_S = 150          # the whole test, server start to screenshots; about a third of it on 2 idle cores

# JupyterLab settings for an unattended run: no news toast over the page, every cell rendered
# (windowed notebooks render only what is on screen), nothing autosaved.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a copy of notebook 98 (the checkout's file is never touched), with the
    smoke profile and a run folder of its own in the server's (and so the kernel's) environment."""
    exe = chromium()
    missing = [m for m in ("playwright", "jupyterlab") if not _importable(m)]
    if exe is None or missing:
        pytest.skip("browser test skipped: " + ", ".join(
            (["no Chromium (Debian: apt-get install chromium)"] if exe is None else [])
            + [f"no {m} (pip install {m})" for m in missing]))
    outputs = Path(os.environ.get("HWLIB_BROWSER_OUTPUTS") or tmp_path / "outputs").resolve()
    shutil.rmtree(outputs / RUN, ignore_errors=True)
    (outputs / RUN).mkdir(parents=True)
    served = tmp_path / "served"
    served.mkdir()
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, served / NOTEBOOK)
    settings = tmp_path / "lab-settings"
    for rel, value in SETTINGS.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    env = {**os.environ, "HWLIB_PROFILE": "smoke", "HWLIB_OUTPUTS": str(outputs), "HWLIB_RUN": RUN,
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "JUPYTERLAB_SETTINGS_DIR": str(settings), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-ws"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "jconfig"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "jruntime"),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    port = free_port()
    log = open(tmp_path / "jupyterlab.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
                             "--allow-root", f"--ServerApp.root_dir={served}"],
                            env=env, cwd=served, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, proc, 60)
        yield {"url": url, "chromium": exe, "shots": outputs / RUN / "screenshots", "log": tmp_path / "jupyterlab.log"}
    finally:
        stop(proc)
        log.close()


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


# The status bar's kernel item reads "<kernel name> | Idle" once the session is connected to it.
KERNEL_IDLE = "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')].some(e => /[|] Idle/.test(e.textContent))"


def run_all(page) -> None:
    page.locator("#jp-MainMenu .lm-MenuBar-item", has_text="Run").first.click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()


def _state(page) -> dict:
    """Prompts of every code cell, and the text of any error output."""
    return page.evaluate("""() => {
        const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden)');
        const prompts = [...nb.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(e => e.textContent.trim());
        const errors = [...nb.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')]
            .map(e => e.textContent.slice(0, 2000));
        return {prompts, errors};
    }""")


def test_dashboard_notebook_runs_and_reacts_in_a_browser(lab):
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    lab["shots"].mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=lab["chromium"], headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{lab['url']}/lab/tree/{NOTEBOOK}?reset", timeout=60_000)
            panel = ".jp-NotebookPanel:not(.lm-mod-hidden)"
            page.wait_for_selector(f"{panel} .jp-Notebook", timeout=60_000)
            # The kernel first: a Run All sent before the session is connected to its kernel opens a
            # "Select Kernel" dialog and is dropped.
            page.wait_for_function(KERNEL_IDLE, timeout=60_000)
            toast = page.locator("button.jp-toast-button:has-text('No')")
            if toast.count():
                toast.first.click()
            run_all(page)
            clicked, deadline = time.monotonic(), t0 + BUDGET_S - 30
            while True:
                dialog = page.locator(".jp-Dialog button.jp-mod-accept")
                if dialog.count():   # the dialog came anyway: take the notebook's kernel, then ask again
                    dialog.first.click()
                    page.wait_for_function(KERNEL_IDLE, timeout=30_000)
                    run_all(page)
                    clicked = time.monotonic()
                st = _state(page)
                assert not st["errors"], "a cell failed in the browser:\n" + "\n---\n".join(st["errors"])
                if st["prompts"] and all(pr[1:-2].isdigit() for pr in st["prompts"]):
                    break
                assert time.monotonic() < deadline, f"cells still running or not run: {st['prompts']}"
                if all(pr == "[ ]:" for pr in st["prompts"]) and time.monotonic() - clicked > 10:
                    run_all(page)   # nothing queued after ten seconds: the click was lost
                    clicked = time.monotonic()
                time.sleep(0.5)
            page.wait_for_selector(f"{panel} .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=30_000)
            page.screenshot(path=str(lab["shots"] / "notebook.png"))

            text = page.locator(panel).inner_text()
            assert "Error displaying widget" not in text and "Loading widget..." not in text, text[-3000:]
            mon = page.locator(f"{panel} .hwlib-monitor").first
            mon.wait_for(timeout=10_000)
            assert mon.locator("svg").count() >= 4           # a card per series, drawn in the browser
            assert "step " in mon.inner_text() and "host CPU" in mon.inner_text()
            mon.screenshot(path=str(lab["shots"] / "monitor.png"))

            ex = page.locator(f"{panel} .hwlib-explorer").first
            ex.wait_for(timeout=10_000)
            table = ex.locator(".hwlib-explorer-table")
            img = ex.locator(".hwlib-explorer-plot")
            before, img_before = table.inner_html(), img.get_attribute("src")
            assert "monitor=live" in before and img_before
            ex.screenshot(path=str(lab["shots"] / "explorer-before.png"))
            ex.locator(".hwlib-explorer-metric select").select_option(label="tokens_per_s (tokens/s)")
            page.wait_for_function("""([sel, old]) => {
                const t = document.querySelector(sel); return t && t.innerHTML !== old;
            }""", arg=[f"{panel} .hwlib-explorer .hwlib-explorer-table", before], timeout=20_000)
            after = table.inner_html()
            assert "tokens/s" in after and after != before
            page.wait_for_function("""([sel, old]) => {
                const i = document.querySelector(sel); return i && i.getAttribute('src') !== old;
            }""", arg=[f"{panel} .hwlib-explorer .hwlib-explorer-plot", img_before], timeout=20_000)
            ex.screenshot(path=str(lab["shots"] / "explorer-after.png"))
            assert not _state(page)["errors"]
        finally:
            browser.close()
    shots = sorted(p.name for p in lab["shots"].glob("*.png"))
    assert shots == ["explorer-after.png", "explorer-before.png", "monitor.png", "notebook.png"], shots
    print(f"screenshots: {lab['shots']} ({time.monotonic() - t0:.0f} s in the browser)")
