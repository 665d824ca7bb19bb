"""The arrival schedule: Poisson (gamma for burstiness != 1) with vLLM's rescaling, seeded."""

import numpy as np
import pytest

from splitserve.bench.loadgen.arrivals import arrival_offsets


def gaps(n, rate, burstiness, seed=0):
    t = np.array(arrival_offsets(n, rate, burstiness, np.random.default_rng(seed)))
    return np.diff(np.concatenate([[0.0], t]))


def test_poisson_schedule_statistics():
    g = gaps(4000, rate=4.0, burstiness=1.0)
    assert g.mean() == pytest.approx(1 / 4.0, rel=1e-9)  # n arrivals span exactly n/rate
    assert np.all(g >= 0)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)  # exponential: CV 1
    assert np.mean(g < g.mean()) == pytest.approx(1 - np.exp(-1), abs=0.02)
    # memoryless: the gap after a long gap is no longer on average
    assert g[1:][g[:-1] > g.mean()].mean() == pytest.approx(g.mean(), rel=0.08)


@pytest.mark.parametrize("burstiness, cv", [(0.25, 2.0), (4.0, 0.5)])
def test_gamma_burstiness_sets_the_coefficient_of_variation(burstiness, cv):
    g = gaps(4000, rate=2.0, burstiness=burstiness)
    assert g.mean() == pytest.approx(0.5, rel=1e-9)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.08)


def test_constant_spacing_and_infinite_rate():
    assert gaps(5, rate=2.0, burstiness=float("inf")) == pytest.approx([0.5] * 5)
    assert arrival_offsets(4, float("inf"), 1.0, np.random.default_rng(0)) == [0.0] * 4


def test_schedule_is_reproducible_from_the_seed():
    a = arrival_offsets(50, 3.0, 1.0, np.random.default_rng([5, 1]))
    assert a == arrival_offsets(50, 3.0, 1.0, np.random.default_rng([5, 1]))
    assert a != arrival_offsets(50, 3.0, 1.0, np.random.default_rng([6, 1]))
    assert a == sorted(a) and a[-1] == pytest.approx(50 / 3.0)
