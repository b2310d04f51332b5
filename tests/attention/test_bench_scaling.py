"""benchmarks/scaling.py at tiny sizes (T 32 / 64, D 16, one repeat, no memory): every configuration
in the JSON and the markdown, every ratio against SDPA, math skipped above --math-max-t, and the
O(T) slope computed (from memory figures put in by hand: measuring them takes subprocesses)."""
import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scaling():
    spec = importlib.util.spec_from_file_location("flashguard_bench_scaling", ROOT / "benchmarks" / "scaling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_run(scaling, tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("scaling")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = scaling.main(["--t-sizes", "32,64", "--t-sweep-d", "16", "--d-sizes", "16", "--d-sweep-t", "32",
                               "--repeats", "1", "--no-memory", "--math-max-t", "32", "--out-dir", str(out)])
    finally:
        torch.set_num_threads(n)
    return scaling, result, out / "scaling-cpu-1thread"


def test_presets_from_the_registry(scaling):
    from flashguard.numerics.policy import GPU_PRESETS, POLICIES

    available, skipped = scaling.cpu_presets()
    assert set(available) | set(skipped) == set(POLICIES)
    assert set(GPU_PRESETS) <= set(skipped) and {"fp32", "paper", "fa2", "paper-fp32fwd"} <= set(available)
    configs = scaling.select_configs(available, skipped, quick=True)
    assert configs == ["sdpa", "fp32", "paper", "fa2", "paper-fp32fwd"]
    assert scaling.select_configs(available, skipped, only=["fa2", "math"]) == ["sdpa", "math", "fa2"]
    with pytest.raises(SystemExit, match="skipped here"):
        scaling.select_configs(available, skipped, only=[GPU_PRESETS[0]])


def test_json_has_every_config_and_ratio(tiny_run):
    scaling, result, stem = tiny_run
    saved = json.loads(stem.with_suffix(".json").read_text())
    assert saved["threads"] == 1 and saved["shape"]["B"] == 1 and saved["shape"]["H"] == 4
    configs = saved["configs"]
    assert configs[:2] == ["sdpa", "math"] and len(configs) == 2 + len(scaling.cpu_presets()[0])
    grid = saved["grid"]
    assert [p["T"] for p in grid["t_sweep"]] == [32, 64] and [p["D"] for p in grid["d_sweep"]] == [16]
    for p in grid["t_sweep"] + grid["d_sweep"]:
        ran = [c for c in configs if c not in p["skipped"]]
        assert set(p["median_s"]) == set(p["x_sdpa"]) == set(ran)
        assert p["x_sdpa"]["sdpa"] == 1.0
        for c in ran:
            assert len(p["times_s"][c]) == 1
            assert math.isclose(p["x_sdpa"][c], p["median_s"][c] / p["median_s"]["sdpa"])
    assert "math" in grid["t_sweep"][0]["median_s"] and "math" in grid["t_sweep"][1]["skipped"]
    assert grid["memory_slope"] is None


def test_markdown_tables(tiny_run):
    _, result, stem = tiny_run
    md = stem.with_suffix(".md").read_text()
    assert md.count("## ") == 3 and "not timed tests" in md and "--no-memory" in md
    for c in result["configs"]:
        assert f"\n| {c} |" in md
    assert "| math | " in md and "skipped" in md and "(1.00x)" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert stem.with_suffix(".png").stat().st_size > 0


def test_memory_slope_and_statement(tiny_run):
    scaling, result, _ = tiny_run
    points = [{"T": t, "peak_mib": {"sdpa": 0.01 * t, "math": 1e-5 * t * t, "fa2": 5 + 0.001 * t}}
              for t in (512, 1024, 2048, 4096)]
    ms = scaling.memory_slopes(points, ["sdpa", "math", "fa2"], min_t=1024)
    assert math.isclose(ms["sdpa"], 1.0) and math.isclose(ms["math"], 2.0)
    assert 0 < ms["flash_max"] < 1 and ms["o_t"] is True and ms["min_t"] == 1024
    assert scaling.loglog_slope([1, 2], [0.0, 3.0]) is None
    result = copy.deepcopy(result)
    for p in result["grid"]["t_sweep"]:
        p["peak_mib"] = {c: 1.0 + 1e-3 * p["T"] for c in p["median_s"]}
    result["grid"]["memory_slope"] = scaling.memory_slopes(result["grid"]["t_sweep"], result["configs"], min_t=32)
    md = scaling.markdown(result)
    assert "Is attention memory O(T)?" in md and "slope (T >= 32)" in md and "math -" in md
