"""A notebook's kernel dumps its stacks before its time runs out: what a notebook that ``hwlib reproduce``
then ends was doing. Its own module, free of torch, so that a kernel arms it within a second of starting
(``hwlib.notebook.setup`` arms it; a notebook that imports nothing else can too)."""

from __future__ import annotations

import os
import time

from .paths import STACKS_CELL_S, STACKS_DEADLINE, STACKS_FILE

_STACKS: list = []   # the open file faulthandler writes stack dumps to: kept for the process's life
STACKS_MARGIN_S = 3.0   # the dump comes this long before the limit, so that it is written before the kernel is ended


def arm_stack_dump() -> str | None:
    """Under ``hwlib reproduce`` (``$HWLIB_STACKS_FILE``), have every thread's Python stack dumped into
    that file a few seconds before this notebook (``$HWLIB_STACKS_DEADLINE``, its end in epoch
    seconds) or the cell running then (``$HWLIB_STACKS_CELL_S``, each cell's limit) runs out of time:
    what a notebook that is then ended was doing. faulthandler's timer dumps from a thread of its own,
    which needs nothing from the stuck one (a kernel stuck in inductor's compile on an H100 dumped this
    way, where a signal sent to it from outside left nothing). Re-armed as each cell starts. Returns
    the file, or None where nothing was armed."""
    import faulthandler
    if _STACKS:
        return _STACKS[0].name
    path = os.environ.get(STACKS_FILE)
    deadline = float(os.environ.get(STACKS_DEADLINE) or "inf")
    cell_s = float(os.environ.get(STACKS_CELL_S) or "inf")
    if not path or (deadline == cell_s == float("inf")):
        return None
    f = open(path, "w")   # noqa: SIM115 (faulthandler writes to its descriptor until the process ends)
    _STACKS.append(f)

    def arm(*_info) -> None:
        # a dump from a cell that then finished in time is not this cell's: start the file afresh
        f.seek(0)
        f.truncate()
        left = min(deadline - time.time(), cell_s) - STACKS_MARGIN_S
        faulthandler.dump_traceback_later(max(left, 1.0), file=f)

    arm()
    try:
        from IPython import get_ipython
        ip = get_ipython()
    except ImportError:
        ip = None
    if ip is not None:
        ip.events.register("pre_run_cell", arm)
    return path
