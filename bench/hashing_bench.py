"""Cost of the block hash chain on the routing hot path (events/hashing.py).

Measures a 32k-token prompt at H=16 (2048 fine hashes) per algorithm:

- cold, no memo: every block hashed (what a never-seen long prompt costs if fully hashed);
- cold, memo on: the same plus memo inserts (first sight of a prefix);
- warm: the whole prompt seen before (repeated system prompt / multi-turn history);
- warm stem + novel tail: 30k tokens seen before, 2k new;
- lazy novel, first read: a never-seen prompt where the router stops at the first miss;
- lazy warm, every fine hash read one by one with wire(i), and with iter_block_wires().

First, the compiled chain (``events._chain``, docs/native-hashing.md) against the pure-Python
one, cold (no memo), for 2k- and 32k-token prompts and every algorithm, timed interleaved in
this one process so each ratio comes from one run; then the ways of computing sha256 that were
tried (SHA-NI, hashlib called back per block). The table after that times the
hashers as the router builds them (compiled when built).

``--baseline-rev REV`` also loads ``events/hashing.py`` as it was at git revision REV and
times the cold chain per block for both, interleaved in this one process (same tokens, same
machine state), so a change to the hashing code is judged by a ratio, not by two runs on a
noisy machine.

Run:  .venv/bin/python bench/hashing_bench.py [--repeat N] [--quick] [--baseline-rev REV]
Writes bench/results/hashing_bench.json.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import pickle
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from events import hashing
from events.hashing import BlockHasher, native_hashing
from events.layout import HashSettings

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "hashing_bench.json"
#: The compiled-vs-pure tables, committed (the JSON is not): docs/native-hashing.md cites them.
SUMMARY = ROOT / "bench" / "results" / "hashing_bench.md"
ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def timed(fn: Callable[[], object], setup: Callable[[], object] | None, repeat: int) -> dict:
    """Median and best of ``repeat`` runs in microseconds; ``setup`` runs untimed before each."""
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "runs": repeat}


def naive_chain(tokens: list[int], H: int) -> list[int]:
    """The obvious implementation, as the baseline: one pickle.dumps + sha256 per block."""
    p = hashlib.sha256(pickle.dumps("vllm-none-hash", 5)).digest()
    out = []
    for a in range(0, len(tokens) - H + 1, H):
        p = hashlib.sha256(pickle.dumps((p, tuple(tokens[a : a + H]), None), 5)).digest()
        out.append(int.from_bytes(p[-8:], "big"))
    return out


def settings_for(algo: str) -> HashSettings:
    return HashSettings(algo=algo, pythonhashseed="0" if algo.startswith("xxhash") else None)


def bench_algo(algo: str, tokens: list[int], H: int, repeat: int, rng: random.Random) -> dict:
    s = settings_for(algo)
    nomemo = BlockHasher(s, H, memo_entries=0)
    memo = BlockHasher(s, H)
    stem = tokens[:30_720]
    novel_tails = [[rng.randrange(150_000) for _ in range(2048)] for _ in range(repeat)]
    tails = iter(novel_tails)
    out = {
        "cold_no_memo": timed(lambda: nomemo.wire_chain(tokens), None, repeat),
        "cold_memo_insert": timed(lambda: memo.wire_chain(tokens), memo.clear_memo, repeat),
    }
    memo.clear_memo()
    memo.wire_chain(tokens)
    out["warm"] = timed(lambda: memo.wire_chain(tokens), None, repeat)
    out["warm_stem_30k_novel_tail_2k"] = timed(
        lambda: memo.wire_chain(stem + next(tails)), None, repeat
    )

    novel = iter([[rng.randrange(150_000) for _ in range(16)] + tokens[16:] for _ in range(repeat)])
    out["lazy_novel_first_read"] = timed(lambda: memo.lazy_chain(next(novel)).wire(0), None, repeat)

    def lazy_walk() -> None:
        c = memo.lazy_chain(tokens)
        w = c.wire
        for i in range(len(c)):
            w(i)

    out["lazy_warm_read_all"] = timed(lazy_walk, None, repeat)

    def lazy_iter() -> None:
        for _ in memo.lazy_chain(tokens).iter_block_wires(1):
            pass

    out["lazy_warm_iter_all"] = timed(lazy_iter, None, repeat)
    assert memo.wire_chain(tokens) == nomemo.wire_chain(tokens)
    return out


def interleaved(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, list[float]]:
    """Microseconds per call of each fn, run alternately (order flipped every round)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeat):
        for k in sorted(fns, reverse=bool(r % 2)):
            t0 = time.perf_counter_ns()
            fns[k]()
            samples[k].append((time.perf_counter_ns() - t0) / 1000)
    return samples


