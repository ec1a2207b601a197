"""The fits of a scaling ladder (ladder.py): runs of several sizes at several compute budgets, each a val loss.

A run here is a dict with `n` (non-lookup params: the count the FLOPs follow), `d` (tokens trained), `budget` (the
target FLOPs it ran at) and `loss`. Three fits, each with its R^2 and bootstrap 95% intervals over the runs
(FITS.boot replicates of the runs, each run's loss the law's fit times a residual of the law drawn with replacement:
resample(); from a fixed seed, so the same runs give the same numbers):

- isoflop(): per budget, loss against ln n is a parabola (Chinchilla's approach 2, nanochat's scaling notebook);
  its vertex is the compute-optimal size n_opt and the loss there; the tokens there (d_opt) follow from ln d
  against ln n, a straight line within one budget. An optimum at an end of the sizes is flagged (at_edge:
  'smaller' or 'larger', the way to extend the sizes).
- power_laws(): across budgets, n_opt = n_coef * C^a and d_opt = d_coef * C^b (least squares in log space), and
  the tokens-per-parameter ratio at the optimum (the geometric mean of d_opt / n_opt over the budgets).
- fit_law(): L(n, d) = E + A / n^alpha + B / d^beta over every run (Chinchilla's approach 3, as the paper fits it:
  the Huber loss (delta 1e-3) of log L against the log-sum-exp form LSE(a - alpha ln n, b - beta ln d, e),
  A = e^a, B = e^b, E = e^e, minimised by scipy's L-BFGS-B from the best points of a grid of starts).

A prediction's band (predict()) is the 2.5 and 97.5 percentiles over the bootstrap fits of their prediction times
a residual of the law (in log space) drawn at random: the fit's uncertainty and one run's scatter about it.

scipy is imported here only: ladder.py's fits, never imported by train.py.
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np


class FitError(ValueError):
    """The runs cannot support a fit: one line saying what the fit needs."""


@dataclass(frozen=True)
class Fits:
    boot: int = 200  # bootstrap replicates
    seed: int = 0  # of the resampling
    huber_delta: float = 1e-3  # Chinchilla's
    starts: int = 8  # L-BFGS-B runs from the best points of the grid (every replicate also starts from the point fit)


FITS = Fits()
LAW_KEYS = ("E", "A", "alpha", "B", "beta")
# Chinchilla's grid of initialisations (a, alpha, b, beta, e): a, b in 0..25 by 5, alpha, beta in 0..2 by 0.5,
# e in -1..1 by 0.5
COEFS, EXPONENTS = np.arange(0, 30, 5.0), np.arange(0, 2.5, 0.5)
GRID = np.array(list(itertools.product(COEFS, EXPONENTS, COEFS, EXPONENTS, [-1, -0.5, 0, 0.5, 1])))
BOUNDS = [(None, None), (0.0, 5.0), (None, None), (0.0, 5.0), (None, None)]
LBFGSB = {
    "jac": True,
    "method": "L-BFGS-B",
    "bounds": BOUNDS,
    "options": {"gtol": 1e-7, "ftol": 1e-10, "maxiter": 1000},
}


def check_runs(runs, min_sizes=3, min_budgets=2):
    """FitError unless the runs hold at least min_sizes sizes within each of at least min_budgets budgets."""
    budgets = sorted({r["budget"] for r in runs})
    thin = [b for b in budgets if len({r["n"] for r in runs if r["budget"] == b}) < min_sizes]
    if len(budgets) < min_budgets or thin:
        got = ", ".join(f"{b:g}: {len({r['n'] for r in runs if r['budget'] == b})}" for b in budgets) or "none"
        raise FitError(
            f"the fits need at least {min_sizes} sizes at each of at least {min_budgets} budgets "
            f"(runs that ended ok, sizes per budget: {got})"
        )


def r_squared(y, fitted):
    """1 - SS_res / SS_tot; None where y does not vary (every budget's optimum at the same end size: no line)."""
    y, fitted = np.asarray(y, float), np.asarray(fitted, float)
    total = float(((y - y.mean()) ** 2).sum())
    return 1 - float(((y - fitted) ** 2).sum()) / total if total > 1e-12 * max(1.0, float((y**2).mean())) else None


# ----------------------------------------------------------------------------- IsoFLOP parabolas


def parabola(runs):
    """One budget's IsoFLOP fit: {n_opt, d_opt, loss_opt, r2, at_edge}. An optimum at or beyond an end of the sizes
    (the vertex, or the best run, there) is flagged (at_edge: 'smaller' or 'larger') and n_opt is that end's size,
    never an extrapolation; a curve that opens downward has no minimum: the best run's size stands in."""
    x = np.log([r["n"] for r in runs])
    y = np.array([r["loss"] for r in runs])
    c2, c1, c0 = np.polyfit(x, y, 2)
    r2 = r_squared(y, np.polyval([c2, c1, c0], x))
    lo, hi = x.min(), x.max()
    best = x[np.argmin(y)]
    vertex = -c1 / (2 * c2) if c2 > 0 else best
    at_edge = "smaller" if vertex <= lo or best == lo else "larger" if vertex >= hi or best == hi else False
    vertex = min(max(vertex, lo), hi)  # an optimum at the edge is the end size, flagged: no extrapolation
    slope, intercept = np.polyfit(x, np.log([r["d"] for r in runs]), 1)  # ln d against ln n: C = F(n) d
    return {
        "n_opt": float(math.exp(vertex)),
        "d_opt": float(math.exp(intercept + slope * vertex)),
        "loss_opt": float(np.polyval([c2, c1, c0], vertex)),
        "r2": r2,
        "at_edge": at_edge,
    }


def isoflop(runs):
    """[{flops, n_opt, d_opt, loss_opt, r2, at_edge}] per budget, smallest first."""
    return [
        {"flops": b, **parabola([r for r in runs if r["budget"] == b])} for b in sorted({r["budget"] for r in runs})
    ]


def power_laws(curves):
    """{a, b, n_coef, d_coef, ratio, r2}: n_opt = n_coef C^a, d_opt = d_coef C^b over the IsoFLOP optima (r2 of each
    log-space line: {'a': .., 'b': ..}); ratio: the geometric mean of d_opt / n_opt."""
    c = np.log([k["flops"] for k in curves])
    out, r2 = {}, {}
    for key, coef, exponent in (("n_opt", "n_coef", "a"), ("d_opt", "d_coef", "b")):
        y = np.log([k[key] for k in curves])
        slope, intercept = np.polyfit(c, y, 1)
        out[exponent], out[coef] = float(slope), float(math.exp(intercept))
        r2[exponent] = r_squared(y, intercept + slope * c)
    ratio = math.exp(float(np.mean([math.log(k["d_opt"] / k["n_opt"]) for k in curves])))
    return {**out, "ratio": ratio, "r2": r2}


# ----------------------------------------------------------------------------- the loss law


def law_objective(theta, log_n, log_d, log_loss, delta):
    """Chinchilla's objective and its gradient: the summed Huber loss of LSE(a - alpha ln n, b - beta ln d, e) -
    ln L, theta = (a, alpha, b, beta, e)."""
    a, alpha, b, beta, e = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, runs)
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    r = top + np.log(total) - log_loss
    weights /= total  # d LSE / d term
    huber = np.where(np.abs(r) <= delta, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))
    dr = np.clip(r, -delta, delta)  # d huber / d r
    grad = np.array(
        [
            (dr * weights[0]).sum(),
            -(dr * weights[0] * log_n).sum(),
            (dr * weights[1]).sum(),
            -(dr * weights[1] * log_d).sum(),
            (dr * weights[2]).sum(),
        ]
    )
    return float(huber.sum()) / delta, grad / delta  # in units of delta: L-BFGS-B's tolerances are absolute


