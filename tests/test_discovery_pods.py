"""Kubernetes discovery's pure parts: the config table, label selectors, a pod object to a
replica (router.core.pods.read_pod) and the reconcile plan (router.core.pods.plan).

The I/O side (list/watch against an API server) is tests/test_discovery_k8s.py.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.config import ConfigError, KubernetesConfig, ReplicaConfig, parse_config
from router.core.label_selector import Requirement, SelectorError, parse_selector
from router.core.pods import Owned, PodRefused, PodView, plan, read_pod
from router.server.discovery import BACKOFF_BASE_S, BACKOFF_MAX_S, backoff_delay
from tests.k8s_fake_api import make_pod

K = KubernetesConfig(label_selector="app=vllm", http_port=8000, events_port=5557, replay_port=5558)

# ------------------------------------------------------------------------- config

BASE = '[[pools]]\nmodel = "m"\nreplicas = []\n'


def test_config_reads_the_contracts_table() -> None:
    cfg = parse_config(
        BASE + 'discovery = "kubernetes"\n[pools.kubernetes]\nnamespace = ""\n'
        'label_selector = "app.kubernetes.io/name=vllm"\nhttp_port = 8000\nevents_port = 5557\n'
        'replay_port = 5558\ndrain_timeout_s = 30.0\napi_server = ""\n'
    )
    k = cfg.pools[0].kubernetes
    assert cfg.pools[0].discovery == "kubernetes" and k is not None
    assert k.label_selector == "app.kubernetes.io/name=vllm" and k.drain_timeout_s == 30.0
    assert parse_config(BASE).pools[0].discovery == "static"


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('discovery = "kubernetes"\n', "needs a [pools.kubernetes] table"),
        ('[pools.kubernetes]\nlabel_selector = "a=b"\n', 'only read with discovery = "kubernetes"'),
        ('discovery = "dns"\n', "$.pools[0].discovery"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\n', "label_selector is required"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a in b"\n', "'('"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b,"\n', "ends"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "-a=b"\n', "label key"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\nhttp_port = 0\n',
         "http_port must be 1..65535"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\n'
         "events_port = 70000\n", "events_port must be 0..65535"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\n'
         "replay_port = -1\n", "replay_port"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\n'
         "drain_timeout_s = -1\n", "drain_timeout_s"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\n'
         'api_server = "http://127.0.0.1:1"\n', "namespace is required with api_server"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\n'
         'api_server = "ftp://x"\nnamespace = "n"\n', "http(s)://"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\n'
         'namespace = "Not_A_Namespace"\n', "namespace"),
        ('discovery = "kubernetes"\n[pools.kubernetes]\nlabel_selector = "a=b"\nport = 1\n',
         "unknown field `port`"),
    ],
)  # fmt: skip
def test_config_refuses_bad_discovery_settings_naming_the_fix(toml: str, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(BASE + toml)
    assert needle in str(exc.value) and "$.pools[0]" in str(exc.value)


# ----------------------------------------------------------------------- selectors


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("app=vllm", [Requirement("app", "=", ("vllm",))]),
        ("app.kubernetes.io/name == vllm", [Requirement("app.kubernetes.io/name", "=", ("vllm",))]),
        ("tier!=canary", [Requirement("tier", "!=", ("canary",))]),
        ("env in (prod, staging),gpu", [Requirement("env", "in", ("prod", "staging")),
                                        Requirement("gpu", "exists")]),
        ("!spot, zone notin (a)", [Requirement("spot", "!exists"),
                                   Requirement("zone", "notin", ("a",))]),
        ("k=", [Requirement("k", "=", ("",))]),
        ("", []),
    ],
)  # fmt: skip
def test_selectors_parse(text: str, want: list[Requirement]) -> None:
    assert list(parse_selector(text)) == want


@pytest.mark.parametrize(
    "text",
    ["a=b,", ",a", "a in ()", "a in (b", "a in b", "a b", "a=(b)", "a>1", "=b", "a==b=c",
     "Foo.com/x=y", "a=" + "b" * 64, "x" * 64, "a notin (b,,c)", "!", "a=b c"],
)  # fmt: skip
def test_bad_selectors_are_refused(text: str) -> None:
    with pytest.raises(SelectorError):
        parse_selector(text)


_name = st.from_regex(r"[a-z0-9]([-a-z0-9_.]{0,10}[a-z0-9])?", fullmatch=True)
_key = st.one_of(_name, st.builds(lambda p, n: f"{p}.io/{n}", _name.filter(lambda s: "_" not in s
                                  and "." not in s), _name))  # fmt: skip
_req = st.one_of(
    st.builds(lambda k: Requirement(k, "exists"), _key),
    st.builds(lambda k: Requirement(k, "!exists"), _key),
    st.builds(lambda k, v, o: Requirement(k, o, (v,)), _key, _name, st.sampled_from(["=", "!="])),
    st.builds(lambda k, vs, o: Requirement(k, o, tuple(vs)), _key,
              st.lists(_name, min_size=1, max_size=3), st.sampled_from(["in", "notin"])),
)  # fmt: skip


def _render(r: Requirement) -> str:
    if r.op == "exists":
        return r.key
    if r.op == "!exists":
        return f"!{r.key}"
    if r.op in ("in", "notin"):
        return f"{r.key} {r.op} ({', '.join(r.values)})"
    return f"{r.key}{r.op}{r.values[0]}"


@settings(max_examples=300, deadline=None)
@given(st.lists(_req, min_size=1, max_size=4))
def test_selectors_round_trip(reqs: list[Requirement]) -> None:
    assert list(parse_selector(",".join(_render(r) for r in reqs))) == reqs


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=40))
def test_any_text_parses_or_is_refused_with_a_selector_error(text: str) -> None:
    with contextlib.suppress(SelectorError):  # anything else (IndexError...) fails the test
        parse_selector(text)


# ----------------------------------------------------------------------------- pods


def test_a_ready_pod_is_a_replica_with_the_pools_ports() -> None:
    pod = make_pod("vllm-0", ip="10.1.2.3")
    v = read_pod(pod, K)
    assert v.refused is None and v.not_ready is None
    assert v.name == "vllm-0" and v.uid == pod["metadata"]["uid"]
    assert v.replica == ReplicaConfig(
        name="vllm-0",
        url="http://10.1.2.3:8000",
        event_endpoint="tcp://10.1.2.3:5557",
        replay_endpoint="tcp://10.1.2.3:5558",
    )


def test_annotations_override_ports_and_ranks() -> None:
    pod = make_pod("vllm-1", ip="10.0.0.9", annotations={
        "kvrouter.io/http-port": "9000", "kvrouter.io/events-port": "6000",
        "kvrouter.io/replay-port": "0", "kvrouter.io/dp-ranks": " 0, 1,2,3 ",
    })  # fmt: skip
    rep = read_pod(pod, K).replica
    assert rep is not None and rep.url == "http://10.0.0.9:9000"
    assert rep.replay_endpoint is None and rep.dp_ranks == (0, 1, 2, 3)
    assert [s.endpoint for s in rep.stream_list()] == [
        f"tcp://10.0.0.9:{6000 + r}" for r in range(4)
    ]
    no_events = read_pod(make_pod("p", annotations={"kvrouter.io/events-port": "0"}), K)
    assert no_events.replica is not None and no_events.replica.event_endpoint is None
    assert no_events.replica.replay_endpoint is None


def test_an_ipv6_pod_gets_bracketed_addresses() -> None:
    rep = read_pod(make_pod("p", ip="fd00::12"), K).replica
    assert rep is not None and rep.url == "http://[fd00::12]:8000"
    assert rep.event_endpoint == "tcp://[fd00::12]:5557"


def _edit(change: Any) -> dict[str, Any]:
    pod = make_pod("p")
    change(pod)
    return pod


def _conds(pod: dict[str, Any], status: str) -> None:
    for c in pod["status"]["conditions"]:
        if c["type"] == "Ready":
            c["status"] = status


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        (make_pod("p", ip=None), "no pod IP yet"),
        (make_pod("p", ready=False), "Ready condition not True"),
        (_edit(lambda p: _conds(p, "Unknown")), "Ready condition not True"),
        (_edit(lambda p: p["status"].pop("conditions")), "Ready condition not True"),
        (_edit(lambda p: p["metadata"].update(deletionTimestamp="2025-06-01T13:00:00Z")),
         "terminating"),
        (_edit(lambda p: p["status"].update(phase="Failed")), "phase Failed"),
        (_edit(lambda p: p["status"].update(phase="Succeeded")), "phase Succeeded"),
    ],
)  # fmt: skip
def test_pods_that_are_not_serving_are_no_replicas(pod: dict[str, Any], why: str) -> None:
    v = read_pod(pod, K)
    assert v.replica is None and v.not_ready == why and v.refused is None


@pytest.mark.parametrize(
    ("annotations", "reason", "needle"),
    [
        ({"kvrouter.io/http-port": "0"}, "bad_annotation", "1..65535"),
        ({"kvrouter.io/http-port": "65536"}, "bad_annotation", "http-port"),
        ({"kvrouter.io/events-port": "-1"}, "bad_annotation", "events-port"),
        ({"kvrouter.io/replay-port": "8k"}, "bad_annotation", "replay-port"),
        ({"kvrouter.io/dp-ranks": ""}, "bad_annotation", "dp-ranks"),
        ({"kvrouter.io/dp-ranks": "0,a"}, "bad_annotation", "dp-ranks"),
        ({"kvrouter.io/dp-ranks": "1,1"}, "bad_annotation", "repeated"),
        ({"kvrouter.io/dp-ranks": "1024"}, "bad_annotation", "0..1023"),
        ({"kvrouter.io/events-port": "65535", "kvrouter.io/dp-ranks": "0,1"}, "bad_annotation",
         "past port 65535"),
    ],
)  # fmt: skip
def test_bad_annotations_are_refused_with_a_reason(
    annotations: dict[str, str], reason: str, needle: str
) -> None:
    v = read_pod(make_pod("p", annotations=annotations), K)
    assert v.replica is None and v.refused is not None
    assert v.refused.reason == reason and needle in str(v.refused)
    # refused whether ready or not: the operator hears of it before the pod is ready
    assert read_pod(make_pod("p", ready=False, annotations=annotations), K).refused is not None


def test_a_bad_pod_ip_is_refused() -> None:
    v = read_pod(make_pod("p", ip="not-an-ip"), K)
    assert v.refused is not None and v.refused.reason == "bad_pod"


@pytest.mark.parametrize("obj", [None, [], "pod", {}, {"metadata": {}}, {"metadata": []},
                                 {"metadata": {"name": 3}}])  # fmt: skip
def test_objects_without_a_name_raise_pod_refused(obj: Any) -> None:
    with pytest.raises(PodRefused) as exc:
        read_pod(obj, K)
    assert exc.value.reason == "bad_pod"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=12,
)
_paths = st.sampled_from([
    ("metadata", "annotations"), ("metadata", "annotations", "kvrouter.io/http-port"),
    ("metadata", "annotations", "kvrouter.io/dp-ranks"), ("status", "podIP"),
    ("status", "conditions"), ("status",), ("metadata", "deletionTimestamp"),
    ("metadata", "uid"), ("status", "phase"),
])  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(_paths, _json), max_size=4))
# digits str.isdigit() accepts and int() refuses (found by this test)
@example([(("metadata", "annotations", "kvrouter.io/http-port"), "\u00b9")])
@example([(("metadata", "annotations", "kvrouter.io/dp-ranks"), "0,\u00b2")])
def test_hostile_pod_fields_never_raise_anything_but_pod_refused(
    edits: list[tuple[tuple[str, ...], Any]],
) -> None:
    pod = make_pod("p")
    for path, value in edits:
        node: Any = pod
        for key in path[:-1]:
            if not isinstance(node, dict):
                break
            node = node.setdefault(key, {})
        if isinstance(node, dict):
            node[path[-1]] = copy.deepcopy(value)
    try:
        v = read_pod(pod, K)
    except PodRefused:
        return
    assert (v.replica is None) == (v.not_ready is not None or v.refused is not None)


# ----------------------------------------------------------------------------- plan


def _view(name: str, uid: str = "u", url: str = "http://10.0.0.1:8000") -> PodView:
    return PodView(name, uid, "1", ReplicaConfig(name=name, url=url))


def _owned(v: PodView) -> Owned:
    assert v.replica is not None
    return Owned(v.uid, v.replica)


def test_plan_adds_replaces_drains_undrains_and_refuses_clashes() -> None:
    a, b, c = _view("a"), _view("b"), _view("c")
    b2 = _view("b", url="http://10.0.0.2:8000")  # a new IP
    c2 = _view("c", uid="u2")  # a new pod of the same name
    not_ready = PodView("d", "u", "1", None, not_ready="terminating")
    p = plan(
        {"a": a, "b": b2, "c": c2, "d": not_ready, "s": _view("s"), "e": _view("e")},
        {"b": _owned(b), "c": _owned(c), "d": _owned(_view("d")), "e": _owned(_view("e")),
         "gone": _owned(_view("gone"))},
        draining=frozenset({"e"}),
        taken=frozenset({"s"}),
    )  # fmt: skip
    assert [n for n, _ in p.add] == ["a"]
    assert [n for n, _ in p.replace] == ["b", "c"]
    assert p.drain == ["d", "gone"] and p.undrain == ["e"] and p.clash == ["s"]
    assert not plan({"a": a}, {"a": _owned(a)}, frozenset(), frozenset())


_names = st.sampled_from(["p0", "p1", "p2", "p3", "p4", "p5"])
_views = st.builds(
    lambda n, uid, ip, ready: PodView(
        n, uid, "1",
        ReplicaConfig(name=n, url=f"http://10.0.0.{ip}:8000") if ready else None,
        not_ready=None if ready else "terminating",
    ),
    _names, st.sampled_from(["u1", "u2"]), st.integers(1, 2), st.booleans(),
)  # fmt: skip


@settings(max_examples=500, deadline=None)
@given(
    st.lists(_views, max_size=6),
    st.lists(_views.filter(lambda v: v.replica is not None), max_size=6),
    st.sets(_names),
    st.sets(_names),
)
def test_plan_applied_reaches_the_ready_pods_and_is_then_quiet(
    pods_list: list[PodView], owned_list: list[PodView], draining: set[str], taken: set[str]
) -> None:
    pods = {v.name: v for v in pods_list}
    owned = {v.name: _owned(v) for v in owned_list}
    taken = taken - set(owned)  # a name is either discovery's or another source's
    draining &= set(owned)
    p = plan(pods, owned, frozenset(draining), frozenset(taken))
    touched = [n for n, _ in p.add + p.replace] + p.drain + p.undrain
    assert not set(touched) & taken, "another source's replica touched"
    assert len(touched) == len(set(touched)), "a name in two actions"
    # apply it as the watcher does
    for name, o in p.replace + p.add:
        owned[name] = o
        draining.discard(name)
    draining -= set(p.undrain)
    draining |= set(p.drain)
    ready = {n: _owned(v) for n, v in pods.items() if v.replica is not None}
    serving = {n: o for n, o in owned.items() if n not in draining}
    assert serving == {n: o for n, o in ready.items() if n not in taken}
    assert set(p.clash) == set(ready) & taken
    again = plan(pods, owned, frozenset(draining), frozenset(taken))
    assert not (again.add or again.replace or again.drain or again.undrain)


def test_replica_config_of_a_pod_round_trips_as_a_static_one() -> None:
    rep = read_pod(make_pod("vllm-0", ip="10.1.2.3"), K).replica
    assert msgspec.convert(msgspec.to_builtins(rep), ReplicaConfig) == rep


@given(st.integers(0, 10_000), st.floats(0, 1))
def test_backoff_doubles_up_to_its_bound_with_jitter(failures: int, rand: float) -> None:
    d = backoff_delay(failures, rand)
    top = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** min(max(0, failures - 1), 100))
    assert top / 2 <= d <= top <= BACKOFF_MAX_S
    assert backoff_delay(failures + 1, 1.0) >= backoff_delay(failures, 1.0)
