"""gpt2train/scaling.py: the ladder's fits recover what runs synthesised from known laws hold."""

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpt2train import scaling
from gpt2train.scaling import FitError, Fits

ROOT = Path(__file__).resolve().parent.parent
TRUE = {"E": 1.7, "A": 400.0, "alpha": 0.34, "B": 410.0, "beta": 0.28}  # Chinchilla's fitted law


def synthetic_runs(noise=0.003, budgets=(1e17, 3e17, 1e18, 3e18), sizes=7, seed=1):
    """Runs of TRUE's law in Chinchilla's range (N 1e7 to 1e9), C = 6 N D at each budget, the loss times a
    log-normal noise."""
    rng = np.random.default_rng(seed)
    runs = []
    for c in budgets:
        for n in np.geomspace(1e7, 1e9, sizes):
            d = c / (6 * n)
            loss = scaling.law_loss(TRUE, n, d) * math.exp(rng.normal(0, noise))
            runs.append({"n": float(n), "d": float(d), "budget": c, "loss": loss})
    return runs


@pytest.fixture(scope="module")
def fit():
    return scaling.fit_all(synthetic_runs(), Fits(boot=60))


def test_the_law_recovers_known_exponents_within_5_percent_and_its_band_covers_them(fit):
    law = fit["law"]
    for key in ("alpha", "beta"):  # the exponents: what a prediction's extrapolation rests on
        assert law[key] == pytest.approx(TRUE[key], rel=0.05)
        low, high = law["ci95"][key]
        assert low <= TRUE[key] <= high, (key, law["ci95"][key])
    assert law["E"] == pytest.approx(TRUE["E"], rel=0.05)
    assert set(law["ci95"]) == set(scaling.LAW_KEYS) and law["r2"] > 0.99


def test_the_power_laws_follow_the_law_and_predict_a_budget_with_its_band(fit):
    # the law's own optimum: n_opt ~ C^(beta / (alpha + beta)) (Chinchilla's eq. 4)
    a = TRUE["beta"] / (TRUE["alpha"] + TRUE["beta"])
    laws = fit["power_laws"]
    assert laws["a"] == pytest.approx(a, abs=0.05) and laws["b"] == pytest.approx(1 - a, abs=0.05)
    assert laws["ci95"]["a"][0] <= laws["a"] <= laws["ci95"]["a"][1]
    out = scaling.predict(fit, flops=1e19)
    assert out["n_opt"] == out["params"] and out["d_opt"] == out["tokens"] and out["flops"] == 1e19
    true_loss = scaling.law_loss(TRUE, out["params"], out["tokens"])
    assert out["val_loss"] == pytest.approx(true_loss, rel=0.01)
    assert out["ci95"][0] <= true_loss <= out["ci95"][1]
    run = scaling.predict(fit, n=1e9, d=2e9, flops=1.2e19)
    assert "n_opt" not in run and run["params"] == 1e9 and run["ci95"][0] < run["val_loss"] < run["ci95"][1]


def test_an_isoflop_parabola_gives_its_vertex_and_flags_an_optimum_at_an_edge():
    def budget(center, sizes=(1e5, 2e5, 4e5, 8e5, 1.6e6)):
        return [
            {"n": n, "d": 1e12 / (6 * n), "budget": 1e12, "loss": 2 + 0.1 * math.log(n / center) ** 2} for n in sizes
        ]

    curve = scaling.parabola(budget(3e5))
    assert curve["n_opt"] == pytest.approx(3e5, rel=1e-6) and curve["loss_opt"] == pytest.approx(2.0)
    assert curve["d_opt"] == pytest.approx(1e12 / (6 * 3e5), rel=1e-6) and curve["r2"] == pytest.approx(1.0)
    assert curve["at_edge"] is False
    assert scaling.parabola(budget(5e4))["at_edge"] == "smaller"  # the optimum is below the smallest size
    assert scaling.parabola(budget(5e6))["at_edge"] == "larger"
    flat = [{**r, "loss": 3 - 0.1 * math.log(r["n"])} for r in budget(3e5)]  # still falling at the largest
    assert scaling.parabola(flat)["at_edge"] == "larger"


@pytest.mark.parametrize(
    "runs, expected",
    [
        ([r for r in synthetic_runs() if r["budget"] == 1e17], "at least 2 budgets (runs that ended ok, sizes"),
        (synthetic_runs(sizes=2), "at least 3 sizes at each of at least 2 budgets"),
        ([], "sizes per budget: none"),
    ],
)
def test_too_few_runs_for_a_fit_is_one_line(runs, expected):
    with pytest.raises(FitError) as err:
        scaling.fit_all(runs)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_the_law_objective_gradient_is_its_derivative():
    runs = synthetic_runs(noise=0.02)[:10]
    data = (np.log([r["n"] for r in runs]), np.log([r["d"] for r in runs]), np.log([r["loss"] for r in runs]), 1e-3)
    theta = np.array([6.0, 0.3, 6.0, 0.3, 0.5])
    value, grad = scaling.law_objective(theta, *data)
    step = 1e-7
    numeric = [(scaling.law_objective(theta + step * e, *data)[0] - value) / step for e in np.eye(5)]
    assert np.allclose(grad, numeric, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_train_does_not_import_scipy():
    """scipy is ladder.py's (its fits), never a training dependency."""
    code = "import sys, train; print('scipy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
