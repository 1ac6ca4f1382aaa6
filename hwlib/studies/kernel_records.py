"""A table of kernels timed alone (the rows of a study's ``kernel_rows``): one row format against the
bytes a kernel moves, its words, and its records, for every study that times kernels beside a ladder step."""

from __future__ import annotations

from .. import bench, results


def timed_row(kernel: str, t: bench.Timing, nbytes: float, ceilings: dict | None, **shape) -> dict:
    """A row for ``kernel`` timed as ``t`` moving ``nbytes``: median ms (p20, p80), GB/s on those bytes, that
    over the measured copy ceiling and the bytes' time at it (None without ceilings); ``shape`` in front."""
    copy = (ceilings or {}).get("copy_gbps")
    gbps = nbytes / (t.median_ms * 1e-3) / 1e9
    return {"kernel": kernel, **shape, "ms": t.median_ms, "p20": t.p20_ms, "p80": t.p80_ms, "bytes": nbytes,
            "GB/s": gbps, "share of copy": gbps / copy if copy else None,
            "floor ms": nbytes / (copy * 1e9) * 1e3 if copy else None}


def bandwidth_words(r: dict) -> str:
    """A ``timed_row`` in words: "({GB/s} GB/s on the {MB} MB it moves, {share} of the measured copy
    bandwidth; its floor is {us} us)"."""
    text = f"({r['GB/s']:,.0f} GB/s on the {r['bytes'] / 1e6:.0f} MB it moves"
    if r["share of copy"] is not None:
        text += f", {r['share of copy']:.0%} of the measured copy bandwidth; its floor is {r['floor ms'] * 1e3:.1f} us"
    return text + ")"


def not_timed_words(what: str = "The kernels", them: str = "them") -> str:
    """The sentence a study's words give where nothing was timed alone (a CPU, or the smoke profile)."""
    return f"{what} {'was' if them == 'it' else 'were'} not timed alone here (a GPU and the full or mid profile time {them})."


def alone_words(rows: list[dict], where) -> str:
    """A table of ``timed_row``s in words: each kernel's median per call at ``where(row)`` (its shape in
    words) and its bandwidth; a sentence saying so where nothing was timed."""
    if not rows:
        return not_timed_words()
    return "Alone (median per call): " + "; ".join(
        f"{r['kernel']}: {r['ms'] * 1e3:.1f} us per call at {where(r)} {bandwidth_words(r)}" for r in rows) + "."


def kernel_records(rows: list[dict], *, notebook: str, study: str, keys: tuple[str, ...], profile: str,
                   device, params: tuple[str, ...] = ()) -> list[dict]:
    """A ``kernel_ms`` record per row (median, p20, p80), and a ``kernel_gbps`` record beside it where the
    row has a bandwidth ("GB/s"); ``study`` and the row's ``keys`` (its name and shape) in the fields, the
    row's ``params`` (what describes it without telling it apart) in the params."""
    recs = []
    for r in rows:
        f = {"study": study, **{k: r[k] for k in keys}}
        recs.append(results.make_record(notebook=notebook, workload="gpt", step=None, metric="kernel_ms",
                                        value=r["ms"], p20=r["p20"], p80=r["p80"], unit="ms", profile=profile,
                                        device=device, fields=f, params={k: r[k] for k in params} or None))
        if r.get("GB/s") is not None:
            recs.append(results.make_record(notebook=notebook, workload="gpt", step=None, metric="kernel_gbps",
                                            value=r["GB/s"], unit="GB/s", profile=profile, device=device, fields=f))
    return recs
