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


def test_a_timed_row_against_the_copy_ceiling_and_in_words():
    from hwlib.bench import Timing
    from hwlib.studies.kernel_records import bandwidth_words, timed_row
    t = Timing(median_ms=0.5, p20_ms=0.4, p80_ms=0.6, n=3)
    r = timed_row("k", t, 1e9, {"copy_gbps": 4000.0}, M=8)
    assert r["kernel"] == "k" and r["M"] == 8 and r["GB/s"] == 2000.0 and r["share of copy"] == 0.5
    assert r["floor ms"] == 0.25 and (r["ms"], r["p20"], r["p80"]) == (0.5, 0.4, 0.6)
    assert bandwidth_words(r) == "(2,000 GB/s on the 1000 MB it moves, 50% of the measured copy bandwidth; its floor is 250.0 us)"
    bare = timed_row("k", t, 1e9, None)
    assert bare["share of copy"] is None and bare["floor ms"] is None
    assert bandwidth_words(bare) == "(2,000 GB/s on the 1000 MB it moves)"


def test_a_table_in_words_and_none_timed():
    from hwlib.bench import Timing
    from hwlib.studies.kernel_records import alone_words, timed_row
    rows = [timed_row("k", Timing(median_ms=0.05, p20_ms=0.04, p80_ms=0.06, n=3), 1.5e8, None, M=4)]
    assert alone_words(rows, lambda r: f"{r['M']} rows") == \
        "Alone (median per call): k: 50.0 us per call at 4 rows (3,000 GB/s on the 150 MB it moves)."
    assert alone_words([], str).startswith("The kernels were not timed alone here")


def test_the_not_timed_sentence_agrees_with_its_subject():
    from hwlib.studies.kernel_records import not_timed_words
    assert not_timed_words() == "The kernels were not timed alone here (a GPU and the full or mid profile time them)."
    assert not_timed_words("The head", "it") == "The head was not timed alone here (a GPU and the full or mid profile time it)."
