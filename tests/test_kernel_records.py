"""hwlib.studies.kernel_records: one record format for the studies' kernels timed alone."""

from __future__ import annotations

from hwlib.studies.kernel_records import kernel_records


def test_a_ms_record_per_row_and_a_bandwidth_record_where_the_row_has_one():
    rows = [{"kernel": "a", "M": 8, "ms": 0.5, "p20": 0.4, "p80": 0.6, "GB/s": 100.0},
            {"kernel": "b", "M": 8, "ms": 0.7, "p20": 0.6, "p80": 0.8}]
    recs = kernel_records(rows, notebook="nb", study="s", keys=("kernel", "M"), profile="smoke", device="cpu")
    assert [(r["metric"], r["value"], r["fields"]) for r in recs] == [
        ("kernel_ms", 0.5, {"study": "s", "kernel": "a", "M": 8}),
        ("kernel_gbps", 100.0, {"study": "s", "kernel": "a", "M": 8}),
        ("kernel_ms", 0.7, {"study": "s", "kernel": "b", "M": 8})]
    assert recs[0]["p20"] == 0.4 and recs[0]["p80"] == 0.6 and all(r["notebook"] == "nb" for r in recs)
