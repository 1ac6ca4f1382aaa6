"""The records of a table of kernels timed alone (the rows of a study's ``kernel_rows``), one format for
every study that times kernels beside a ladder step."""

from __future__ import annotations

from .. import results


def kernel_records(rows: list[dict], *, notebook: str, study: str, keys: tuple[str, ...], profile: str,
                   device) -> list[dict]:
    """A ``kernel_ms`` record per row (median, p20, p80), and a ``kernel_gbps`` record beside it where the
    row has a bandwidth ("GB/s"); ``study`` and the row's ``keys`` (its name and shape) in the fields."""
    recs = []
    for r in rows:
        f = {"study": study, **{k: r[k] for k in keys}}
        recs.append(results.make_record(notebook=notebook, workload="gpt", step=None, metric="kernel_ms",
                                        value=r["ms"], p20=r["p20"], p80=r["p80"], unit="ms", profile=profile,
                                        device=device, fields=f))
        if r.get("GB/s") is not None:
            recs.append(results.make_record(notebook=notebook, workload="gpt", step=None, metric="kernel_gbps",
                                            value=r["GB/s"], unit="GB/s", profile=profile, device=device, fields=f))
    return recs
