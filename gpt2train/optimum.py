"""Where a swept hyperparameter is best (sweep.py): a parabola in log(value) through the best grid point and its two
neighbours, its vertex the optimum, with a bootstrap 95% interval over seeds.

    fit = fit_optimum([1e-3, 2e-3, 4e-3, 8e-3], [[3.1, 3.0, 3.05, 3.3], [3.2, 3.0, 3.1, 3.4]])  # rows: seeds
    fit["value"], fit["ci95"], fit["at_edge"], fit["extend"]

Lower metrics are better (a loss). A grid point with a missing (None: a diverged or failed run) or non-finite value
in any seed counts as worse than every finite one. Where the best point is an end of the grid the optimum is that
end, `at_edge` is True and `extend` says which way the grid should grow ('lower' or 'higher'); where the three
points are not convex (a flat or noisy curve) the optimum is the best grid point itself."""

import math
import random

import numpy as np

BOOTSTRAP = 2000  # resamples of the seeds


def mean_curve(rows):
    """The mean over seeds (rows) of each grid point; inf where any seed has no finite value."""
    curve = []
    for column in zip(*rows):
        finite = all(v is not None and math.isfinite(v) for v in column)
        curve.append(sum(column) / len(column) if finite else math.inf)
    return curve


def vertex(logs, curve):
    """(log of the optimum, index of the best point) of a mean curve over the sorted log values."""
    best = min(range(len(curve)), key=lambda i: (curve[i], i))
    if best in (0, len(curve) - 1) or not math.isfinite(curve[best - 1] + curve[best + 1]):
        return logs[best], best
    (x0, x1, x2), (y0, y1, y2) = logs[best - 1 : best + 2], curve[best - 1 : best + 2]
    # the parabola through the three points: its curvature and its vertex (Lagrange form)
    d0, d2 = (y0 - y1) / (x0 - x1), (y2 - y1) / (x2 - x1)
    a = (d2 - d0) / (x2 - x0)
    if a <= 0:  # not convex: no vertex between the neighbours
        return logs[best], best
    u = (x0 + x1) / 2 - d0 / (2 * a)  # slope of the chord (x0, x1) is a*(x0+x1) + b, and the vertex is -b / (2a)
    return min(max(u, x0), x2), best


def ci95(logs):
    """exp of the 2.5th and 97.5th percentiles of logs."""
    return [math.exp(v) for v in np.percentile(logs, [2.5, 97.5])]


def bootstrap_logs(logs, rows, seed=0):
    """The optimum's log over BOOTSTRAP resamples (with replacement) of the seeds, sorted."""
    rng = random.Random(seed)
    return sorted(vertex(logs, mean_curve([rng.choice(rows) for _ in rows]))[0] for _ in range(BOOTSTRAP))


def fit_optimum(values, rows, seed=0):
    """{value, ci95, at_edge, extend, best} for grid `values` (positive numbers, any order) and `rows`: one list per
    seed of the metric at each value (None: no result). ci95 is None with fewer than two seeds."""
    if len(values) < 3 or any(v <= 0 for v in values):
        raise ValueError(f"fitting an optimum needs >= 3 positive grid values; got {values}")
    order = sorted(range(len(values)), key=lambda i: values[i])
    logs = [math.log(values[i]) for i in order]
    rows = [[row[i] for i in order] for row in rows]
    curve = mean_curve(rows)
    if not any(math.isfinite(v) for v in curve):
        return {"value": None, "ci95": None, "at_edge": False, "extend": None, "best": None}
    u, best = vertex(logs, curve)
    edge = best in (0, len(logs) - 1)
    ci = ci95(bootstrap_logs(logs, rows, seed)) if len(rows) > 1 else None
    extend = ("lower" if best == 0 else "higher") if edge else None
    return {"value": math.exp(u), "ci95": ci, "at_edge": edge, "extend": extend, "best": values[order[best]]}


def moved(small, large, seed=0):
    """{ratio, ci95}: the optimum of `large` over that of `small` (each (values, rows) as fit_optimum takes them),
    its interval from independent bootstrap resamples of each one's seeds."""
    fits = [fit_optimum(v, r, seed) for v, r in (small, large)]
    if any(f["value"] is None for f in fits):
        return {"ratio": None, "ci95": None}
    ratio = fits[1]["value"] / fits[0]["value"]
    draws = []
    for (values, rows), s in ((small, seed), (large, seed + 1)):
        order = sorted(range(len(values)), key=lambda i: values[i])
        logs = [math.log(values[i]) for i in order]
        draws.append(bootstrap_logs(logs, [[row[i] for i in order] for row in rows], s) if len(rows) > 1 else None)
    if None in draws:
        return {"ratio": ratio, "ci95": None}
    rng = random.Random(seed)
    rng.shuffle(draws[1])  # pair the two sizes' resamples at random: independent seeds
    return {"ratio": ratio, "ci95": ci95([b - a for a, b in zip(*draws)])}
