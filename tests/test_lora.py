"""LoRA requests end to end: ``[pools.lora_adapters]`` routes an adapter's requests to its pool
and hashes ``("lora", name, path)`` into their blocks as vLLM 0.32 does (spec §1.3), in front of
simulated replicas that serve the adapter (``--lora-modules``) and hash with their own engine.

Real loopback HTTP and ZeroMQ (tests/sim_cluster.py). The prediction (the router's
``x-kvrouter-predicted-hit``) is compared with the replica's own ``cached_tokens``."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from router.config import parse_config
from tests.sim_cluster import MODEL, SimCluster, words

ADAPTER, PATH = "sql-lora", "/adapters/sql-lora-v1"


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimCluster]:
    c = SimCluster(
        256,
        names=("a", "b"),
        extra_toml=f'[health]\nprobe_interval_s = 0\n[pools.lora_adapters]\n{ADAPTER} = "{PATH}"\n',
        lora_modules={ADAPTER: PATH},
    )
    try:
        yield c
    finally:
        c.close()


def send(cluster: SimCluster, model: str, prompt: str) -> tuple[str, int, int]:
    """(replica, predicted hit, vLLM's cached_tokens) of one request through the router."""
    r = cluster.client.post(
        "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    name = r.headers["x-kvrouter-replica"]
    predicted = int(r.headers["x-kvrouter-predicted-hit"])
    cluster.sync(name)  # its events applied before the next request is predicted
    return name, predicted, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_an_adapters_requests_hash_apart_and_are_predicted_exactly(cluster: SimCluster) -> None:
    prompt = words(random.Random(1), 200)
    send(cluster, MODEL, prompt)
    assert send(cluster, MODEL, prompt)[1:] == (192, 192)  # the base model's blocks, exact
    # the same text under the adapter: every block carries ("lora", name, path), no hit
    first, predicted, cached = send(cluster, ADAPTER, prompt)
    assert (predicted, cached) == (0, 0)
    # its own blocks then hit, on the replica that holds them, predicted exactly
    again = send(cluster, ADAPTER, prompt)
    assert again == (first, 192, 192)
    models = {m["id"] for m in cluster.client.get("/v1/models").json()["data"]}
    assert {MODEL, ADAPTER} <= models


def test_an_adapter_path_is_part_of_the_hash() -> None:
    # the same adapter name with another path (the replica re-pointed, or a config typo):
    # vLLM hashes the path, so the router that believes "/elsewhere" predicts no hit
    c = SimCluster(
        256,
        names=("a",),
        extra_toml=f'[pools.lora_adapters]\n{ADAPTER} = "/elsewhere"\n',
        lora_modules={ADAPTER: PATH},
    )
    try:
        prompt = words(random.Random(2), 200)
        send(c, ADAPTER, prompt)
        _, predicted, cached = send(c, ADAPTER, prompt)
        assert (predicted, cached) == (0, 192)
    finally:
        c.close()


def test_adapter_names_are_checked_at_start() -> None:
    head = '[[pools]]\nmodel = "m"\nreplicas = []\n[pools.lora_adapters]\n'
    with pytest.raises(ValueError, match="lora_adapters"):
        parse_config(head + 'sql = ""\n')
    with pytest.raises(ValueError, match="served by two pools"):
        parse_config(head + 'sql = "/p"\n[[pools]]\nmodel = "sql"\nreplicas = []\n')
    cfg = parse_config(head + 'sql = "/p"\n')
    assert cfg.pool_for("sql") is cfg.pools[0]


def test_unknown_models_are_still_404(cluster: SimCluster) -> None:
    r = cluster.client.post("/v1/completions", json={"model": "nope", "prompt": "w1"})
    assert r.status_code == 404
