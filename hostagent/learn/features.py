"""Feature extraction: one numeric row per (request, device) pair, the same code for training and for placement.

Categorical values (task type, precision, GPU model, vendor) are one-hot columns from a vocabulary learned at
training time and saved with the model; an unseen value is all zeros. Numbers the request or device does not
know are NaN, which the gradient-boosted trees route as "missing". One-hot (rather than the estimator's native
categorical support) keeps the estimator free of its input preprocessor, so the fitted trees can be evaluated
directly in one vectorised pass (see ``hostagent.learn.forest``). Everything is plain numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from hostagent.domain.placement import DeviceView, PlacementRequest

CATEGORICAL = ("task_type", "precision", "model", "vendor")
REQUEST_NUMERIC = ("log_data_scale", "min_memory_gib", "log_duration_s", "priority", "count")
DEVICE_NUMERIC = ("memory_gib", "link_gen", "link_width", "probe_score", "recent_errors", "numa_node")
PAIR_NUMERIC = ("numa_match", "memory_headroom_gib")
_NAN = math.nan
_DEVICE_CACHE_MAX = 4096


def _f(x: float | int | None) -> float:
    return _NAN if x is None else float(x)


def _log1p(x: float | None) -> float:
    return _NAN if x is None or x < 0 else math.log1p(x)


def fit_vocabulary(requests: Iterable[PlacementRequest], devices: Iterable[DeviceView]) -> dict[str, list[str]]:
    """The categories seen in training, in a stable (sorted) order."""
    seen: dict[str, set[str]] = {name: set() for name in CATEGORICAL}
    for r in requests:
        seen["task_type"].add(r.task_type)
        if r.precision:
            seen["precision"].add(r.precision)
    for d in devices:
        seen["model"].add(d.model)
        if d.vendor:
            seen["vendor"].add(d.vendor)
    return {name: sorted(values) for name, values in seen.items()}


class FeatureEncoder:
    """Turns requests and devices into rows of ``feature_names`` using a fixed vocabulary."""

    def __init__(self, vocabulary: Mapping[str, Sequence[str]]) -> None:
        self.vocabulary = {name: list(vocabulary.get(name, ())) for name in CATEGORICAL}
        self._index = {name: {v: i for i, v in enumerate(vals)} for name, vals in self.vocabulary.items()}
        v = self.vocabulary
        self.request_names = ([f"task_type={x}" for x in v["task_type"]] + [f"precision={x}" for x in v["precision"]]
                              + list(REQUEST_NUMERIC))
        self.device_names = ([f"model={x}" for x in v["model"]] + [f"vendor={x}" for x in v["vendor"]]
                             + list(DEVICE_NUMERIC))
        self.feature_names = tuple(self.request_names + self.device_names + list(PAIR_NUMERIC))
        self._nr, self._nd = len(self.request_names), len(self.device_names)
        self._device_cache: dict[DeviceView, np.ndarray] = {}

    def _onehot(self, name: str, value: str | None) -> list[float]:
        out = [0.0] * len(self.vocabulary[name])
        i = self._index[name].get(value) if value is not None else None
        if i is not None:
            out[i] = 1.0
        return out

    def request_part(self, r: PlacementRequest) -> np.ndarray:
        """The request's columns (shared by every candidate device)."""
        return np.array(self._onehot("task_type", r.task_type) + self._onehot("precision", r.precision) + [
            _log1p(r.data_scale), float(r.min_memory_gib), _log1p(r.duration_s), float(r.priority), float(r.count),
        ])

    def device_part(self, d: DeviceView) -> np.ndarray:
        """The device's columns; cached, because a host's devices change rarely between decisions."""
        row = self._device_cache.get(d)
        if row is None:
            row = np.array(self._onehot("model", d.model) + self._onehot("vendor", d.vendor or None) + [
                _f(d.memory_gib), _f(d.link_gen), _f(d.link_width), _f(d.probe_score), float(d.recent_errors),
                _f(d.numa_node),
            ])
            if len(self._device_cache) >= _DEVICE_CACHE_MAX:
                self._device_cache.clear()
            self._device_cache[d] = row
        return row

    def matrix(self, request: PlacementRequest, devices: Sequence[DeviceView]) -> np.ndarray:
        """An (n, F) float matrix: one row per candidate device for one request."""
        nr, nd = self._nr, self._nd
        out = np.empty((len(devices), len(self.feature_names)))
        out[:, :nr] = self.request_part(request)
        for i, d in enumerate(devices):
            out[i, nr:nr + nd] = self.device_part(d)
            out[i, nr + nd] = _numa_match(request, d)
            mem = d.memory_gib
            out[i, nr + nd + 1] = _NAN if mem is None else mem - request.min_memory_gib
        return out

    def rows(self, pairs: Iterable[tuple[PlacementRequest, DeviceView]]) -> np.ndarray:
        """Rows for (request, device) pairs (training): each pair may have its own request."""
        chunks = [self.matrix(r, [d]) for r, d in pairs]
        return np.vstack(chunks) if chunks else np.empty((0, len(self.feature_names)))


def _numa_match(r: PlacementRequest, d: DeviceView) -> float:
    if r.vm_numa_node is None or d.numa_node is None:
        return _NAN
    return 1.0 if r.vm_numa_node == d.numa_node else 0.0
