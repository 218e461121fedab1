"""router.core.layout_quorum: which learned layout a pool adopts when its replicas' views
differ, as a pure rule and inside the index (real hashes, the conformance check on)."""

from __future__ import annotations

from fake_replica import fa_swa_events
from test_index import LEARN, make

from events.hashing import BlockHasher
from events.layout import GroupKind, GroupSpec
from events.schema import BlockStored
from router.core.layout_quorum import complete_view, decide, describe, diff

FA16 = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=16)
FA32 = GroupSpec(kind=GroupKind.FULL_ATTENTION, block_size=32)
SWA16 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=16, sliding_window=48)
SWA32 = GroupSpec(kind=GroupKind.SLIDING_WINDOW, block_size=32, sliding_window=48)
V16 = {0: FA16, 1: SWA16}
V32 = {0: FA32, 1: SWA32}


def run(views, current=None, members=None, usable=lambda v: True):
    return decide(views, current, len(views) if members is None else members, usable)


# ------------------------------------------------------------------ the pure rule


def test_one_member_learns_its_view() -> None:
    v = run({"a": V16})
    assert (v.status, v.layout, v.held) == ("learned", (FA16, SWA16), {})


def test_one_voter_of_several_is_provisional_and_predicts() -> None:
    v = run({"a": V32}, members=3)
    assert (v.status, v.layout, v.held) == ("provisional", (FA32, SWA32), {})


def test_two_agreeing_confirm() -> None:
    v = run({"a": V16, "b": dict(V16)}, current=(FA16, SWA16), members=3)
    assert (v.status, v.layout, v.held) == ("confirmed", (FA16, SWA16), {})
    assert v.holders == {(FA16, SWA16): ("a", "b")}


def test_two_disagreeing_are_contested_and_the_first_keeps_the_layout() -> None:
    v = run({"a": V32, "b": V16}, current=(FA32, SWA32))
    assert v.status == "contested" and v.layout == (FA32, SWA32)
    assert list(v.held) == ["b"]
    kind, reason = v.held["b"]
    assert kind == "contested"
    assert describe((FA16, SWA16)) in reason and describe((FA32, SWA32)) in reason
    assert "group 0 block_size 16 (pool: 32)" in reason
    assert "held by 1 (a)" in reason and "held by 1 (b)" in reason


def test_the_odd_first_speaker_is_outvoted_by_two_that_agree() -> None:
    v = run({"odd": V32, "a": V16, "b": dict(V16)}, current=(FA32, SWA32))
    assert v.status == "confirmed" and v.layout == (FA16, SWA16)
    assert list(v.held) == ["odd"]
    kind, reason = v.held["odd"]
    assert kind == "outvoted" and "2 of the 3" in reason
    assert describe((FA32, SWA32)) in reason and describe((FA16, SWA16)) in reason


def test_a_tie_of_two_against_two_is_contested() -> None:
    v = run({"a": V32, "b": V32, "c": V16, "d": V16}, current=(FA32, SWA32))
    assert v.status == "contested" and v.layout == (FA32, SWA32)
    assert {k: kind for k, (kind, _) in v.held.items()} == {"c": "contested", "d": "contested"}


def test_a_strict_majority_is_needed_not_a_plurality() -> None:
    three = {0: FA16, 1: SWA16, 2: FA16}
    v = run({"a": V32, "b": V32, "c": V16, "d": three, "e": {0: FA32}}, current=(FA32, SWA32))
    assert v.status == "contested", "2 of 5 is the most held view but not a majority"


def test_views_with_a_gap_do_not_vote_and_are_held_only_when_they_contradict() -> None:
    ahead = {0: FA16, 1: SWA16, 3: FA16}  # a stray group past a gap: waiting, not disagreeing
    wrong = {0: FA32, 3: FA16}
    v = run({"a": V16, "b": ahead, "c": wrong}, current=(FA16, SWA16))
    assert v.status == "provisional" and v.layout == (FA16, SWA16)
    assert v.holders == {(FA16, SWA16): ("a",)}
    assert list(v.held) == ["c"] and v.held["c"][0] == "contested"


def test_a_view_vllm_would_refuse_does_not_vote() -> None:
    v = run({"a": V16, "b": V32}, usable=lambda view: view != (FA32, SWA32))
    assert v.status in ("learned", "provisional") and v.layout == (FA16, SWA16)
    assert v.held["b"][0] == "contested"


def test_a_prefix_view_is_a_view_of_its_own() -> None:
    """Views are compared whole: a replica that shows fewer groups than another (views are
    settled after a whole batch, and vLLM publishes every group with a request's stores)
    does not confirm the longer view."""
    v = run({"a": V16, "b": {0: FA16}}, current=(FA16, SWA16))
    assert v.status == "contested" and v.held["b"][0] == "contested"
    assert "group count 1 (pool: 2)" in v.held["b"][1]


def test_with_no_voter_the_layout_in_use_stays() -> None:
    assert run({}, current=None).status == "unknown"
    v = run({}, current=(FA16,), members=2)
    assert (v.status, v.layout) == ("provisional", (FA16,))


