"""How long the simulated replica's engine steps take: a small, explicit timing model.

The replica does no model math; it sleeps for what the step would cost on a GPU, so a demo or a
routing benchmark sees the effect that matters: a prefix-cache hit shortens time to first
token, and load (running and waiting requests) lengthens it.

The model, per engine step (one iteration of the scheduler loop, like vLLM's):

    step_seconds = time_scale * (step_overhead_s
                                 + prefill_s_per_token * uncached prompt tokens admitted
                                 + decode_s_per_step  if any request decodes in the step)

* **Prefill** costs per *uncached* token: a hit of ``h`` tokens saves ``h * prefill_s_per_token``.
  The whole uncached part is computed in the admitting step (no chunked prefill).
* **Decode** is batched: one step advances every running sequence by one token for
  ``decode_s_per_step``, whatever the batch size (decode is memory-bound; on a GPU a small
  batch costs about the same as one sequence). Requests admitted in the step do not decode in
  it: their first token comes out of the prefill, as in vLLM.
* **Concurrency** is bounded by the engine's ``max_num_seqs`` and by KV blocks; requests
  beyond that wait in a FIFO queue (``gpu_emitter.engine``), so waiting time is part of TTFT.
* ``time_scale`` multiplies everything: 1 is "GPU speed", 0.01 makes tests fast, 0 removes the
  simulated compute (the engine then only yields to the event loop between steps, which is how
  ``bench/replica_bench.py`` measures the replica's own overhead).

Defaults (0.2 ms per prefill token, 20 ms per decode step) put a 2,000-token cold prefill at
400 ms and a fully cached one at about 1 ms: a visible TTFT difference in a demo.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CostModel", "CostModelError"]


class CostModelError(ValueError):
    """A timing parameter that cannot describe a step (negative or not finite)."""


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per engine step; see the module docstring for the formula."""

    prefill_s_per_token: float = 0.0002
    decode_s_per_step: float = 0.020
    step_overhead_s: float = 0.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_step", "step_overhead_s", "time_scale"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0 or value == float("inf"):
                raise CostModelError(f"{name} must be a finite number >= 0, got {value!r}")

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Simulated time to prefill ``uncached_tokens`` (prompt tokens minus the hit)."""
        return self.time_scale * self.prefill_s_per_token * max(0, uncached_tokens)

    def step_seconds(self, uncached_prefill_tokens: int, decoding: bool) -> float:
        """Simulated time of one step that prefills ``uncached_prefill_tokens`` and, when
        ``decoding``, advances the running sequences by one token."""
        if uncached_prefill_tokens <= 0 and not decoding:
            return 0.0
        seconds = self.step_overhead_s + self.prefill_s_per_token * max(0, uncached_prefill_tokens)
        if decoding:
            seconds += self.decode_s_per_step
        return self.time_scale * seconds
