"""Layouts written both ways for the layout-exactness tests (test-only, no vLLM import).

:class:`Draw` is one layout as a user would describe a vLLM deployment: per-rank block sizes,
the DCP size, EAGLE draft groups, head sizes (``spec_id``), bounded replay. :func:`router_config`
writes it as a kvrouter pool config (what ``router.toml`` holds); tests/test_layout_vs_vllm.py
writes the same draw as vLLM kv-cache specs. :data:`EXAMPLES` are the hand-worked cases of
issue 14 (one per item), each with the presence and the hit vLLM 0.32 reports: the
differential test checks them against vLLM, tests/test_layout_rules.py against kvrouter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class G:
    """One group as drawn: enough to write both the kvrouter config and the vLLM spec."""

    kind: str
    block: int
    """Per-rank block size (vLLM's ``spec.block_size``)."""
    window: int | None = None
    chunk: int | None = None
    mode: str = "align"
    eagle: bool = False
    spec_id: str | None = None
    sharded: bool | None = None
    """Explicit ``dcp_sharded``; None keeps both sides' per-spec default."""
    replay: bool = False
    circular: bool = False

    def is_sharded(self) -> bool:
        if self.sharded is not None:
            return self.sharded
        return self.kind != "mamba"


@dataclass
class Draw:
    family: str
    groups: list[G]
    pmu: int | None = None
    dcp: int = 1
    retention: int | None = 0

    def describe(self) -> str:
        gs = []
        for g in self.groups:
            bits = [g.kind, str(g.block)]
            for name in ("window", "chunk", "spec_id"):
                if getattr(g, name) is not None:
                    bits.append(f"{name}={getattr(g, name)}")
            bits += [n for n in ("eagle", "replay", "circular") if getattr(g, n)]
            if g.kind == "mamba" and g.mode != "align":
                bits.append(g.mode)
            if g.sharded is not None:
                bits.append(f"sharded={g.sharded}")
            gs.append("/".join(bits))
        return f"{self.family} dcp={self.dcp} pmu={self.pmu} [{', '.join(gs)}]"


# --------------------------------------------------------------------------- both sides' config

KIND = {
    "fa": "full_attention",
    "mla": "mla_attention",
    "swa": "sliding_window",
    "swa_mla": "sliding_window_mla",
    "cla": "chunked_local_attention",
    "mamba": "mamba",
}


def effective_block(d: Draw, g: G) -> int:
    return g.block * (d.dcp if g.is_sharded() else 1)


def router_config(d: Draw) -> dict:
    """The pool config a user would write for this layout (TOML-shaped)."""
    groups = []
    for g in d.groups:
        entry: dict[str, Any] = {"kind": KIND[g.kind], "block_size": effective_block(d, g)}
        if g.window is not None:
            entry["sliding_window"] = g.window
        if g.chunk is not None:
            entry["attention_chunk_size"] = g.chunk
        if g.kind == "mamba":
            entry["mamba_mode"] = g.mode
        for name in ("eagle", "spec_id", "bounded_replay"):
            value = g.replay if name == "bounded_replay" else getattr(g, name)
            if value:
                entry[name] = value
        if g.sharded is not None:
            entry["dcp_sharded"] = g.sharded
        if g.circular:
            entry["prefix_cacheable"] = False
        groups.append(entry)
    layout: dict[str, Any] = {"groups": groups, "dcp_world_size": d.dcp}
    if d.pmu is not None:
        layout["prefix_match_unit"] = d.pmu
    return {"model": "m", "replicas": [], "layout": layout}


@dataclass(frozen=True)
class Example:
    """A layout, a request of ``num_tokens`` and the fine indices each group holds."""

    name: str
    draw: Draw
    num_tokens: int
    held: dict[int, set[int]]
    hit: int
    """What vLLM 0.32 reports (``get_computed_blocks``, then the scheduler's bounded replay)."""


EXAMPLES = (
    # Item 1: the SWA group's block (16) is not H (8) and its manager cannot look up
    # fine-grained: vLLM disables partial hits (A = S = 32) instead of refusing.
    Example(
        "mamba_swa_partial_disabled",
        Draw("mamba+swa", [G("fa", 32), G("swa", 16, window=17), G("mamba", 32)], pmu=8),
        100,
        {0: {3, 7, 11}, 1: {11}, 2: {11}},
        96,
    ),
    # Item 2: DCP 2 scales the FA block to 32; a Mamba block equal to H (16) turns partial
    # hits on under DCP, so the FA partial entry at token 16 counts.
    Example(
        "dcp_mamba_equal_h",
        Draw("dcp", [G("fa", 16), G("mamba", 16)], dcp=2),
        40,
        {0: {0}, 1: {0}},
        16,
    ),
    # Item 3: the draft group shares the target's spec: one joint spec group, EAGLE because
    # one member is. Jointly only block 0 is held; the drop leaves 0 (separately: 16).
    Example(
        "eagle_merged_with_target",
        Draw("eagle", [G("fa", 16), G("fa", 16, eagle=True)]),
        50,
        {0: {0}, 1: {0, 1, 2}},
        0,
    ),
    # Item 4: two FA specs of one block size (head 64 and 128), partial hits on: each probes
    # its own partial entries; merged, the joint lookup would stop at 32 and Mamba give 0.
    Example(
        "distinct_fa_specs",
        Draw(
            "spec_id",
            [G("fa", 32), G("fa", 32, spec_id="h128"), G("mamba", 32)],
            pmu=8,
        ),
        70,
        {0: {3, 7}, 1: {3, 4}, 2: {4}},
        40,
    ),
    # Item 5: bounded replay (window 64): a 48-token hit is dropped ...
    Example(
        "bounded_replay_drops_short_hit",
        Draw("replay", [G("mla", 16), G("swa_mla", 16, window=64, replay=True)]),
        100,
        {0: {0, 1, 2}},
        0,
    ),
    # ... a 96-token one is reported whole (its last 64 tokens are recomputed).
    Example(
        "bounded_replay_keeps_long_hit",
        Draw("replay", [G("mla", 16), G("swa_mla", 16, window=64, replay=True)]),
        100,
        {0: {0, 1, 2, 3, 4, 5}},
        96,
    ),
)
