"""What the router reads in a vLLM replica's Prometheus ``/metrics``: load per engine (DP
rank), its KV cache's size (``vllm:cache_config_info``) and the process start time, the
replica's epoch. Pure parsing; the scrape loop is :mod:`router.server.scrape`."""

from __future__ import annotations

import re

__all__ = [
    "MAX_PAGE_BYTES",
    "RESTART_TOLERANCE_S",
    "parse_start_time",
    "parse_vllm_metrics",
    "restarted",
]

MAX_PAGE_BYTES = 32 << 20
"""Largest ``/metrics`` page read (32 MiB). vLLM 0.32's is tens of kilobytes per engine,
histograms included; a larger one is refused as a failed scrape rather than held in memory."""

_METRIC = re.compile(
    rb"^(vllm:num_requests_running|vllm:num_requests_waiting|vllm:kv_cache_usage_perc"
    rb"|vllm:gpu_cache_usage_perc|vllm:request_success_total)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN)",
    re.M,
)
_ENGINE = re.compile(rb'(?:^|[{,])\s*engine="([^"]*)"')
_CACHE_INFO = re.compile(rb"^vllm:cache_config_info\{([^}]*)\}", re.M)
_GPU_BLOCKS = re.compile(rb'(?:^|,)\s*num_gpu_blocks="([^"]*)"')
_MAX_DIGITS = 15
"""Longest count or rank read (a quadrillion): a longer label value is not one, and a
thousands-digit one would make ``int`` refuse it (CPython's limit) or ``float`` overflow."""
_START = re.compile(rb"^process_start_time_seconds(?:\{[^}]*\})?\s+([-+0-9.eE]+)", re.M)
RESTART_TOLERANCE_S = 0.05
"""Start times closer than this are the same process. The process collector derives the
time from boot time and clock ticks (10 ms), stable across scrapes; no vLLM restarts faster."""
_NAMES = {
    b"vllm:num_requests_running": "running",
    b"vllm:num_requests_waiting": "waiting",
    b"vllm:kv_cache_usage_perc": "kv_usage",
    b"vllm:gpu_cache_usage_perc": "kv_usage",
    b"vllm:request_success_total": "finished",
}


def parse_vllm_metrics(text: bytes) -> dict[str, dict[int, float]]:
    """running / waiting / kv_usage / finished (requests, every reason) per engine (DP rank;
    -1 when unlabelled), summed; num_gpu_blocks per engine (the info gauge's label: the
    blocks of its one shared pool, what ``kv_usage`` is a fraction of). Never raises: a
    sample whose ``engine`` label is not a rank, or a value that is not a number, is skipped
    (tests/test_load_estimate.py fuzzes it)."""
    out: dict[str, dict[int, float]] = {
        "running": {},
        "waiting": {},
        "kv_usage": {},
        "finished": {},
        "num_gpu_blocks": {},
    }
    for m in _CACHE_INFO.finditer(text):
        labels = m.group(1)
        bm = _GPU_BLOCKS.search(labels)
        blocks = _count(bm.group(1)) if bm else None
        rank = _rank(labels)
        if blocks is not None and rank is not None:
            out["num_gpu_blocks"][rank] = float(blocks)
    for m in _METRIC.finditer(text):
        name, labels, value = m.groups()
        rank = _rank(labels or b"")
        if rank is None:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        d = out[_NAMES[name]]
        d[rank] = d.get(rank, 0.0) + v
    return out


def _count(text: bytes) -> int | None:
    """A label's whole number, or None if it is not one (ASCII digits, at most
    ``_MAX_DIGITS``)."""
    return int(text) if text.isdigit() and len(text) <= _MAX_DIGITS else None


def _rank(labels: bytes) -> int | None:
    """The sample's DP rank: -1 without an ``engine`` label, None (skip the sample) when the
    label is not a rank: a hostile or broken exporter must not become a rank the router
    keeps state for."""
    m = _ENGINE.search(labels)
    return -1 if m is None else _count(m.group(1))


def parse_start_time(text: bytes) -> float | None:
    """The replica process's ``process_start_time_seconds`` (vLLM's API server exports the
    Prometheus client's process collector): the replica's epoch, or None if absent."""
    m = _START.search(text)
    if m is None:
        return None
    try:
        return float(m.group(1))
    except ValueError:
        return None


def restarted(known: float | None, seen: float | None) -> bool:
    """Whether a newly scraped start time means a different process than the known one."""
    return known is not None and seen is not None and abs(seen - known) > RESTART_TOLERANCE_S
