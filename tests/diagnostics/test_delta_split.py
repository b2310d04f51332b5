"""delta's error split where it is born (issue 23 item 3): the parts add up to the error; with
delta's product and sum in fp64 its own part vanishes, with O in fp64 the part from O does; the
tied / untied means cover the rows; the probes write the keys."""
from __future__ import annotations

import math

import torch

from flashguard import keys
from flashguard.attention.trace import Arithmetic, trace
from flashguard.diagnostics.probes import delta_split_metrics


def _trace(precision, seed=0, T=96):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 2, T, 16, generator=g) for _ in range(4))
    q = q * 4  # peaked rows, a few ties in bf16
    return trace(q, k, v, do, Arithmetic.of(precision, block_q=32, block_k=32), causal=True, grads=False)


def test_the_parts_add_up_to_the_error_and_each_vanishes_where_its_source_is_exact():
    t = _trace("paper")
    tied = t.ties.multi_one > 0
    m = delta_split_metrics(t, tied, 0)
    total = t.delta_err.mean().item()
    assert math.isclose(m[keys.DELTA_FROM_O_MEAN.key(0)] + m[keys.DELTA_OWN_MEAN.key(0)], total, rel_tol=1e-9,
                        abs_tol=1e-15)
    assert abs(m[keys.DELTA_OWN_MEAN.key(0)]) > 0 and abs(m[keys.DELTA_FROM_O_MEAN.key(0)]) > 0
    # delta's product and sum in fp64: nothing of its own is added
    own_exact = delta_split_metrics(_trace("paper[delta_product=fp64,delta=fp64]"), tied, 0)
    assert abs(own_exact[keys.DELTA_OWN_MEAN.key(0)]) < 1e-6 * abs(own_exact[keys.DELTA_FROM_O_MEAN.key(0)])
    # O in fp64 (every forward intermediate fp64): O's error carries nothing
    fwd64 = "paper[scores=fp64,stats=fp64,pbar=fp64,pv=fp64,o_accum=fp64,output=fp64,lse=fp64]"
    o_exact = delta_split_metrics(_trace(fwd64), tied, 0)
    assert abs(o_exact[keys.DELTA_FROM_O_MEAN.key(0)]) < 1e-6 * abs(o_exact[keys.DELTA_OWN_MEAN.key(0)])


def test_tied_and_untied_means_partition_the_rows():
    t = _trace("paper")
    tied = torch.zeros_like(t.delta, dtype=torch.bool)
    tied[:, :, ::3] = True
    m = delta_split_metrics(t, tied, 1)
    frac = m[keys.TIED_ROW_FRAC.key(1)]
    mixed = frac * m[keys.DELTA_OWN_TIED.key(1)] + (1 - frac) * m[keys.DELTA_OWN_UNTIED.key(1)]
    assert math.isclose(mixed, m[keys.DELTA_OWN_MEAN.key(1)], rel_tol=1e-9, abs_tol=1e-15)
    none = delta_split_metrics(t, torch.zeros_like(tied), 1)
    assert none[keys.TIED_ROW_FRAC.key(1)] == 0 and keys.DELTA_OWN_TIED.key(1) not in none  # no rows: no value
    assert all(keys.metric(k) is not None for k in m)  # in the schema


def test_split_across_probes_adds_up_z_and_means():
    from flashguard.diagnostics.across_probes import split_across_probes
    recs = []
    for step, (zo, zw) in enumerate([(2.0, 0.5), (2.0, -0.5), (2.0, 0.0), (2.0, 0.0)]):
        r = {keys.STEP: step * 50, keys.DELTA_FROM_O_Z.key(0): zo, keys.DELTA_OWN_Z.key(0): zw,
             keys.DELTA_FROM_O_MEAN.key(0): 1e-6, keys.DELTA_OWN_MEAN.key(0): -2e-6, keys.TIED_ROW_FRAC.key(0): 0.1,
             keys.DELTA_OWN_TIED.key(0): 3e-6}
        if step % 2 == 0:
            r[keys.DELTA_FROM_O_TIED.key(0)] = 4e-6
        recs.append(r)
    s = split_across_probes(recs)[0]
    assert s["from_o"]["stouffer_z"] == 4.0 and s["from_o"]["significant"] and s["from_o"]["positive"] == 4
    assert s["own"]["stouffer_z"] == 0.0 and not s["own"]["significant"]
    assert s["from_o"]["tied"] == 4e-6 and s["from_o"]["untied"] is None and s["own"]["mean"] == -2e-6
    assert s["tied_row_frac"] == 0.1
    assert split_across_probes(recs, since=200) == {}
