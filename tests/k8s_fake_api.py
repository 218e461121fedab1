"""A Kubernetes API server for pods, as far as list and watch go, on 127.0.0.1.

No API server can run on these machines, so the router's pod discovery is tested against this
one. It speaks the protocol the router's watcher relies on, with objects in the API's own JSON
format (``apiVersion: v1``, ``kind: Pod`` / ``PodList``, ``metadata.resourceVersion``,
``status.podIP``, the ``Ready`` condition, ``deletionTimestamp``):

* ``GET /api/v1/namespaces/<ns>/pods?labelSelector=k=v,...``: a ``PodList`` whose
  ``metadata.resourceVersion`` is the store's current one;
* ``...?watch=1&resourceVersion=<rv>``: a chunked stream of ``{"type", "object"}`` lines: the
  stored history after ``rv`` first, then changes as they happen; ``BOOKMARK`` events (only
  when ``allowWatchBookmarks=true``) carry a resourceVersion alone; a resourceVersion older
  than the compacted history gets ``410 Gone`` either as the HTTP status of the watch request
  (``gone_mode = "http"``) or as an ``ERROR`` event holding a ``Status`` with code 410 on a 200
  stream (``"event"``), both as the real server does depending on where the watch is served;
* every request is recorded (path and query), and the test can make the next requests fail,
  end every open watch cleanly (the server's ``timeoutSeconds``) or drop them mid-stream (the
  connection is cut without the chunked body's end), and refuse watches for a while.

Only equality selectors (``k=v``, ``k==v``, ``k!=v``) are implemented here; the router's own
parser (router.core.label_selector) is tested separately. Mutations come from the test's
thread; each open watch gets its events through a queue on the server's loop.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from tests.fake_replica import ServerThread

__all__ = ["FakeKubeApi", "make_pod"]

NAMESPACE = "kvr"
LABELS = {"app.kubernetes.io/name": "vllm"}
SELECTOR = "app.kubernetes.io/name=vllm"


class DroppedOnPurpose(Exception):
    """Raised inside a watch response to cut its connection mid-stream (uvicorn closes the
    socket without the terminating chunk, as a failing proxy or API server would)."""


def make_pod(
    name: str,
    *,
    ip: str | None = "127.0.0.1",
    ready: bool = True,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    namespace: str = NAMESPACE,
) -> dict[str, Any]:
    """A running vLLM pod as the API server serves it (resourceVersion set on store)."""
    conds = [
        ("Initialized", "True"),
        ("Ready", "True" if ready else "False"),
        ("ContainersReady", "True" if ready else "False"),
        ("PodScheduled", "True"),
    ]
    status: dict[str, Any] = {
        "phase": "Running" if ip else "Pending",
        "hostIP": "10.0.0.7",
        "startTime": "2025-06-01T12:00:00Z",
        "conditions": [
            {
                "type": t,
                "status": s,
                "lastProbeTime": None,
                "lastTransitionTime": "2025-06-01T12:00:05Z",
            }
            for t, s in conds
        ],
        "containerStatuses": [
            {
                "name": "vllm",
                "ready": ready,
                "restartCount": 0,
                "image": "vllm/vllm-openai:v0.11.0",
                "imageID": "docker.io/vllm/vllm-openai@sha256:" + "0" * 64,
                "started": True,
                "state": {"running": {"startedAt": "2025-06-01T12:00:01Z"}},
            }
        ],
        "qosClass": "Burstable",
    }
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "generateName": name.rsplit("-", 1)[0] + "-",
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "resourceVersion": "0",
            "creationTimestamp": "2025-06-01T12:00:00Z",
            "labels": dict(LABELS if labels is None else labels),
            "annotations": dict(annotations or {}),
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "ReplicaSet",
                    "name": "vllm-5d8f7",
                    "uid": "6b1c9e43-0000-4000-8000-000000000001",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.11.0",
                    "ports": [{"containerPort": 8000, "name": "http", "protocol": "TCP"}],
                }
            ],
            "nodeName": "node-1",
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "serviceAccountName": "default",
        },
        "status": status,
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        else:
            raise ValueError(f"the fake API server only does equality selectors: {term!r}")
    return True


@dataclass(eq=False)
class _Watch:
    loop: asyncio.AbstractEventLoop
    namespace: str
    selector: str
    bookmarks: bool
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)

    def put(self, item: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class FakeKubeApi:
    """The pod store, its history and the HTTP face (module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._rv = itertools.count(1000)
        self.rv = next(self._rv)
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted = 0
        """Watches from a resourceVersion below this get 410 Gone (history holds what came
        after it)."""
        self.requests: list[dict[str, Any]] = []
        self.listed: list[int] = []
        """The resourceVersion of every list answered."""
        self.watches: set[_Watch] = set()
        self.gone_mode = "http"
        self.fail_next: list[int] = []
        """HTTP statuses the next requests get (a Status body), one each."""
        self.refuse_watches = False
        """While set, watch requests get 503."""

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await self.app(scope, receive, send)  # a plain coroutine function: ASGI 3

        self.server = ServerThread(app)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        self.server.start()
        return self

    def close(self) -> None:
        self.drop_watches(abrupt=False)
        self.server.stop()

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return self.server.url

    # -- the test's side ------------------------------------------------------------------

    def _emit(self, typ: str, obj: dict[str, Any]) -> int:
        """Store a change at a new resourceVersion and send it to the open watches (called
        with the lock held)."""
        self.rv = next(self._rv)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        snap = copy.deepcopy(obj)
        self.history.append((self.rv, typ, snap))
        for w in self.watches:
            if snap["metadata"]["namespace"] == w.namespace and _matches(
                w.selector, snap["metadata"]["labels"]
            ):
                w.put(("event", {"type": typ, "object": snap}))
        return self.rv

    def create(self, pod: dict[str, Any]) -> int:
        with self.lock:
            key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
            if key in self.pods:
                raise ValueError(f"pod {key} exists")
            self.pods[key] = pod
            return self._emit("ADDED", pod)

    def modify(self, name: str, change: Any, namespace: str = NAMESPACE) -> int:
        """``change(pod)`` edits the stored pod in place; a MODIFIED event follows."""
        with self.lock:
            pod = self.pods[(namespace, name)]
            change(pod)
            return self._emit("MODIFIED", pod)

    def terminate(self, name: str, namespace: str = NAMESPACE) -> int:
        """What the kubelet's graceful deletion looks like first: deletionTimestamp set, the
        pod not Ready any more (it still exists, its IP too)."""

        def change(pod: dict[str, Any]) -> None:
            pod["metadata"]["deletionTimestamp"] = "2025-06-01T13:00:30Z"
            pod["metadata"]["deletionGracePeriodSeconds"] = 30
            for c in pod["status"]["conditions"]:
                if c["type"] in ("Ready", "ContainersReady"):
                    c["status"] = "False"

        return self.modify(name, change, namespace)

    def delete(self, name: str, namespace: str = NAMESPACE) -> int:
        with self.lock:
            pod = self.pods.pop((namespace, name))
            return self._emit("DELETED", pod)

    def bookmark(self) -> int:
        """Other objects changed (the global resourceVersion moves on) and the server tells
        every watch that asked for bookmarks where it stands."""
        with self.lock:
            self.rv = next(self._rv)
            obj = {"kind": "Pod", "apiVersion": "v1",
                   "metadata": {"resourceVersion": str(self.rv)}}  # fmt: skip
            for w in self.watches:
                if w.bookmarks:
                    w.put(("event", {"type": "BOOKMARK", "object": obj}))
            return self.rv

    def compact(self) -> None:
        """Forget the history up to now (etcd compaction): older resourceVersions are Gone."""
        with self.lock:
            self.history.clear()
            self.compacted = self.rv

    def drop_watches(self, *, abrupt: bool = True) -> None:
        """Cut every open watch mid-stream (``abrupt``) or end it as ``timeoutSeconds`` does."""
        with self.lock:
            for w in self.watches:
                w.put(("drop" if abrupt else "end", None))

    def inject(self, line: bytes) -> None:
        """Send a raw line (a broken event) to every open watch."""
        with self.lock:
            for w in self.watches:
                w.put(("raw", line))

    def queries(self, watch: bool) -> list[dict[str, str]]:
        """The recorded list (``watch=False``) or watch requests' query parameters."""
        with self.lock:
            return [
                r["query"]
                for r in self.requests
                if r["path"].endswith("/pods") and ("watch" in r["query"]) == watch
            ]

    def open_watches(self) -> int:
        with self.lock:
            return len(self.watches)

    # -- the HTTP face --------------------------------------------------------------------

    async def app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        path = scope["path"]
        with self.lock:
            self.requests.append({"path": path, "query": query})
            fail = self.fail_next.pop(0) if self.fail_next else None
        parts = path.strip("/").split("/")
        if len(parts) != 5 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
            await self._json(send, 404, _status(404, "NotFound", f"no route {path}"))
            return
        if fail is not None:
            await self._json(send, fail, _status(fail, "InternalError", "injected failure"))
            return
        ns, selector = parts[3], query.get("labelSelector", "")
        if query.get("watch") in ("1", "true"):
            await self._watch(send, ns, selector, query)
            return
        with self.lock:
            items = [
                copy.deepcopy(p)
                for (pns, _), p in sorted(self.pods.items())
                if pns == ns and _matches(selector, p["metadata"]["labels"])
            ]
            rv = self.rv
            self.listed.append(rv)
        await self._json(
            send,
            200,
            {"kind": "PodList", "apiVersion": "v1",
             "metadata": {"resourceVersion": str(rv)}, "items": items},
        )  # fmt: skip

    async def _json(self, send: Any, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": code,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode())],
            }
        )  # fmt: skip
        await send({"type": "http.response.body", "body": data})

    async def _watch(self, send: Any, ns: str, selector: str, query: dict[str, str]) -> None:
        if self.refuse_watches:
            await self._json(send, 503, _status(503, "ServiceUnavailable", "watch refused"))
            return
        rv_text = query.get("resourceVersion", "")
        w = _Watch(
            asyncio.get_running_loop(), ns, selector, query.get("allowWatchBookmarks") == "true"
        )
        with self.lock:
            since = int(rv_text) if rv_text not in ("", "0") else None
            gone = since is not None and since < self.compacted
            if since is None:  # "start at most recent": the current pods as ADDED
                backlog = [
                    {"type": "ADDED", "object": copy.deepcopy(p)}
                    for (pns, _), p in sorted(self.pods.items())
                    if pns == ns and _matches(selector, p["metadata"]["labels"])
                ]
            else:
                backlog = [
                    {"type": typ, "object": obj}
                    for rv, typ, obj in self.history
                    if rv > since and obj["metadata"]["namespace"] == ns
                    and _matches(selector, obj["metadata"]["labels"])
                ]  # fmt: skip
            if not gone:
                self.watches.add(w)
        message = f"too old resource version: {rv_text} ({self.compacted})"
        if gone and self.gone_mode == "http":
            await self._json(send, 410, _status(410, "Expired", message))
            return
        await send(
            {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json")]}
        )  # fmt: skip
        if gone:
            line = {"type": "ERROR", "object": _status(410, "Expired", message)}
            await send({"type": "http.response.body", "body": json.dumps(line).encode() + b"\n"})
            await send({"type": "http.response.body", "body": b""})
            return
        try:
            for ev in backlog:
                await self._line(send, ev)
            while True:
                kind, ev = await w.queue.get()
                if kind == "end":
                    await send({"type": "http.response.body", "body": b""})
                    return
                if kind == "drop":
                    raise DroppedOnPurpose("the test cut this watch")
                if kind == "raw":
                    await send({"type": "http.response.body", "body": ev, "more_body": True})
                    continue
                await self._line(send, ev)
        finally:
            with self.lock:
                self.watches.discard(w)

    async def _line(self, send: Any, ev: dict[str, Any]) -> None:
        body = json.dumps(ev).encode() + b"\n"
        await send({"type": "http.response.body", "body": body, "more_body": True})
