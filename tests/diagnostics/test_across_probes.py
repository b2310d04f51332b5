"""A lean read across probes (Stouffer's z): known answers each way, the false-alarm rate, the census."""
import json
import math

import pytest
import torch

from flashguard import keys
from flashguard.attention.error_stats import Z_CRIT
from flashguard.diagnostics.across_probes import format_across_probes, lean_across_probes
from flashguard.diagnostics.census_table import Census, census_from_records, format_census


def _records(zs, ratio, layer=0, what=keys.DELTA_ERR_Z, ratio_metric=keys.DELTA_ERR_RATIO_ROW, every=50):
    return [{keys.STEP: i * every, what.key(layer): z, ratio_metric.key(layer): ratio,
             keys.TIE_RATE.key(layer): 0.02} for i, z in enumerate(zs)]


@pytest.mark.parametrize("zs, ratio, verdict", [
    ([1.5] * 12, 0.05, "leans +"),          # no probe significant alone; together z = 1.5 * sqrt(12) = 5.2
    ([-1.5] * 12, -0.05, "leans -"),
    ([1.5] * 12, 0.001, "weak +"),          # significant but a tiny effect: not a lean by the lab's rule
    ([1.5] * 12, -0.05, "weak +"),          # ratio of the other sign: not a lean either
    ([1.5, -1.5] * 6, 0.05, "no lean"),     # a sign that comes and goes adds to nothing
])
def test_known_answers(zs, ratio, verdict):
    s = lean_across_probes(_records(zs, ratio))[0]
    assert s.verdict == verdict
    assert s.stouffer_z == pytest.approx(sum(zs) / math.sqrt(len(zs)))
    assert s.positive == sum(z > 0 for z in zs) and s.steps[0] == 0 and len(s.steps) == len(zs)


def test_no_lean_alarms_at_the_stated_rate_and_a_small_steady_lean_is_found():
    g = torch.Generator().manual_seed(0)
    n_series, n_probes = 20000, 20
    null = torch.randn(n_series, n_probes, generator=g, dtype=torch.float64)
    stouffer = null.sum(1) / math.sqrt(n_probes)
    rate = float((stouffer.abs() >= Z_CRIT).double().mean())
    assert rate < 0.003  # two-sided p = 0.001 by construction; 20,000 series put 0.003 beyond 4 sd of it
    # a steady lean of +1 sd a probe (never significant alone; expected Stouffer z 4.5): found in most
    # series, by the verdict itself; the same series without it are not
    verdicts = [lean_across_probes(_records((z + shift).tolist(), 0.05))[0].verdict
                for z in null[:400] for shift in (0.0, 1.0)]
    found = verdicts[1::2].count("leans +") / 400
    alarms = sum(v != "no lean" for v in verdicts[0::2]) / 400
    assert found > 0.8 and alarms < 0.02


def test_window_and_the_o_series_and_bad_input():
    recs = _records([0.0] * 10 + [3.0] * 10, 0.05)
    assert lean_across_probes(recs, until=450)[0].verdict == "no lean"
    assert lean_across_probes(recs, since=500)[0].verdict == "leans +"
    o = _records([-2.0] * 9, -0.03, what=keys.O_ERR_Z, ratio_metric=keys.O_ERR_RATIO_ROW)
    assert lean_across_probes(o, "O")[0].verdict == "leans -" and lean_across_probes(o) == {}
    with pytest.raises(ValueError, match="what must be one of"):
        lean_across_probes(recs, "dq")


def test_the_census_carries_it_and_survives_json():
    c = census_from_records(_records([1.5] * 12, 0.05))
    assert c.across["delta"][0].verdict == "leans +"
    text = format_census(c)
    assert format_across_probes(c.across["delta"]) in text and "Stouffer z +5.2" in text
    back = Census.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.across == c.across and format_census(back) == text
