"""What every notebook does around the measurement: resolve parameters, show tables and figures.

Kept here so that the notebooks stay thin and identical in shape; nothing in this module measures.
"""

from __future__ import annotations

from . import results
from .device import resolve_device
from .profiles import resolve_profile


def resolve(profile: str = "auto", device: str = "auto") -> tuple[str, str]:
    """The notebook's parameters after ``HWLIB_PROFILE`` and 'auto' are applied: (profile, device)."""
    dev = resolve_device(device)
    return resolve_profile(profile, dev), dev.type


def markdown(text: str):
    try:
        from IPython.display import Markdown, display
        display(Markdown(text))
    except ImportError:  # plain Python: print it
        print(text)


def table(rows: list[dict], columns: list[str] | None = None) -> None:
    """A list of dicts as a Markdown table."""
    if not rows:
        markdown("_nothing to show_")
        return
    cols = columns or list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else
                                       (f"{r[c]:,.4g}" if isinstance(r[c], float) else str(r[c])) for c in cols) + " |")
    markdown("\n".join(lines))


def show_change(step: str) -> None:
    from .steps import describe
    table(describe(step), ["setting", "before", "after"])


def show_ladder(workload: str, run=None, figure: bool = True) -> list[dict]:
    """The cumulative table (and figure) of ``workload`` from this run's results; returns the rows."""
    from .report import ladder_figure, ladder_rows, markdown_table
    recs = results.load(run)
    rows = ladder_rows(recs, workload)
    markdown(f"**{workload}**, run `{results.run_dir(run).name}`\n\n" + markdown_table(rows))
    if figure and any(r["throughput"] for r in rows):
        import matplotlib.pyplot as plt
        ladder_figure(rows, workload)
        plt.show()
    return rows


def what_we_saw(workload: str, run=None) -> str:
    from .report import ladder_rows, what_we_saw as prose
    text = prose(ladder_rows(results.load(run), workload), workload)
    markdown("**What we saw.** " + text)
    return text
