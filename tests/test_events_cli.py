"""``kvrouter events tail`` as a real subprocess against a real publisher on loopback."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from events.publisher import EventPublisher
from events.schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.zmq_helpers import (
    LOOPBACK,
    LossyForwarder,
    RawPub,
    dp_publishers,
    publish_until,
    wait_for,
)

U64 = 2**64 - 1


@pytest.fixture(autouse=True, scope="module")
def _sigint_as_a_terminal_gives_it() -> Any:
    """The tails these tests start get SIGINT the way a terminal's Ctrl-C reaches them. A shell
    without job control starts a background job (``bash .ci/run &``) with SIGINT ignored, every
    child inherits that, and Python leaves an ignored SIGINT ignored: the tail then rightly
    outlives the tests' SIGINT and they time out. A handler in this process is reset to the
    default at exec, so the children start as from a terminal."""
    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


class Tail:
    """``python -m router.cli events tail ARGS`` with its output collected line by line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "events", "tail", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def wait(self, timeout: float = 20) -> int:
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join(5)
        return code

    def json_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in list(self.out)]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> Tail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stored() -> BlockStored:
    return BlockStored(
        block_hashes=[U64, b"\xab" * 32],
        parent_block_hash=2**63,
        token_ids=[1, 2, 3, 4],
        block_size=2,
        medium="GPU",
        extra_keys=[None, ["salt", b"\x01\x02"]],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=64,
    )


def test_json_lines_carry_every_field() -> None:
    with EventPublisher(LOOPBACK) as pub, Tail(pub.endpoint, "--json", "--count", "40") as t:
        events = [stored(), BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)]
        events.append(AllBlocksCleared())
        publish_until(lambda: pub.publish(KVEventBatch(12.5, events, None)), lambda: t.out)
        publish_until(
            lambda: pub.publish(KVEventBatch(12.5, events, None)), lambda: t.proc.poll() is not None
        )
        assert t.wait() == 0
        lines = t.json_lines()
        assert len(lines) == 40  # exactly --count events, even mid-batch
        first = lines[0]
        assert first["stream"] == pub.endpoint and first["ts"] == 12.5 and first["dp_rank"] == 0
        assert first["type"] == "BlockStored" and first["replayed"] is False
        assert first["block_hashes"] == [U64, "ab" * 32]  # ints stay ints, bytes become hex
        assert first["parent_block_hash"] == 2**63
        assert first["token_ids"] == [1, 2, 3, 4] and first["block_size"] == 2
        assert first["extra_keys"] == [None, ["salt", "0102"]]
        assert first["group_idx"] == 1 and first["kv_cache_spec_sliding_window"] == 64
        assert first["lora_name"] is None and first["session_id"] is None
        assert lines[1]["type"] == "BlockRemoved" and lines[1]["block_hashes"] == [7]
        head = {k: lines[2][k] for k in ("stream", "seq", "ts", "dp_rank")}
        assert lines[2] == {**head, "replayed": False, "type": "AllBlocksCleared"}
        # One line per event, batches in sequence order, events in batch order.
        seqs = [line["seq"] for line in lines]
        assert seqs == sorted(seqs)
        kinds = ["BlockStored", "BlockRemoved", "AllBlocksCleared"] * 14
        assert [line["type"] for line in lines] == kinds[:40]


def test_text_mode_lines_and_signals_on_stderr() -> None:
    with RawPub() as raw, Tail(raw.endpoint) as t:
        n = iter(range(10**6))
        ev = BlockRemoved(block_hashes=[5], medium="GPU", group_idx=0)
        seq = publish_until(lambda: (raw.send_batch(s := next(n), [ev]), s)[1], lambda: t.out)
        raw.send([b"only-one-frame"])
        wait_for(lambda: t.err, what="signal on stderr")
        raw.send_batch(seq + 1, [ev, AllBlocksCleared()])
        wait_for(lambda: t.out[-1].endswith("AllBlocksCleared"), what="the last event")
        t.proc.send_signal(signal.SIGINT)
        assert t.wait() == 0
        assert re.fullmatch(
            r"seq=\d+ ts=\d+\.\d{6} dp_rank=0 BlockRemoved group=0 medium=GPU hashes=\[5\]",
            t.out[0],
        )
        assert t.out[-2].startswith(f"seq={seq + 1} ") and t.out[-2].endswith("hashes=[5]")
        assert t.out[-1].startswith(f"seq={seq + 1} ")
        assert t.err == [
            f"! MalformedMessage stream={raw.endpoint} seq=None "
            "reason=expected 3 frames, got 1 replayed=False"
        ]


