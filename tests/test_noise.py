import random

import pytest

from hwlib import noise


def windows(rng, n_windows, steps, ms, spread=0.05):
    return [[ms * (1 + rng.gauss(0, spread)) for _ in range(steps)] for _ in range(n_windows)]


def test_a_toggle_with_no_effect_is_within_noise():
    rng = random.Random(1)
    a, b = windows(rng, 4, 10, 10.0), windows(rng, 4, 10, 10.0)
    iv = noise.ratio_interval(a, b, seed=0)
    assert iv.lo < 1.0 < iv.hi and iv.hi - iv.lo < 0.2
    assert noise.effect(iv.lo, iv.hi) == "within noise"


@pytest.mark.parametrize("after_ms, effect", [(5.0, "faster"), (20.0, "slower")])
def test_a_large_effect_lies_outside_one(after_ms, effect):
    rng = random.Random(2)
    iv = noise.ratio_interval(windows(rng, 4, 10, 10.0), windows(rng, 4, 10, after_ms), seed=0)
    assert iv.ratio == pytest.approx(10.0 / after_ms, rel=0.05)
    assert iv.lo <= iv.ratio <= iv.hi
    assert noise.effect(iv.lo, iv.hi) == effect


def test_the_interval_is_seeded_and_deterministic():
    rng = random.Random(3)
    a, b = windows(rng, 3, 8, 10.0), windows(rng, 3, 8, 9.0)
    assert noise.ratio_interval(a, b, seed=7) == noise.ratio_interval(a, b, seed=7)
    assert noise.ratio_interval(a, b, seed=7) != noise.ratio_interval(a, b, seed=8)


def test_a_drift_between_repeats_widens_the_interval():
    """Window pairs that disagree with each other (a drift between repeats) give a wider interval
    than the same steps would inside one window: the between-repeat level is resampled."""
    steady_a = [[10.0, 10.1, 9.9, 10.0]] * 4
    steady_b = [[9.0, 9.1, 8.9, 9.0]] * 4
    drift_b = [[x * f for x in w] for w, f in zip(steady_b, (0.9, 1.0, 1.1, 1.2))]
    narrow = noise.ratio_interval(steady_a, steady_b, seed=0)
    wide = noise.ratio_interval(steady_a, drift_b, seed=0)
    assert (wide.hi - wide.lo) > 3 * (narrow.hi - narrow.lo)


def test_interleaved_order_alternates_and_balances():
    assert noise.interleaved_order(1) == ["A", "B"]
    assert noise.interleaved_order(4) == ["A", "B", "B", "A", "A", "B", "B", "A"]
    order = noise.interleaved_order(6)
    assert order.count("A") == order.count("B") == 6
    # every pair of windows holds one of each arm: A and B run side by side
    assert all(sorted(order[i:i + 2]) == ["A", "B"] for i in range(0, len(order), 2))
    # any number of arms (the anchors beside a ladder step): every round holds each once, every second reversed
    assert noise.interleaved_order(2, ["lab", "x", "y"]) == ["lab", "x", "y", "y", "x", "lab"]
    for bad in ([], ["a", "a"]):
        with pytest.raises(ValueError, match="arms must be distinct names"):
            noise.interleaved_order(2, bad)


@pytest.mark.parametrize("lo, hi, threshold, where", [
    (1.1, 1.2, 1.0, "above"), (0.8, 0.9, 1.0, "below"), (0.9, 1.1, 1.0, "within noise"), (1.0, 1.2, 1.0, "within noise"),
])
def test_compare(lo, hi, threshold, where):
    assert noise.compare(lo, hi, threshold) == where


@pytest.mark.parametrize("kw, says", [
    ({"before": [], "after": [[1.0]]}, "before"),
    ({"before": [[1.0]], "after": [[1.0], [1.0]]}, "interleaved pairs"),
    ({"before": [[1.0, float("nan")]], "after": [[1.0]]}, "before[0]"),
    ({"before": [[1.0]], "after": [[0.0]]}, "after[0]"),
    ({"before": [1.0, 2.0], "after": [[1.0]]}, "before[0] is a number"),
    ({"before": [[1.0]], "after": [[1.0]], "level": 1.5}, "level"),
    ({"before": [[1.0]], "after": [[1.0]], "resamples": 10}, "resamples"),
    ({"before": [[1.0]], "after": [[1.0]], "stat": "mode"}, "stat"),
])
def test_bad_input_names_the_argument(kw, says):
    with pytest.raises(ValueError, match=r".*" + says.replace("[", r"\[").replace("]", r"\]")):
        noise.ratio_interval(**kw)


def test_compare_refuses_a_reversed_interval():
    with pytest.raises(ValueError, match="lo"):
        noise.compare(1.2, 1.1, 1.0)


def test_within_spread_takes_the_larger_spread_either_way_and_says_nothing_unmeasured():
    assert noise.within_spread(1.004, [1.002, None, 1.005]) is True
    assert noise.within_spread(1 / 1.004, [1.005]) is True           # a slow-down is judged the same way
    assert noise.within_spread(1.006, [1.002, 1.005]) is False
    assert noise.within_spread(1.5, [None]) is None and noise.within_spread(1.5, []) is None
