"""The QoE model of CascadeInfer §4.1 and its least-squares fit.

A request's QoE is its *normalized latency* (end-to-end time divided by its output tokens). In a
batch of n requests with input lengths I_i and sequence lengths L_i every request is stretched
to the same value

    Q_j = D0 + D1·n + D2·ΣI + D3·ΣI² + D4·ΣL          (F0 = 1, F1 = n, F2 = ΣI, F3 = ΣI², F4 = ΣL)

(prefill is quadratic in I, a decode iteration linear in L), and the batch's QoE is
Q^B = n·Q_j (Eq. 1). The D_k are fitted by least squares over profiled requests: each request's
normalized latency against the batch features averaged over its lifetime.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Features = tuple[float, float, float, float, float]  # (1, n, ΣI, ΣI², ΣL)


def batch_features(seqs: Iterable[tuple[float, float]]) -> Features:
    """(1, n, ΣI, ΣI², ΣL) of a batch of ``(input length, sequence length)`` pairs."""
    n = si = si2 = sl = 0.0
    for i, length in seqs:
        n += 1
        si += i
        si2 += i * i
        sl += length
    return (1.0, n, si, si2, sl)


@dataclass(frozen=True)
class QoEModel:
    """Fitted coefficients D0..D4 (seconds per output token per unit of each feature)."""

    d: Features

    def request(self, f: Features) -> float:
        """Q_j: the normalized latency every request of a batch with features ``f`` sees."""
        d = self.d
        return d[0] * f[0] + d[1] * f[1] + d[2] * f[2] + d[3] * f[3] + d[4] * f[4]

    def batch(self, f: Features) -> float:
        """Q^B = n·Q_j, the batch's QoE (Eq. 1); an empty batch costs nothing."""
        return f[1] * self.request(f) if f[1] else 0.0


def fit(features: Sequence[Features], q: Sequence[float]) -> QoEModel:
    """Least-squares D_k minimising Σ_j (Q_j − Σ_k D_k F_k^(j))² (§4.1).

    The features span many orders of magnitude (ΣI² of long prompts ~1e12 beside F0 = 1), so
    each column is scaled to unit RMS before solving the normal equations, and a column that is
    all zero (never varied in the profile) gets coefficient 0.
    """
    if len(features) != len(q) or not features:
        raise ValueError("fit needs as many feature rows as latencies, and at least one")
    k = 5
    scale = [max(1e-300, (sum(f[c] * f[c] for f in features) / len(features)) ** 0.5) for c in range(k)]
    live = [c for c in range(k) if any(f[c] for f in features)]
    rows = [[f[c] / scale[c] for c in live] for f in features]
    m = len(live)
    a = [[sum(r[i] * r[j] for r in rows) for j in range(m)] for i in range(m)]
    b = [sum(r[i] * y for r, y in zip(rows, q)) for i in range(m)]
    sol = _solve(a, b)
    d = [0.0] * k
    for c, v in zip(live, sol):
        d[c] = v / scale[c]
    return QoEModel((d[0], d[1], d[2], d[3], d[4]))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a (near-)singular direction gets 0."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-12 * max(1.0, max(abs(x) for x in m[col][:n])):
            m[col] = [0.0] * (n + 1)
            m[col][col] = 1.0  # a degenerate column: fix its coefficient at 0
            continue
        for r in range(n):
            if r != col and m[r][col]:
                ratio = m[r][col] / m[col][col]
                m[r] = [x - ratio * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def mean_relative_error(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean of |predicted − measured| / measured over requests (§6.5's prediction error)."""
    pairs = [(p, y) for p, y in zip(predicted, measured) if y > 0]
    if not pairs:
        return float("nan")
    return sum(abs(p - y) / y for p, y in pairs) / len(pairs)
