"""Cost-model calibration on a busy machine: unstable points measured again, a monotone fit, a warning; and the
curve of several sequences' trees for engines that run them apart (docs/trees.md#adaptive-tree-budget)."""

import pytest

import clover.adaptive as adaptive
from clover.adaptive import CostModel, busy_machine_warning, calibrate, monotone_fit
from clover.backends.onnxruntime import OnnxRuntimeEngine
from clover.drafters import save_drafter
from clover.export.builder import build_engine
from clover.target import load_target
from tests.conftest import make_drafter, write_tiny_checkpoint

# what a new user's build stored on a loaded machine (2, 4, 8, 16 tokens)
LOADED = [[2, 0.063], [4, 0.050], [8, 0.088], [16, 0.076]]


def test_monotone_fit_pools_the_points_measured_in_the_wrong_order():
    fitted = monotone_fit(LOADED)
    assert [x for x, _ in fitted] == [2, 4, 8, 16]
    assert [t for _, t in fitted] == pytest.approx([0.0565, 0.0565, 0.082, 0.082])
    assert monotone_fit([[1, 0.01], [2, 0.02]]) == [[1, 0.01], [2, 0.02]]  # an ordered curve is left as it is


def test_unstable_points_are_measured_again_and_the_fastest_median_kept(monkeypatch):
    rounds = [{("target", n): t for n, t in LOADED},  # first pass: as on the loaded machine
              {("target", 2): 0.040, ("target", 4): 0.049, ("target", 8): 0.070, ("target", 16): 0.074}]
    asked = []

    def fake_median(jobs, repeats, device):
        asked.append(set(jobs))
        return {key: rounds[min(len(asked), len(rounds)) - 1][key] for key in jobs}

    monkeypatch.setattr(adaptive, "median_seconds", fake_median)
    jobs = {("target", n): None for n, _ in LOADED}
    seconds = adaptive._steady_seconds(jobs, repeats=3, device="cpu")
    assert asked[1] == set(jobs)  # every point in a violating pair (2 > 4, 8 > 16) measured again
    assert seconds == {("target", 2): 0.040, ("target", 4): 0.049, ("target", 8): 0.070, ("target", 16): 0.074}
    assert len(asked) == 2  # steady after one retry


def test_busy_machine_warning_names_the_recalibrate_command(monkeypatch):
    monkeypatch.setattr(adaptive.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(adaptive.os, "getloadavg", lambda: (5.3, 4.0, 3.0))
    warning = busy_machine_warning()
    assert "load average 5.3 on 2 cores" in warning and "--recalibrate" in warning
    monkeypatch.setattr(adaptive.os, "getloadavg", lambda: (1.2, 1.0, 1.0))
    assert busy_machine_warning() is None


def test_pass_time_prices_several_sequences_trees_on_their_own_curve():
    model = CostModel(target=[[1, 0.010], [8, 0.020]], target_batched=[[2, 0.030], [8, 0.040]])
    assert model.pass_time(1, 8) == pytest.approx(0.020)  # one sequence: the in-place curve
    assert model.pass_time(4, 1) == model.target_time(4)  # vanilla steps of several sequences: in place too
    assert model.pass_time(4, 2) == pytest.approx(0.040)  # several trees: the batched graph's curve
    assert CostModel(target=[[1, 0.01], [8, 0.02]]).pass_time(4, 2) == pytest.approx(0.02)  # no such curve


def test_calibrating_a_gqa_engine_measures_both_curves(tmp_path):
    checkpoint = write_tiny_checkpoint(tmp_path / "ckpt")
    save_drafter(make_drafter(load_target(checkpoint), num_heads=2), tmp_path / "heads")
    engine_dir = build_engine(tmp_path / "engine", str(checkpoint), str(tmp_path / "heads"), max_seq=128,
                              progress=lambda m: None)
    model = calibrate(OnnxRuntimeEngine(engine_dir), max_tokens=16, repeats=2)
    assert [n for n, _ in model.target] == [1, 2, 4, 8, 16]
    assert [n for n, _ in model.target_batched] == [2, 4, 8, 16]
    for curve in (model.target, model.target_batched, model.draft):
        assert all(a[1] <= b[1] for a, b in zip(curve, curve[1:]))  # monotone after the fit
    assert CostModel.from_dict(model.to_dict()) == model
