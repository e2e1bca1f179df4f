"""Kept for old imports: ``/metrics`` of ``osd serve`` lives in :mod:`osd.server.metrics`."""

from osd.server.metrics import Counters, engine_snapshot, metrics_text

__all__ = ["Counters", "engine_snapshot", "metrics_text"]
