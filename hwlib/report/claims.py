"""The seeds' claims as Markdown: one table per seed write-up, with a line counting the verdicts.

The rows come from ``hwlib.seeds.verdicts.evaluate``; this module only formats them."""

from __future__ import annotations

from ..seeds.data import SEEDS
from ..seeds.verdicts import VERDICTS, evaluate

# evaluate, SEEDS and VERDICTS are here too, so that a reader of the tables (notebook 99) needs one import.
__all__ = ["COLUMNS", "SEEDS", "VERDICTS", "evaluate", "markdown", "run_markdown", "summary_line", "tables"]

COLUMNS = (("claim", "claim"), ("claimed", "claimed"), ("measured here", "measured_text"), ("interval", "interval_text"),
           ("compares", "compares"), ("workload", "workload"), ("verdict", "verdict"), ("note", "note"))


def _cell(v) -> str:
    return "-" if v in (None, "") else str(v).replace("|", "\\|").replace("\n", " ")


def tables(rows: list[dict]) -> dict[str, str]:
    """One Markdown table per seed system, keyed by seed id ('000' ... '004'); every seed has a table."""
    out = {}
    for sid in SEEDS:
        mine = [r for r in rows if r["seed"] == sid]
        lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
        for r in mine:
            lines.append("| " + " | ".join(_cell(r.get(k)) for _, k in COLUMNS) + " |")
        if not mine:
            lines.append("| " + " | ".join(["_no claims listed_"] + ["-"] * (len(COLUMNS) - 1)) + " |")
        out[sid] = "\n".join(lines) + "\n"
    return out


def summary_line(rows: list[dict]) -> str:
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS}
    gpus = sorted({r["gpu"] for r in rows if r.get("gpu")})
    parts = [f"{n} {v}" for v, n in counts.items() if n]
    return (f"Measured on {', '.join(gpus)}: " if gpus else "Nothing measured on a GPU yet: ") + ", ".join(parts) + "."


def markdown(rows: list[dict], level: int = 3) -> str:
    """Every seed's table under a heading, with a line counting the verdicts."""
    h = "#" * level
    out = []
    for sid, table in tables(rows).items():
        s = SEEDS[sid]
        mine = [r for r in rows if r["seed"] == sid]
        out += [f"{h} {sid} · {s.title}", "", f"Claims of the write-up {s.source}. " + summary_line(mine), "", table]
    return "\n".join(out)


def run_markdown(run, level: int = 3, elsewhere: tuple = ()) -> str:
    """``markdown`` of a run's claims (``run``: a name, folder or list of records); claims the run
    cannot measure are read from the ``elsewhere`` runs where they can be (``evaluate``)."""
    return markdown(evaluate(run, elsewhere=elsewhere), level=level)