def law_theta(runs, starts=None, fits=FITS):
    """The fitted theta = (a, alpha, b, beta, e) of the runs: L-BFGS-B from `starts` (default: the fits.starts best
    points of GRID by the objective) and kept the lowest."""
    from scipy.optimize import minimize

    data = (
        np.log([r["n"] for r in runs]),
        np.log([r["d"] for r in runs]),
        np.log([r["loss"] for r in runs]),
        fits.huber_delta,
    )
    if starts is None:
        scores = [law_objective(theta, *data)[0] for theta in GRID]
        starts = GRID[np.argsort(scores)[: fits.starts]]
    results = (minimize(law_objective, start, args=data, **LBFGSB) for start in starts)
    return min(results, key=lambda res: res.fun).x  # the first of equal lows, as the loop kept


def law_params(theta):
    a, alpha, b, beta, e = theta
    return {"E": math.exp(e), "A": math.exp(a), "alpha": float(alpha), "B": math.exp(b), "beta": float(beta)}


def law_loss(params, n, d):
    """L(n, d) = E + A / n^alpha + B / d^beta."""
    return params["E"] + params["A"] / n ** params["alpha"] + params["B"] / d ** params["beta"]


# ----------------------------------------------------------------------------- all of it, with the bootstrap


def resample(runs, fitted, residuals, rng):
    """A bootstrap replicate of the runs: each run's loss the law's fitted value times one of the law's residuals
    (log space) drawn with replacement (a residual bootstrap: every replicate keeps the ladder's sizes and budgets,
    which resampling whole runs of a 3-size ladder would not)."""
    draws = np.exp(rng.choice(residuals, size=len(runs)))
    return [{**r, "loss": float(f * e)} for r, f, e in zip(runs, fitted, draws)]


