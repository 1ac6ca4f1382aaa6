"""Screenshots of what a reader meets: the README rendered, and executed reference notebooks opened in
JupyterLab, taken in Debian's Chromium through Playwright (the browser test's machinery), so that a
change that hides a figure shows in a picture and in the exit status.

``python -m hwlib.report.screenshots [--run reference/h100] [--notebooks 09 25 99] [--out docs/screenshots]``

The README's links are absolute (it is also the package's long description), and the machines that take
these pictures reach no network: the page is served from a temporary copy whose links to this
repository's files point at the local copies instead. Nothing is executed: the notebooks show the outputs
their reference run saved. Each screenshot scrolls to the page's first figure; the command fails, naming
the page, where a page shows no figure or a figure that did not load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .. import paths
from . import tables

ROOT = Path(__file__).resolve().parents[2]
# JupyterLab for an unattended look: no news toast, every cell rendered (a windowed notebook draws only
# what is on screen), Markdown files opened rendered, nothing autosaved.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {
        "autosave": False, "defaultViewers": {"markdown": "Markdown Preview"}},
}
# A figure counts once the browser has decoded it: an <img> with its natural width.
FIGURES = """(sel) => [...document.querySelectorAll(sel)].map(i => ({w: i.naturalWidth, src: i.src.slice(0, 200),
                                                                 done: i.complete}))"""


def chromium() -> str | None:
    for c in (os.environ.get("HWLIB_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium"),
              shutil.which("chromium-browser")):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def localized_readme(text: str) -> tuple[str, list[str]]:
    """The README with every absolute link to a file of this repository (its raw bytes or its page)
    pointing at the file's path, and the paths it names."""
    prefixes = [re.escape(tables.raw_url("")), re.escape(tables.repo_url(""))]
    pattern = re.compile(r"(?:" + "|".join(prefixes) + r")([^)\s\"'>]+)")
    named = sorted({m.group(1) for m in pattern.finditer(text)})
    return pattern.sub(lambda m: m.group(1), text), named


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, seconds: float) -> None:
    """Until JupyterLab at ``url`` answers, or fail (its process ended, or ``seconds`` passed)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {proc.returncode} before answering")
        try:
            with urllib.request.urlopen(url + "/api/status", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"JupyterLab did not answer on {url} within {seconds:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """The server and its kernels (one process group, started by us): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _stage(served: Path, run: str, notebooks: list[str]) -> list[tuple[str, str]]:
    """Copy the README (links made local), the files it names and the executed notebooks into
    ``served``; the pages to photograph as (name, path under served)."""
    text, named = localized_readme((ROOT / "README.md").read_text())
    for rel in named:
        src = ROOT / rel
        if src.is_file():
            (served / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, served / rel)
    (served / "README.md").write_text(text)
    pages = [("readme", "README.md")]
    executed = paths.read_dir(run) / "executed"
    for n in notebooks:
        found = sorted(executed.glob(f"{n}_*.ipynb"))
        if not found:
            raise SystemExit(f"screenshots: --notebooks {n}: no executed notebook {n}_*.ipynb under {executed}")
        rel = f"executed/{found[0].name}"
        (served / "executed").mkdir(exist_ok=True)
        shutil.copy(found[0], served / rel)
        pages.append((found[0].stem, rel))
    return pages


def take(run: str = "reference/h100", notebooks=("09", "25", "99"), out: Path | str = "docs/screenshots",
         width: int = 1400, height: int = 1100) -> list[dict]:
    """One PNG per page under ``out``; per page, the figures it shows (how many, how many loaded)."""
    from playwright.sync_api import sync_playwright

    exe = chromium()
    if exe is None:
        raise SystemExit("screenshots: no Chromium (Debian: apt-get install chromium; or set HWLIB_CHROMIUM)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seen = []
    with tempfile.TemporaryDirectory(prefix="hwlib-shots-") as tmp:
        tmp = Path(tmp)
        served = tmp / "served"
        served.mkdir()
        pages = _stage(served, run, list(notebooks))
        for rel, value in SETTINGS.items():
            (tmp / "settings" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "settings" / rel).write_text(json.dumps(value))
        env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"),
               "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "ws"), "JUPYTER_CONFIG_DIR": str(tmp / "jconfig"),
               "JUPYTER_RUNTIME_DIR": str(tmp / "jruntime")}
        port = free_port()
        log = open(tmp / "jupyterlab.log", "wb")
        # No kernel is wanted: the notebooks are looked at, never run.
        proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
                                 "--ServerApp.ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
                                 "--allow-root", f"--ServerApp.root_dir={served}",
                                 "--MappingKernelManager.default_kernel_name=python3"],
                                env=env, cwd=served, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_up(url, proc, 90)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=exe, headless=True,
                                            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                                  "--disable-background-networking"])
                try:
                    for name, rel in pages:
                        seen.append(_shoot(browser, url, name, rel, out, width, height))
                finally:
                    browser.close()
        finally:
            stop(proc)
            log.close()
    bad = [s for s in seen if not s["figures"] or s["loaded"] < s["figures"]]
    if bad:
        raise SystemExit("screenshots: " + "; ".join(
            f"{s['page']} shows {s['figures']} figure(s), {s['loaded']} loaded" for s in bad))
    return seen


def _badge(src: str) -> bool:
    """A Colab or shields badge: an image of every notebook row, not a figure."""
    return "badge" in src or "shields.io" in src


def _shoot(browser, url: str, name: str, rel: str, out: Path, width: int, height: int) -> dict:
    page = browser.new_page(viewport={"width": width, "height": height})
    try:
        page.goto(f"{url}/lab/tree/{rel}?reset", timeout=60_000)
        panel = ".jp-MainAreaWidget:not(.lm-mod-hidden)"
        body = f"{panel} .jp-RenderedMarkdown" if rel.endswith(".md") else f"{panel} .jp-Notebook"
        # Rendered, not merely opened: the page's text is there (a widget appears before its content).
        page.wait_for_function(f"() => {{ const b = document.querySelector('{body}'); "
                               f"return b && b.innerText.length > 500; }}", timeout=60_000)
        page.keyboard.press("Control+b")      # the file browser closed: the page at the window's width
        imgs = f"{panel} img"
        page.wait_for_function(f"() => [...document.querySelectorAll('{imgs}')].every(i => i.complete)",
                               timeout=30_000)
        figs = [f for f in page.evaluate(FIGURES, imgs) if not _badge(f["src"])]
        if figs:
            page.evaluate("""(sel) => { const i = [...document.querySelectorAll(sel)]
                .find(i => !/badge|shields[.]io/.test(i.src)); i.scrollIntoView({block: "start"}); }""", imgs)
            time.sleep(0.5)
        path = out / f"{name}.png"
        page.screenshot(path=str(path))
        return {"page": rel, "png": str(path), "figures": len(figs), "loaded": sum(1 for f in figs if f["w"] > 0)}
    finally:
        page.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="reference/h100", help="the run whose executed notebooks to show")
    ap.add_argument("--notebooks", nargs="+", default=["09", "25", "99"], help="their numbers")
    ap.add_argument("--out", default="docs/screenshots")
    a = ap.parse_args(argv)
    for s in take(a.run, a.notebooks, a.out):
        print(f"{s['png']}: {s['page']}, {s['loaded']} of {s['figures']} figure(s) shown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
