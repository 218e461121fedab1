"""Issue 12, router half: no frame can kill, freeze or poison a running router.

A real router app (uvicorn on 127.0.0.1) with one pool of three replicas on their own ZeroMQ
PUB endpoints (:class:`bench.fuzz_router.RouterRig`): ``b`` and ``c`` published a fixed set of
hand-built FA + SWA batches; ``a`` sends 20,000 seeded hostile messages
(:class:`bench.fuzz_router.HostileStream` over :class:`bench.fuzz_frames.FrameFuzzer`) with
valid batches among them. Checked:

* the router stays up and its loop answers HTTP throughout (every chunk of 2,000 messages is
  awaited by polling ``/admin/events``), and every subscriber is alive at the end: each
  replica's final batch is applied, ``a``'s included (its index then holds exactly that batch);
* every bad message is counted: the hostile stream's counters equal what the fuzzer's own
  classification implies; ``lost_events`` in ``kvrouter_ingest_errors_total`` equals the
  messages not applied plus the gaps; every refusal by reason equals an offline twin of the
  ingest fed the same frames; nothing fell through to ``ingest_exception``;
* ``b`` and ``c`` stay exact and predict, before and after, the hits derived by hand below;
  the pool layout (declared, or learned from ``b``) is unchanged.

The long run is ``bench/fuzz_router.py --frames 1000000``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fuzz_frames import FrameFuzzer  # noqa: E402
from bench.fuzz_router import HOSTILE, HostileStream, RouterRig  # noqa: E402

MESSAGES = 20_000

# Layout: FA + SWA (window 48), 16-token blocks, so a hit of L = 16k tokens (L <= len - 1)
# needs FA blocks 0..k-1 and the SWA blocks max(0, k-3)..k-1 (ceil(47/16) = 3).
#   b holds P: FA 0..11, SWA 8..11; R: FA 0..5, SWA 0..5.
#   c holds Q: FA 0..11, SWA 0..11 (Q's blocks 0..4 are P's); R: FA 0..3, SWA 0,1,3.
STEADY_HITS = {
    # P, 200 tokens, k <= 12. b: k = 12 needs SWA 9..11: 192. c: FA run is the 5 shared
    # blocks, k = 5 needs SWA 2..4 (Q's, the same hashes): 80.
    "P": {"b": 192, "c": 80},
    # P's first 150 tokens, k <= 9. b: every k <= 9 needs an SWA block below 8: 0. c: 80.
    "P150": {"b": 0, "c": 80},
    # Q. b: FA 0..4 (P's), but no SWA block below 8 of P: 0. c: k = 12, SWA 9..11: 192.
    "Q": {"b": 0, "c": 192},
    # R, 100 tokens, k <= 6. b: k = 6, SWA 3..5: 96. c: FA 0..3; k = 4 and 3 need SWA
    # block 2 (evicted); k = 2 needs SWA 0..1: 32.
    "R": {"b": 96, "c": 32},
    "W": {"b": 0, "c": 0},
}
# The final batches add W (100 tokens, k <= 6): b FA 0..5 and SWA 3..5: 96; c FA and SWA
# 0..2: 48 (and a holds W's 6 blocks in both groups, nothing else).
FINAL_HITS = {**STEADY_HITS, "W": {"b": 96, "c": 48}}
GROUPS = [("full_attention", 16, None), ("sliding_window", 16, 48)]

#: Every way the index refuses an event, which the fuzz must reach for the test to mean much.
REASONS = {
    "lost_events",
    "unknown_event",
    "refused_group_idx",
    "refused_block_size",
    "refused_medium",
    "layout_conflict",
    "mixed_group_idx",
}


def steady(probe: dict) -> dict[str, dict[str, tuple[int, str]]]:
    return {p: {r: v for r, v in hits.items() if r != HOSTILE} for p, hits in probe.items()}


def hand(hits: dict[str, dict[str, int]]) -> dict[str, dict[str, tuple[int, str]]]:
    return {p: {r: (n, "exact") for r, n in per.items()} for p, per in hits.items()}


def groups(rig: RouterRig) -> list[tuple]:
    return [(g["kind"], g["block_size"], g["sliding_window"]) for g in rig.index()["groups"]]


@pytest.mark.parametrize("layout", ["declared", "learned"])
def test_hostile_replica_kills_freezes_and_poisons_nothing(layout: str) -> None:
    with RouterRig(learned=layout == "learned") as rig:
        next_seq = rig.prime()
        assert steady(rig.probe()) == hand(STEADY_HITS)
        assert groups(rig) == GROUPS

        stream = HostileStream(FrameFuzzer(seed=2026), next_seq)
        rig.send(stream.messages(MESSAGES))

        # The router is up, its subscribers too, and its loop answered all along.
        assert rig.server is not None and rig.server.thread.is_alive()
        assert rig.http.get("/health").json() == {"status": "ok"}  # type: ignore[union-attr]
        assert rig.subscribers_alive() == {"a": True, "b": True, "c": True}

        # Every bad message counted, by the fuzzer's classification and by the twin.
        ledger = rig.ledger
        assert ledger.sent == MESSAGES and not ledger.escaped
        got_stream = rig.hostile_stream()
        assert got_stream == ledger.expected_stream()
        assert {k: v for k, v in got_stream.items() if v} == ledger.twin_stream()
        errors = rig.hostile_errors()
        assert errors["lost_events"] == ledger.expected_lost()
        assert errors["unknown_event"] == ledger.unknown_events
        assert errors == ledger.twin_errors()
        assert "ingest_exception" not in errors
        assert set(errors) >= REASONS, f"the fuzz did not reach {REASONS - set(errors)}"
        assert not rig.ingest_errors().get("b") and not rig.ingest_errors().get("c")

        # Nothing of the other replicas moved: hits as derived by hand, layout as it was.
        assert steady(rig.probe()) == hand(STEADY_HITS)
        assert groups(rig) == GROUPS

        # Every subscriber still applies what arrives, the hostile one's included.
        rig.finish(stream.seq)
        assert steady(rig.probe()) == hand(FINAL_HITS)
        held = rig.held()
        assert held["a"] == {"GPU": {"0": 6, "1": 6}}
        assert held["b"]["LMCACHE"] == {"0": 1}, "b's connector tier was refused"
        assert rig.subscribers_alive() == {"a": True, "b": True, "c": True}
