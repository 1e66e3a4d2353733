"""Test support for /metrics: scrape an agent rig with the operator's token and parse the exposition with
prometheus_client's own text parser, so a test reads values, not substrings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Scrape:
    """One scrape: every sample by (series name, labels), and the families' types."""

    samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float]
    types: Mapping[str, str]  # family name (as exported after `# TYPE`) -> counter, gauge, histogram, ...

    def value(self, name: str, **labels: str) -> float:
        """The sample `name{labels}` (exact label set; KeyError when the agent does not export it)."""
        return self.samples[(name, frozenset(labels.items()))]

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        """`value`, or `default` for a labelled child not created yet (a counter no event has touched)."""
        return self.samples.get((name, frozenset(labels.items())), default)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Every sample of `name` keyed by one label's value (series with other labels too are summed)."""
        out: dict[str, float] = {}
        for (n, labels), v in self.samples.items():
            if n == name:
                key = dict(labels).get(label, "")
                out[key] = out.get(key, 0.0) + v
        return out

    def names(self) -> set[str]:
        """Every series name exported (histograms as their _bucket/_count/_sum, counters as their _total)."""
        return {n for n, _ in self.samples}


def parse(text: str) -> Scrape:
    """Parse Prometheus exposition text."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return Scrape(samples, types)


async def scrape(client: Any, token: str) -> Scrape:
    """GET /metrics from an aiohttp test client with `token`; the scrape must answer 200."""
    r = await client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
    text = await r.text()
    assert r.status == 200, text
    return parse(text)
