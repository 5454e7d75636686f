"""Metric windows: what the trainer logs of the values gathered since the last log."""

from __future__ import annotations


def window_summary(window: dict[str, list[float]]) -> dict[str, float]:
    """One value per metric over a logging window: the extreme for `*_max`/`*/max` (and `async/pending`) and
    `*_min`/`*/min` keys, the mean otherwise.

    >>> window_summary({"reward": [0.0, 1.0], "async/staleness_max": [0.0, 2.0], "empty": []})
    {'reward': 0.5, 'async/staleness_max': 2.0}
    """
    out = {}
    for key, values in window.items():
        if not values:
            continue
        if key.endswith(("/max", "_max")) or key == "async/pending":
            out[key] = max(values)
        elif key.endswith(("/min", "_min")):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out
