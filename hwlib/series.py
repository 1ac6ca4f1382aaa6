"""The notebook series: where its notebooks are and the order a run executes them.

A notebook's number is its place in the reading; its metadata's ``hwlib.run_after`` moves it later
in a run. "ladder": a study that times ladder steps itself (16's profiles, 19's ablations and noise
pairs, 20's inductor knobs, 98's live run) runs after every notebook without the key, so that it sees
the whole ladder in the run's records, and so that the graphs it compiles into the run's cache are
never found there by a later ladder notebook, whose compile seconds would then read as nothing.
"all": after those too (99's tables, built from every other notebook's results).

``hwlib reproduce`` runs in this order, nbval (``make test``) is given the notebooks in it, and the
README's time table lists a run's notebooks in it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .paths import REPO_ROOT

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
RUN_AFTER = {None: 0, "ladder": 1, "all": 2}


class SeriesError(ValueError):
    """A notebook whose metadata cannot place it in the run order."""


def notebook_paths(folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """The numbered notebooks (NN_name.ipynb) in ``folder``, by name."""
    return sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))


def run_after(path: Path) -> str | None:
    """A notebook's ``hwlib.run_after`` metadata (None where it has none)."""
    path = Path(path)
    try:
        meta = json.loads(path.read_text(encoding="utf-8")).get("metadata", {})
    except (OSError, ValueError) as e:
        raise SeriesError(f"{path.name}: not a readable notebook ({type(e).__name__}: {e})") from None
    value = (meta.get("hwlib") or {}).get("run_after")
    if value not in RUN_AFTER:
        raise SeriesError(f"{path.name}: metadata hwlib.run_after must be one of "
                          f"{', '.join(repr(k) for k in RUN_AFTER if k)} or absent, got {value!r}")
    return value


def run_group(path: Path) -> int:
    """The notebook's place among ``RUN_AFTER``'s groups (0: the ladder and the numbered order)."""
    return RUN_AFTER[run_after(path)]


def run_order(nbs: list[Path]) -> list[Path]:
    """``nbs`` in the order a run executes them: by ``run_group``, then by name."""
    return sorted(nbs, key=lambda p: (run_group(p), p.name))


def order_names(names, folder: Path = NOTEBOOKS_DIR) -> list[str]:
    """Notebook names (stems, as a run's state.json keys them) in the run order of ``folder``'s
    notebooks; a name with no notebook there (renamed since, or a variant's executed copy), or one
    whose metadata is bad (reproduce names it), goes by name among the ungrouped ones."""
    group = {}
    for p in notebook_paths(folder):
        try:
            group[p.stem] = run_group(p)
        except SeriesError:
            pass
    return sorted(names, key=lambda n: (group.get(n, 0), n))
