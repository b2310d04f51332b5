"""The grid read by coherent component, the real run's margin and the leading-layer verdict (C3)."""
import math

import pytest

from md_helpers import numbers
from flashguard import keys
from flashguard.experiments.injection.coherence import (MIN_RUNS, by_component, coherent_component,
                                                        judge_leading_layer, margin, real_bias_ratio,
                                                        runaway_steps)


def test_coherent_component_of_each_rule():
    assert coherent_component("coherent", 1.0, 10) == 10
    assert coherent_component("coherent", 0.75, 4) == pytest.approx(2.0)
    assert coherent_component("zero-mean", None, 100) == 0.0
    assert coherent_component("real", None, 3, b=-0.1) == pytest.approx(0.3)
    assert coherent_component("shuffled", None, 3) is None
    with pytest.raises(ValueError, match="'sideways'"):
        coherent_component("sideways", None, 1)


def _records(bs_by_layer, size=2.0):
    n = len(next(iter(bs_by_layer.values())))
    return [{keys.STEP: 25 * i, **{keys.DELTA_ERR_MEAN.key(layer): bs[i] * size for layer, bs in bs_by_layer.items()},
             **{keys.DELTA_ERR_ABS.key(layer): size for layer in bs_by_layer}} for i in range(n)]


def test_real_bias_ratio_takes_the_persistent_lean_with_its_bound():
    # layer 0 leans +0.1 every probe; layer 1 flips sign (mean 0) with the same size per probe
    recs = _records({0: [0.1 + 0.01 * (-1) ** i for i in range(40)], 1: [0.3 * (-1) ** i for i in range(40)]})
    r = real_bias_ratio(recs)
    assert r["by_layer"][0]["mean"] == pytest.approx(0.1, abs=1e-12)
    assert abs(r["by_layer"][1]["mean"]) < 1e-12
    assert r["b"] == pytest.approx(0.1)
    # the upper bound of the noisy layer exceeds its zero mean; the lean layer's exceeds 0.1
    assert r["by_layer"][1]["upper"] > 0.1 and r["by_layer"][0]["upper"] > 0.1
    assert r["n"] == 80
    empty = real_bias_ratio([{keys.STEP: 0, keys.LOSS_TRAIN: 1.0}])
    assert empty["b"] is None and empty["upper"] is None


def _run(column, rule, p, alpha, status, step=None):
    return {"column": column, "rule": rule, "p": p, "alpha": alpha,
            "summary": {"status": status, "diverged_at": step}}


def test_by_component_orders_and_margin_reads_the_boundary():
    runs = [_run("zero-mean", "zero-mean", None, 100, "done"),
            _run("coherent-p1", "coherent", 1.0, 1, "done"),
            _run("coherent-p1", "coherent", 1.0, 3, "diverged", 800),
            _run("coherent-p0.75", "coherent", 0.75, 10, "diverged", 300),
            _run("real", "real", None, 1, "done")]
    rows = by_component(runs, b=0.05)
    assert [r["c"] for r in rows] == pytest.approx([0.0, 0.05, 1.0, 3.0, 5.0])
    m = margin(rows, 0.1)
    assert m["c_diverged"] == 3.0 and m["c_trained"] == 1.0 and m["ratio"] == pytest.approx(30.0)
    assert "30x below" in m["text"] and {3, 0.1} <= set(numbers(m["text"]))   # the boundary, the lean
    # nothing coherent diverged: no boundary, no ratio
    m2 = margin(by_component(runs[:2], b=0.05), 0.1)
    assert m2["ratio"] is None and m2["c_diverged"] is None and numbers(m2["text"]) == [0.1]   # the lean, no boundary
    assert margin(rows, None)["ratio"] is None


def _outcome(norms):
    return {"wq_norm": {layer: [[s, v] for s, v in pts] for layer, pts in norms.items()}}


def test_runaway_steps_against_the_baseline():
    base = _outcome({0: [(0, 1.0), (25, 1.0), (50, 1.1)], 1: [(0, 1.0), (25, 1.0), (50, 1.0)]})
    run = _outcome({0: [(0, 1.0), (25, 1.5), (50, 2.3)], 1: [(0, 1.0), (25, 2.0), (50, 9.0)]})
    assert runaway_steps(run, base) == {0: 50, 1: 25}
    assert runaway_steps(base, base) == {0: None, 1: None}


def test_leading_layer_held_not_held_inconclusive():
    n = MIN_RUNS + 2
    held = judge_leading_layer([{0: 100, 1: 50}] * n, 2)
    assert held["verdict"] == "held" and held["numbers"]["leader"] == 1
    mixed = judge_leading_layer([{0: 100, 1: 50}, {0: 50, 1: 100}] * (n // 2), 2)
    assert mixed["verdict"] == "not held" and mixed["numbers"]["leader"] is None
    few = judge_leading_layer([{0: 100, 1: 50}] * (MIN_RUNS - 1), 2)
    assert few["verdict"] == "inconclusive"
    # a late layer that leads is no early layer: not held
    late = judge_leading_layer([{0: 100, 1: 100, 2: 100, 3: 20}] * n, 4)
    assert late["verdict"] == "not held" and late["numbers"]["leader"] == 3 and "early" in late["evidence"]
    # ties leave a run without a single leader
    tied = judge_leading_layer([{0: 50, 1: 50}] * n, 2)
    assert tied["numbers"]["no_single_leader"] == n and tied["verdict"] == "not held"
    assert math.isclose(tied["numbers"]["p"], 1.0)


def _o(peak, status="done"):
    return {"summary": {"status": status}, "wq_norm": {0: [[0, 1.0], [25, peak]]}}


def test_runaway_reading_held_not_held_inconclusive():
    from flashguard.experiments.injection.coherence import judge_runaway
    base = {1: _o(1.0), 2: _o(1.0)}
    alphas = (1.0, 10.0)

    def grid(coh, zm):
        return {("coherent-p1", a): {1: _o(coh[i]), 2: _o(coh[i])} for i, a in enumerate(alphas)} | \
               {("zero-mean", a): {1: _o(zm[i]), 2: _o(zm[i])} for i, a in enumerate(alphas)}

    held = judge_runaway(grid([5.0, 9.0], [1.2, 1.5]), base, alphas, coherent="coherent-p1")
    assert held["verdict"] == "held"
    assert held["numbers"]["coherent"] == {1.0: "ran away", 10.0: "ran away"}
    assert held["numbers"]["zero_mean"] == {1.0: "held", 10.0: "held"}
    pair = held["evidence"][:held["evidence"].index(" (alpha")]   # the cells it compares, before the table
    assert numbers(pair)[-2:] == [1, 10] and pair.index("coherent-p1") < pair.index("zero-mean")
    both = judge_runaway(grid([5.0, 9.0], [3.0, 4.0]), base, alphas, coherent="coherent-p1")
    assert both["verdict"] == "not held"
    only_zm = judge_runaway(grid([1.1, 1.2], [1.1, 3.0]), base, alphas, coherent="coherent-p1")
    assert only_zm["verdict"] == "not held"
    nothing = judge_runaway(grid([1.1, 1.2], [1.1, 1.2]), base, alphas, coherent="coherent-p1")
    assert nothing["verdict"] == "inconclusive"
    unfinished = grid([5.0, 9.0], [1.2, 1.5])
    unfinished[("zero-mean", 10.0)][2] = _o(1.2, status="partial")
    unfinished[("zero-mean", 1.0)][2] = _o(1.2, status="partial")
    assert judge_runaway(unfinished, base, alphas, coherent="coherent-p1")["verdict"] == "inconclusive"