def test_json_signals_and_replay() -> None:
    with (
        EventPublisher(LOOPBACK, replay_endpoint=LOOPBACK) as pub,
        LossyForwarder(pub.endpoint) as fwd,
        Tail(fwd.endpoint, "--replay-endpoint", pub.replay_endpoint, "--json") as t,
    ):
        ev = BlockRemoved(block_hashes=[1], medium="GPU")
        k = publish_until(lambda: pub.publish([ev]), lambda: t.out)
        wait_for(lambda: any(line.get("seq") == k for line in t.json_lines()))
        fwd.drop.add(k + 1)
        pub.publish([ev])
        pub.publish([ev])
        wait_for(lambda: any(line.get("seq") == k + 2 for line in t.json_lines()))
        lines = [x for x in t.json_lines() if x.get("seq", -1) > k]
        assert [(x["seq"], x["replayed"]) for x in lines] == [(k + 1, True), (k + 2, False)]
        t.proc.send_signal(signal.SIGINT)
        assert t.wait() == 0


def test_rank_mismatch_signal_in_json() -> None:
    with (
        EventPublisher(LOOPBACK, data_parallel_rank=3) as pub,
        Tail(pub.endpoint, "--json", "--dp-rank", "0") as t,
    ):
        publish_until(lambda: pub.publish([AllBlocksCleared()]), lambda: t.out)
        sig = t.json_lines()[0]
        assert sig["signal"] == "RankMismatch"
        assert sig["expected_rank"] == 0 and sig["got_rank"] == 3 and sig["stream"] == pub.endpoint


def test_ctrl_c_exits_cleanly() -> None:
    with EventPublisher(LOOPBACK) as pub, Tail(pub.endpoint) as t:
        publish_until(lambda: pub.publish([AllBlocksCleared()]), lambda: t.out)
        t.proc.send_signal(signal.SIGINT)
        assert t.wait() == 0
        assert not any("Traceback" in line for line in t.err), t.err


@pytest.mark.parametrize(
    ("endpoint", "fix"),
    [
        ("foo", "tcp://HOST:PORT"),
        ("tcp://nohost:x", "port must be a number"),
        ("http://host:80", "tcp://HOST:PORT"),
    ],
)
def test_bad_endpoint_exits_2_with_the_fix(endpoint: str, fix: str) -> None:
    with Tail(endpoint) as t:
        assert t.wait() == 2
        assert t.out == []
        text = "\n".join(t.err)
        assert fix in text and "Traceback" not in text


def test_bad_options_exit_2() -> None:
    with Tail("tcp://127.0.0.1:1", "--replay-endpoint", "nope") as t:
        assert t.wait() == 2 and "--replay-endpoint" in "\n".join(t.err)
    with Tail("tcp://127.0.0.1:1", "--offset-ports") as t:
        assert t.wait() == 2 and "--dp-rank" in "\n".join(t.err)


def test_timeout() -> None:
    with EventPublisher(LOOPBACK) as pub:
        with Tail(pub.endpoint, "--timeout", "0.3") as t:
            assert t.wait() == 0 and t.out == []
        with Tail(pub.endpoint, "--timeout", "0.3", "--count", "1") as t:
            assert t.wait() == 1
            assert "timed out after 0.3s with 0/1 events" in "\n".join(t.err)


def test_offset_ports_follows_vllm() -> None:
    base, pubs = dp_publishers(2)
    pub = pubs[1]
    try:
        assert pub.endpoint.endswith(f":{base + 1}")
        ep = f"tcp://127.0.0.1:{base}"
        with Tail(ep, "--dp-rank", "1", "--offset-ports", "--json", "--count", "1") as t:
            publish_until(lambda: pub.publish([AllBlocksCleared()]), lambda: t.out)
            assert t.wait() == 0
            assert t.json_lines()[0]["dp_rank"] == 1
    finally:
        for p in pubs:
            p.close()
