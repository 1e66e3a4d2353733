"""Known-answer tests for compute probes: a GPU that multiplies fast but wrong must not pass.

Each compute runner multiplies two fixed matrices (seeded, the same on every host) in every precision it
measures and hands the product to `check`, which compares it with the product computed here in float64 from the
same inputs rounded to that precision (so the reference sees exactly the numbers the device multiplied). The
tolerance per precision allows the output's rounding and a float32 accumulation, scaled by the largest entry of
the result; anything past it (a flipped bit, a NaN, a product of other numbers) is a problem, which quarantines
the GPU, and the run's figures are never counted towards anyone's reference.
"""

from __future__ import annotations

import numpy as np

from hostagent.domain.capabilities import WRONG_ANSWER

N = 64  # small: the check costs microseconds on a GPU and milliseconds on a CPU
SEED = 20261127
# Largest error allowed, as a share of the result's largest entry: the output's rounding (fp16 2^-11, bf16 2^-8,
# tf32-accumulated fp32 2^-11 at worst) with room for the order of a float32 accumulation over N terms.
TOLERANCE = {"fp64": 1e-9, "fp32": 2e-3, "fp16": 1e-2, "bf16": 4e-2}
PRECISIONS = tuple(TOLERANCE)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> the nearest bfloat16 (round to nearest even on the float32's upper 16 bits) -> float64."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def rounded(x: np.ndarray, precision: str) -> np.ndarray:
    """`x` as the device holds it in `precision`, back in float64."""
    if precision == "fp16":
        return x.astype(np.float16).astype(np.float64)
    if precision == "bf16":
        return _bf16(x)
    if precision == "fp32":
        return x.astype(np.float32).astype(np.float64)
    if precision == "fp64":
        return x.astype(np.float64)
    raise ValueError(f"no known-answer test for precision {precision!r}")


def inputs(precision: str) -> tuple[np.ndarray, np.ndarray]:
    """The two N x N factors, in [-1, 1), as representable in `precision` (float64 arrays)."""
    rng = np.random.default_rng(SEED)
    a, b = rng.uniform(-1.0, 1.0, (N, N)), rng.uniform(-1.0, 1.0, (N, N))
    return rounded(a, precision), rounded(b, precision)


def expected(precision: str) -> np.ndarray:
    """The exact product of `inputs(precision)`, in float64."""
    a, b = inputs(precision)
    return a @ b


def check(precision: str, got: object) -> str | None:
    """None when `got` is the product of `inputs(precision)` within its tolerance, else the problem in words."""
    ref = expected(precision)
    try:
        arr = np.asarray(got, dtype=np.float64)
    except (TypeError, ValueError):
        return f"{WRONG_ANSWER}: {precision} matrix multiply returned something that is not a matrix"
    if arr.shape != ref.shape:
        return f"{WRONG_ANSWER}: {precision} matrix multiply returned shape {arr.shape}, expected {ref.shape}"
    if not np.all(np.isfinite(arr)):
        return f"{WRONG_ANSWER}: {precision} matrix multiply returned {int(np.sum(~np.isfinite(arr)))} NaN/inf entries"
    err = float(np.max(np.abs(arr - ref)) / max(1.0, float(np.max(np.abs(ref)))))
    if err > TOLERANCE[precision]:
        return (f"{WRONG_ANSWER}: {precision} matrix multiply off by {err:.3g} of the result's scale (tolerance "
                f"{TOLERANCE[precision]:g}; known-answer test, {N}x{N}, seed {SEED})")
    return None