def fit_all(runs, fits=FITS):
    """{isoflop, power_laws, law, residuals, replicates} of the runs (check_runs first): the point fits with their
    R^2 and 95% intervals (ci95) from fits.boot bootstrap replicates; `replicates` (their power laws and laws) and
    `residuals` (of the law, log space) are what predict() draws on."""
    check_runs(runs)
    curves = isoflop(runs)
    laws = power_laws(curves)
    theta = law_theta(runs, fits=fits)
    law = law_params(theta)
    fitted = np.array([law_loss(law, r["n"], r["d"]) for r in runs])
    losses = np.array([r["loss"] for r in runs])
    law["r2"] = r_squared(losses, fitted)
    residuals = np.log(losses) - np.log(fitted)
    rng, replicates = np.random.default_rng(fits.seed), []
    for _ in range(fits.boot):
        sample = resample(runs, fitted, residuals, rng)
        sample_curves = isoflop(sample)
        replicates.append(
            {
                "isoflop": sample_curves,
                "power_laws": power_laws(sample_curves),
                "law": law_params(law_theta(sample, starts=[theta], fits=fits)),
            }
        )
    pct = lambda values: [float(v) for v in np.percentile(values, [2.5, 97.5])]  # noqa: E731
    for i, curve in enumerate(curves):
        curve["ci95"] = {k: pct([rep["isoflop"][i][k] for rep in replicates]) for k in ("n_opt", "loss_opt")}
    laws["ci95"] = {k: pct([rep["power_laws"][k] for rep in replicates]) for k in ("a", "b", "ratio")}
    law["ci95"] = {k: pct([rep["law"][k] for rep in replicates]) for k in LAW_KEYS}
    return {
        "isoflop": curves,
        "power_laws": laws,
        "law": law,
        "residuals": [float(v) for v in residuals],
        "replicates": replicates,
    }


def predict(fit, n=None, d=None, flops=None, seed=FITS.seed):
    """{params, tokens, flops, val_loss, ci95} of a run of n params and d tokens, or for a budget of `flops` the
    compute-optimal one (the power laws' n_opt, d_opt; also returned as n_opt, d_opt). ci95: the bootstrap band
    with a residual drawn per replicate (the module's docstring)."""
    rng = np.random.default_rng(seed)
    residuals = np.array(fit["residuals"])

    def optimum(laws):
        return laws["n_coef"] * flops ** laws["a"], laws["d_coef"] * flops ** laws["b"]

    point = optimum(fit["power_laws"]) if flops is not None and n is None else (n, d)
    spread = []
    for rep in fit["replicates"]:
        rn, rd = optimum(rep["power_laws"]) if n is None else point
        spread.append(law_loss(rep["law"], rn, rd) * math.exp(rng.choice(residuals)))
    out = {
        "params": float(point[0]),
        "tokens": float(point[1]),
        "flops": flops,
        "val_loss": float(law_loss(fit["law"], *point)),
        "ci95": [float(v) for v in np.percentile(spread, [2.5, 97.5])],
    }
    if n is None:
        out.update(n_opt=out["params"], d_opt=out["tokens"])
    return out