def native_vs_pure(H: int, repeat: int, rng: random.Random) -> dict:
    """Cold chains (no memo), pure vs compiled, per prompt length and algo."""
    out: dict = {}
    for n_tokens in (2048, 32_768):
        tokens = [rng.randrange(150_000) for _ in range(n_tokens)]
        row: dict = {}
        for algo in ALGOS:
            s = settings_for(algo)
            pure = BlockHasher(s, H, memo_entries=0, native=False)
            fast = BlockHasher(s, H, memo_entries=0)
            if not fast.native:
                continue
            if pure.wire_chain(tokens) != fast.wire_chain(tokens):
                raise SystemExit(f"{algo}: compiled and pure chains differ")
            t = interleaved(
                {
                    "pure": functools.partial(pure.wire_chain, tokens),
                    "native": functools.partial(fast.wire_chain, tokens),
                },
                repeat,
            )
            r = {
                f"{k}_{stat.__name__}_us": stat(v)
                for k, v in t.items()
                for stat in (statistics.median, min)
            }
            r["speedup"] = r["pure_median_us"] / r["native_median_us"]
            row[algo] = r
        out[str(n_tokens)] = row
    return out


def sha256_options(H: int, repeat: int, rng: random.Random) -> dict:
    """The ways of getting sha256 under the compiled serializer, on a cold 32k-token chain.

    "hashlib callback" hands each serialized block to hashlib through a Python callable: the
    cost of using OpenSSL's sha256 without its headers (C-API calls would save only the
    lambda's frame). The compiled module keeps SHA-NI when the CPU has it.
    """
    native = hashing._NATIVE
    if native is None:
        return {}
    tokens = [rng.randrange(150_000) for _ in range(32_768)]
    block = hashing._pickle_block
    default = native.sha_impl()

    def run_with(impl: str | None, digest: object = None) -> Callable[[], object]:
        ext = functools.partial(native.extend, 0, block, digest)

        def go() -> None:
            if impl is not None:
                native._use_sha(impl)
            ext(b"p" * 32, tokens, H, 0, len(tokens) // H, None, [], [], True)

        return go

    fns = {
        "pure python (pickle.dumps + hashlib)": lambda: BlockHasher(
            settings_for("sha256"), H, memo_entries=0, native=False
        ).wire_chain(tokens),
        "C serializer + hashlib callback": run_with(None, lambda b: hashlib.sha256(b).digest()),
    }
    if native._use_sha("sha-ni") == "sha-ni":
        fns["C serializer + SHA-NI sha256"] = run_with("sha-ni")
    try:
        t = interleaved(fns, repeat)
    finally:
        native._use_sha(default)
    return {k: {"median_us": statistics.median(v), "min_us": min(v)} for k, v in t.items()}


def summary_markdown(results: dict, argv: list[str]) -> str:
    """The compiled-vs-pure cold chains and the sha256 options as markdown tables."""
    cmd = " ".join(["bench/hashing_bench.py", *argv])
    lines = [
        "# Block hash chain: compiled (events._chain) vs pure Python",
        "",
        f"Command: `PYTHONPATH=. .venv/bin/python {cmd}`; Python {results['python']}, "
        f"{results['machine']}, compiled chain: {results['native'] or 'not built'}. Cold "
        "chains (no memo), H=16, median / best microseconds; pure and compiled timed "
        "alternately in one process, so each speedup comes from one run.",
        "",
        "| prompt | algo | pure | compiled | speedup |",
        "|---|---|---|---|---|",
    ]
    for n_tokens, row in results["native_vs_pure_cold"].items():
        for algo, r in row.items():
            lines.append(
                f"| {n_tokens} tokens | {algo} | {r['pure_median_us']:,.0f} / "
                f"{r['pure_min_us']:,.0f} | {r['native_median_us']:,.0f} / "
                f"{r['native_min_us']:,.0f} | {r['speedup']:.1f}x |"
            )
    if results["sha256_options_cold_32k"]:
        lines += ["", "sha256, cold 32k-token chain, by implementation:", ""]
        lines += ["| implementation | median / best us |", "|---|---|"]
        for k, v in results["sha256_options_cold_32k"].items():
            lines.append(f"| {k} | {v['median_us']:,.0f} / {v['min_us']:,.0f} |")
    algos = results["algos"]
    lines += ["", f"Hashers as the router builds them, {results['tokens']} tokens:", ""]
    lines += ["| case | " + " | ".join(algos) + " |", "|---" * (len(algos) + 1) + "|"]
    for case in next(iter(algos.values())):
        cells = " | ".join(f"{algos[a][case]['median_us']:,.0f}" for a in algos)
        lines.append(f"| {case} | {cells} |")
    return "\n".join(lines) + "\n"


def load_baseline(rev: str) -> ModuleType:
    """``events/hashing.py`` at git revision ``rev``, as a module beside the current one."""
    src = subprocess.run(
        ["git", "show", f"{rev}:events/hashing.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("baseline_hashing", loader=None)
    if spec is None:
        raise RuntimeError("importlib returned no spec for the baseline module")
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, f"{rev}:events/hashing.py", "exec"), mod.__dict__)
    return mod


def per_block_vs_baseline(
    base: ModuleType, tokens: list[int], H: int, repeat: int
) -> dict[str, dict[str, float]]:
    """Cold chain (no memo) per block, ns: baseline and current alternating, per algo."""
    from events import hashing

    out: dict[str, dict[str, float]] = {}
    n = len(tokens) // H
    for algo in ALGOS:
        s = settings_for(algo)
        pair = {
            "baseline": base.BlockHasher(s, H, memo_entries=0),
            "current": hashing.BlockHasher(s, H, memo_entries=0),
        }
        if pair["baseline"].wire_chain(tokens) != pair["current"].wire_chain(tokens):
            raise SystemExit(f"{algo}: baseline and current chains differ")
        samples: dict[str, list[float]] = {k: [] for k in pair}
        for r in range(repeat):
            for k in sorted(pair, reverse=bool(r % 2)):  # alternate which goes first
                t0 = time.perf_counter_ns()
                pair[k].wire_chain(tokens)
                samples[k].append((time.perf_counter_ns() - t0) / n)
        out[algo] = {
            f"{k}_{stat.__name__}_ns": stat(v)
            for k, v in samples.items()
            for stat in (statistics.median, min)
        }
        out[algo]["ratio_median"] = out[algo]["current_median_ns"] / out[algo]["baseline_median_ns"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--quick", action="store_true", help="5 repeats, for a smoke run")
    ap.add_argument(
        "--baseline-rev",
        metavar="REV",
        help="also time events/hashing.py at this git revision against the current one",
    )
    args = ap.parse_args(argv)
    repeat = 5 if args.quick else args.repeat
    H = 16
    rng = random.Random(20260509)
    tokens = [rng.randrange(150_000) for _ in range(args.tokens)]

    results: dict = {
        "native": native_hashing(),
        "tokens": args.tokens,
        "hash_block_size": H,
        "fine_hashes": args.tokens // H,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "baseline_naive_sha256": timed(lambda: naive_chain(tokens, H), None, repeat),
        "algos": {},
        "memo_span_sha256_warm": {},
        "native_vs_pure_cold": native_vs_pure(H, repeat, rng),
        "sha256_options_cold_32k": sha256_options(H, repeat, rng),
    }
    print(f"compiled chain: {results['native'] or 'not built (pure Python only)'}")
    print(f"cold chain (no memo), pure vs compiled, median / best of {repeat}, microseconds")
    print(f"{'':12}" + "".join(f"{a:>28}" for a in ALGOS))
    for n_tokens, row in results["native_vs_pure_cold"].items():
        for k in ("pure", "native"):
            print(
                f"{n_tokens + ' ' + k:12}"
                + "".join(
                    f"{row[a][k + '_median_us']:>20.0f} /{row[a][k + '_min_us']:>6.0f}"
                    if a in row
                    else f"{'-':>28}"
                    for a in ALGOS
                )
            )
        print(
            f"{n_tokens + ' speedup':12}"
            + "".join(f"{row[a]['speedup']:>27.1f}x" if a in row else f"{'-':>28}" for a in ALGOS)
        )
    if results["sha256_options_cold_32k"]:
        print("sha256, cold 32k-token chain, by implementation (median / best, microseconds):")
        for k, v in results["sha256_options_cold_32k"].items():
            print(f"  {k:40}{v['median_us']:>8.0f} /{v['min_us']:>6.0f}")
    print()
    for algo in ALGOS:
        results["algos"][algo] = bench_algo(algo, tokens, H, repeat, rng)
    for span in (1, 4, 16, 64):
        h = BlockHasher(settings_for("sha256"), H, memo_span=span)
        h.wire_chain(tokens)
        results["memo_span_sha256_warm"][str(span)] = timed(
            lambda h=h: h.wire_chain(tokens), None, repeat
        )

    cases = list(next(iter(results["algos"].values())))
    print(
        f"hashers as the router builds them ({'compiled' if results['native'] else 'pure'}): "
        f"{args.tokens} tokens, H={H} ({args.tokens // H} fine hashes), "
        f"median / best of {repeat} runs, microseconds"
    )
    print(f"{'case':30}" + "".join(f"{a:>17}" for a in ALGOS))

    def cell(r: dict) -> str:
        return f"{r['median_us']:>10.0f} /{r['min_us']:>5.0f}"

    for case in cases:
        print(f"{case:30}" + "".join(cell(results["algos"][a][case]) for a in ALGOS))
    print(f"{'naive pickle+sha256 baseline':30}{cell(results['baseline_naive_sha256'])}")
    print(
        "sha256 warm by memo span K: "
        + ", ".join(
            f"K={k}: {v['median_us']:.1f}" for k, v in results["memo_span_sha256_warm"].items()
        )
    )
    if args.baseline_rev:
        cmp = per_block_vs_baseline(load_baseline(args.baseline_rev), tokens, H, repeat)
        results["per_block_vs_baseline"] = {"rev": args.baseline_rev, "algos": cmp}
        print(f"cold chain per block vs {args.baseline_rev}, ns (median / best, interleaved):")
        for algo, r in cmp.items():
            print(
                f"  {algo:12} baseline {r['baseline_median_ns']:6.0f} /{r['baseline_min_ns']:5.0f}"
                f"  current {r['current_median_ns']:6.0f} /{r['current_min_ns']:5.0f}"
                f"  ratio {r['ratio_median']:.2f}"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    if argv is None:  # a command-line run (not a test calling main): refresh the summary
        SUMMARY.write_text(summary_markdown(results, sys.argv[1:]))
        print(f"wrote {SUMMARY}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