def test_helpers() -> None:
    assert complete_view({1: SWA16, 0: FA16}) == (FA16, SWA16)
    assert complete_view({0: FA16, 2: FA16}) is None and complete_view({}) is None
    assert describe(V16) == "[0: full_attention/16, 1: sliding_window/16 w48]"
    assert diff(V16, (FA16, SWA16)) is None
    assert (
        diff({0: SWA16}, (FA16,))
        == "group 0 kv_cache_spec_kind sliding_window (pool: full_attention)"
    )


# ------------------------------------------------------------ inside the index

H16, H32 = BlockHasher(LEARN.hash, 16), BlockHasher(LEARN.hash, 32)


def batch(block: int, words: range) -> list[BlockStored]:
    """A real replica's first batch for one prompt: FA + SWA (window 48) at ``block``
    tokens, hashes as vLLM computes them with that block size."""
    ids = list(words)
    return fa_swa_events((H16 if block == 16 else H32).wire_chain(ids), ids, block, 2)


def three():
    index = make(layout=LEARN, verify_hashes=True)
    odd, a, b = ("A", 0), ("B", 0), index.add_replica("C")
    return index, odd, a, b


def test_index_odd_first_is_outvoted_and_its_hashes_are_not_blamed() -> None:
    """The odd replica (32-token blocks, consistent hashes) speaks first: its layout is
    provisional; the two 16-token replicas are held (contested) without their hashes being
    judged by the 32-token layout, then the second of them makes a majority: the layout
    switches and the odd one is outvoted, its reason naming both views and the count."""
    index, odd, a, b = three()
    index.apply_events(odd, batch(32, range(1000, 1100)))
    assert index.layout_state().status == "provisional"
    assert index.layout.layout.groups == (FA32, SWA32)
    index.apply_events(a, batch(16, range(2000, 2100)))
    assert index.layout_state().status == "contested"
    assert index.is_trusted(odd) and not index.is_trusted(a)
    assert "layout contested" in index.untrusted_reason(a)
    index.apply_events(b, batch(16, range(3000, 3100)))
    state = index.layout_state()
    assert state.status == "confirmed" and index.layout.layout.groups == (FA16, SWA16)
    assert {v.view: (v.replicas, v.adopted) for v in state.views} == {
        describe(V16): (["B/dp0", "C/dp0"], True),
        describe(V32): (["A/dp0"], False),
    }
    assert state.held == {"A/dp0": "outvoted"}
    assert index.is_trusted(a) and index.is_trusted(b) and not index.is_trusted(odd)
    reason = index.untrusted_reason(odd)
    assert "layout outvoted" in reason and "2 of the 3" in reason
    stats = {s.replica: s for s in index.stats()}
    assert stats["A"].ingest_errors == {"layout_conflict": 1}
    assert stats["B"].ingest_errors == {"layout_contested": 1}  # while it was contested
    assert stats["C"].ingest_errors == {}
    for s in stats.values():
        assert s.conformance_mismatches == 0 and s.conformance_checked == 1, s
    assert (stats["A"].trust, stats["A"].layout_hold) == ("untrusted", "outvoted")
    assert stats["B"].layout_view == describe(V16)


def test_index_an_outvoted_replica_rejoins_when_restarted_with_the_right_flags() -> None:
    index, odd, a, b = three()
    index.apply_events(odd, batch(32, range(1000, 1100)))
    index.apply_events(a, batch(16, range(2000, 2100)))
    index.apply_events(b, batch(16, range(3000, 3100)))
    assert not index.is_trusted(odd)
    index.reset_replica(odd)  # its sequence went back: a restart
    index.apply_events(odd, batch(16, range(4000, 4100)))
    assert index.is_trusted(odd) and index.layout_state().held == {}
    assert index.layout_state().status == "confirmed"


def test_index_removing_a_majority_member_leaves_a_contest() -> None:
    index, odd, a, b = three()
    index.apply_events(a, batch(16, range(2000, 2100)))
    index.apply_events(b, batch(16, range(3000, 3100)))
    index.apply_events(odd, batch(32, range(1000, 1100)))
    assert index.layout_state().held == {"A/dp0": "outvoted"}
    index.remove_replica("C")
    assert index.layout_state().status == "contested"
    assert index.layout.layout.groups == (FA16, SWA16), "the layout in use stays"
    assert index.is_trusted(a) and not index.is_trusted(odd)
    assert "layout contested" in index.untrusted_reason(odd)
    index.remove_replica("B")
    assert index.layout_state().status == "learned"  # one member left: its view
    assert index.layout.layout.groups == (FA32, SWA32) and index.is_trusted(odd)


def test_index_a_lone_replica_is_learned_until_another_joins() -> None:
    index = make(layout=LEARN, verify_hashes=True)
    index.remove_replica("B")
    index.apply_events(("A", 0), batch(16, range(10, 90)))
    assert index.layout_state().status == "learned"
    index.add_replica("D")  # scale-out (admin or discovery)
    assert index.layout_state().status == "provisional"
    assert index.is_trusted(("A", 0))
