"""Reading the consumers' Prometheus counters during the run (they restart: sum lifetimes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["CounterScraper", "scrape_loop"]


class CounterScraper:
    """Totals of one counter by one label across restarts of the process serving it.

    A value lower than the last one seen means the process restarted (counters start at 0):
    the last value is banked. Increments between the last scrape and a kill -9 are lost, so
    the totals are lower bounds.
    """

    def __init__(self, url: str, sample: str, label: str) -> None:
        self.url = url
        self.sample = sample
        self.label = label
        self._banked: dict[str, float] = defaultdict(float)
        self._last: dict[str, float] = {}

    def update(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != self.sample:
                    continue
                key = sample.labels.get(self.label, "")
                if sample.value < self._last.get(key, 0.0):
                    self._banked[key] += self._last[key]
                self._last[key] = sample.value

    def totals(self) -> dict[str, int]:
        keys = set(self._banked) | set(self._last)
        return {k: int(self._banked.get(k, 0.0) + self._last.get(k, 0.0)) for k in sorted(keys)}


async def scrape_loop(
    scrapers: list[CounterScraper], stop: asyncio.Event, interval_s: float = 1.0
) -> None:
    """Scrape every ``interval_s`` seconds until ``stop``, and once more at the end."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        while True:
            for scraper in scrapers:
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(scraper.url)
                    if response.status_code == 200:
                        scraper.update(response.text)
            if stop.is_set():
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
