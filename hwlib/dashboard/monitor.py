"""A live panel beside a running measurement: telemetry plots, the current step's time and loss.

    mon = Monitor(device)
    with mon:
        res = run_step("gpt", "05_fused_optimizer", on_step=mon.on_step)

The panel is one ``ipywidgets.HTML`` holding small inline-SVG plots, rewritten a few times a
second by a background thread: a string of a few kilobytes per refresh, where a matplotlib redraw
would hold the GIL for tens of milliseconds and slow the loop it watches. When the monitor stops it
draws the same series once with matplotlib: that static figure is what a papermill run (where
nothing is rendered live) keeps in the executed notebook.

What it costs the loop it watches, and why it launches no GPU work of its own:

* ``on_step`` (called by the run loop after each step) appends the step's loss tensor and clock
  marks to a deque and returns: no sync, no copy;
* the refresh thread reads a step only once the GPU has finished it (its end ``CUDA event``
  queried, never waited on), takes the step time from the run's own events (``elapsed_time`` of
  two finished events launches nothing), and reads the finished loss on a side stream of its own,
  a 4-byte copy that waits on nothing the training stream queued;
* telemetry comes from ``hwlib.telemetry.Sampler`` (NVML, host counters).

Notebook 98 measures the whole cost on a step (with and without the monitor) instead of assuming it.
Failures are shown in the panel's status line, never raised into the measurement: a telemetry read
that fails mid-run, a loss that cannot be read, a refresh that breaks.
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections import deque

from ..telemetry import Sampler

# (sample key, title, unit) of the telemetry series, GPU first; host series when there is no GPU.
GPU_SERIES = (("gpu_util", "GPU busy", "%"), ("mem_used_gib", "GPU memory", "GiB"),
              ("sm_clock_mhz", "SM clock", "MHz"), ("mem_clock_mhz", "memory clock", "MHz"),
              ("power_w", "power", "W"), ("temp_c", "temperature", "C"))
HOST_SERIES = (("cpu_util", "host CPU", "%"), ("host_mem_used_gib", "host memory", "GiB"))
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def sparkline(xs: list[float], ys: list[float | None], *, title: str, unit: str, colour: str = COLOURS[0],
              width: int = 230, height: int = 74) -> str:
    """One small line plot as inline SVG: title, newest value, min and max. Missing values (None,
    NaN) break the line; no finite value gives a card that says so."""
    pts = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and math.isfinite(y)]
    head = f"{html.escape(title)}"
    if not pts:
        body = (f"<text x='6' y='{height // 2 + 10}' font-size='11' fill='#888'>no readings</text>")
        return _card(head, "-", body, width, height)
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
    span_x, span_y = (x1 - x0) or 1.0, (hi - lo) or max(abs(hi), 1.0)
    top, bottom, left, right = 20, height - 12, 4, width - 4

    def px(x, y):
        return (left + (x - x0) / span_x * (right - left), bottom - (y - lo) / span_y * (bottom - top))
    segs, cur = [], []
    for x, y in zip(xs, ys):   # a gap (None) starts a new segment
        if isinstance(y, (int, float)) and math.isfinite(y):
            cur.append("%.1f,%.1f" % px(x, y))
        elif cur:
            segs.append(cur)
            cur = []
    if cur:
        segs.append(cur)
    lines = "".join(f"<polyline fill='none' stroke='{colour}' stroke-width='1.5' points='{' '.join(s)}'/>"
                    if len(s) > 1 else f"<circle cx='{s[0].split(',')[0]}' cy='{s[0].split(',')[1]}' r='2' fill='{colour}'/>"
                    for s in segs)
    scale = (f"<text x='{right}' y='{top - 8}' font-size='9' fill='#888' text-anchor='end'>"
             f"{_fmt(lo)}-{_fmt(hi)} {html.escape(unit)}</text>")
    return _card(head, f"{_fmt(pts[-1][1])} {html.escape(unit)}", lines + scale, width, height)


def _card(head: str, latest: str, body: str, width: int, height: int) -> str:
    return (f"<div style='display:inline-block;margin:2px;border:1px solid #ddd;border-radius:4px'>"
            f"<svg width='{width}' height='{height}' xmlns='http://www.w3.org/2000/svg'>"
            f"<text x='6' y='13' font-size='11' font-weight='bold'>{head}</text>"
            f"<text x='6' y='{height - 2}' font-size='10'>{latest}</text>{body}</svg></div>")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


class Monitor:
    """Telemetry plots plus the current step's time and loss, live in JupyterLab, and a static
    figure of the same series when it stops.

    ``device``: what to sample ('auto', 'cuda', 'cpu'); ``interval_s``: seconds between telemetry
    readings and between refreshes of the panel; ``window_s``: how many seconds of history the live
    plots show (the static figure shows everything); ``source``: a telemetry source (tests);
    ``figure``: draw the static figure on ``stop``."""

    def __init__(self, device="auto", *, interval_s: float = 0.25, window_s: float = 120.0, source=None,
                 figure: bool = True, title: str = "live monitor"):
        if not isinstance(window_s, (int, float)) or isinstance(window_s, bool) or window_s <= 0:
            raise ValueError(f"window_s must be a positive number of seconds, got {window_s!r}")
        self.sampler = Sampler(device, interval_s, source=source)
        self.interval_s, self.window_s, self.title, self.draw_figure = float(interval_s), float(window_s), title, figure
        self.steps: list[dict] = []           # finished steps: i, t (s since start), ms (timed only), loss
        self.problems: list[str] = []         # said in the status line, in place
        self._pending: deque = deque()
        self._samples: list[dict] = []
        self._seen = 0
        self._side_streams: dict = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0: float | None = None
        self.refreshes = 0
        self.html = self.status = self.panel = None
        self._build_panel()

    # --- the panel ---------------------------------------------------------------------------------

    def _build_panel(self) -> None:
        try:
            import ipywidgets as w
        except ImportError:   # plain Python: the static figure still comes at the end
            return
        self.status = w.HTML(value="")
        self.html = w.HTML(value="")
        self.panel = w.VBox([w.HTML(value=f"<b>{html.escape(self.title)}</b> &middot; "
                                          f"{html.escape(self.sampler.state)}"), self.status, self.html])
        self.panel.add_class("hwlib-monitor")

    def _say(self, msg: str) -> None:
        if msg not in self.problems:
            self.problems.append(msg)

    def status_text(self) -> str:
        parts = list(self.problems)
        if self.sampler.lost:
            parts.insert(0, self.sampler.lost)
        return "; ".join(parts)

    def render(self) -> str:
        """The panel's HTML now: one card per series of the last ``window_s`` seconds."""
        now = self._samples[-1]["t"] if self._samples else 0.0
        recent = [s for s in self._samples if s["t"] >= now - self.window_s]
        ts = [s["t"] for s in recent]
        cards = []
        series = (GPU_SERIES if any(s.get("gpu_util") is not None for s in self._samples) else ()) + HOST_SERIES
        for n, (key, title, unit) in enumerate(series):
            cards.append(sparkline(ts, [s.get(key) for s in recent], title=title, unit=unit,
                                   colour=COLOURS[n % len(COLOURS)]))
        steps = [s for s in self.steps if s["t"] >= now - self.window_s] or self.steps[-200:]
        timed = [s for s in steps if s["ms"] is not None]
        cards.append(sparkline([s["i"] for s in timed], [s["ms"] for s in timed], title="step time (timed steps)",
                               unit="ms", colour=COLOURS[6]))
        cards.append(sparkline([s["i"] for s in steps], [s["loss"] for s in steps], title="loss", unit="",
                               colour=COLOURS[7]))
        last = self.steps[-1] if self.steps else None
        line = ("no step finished yet" if last is None else
                f"step {last['i']}: " + (f"{last['ms']:.2f} ms" if last["ms"] is not None else "untimed (check or warm-up)")
                + (f", loss {last['loss']:.4f}" if last["loss"] is not None else ""))
        return f"<div style='font-size:12px;margin:2px'>{html.escape(line)}</div><div>{''.join(cards)}</div>"

    # --- the run loop's hook -------------------------------------------------------------------------

    def on_step(self, i: int, loss, clock=None) -> None:
        """Called by the run loop after step ``i`` (``hwlib.ladder.run_step(on_step=...)``): keeps a
        reference to the loss tensor and the step's clock marks; reads nothing now."""
        self._pending.append((i, loss, clock.last_step() if clock is not None else None))

    # --- reading finished steps, off the loop's thread -------------------------------------------------

    def _finished(self, k: int) -> bool:
        """Whether pending step ``k`` has finished on its device, asked without waiting."""
        i, loss, marks = self._pending[k]
        dev = getattr(loss, "device", None)
        if dev is None or dev.type != "cuda":
            return True
        import torch
        for _, _, m in list(self._pending)[k:]:   # any later step's finished event finishes this one
            if m is not None and m[1].query():
                return True
        return torch.cuda.default_stream(dev).query()

    def _read_loss(self, loss) -> float | None:
        import torch
        if not isinstance(loss, torch.Tensor):
            return float(loss) if isinstance(loss, (int, float)) else None
        if loss.device.type != "cuda":
            return float(loss.detach())
        # The step has finished, so its value is in memory: copy it on our own stream, which waits
        # on nothing the training stream has queued.
        s = self._side_streams.get(loss.device)
        if s is None:
            s = self._side_streams[loss.device] = torch.cuda.Stream(device=loss.device)
        with torch.cuda.device(loss.device), torch.cuda.stream(s):
            return float(loss.detach().item())

    def _drain(self) -> None:
        while self._pending and self._finished(0):
            i, loss, marks = self._pending.popleft()
            ms = None
            if marks is not None:
                a, b = marks
                ms = a.elapsed_time(b) if hasattr(a, "elapsed_time") else (b - a) * 1e3
            try:
                value = self._read_loss(loss)
            except Exception as e:   # never break the run over a display
                value = None
                self._say(f"loss of step {i} unreadable ({type(e).__name__})")
            self.steps.append({"i": i, "t": time.monotonic() - self._t0, "ms": ms, "loss": value})

    def refresh(self) -> None:
        """Take in new telemetry and finished steps, and redraw the panel; a failure shows in the
        status line."""
        try:
            new, self._seen = self.sampler.since(self._seen)
            self._samples.extend(new)
            self._drain()
            text = self.render()
            if self.html is not None:
                self.html.value = text
        except Exception as e:
            self._say(f"the monitor could not refresh ({type(e).__name__}: {e}); the measurement is unaffected")
        if self.status is not None:
            msg = self.status_text()
            self.status.value = (f"<span style='color:#b35900'>{html.escape(msg)}</span>" if msg else "")
        self.refreshes += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    # --- start / stop ------------------------------------------------------------------------------

    def start(self) -> "Monitor":
        if self._thread is not None:
            raise RuntimeError("Monitor.start: already started (one monitor watches one run)")
        self._t0 = time.monotonic()
        self.sampler.start()
        if self.panel is not None:
            _display(self.panel)
        self._thread = threading.Thread(target=self._loop, name="hwlib-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "Monitor":
        """Stop sampling and refreshing, take in the last steps, draw the static figure."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 4 * self.interval_s))
        self.sampler.stop()
        if self._pending and any(getattr(l, "device", None) is not None and l.device.type == "cuda"
                                 for _, l, _ in self._pending):
            import torch
            torch.cuda.synchronize()   # the run is over: nothing left to disturb
        self.refresh()
        if self.draw_figure:
            try:
                fig = self.figure()
                _display(fig)
                import matplotlib.pyplot as plt
                plt.close(fig)
            except Exception as e:
                self._say(f"no static figure ({type(e).__name__}: {e})")
                self.refresh()
        return self

    def __enter__(self) -> "Monitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the static copy ---------------------------------------------------------------------------

    def figure(self):
        """The whole run's series as one matplotlib figure (what papermill keeps)."""
        import matplotlib.pyplot as plt
        gpu = any(s.get("gpu_util") is not None for s in self._samples)
        series = (GPU_SERIES if gpu else ()) + HOST_SERIES
        n = len(series) + 2
        cols = 4 if n > 4 else n
        rows = math.ceil(n / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.3 * rows), squeeze=False)
        axes = [a for row in axes for a in row]
        ts = [s["t"] for s in self._samples]
        for a, (key, title, unit) in zip(axes, series):
            ys = [s.get(key) if s.get(key) is not None else float("nan") for s in self._samples]
            a.plot(ts, ys, lw=1.2)
            a.set_title(f"{title} ({unit})", fontsize=9)
            a.set_xlabel("s", fontsize=8)
        timed = [s for s in self.steps if s["ms"] is not None]
        a = axes[len(series)]
        a.plot([s["i"] for s in timed], [s["ms"] for s in timed], ".-", lw=1)
        a.set_title("step time, timed steps (ms)", fontsize=9)
        a.set_xlabel("step", fontsize=8)
        a = axes[len(series) + 1]
        a.plot([s["i"] for s in self.steps], [s["loss"] if s["loss"] is not None else float("nan") for s in self.steps],
               ".-", lw=1)
        a.set_title("loss", fontsize=9)
        a.set_xlabel("step", fontsize=8)
        for a in axes[n:]:
            a.axis("off")
        for a in axes[:n]:
            a.tick_params(labelsize=7)
        state = self.sampler.state + (f" | {self.sampler.lost}" if self.sampler.lost else "")
        fig.suptitle(f"{self.title}: {state}", fontsize=9)
        fig.tight_layout()
        return fig


def _display(obj) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return
    if get_ipython() is not None:
        display(obj)
