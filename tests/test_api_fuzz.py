"""Fuzz the router's HTTP API from its own OpenAPI schema (schemathesis): no 5xx of its own.

Every operation of ``/openapi.json`` (the proxied completions included, router.server.
openapi_routes) gets bodies, paths and queries that fit the schema (positive) and that break
it (negative: wrong types, missing fields, out-of-range values), sent over real loopback HTTP
to a router in front of two fake replicas. A 5xx the router answers itself (no
``x-kvrouter-replica`` header: not a replica's answer passed on) fails the test, and so does
any error of the router's that is not an OpenAI error.

Bounded for CI (``KVROUTER_FUZZ_EXAMPLES`` per operation and mode, default 25, four times that
for operations with a body; derandomized); set it higher for a long run (the seed is then
random). ``POST /admin/replicas`` is left out:
a generated URL or endpoint would make the router dial addresses off this machine (its
admission rules are tested by hand in tests/test_doors.py).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from test_proxy import TOKEN, Cluster

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = int(os.environ.get("KVROUTER_FUZZ_EXAMPLES", "25"))
SKIPPED = {("POST", "/admin/replicas")}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # names a generated path parameter will not hit, so the fleet stays routable throughout
    with Cluster(names=("replica-alpha", "replica-beta")) as c:
        yield c


def test_no_5xx_of_the_routers_own_from_schema_driven_requests(cluster: Cluster) -> None:
    schema = schemathesis.openapi.from_dict(cluster.http.get("/openapi.json").json())
    ops = [r.ok() for r in schema.get_all_operations()]
    labels = {(op.method.upper(), op.path) for op in ops}
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")} <= labels
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    seen: Counter[tuple[str, int]] = Counter()
    bad: list[str] = []
    session = requests.Session()

    def check(case: schemathesis.Case) -> None:
        resp = case.call(base_url=cluster.router.url, session=session, headers=headers)
        seen[(case.operation.label, resp.status_code)] += 1
        if "x-kvrouter-replica" in resp.headers or resp.status_code < 400:
            return  # a replica's answer, passed on as it came
        what = f"{case.operation.label} -> {resp.status_code}: {resp.text[:300]}"
        if resp.status_code >= 500:
            bad.append(what)
            return
        try:
            err = resp.json()["error"]
            ok = (
                set(err) == {"message", "type", "param", "code"} and err["code"] == resp.status_code
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            bad.append("not an OpenAI error: " + what)

    fuzzed = 0
    for op in ops:
        if (op.method.upper(), op.path) in SKIPPED:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run = settings(
                max_examples=EXAMPLES * (4 if len(op.body) else 1),
                deadline=None,
                database=None,
                derandomize="KVROUTER_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=list(HealthCheck),
            )(given(case=op.as_strategy(generation_mode=mode))(check))
            with contextlib.suppress(Unsatisfiable):  # an operation without inputs
                run()
            fuzzed += 1
    total = sum(seen.values())
    print(f"\n{total} cases over {fuzzed} operation/mode pairs")
    for (label, status), n in sorted(seen.items()):
        print(f"  {label:45s} {status} x{n}")
    assert not bad, "\n".join(bad[:20])
    assert total >= EXAMPLES * 2, seen
    # the generated requests reached the replicas, not only the doors
    assert any(status == 200 and "/v1/" in label for (label, status) in seen)
