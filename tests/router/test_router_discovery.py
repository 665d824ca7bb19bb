"""Worker discovery: Kubernetes EndpointSlices (list + watch) driven by an in-memory source that
follows the API's contract (no API server can run here), and the router adding and dropping
watchers as the set changes."""

import asyncio
import queue

import pytest

from splitserve.router.placement.discovery import StaticDiscovery
from splitserve.router.placement.discovery_k8s import EndpointSliceDiscovery, Gone, label_selector, slice_addresses


def endpoint_slice(name, addresses, port=50051, port_name="grpc", ready=True, terminating=None, version="1"):
    endpoints = []
    for address in addresses:
        conditions = {"ready": ready}
        if terminating is not None:
            conditions["terminating"] = terminating
        endpoints.append({"addresses": [address], "conditions": conditions})
    return {
        "metadata": {
            "name": name,
            "namespace": "llm",
            "resourceVersion": version,
            "labels": {"kubernetes.io/service-name": name.rsplit("-", 1)[0]},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "metrics", "port": 9090}, {"name": port_name, "port": port}],
    }


class FakeSliceSource:
    """Lists return `items`; each watch() call takes the next scripted stream: a list of
    (type, slice) events or an exception to raise, then blocks until `push` or the test ends."""

    def __init__(self, items, version="10"):
        self.items, self.version = items, version
        self.streams: queue.Queue = queue.Queue()
        self.lists, self.watches = [], []

    def list(self, selector):
        self.lists.append(selector)
        return list(self.items), self.version

    def watch(self, selector, version):
        self.watches.append(version)
        script = self.streams.get(timeout=30)
        if isinstance(script, BaseException):
            raise script
        yield from script


@pytest.mark.parametrize(
    "obj,expected",
    [
        (endpoint_slice("m-decode-abc", ["10.0.0.1", "10.0.0.2"]), {"10.0.0.1:50051", "10.0.0.2:50051"}),
        (endpoint_slice("m-decode-abc", ["10.0.0.1"], ready=False), set()),
        (endpoint_slice("m-decode-abc", ["10.0.0.1"], ready=None), {"10.0.0.1:50051"}),  # unknown = ready
        (endpoint_slice("m-decode-abc", ["10.0.0.1"], terminating=True), set()),
        (endpoint_slice("m-decode-abc", ["10.0.0.1"], port_name="http"), set()),  # no port named grpc
        (endpoint_slice("m-decode-abc", ["fd00::1"]), {"[fd00::1]:50051"}),
        ({"metadata": {"name": "x"}, "endpoints": None, "ports": None}, set()),
    ],
)
def test_slice_addresses(obj, expected):
    assert slice_addresses(obj, "grpc") == expected


def test_label_selector_names_every_pool_service():
    assert label_selector(["m-prefill", "m-decode"]) == "kubernetes.io/service-name in (m-decode,m-prefill)"


def test_list_then_watch_add_modify_delete_and_relist_on_gone():
    source = FakeSliceSource(
        [endpoint_slice("m-prefill-1", ["10.0.0.1"]), endpoint_slice("m-decode-1", ["10.0.1.1"], ready=False)]
    )
    seen = []

    async def main():
        discovery = EndpointSliceDiscovery(source, ["m-prefill", "m-decode"], backoff_initial_s=0.01)

        async def on_change(addresses):
            seen.append(addresses)

        task = asyncio.create_task(discovery.run(on_change))
        source.streams.put(
            [
                ("MODIFIED", endpoint_slice("m-decode-1", ["10.0.1.1"], version="11")),  # became ready
                ("ADDED", endpoint_slice("m-decode-2", ["10.0.1.2"], version="12")),
                ("MODIFIED", endpoint_slice("m-decode-2", ["10.0.1.2"], version="13")),  # no change
                ("DELETED", endpoint_slice("m-prefill-1", ["10.0.0.1"], version="14")),
            ]
        )  # then the server ends the watch: resume from 14
        source.streams.put(Gone("too old"))  # 410: relist
        source.streams.put(RuntimeError("connection refused"))  # any error: relist after a backoff
        while len(source.lists) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(main())
    assert source.lists == [label_selector(["m-prefill", "m-decode"])] * 3
    assert source.watches[:3] == ["10", "14", "10"]
    assert seen == [
        {"10.0.0.1:50051"},
        {"10.0.0.1:50051", "10.0.1.1:50051"},
        {"10.0.0.1:50051", "10.0.1.1:50051", "10.0.1.2:50051"},
        {"10.0.1.1:50051", "10.0.1.2:50051"},
        {"10.0.0.1:50051"},  # the relist shows the source's list again
    ]


def test_static_discovery_reports_once():
    seen = []

    async def on_change(addresses):
        seen.append(addresses)

    asyncio.run(StaticDiscovery(["a:1", "b:2"]).run(on_change))
    assert seen == [{"a:1", "b:2"}]


def test_router_follows_the_discovered_set(loop, tokenizer):
    """Watchers start for new addresses and stop for removed ones; a removed worker leaves the
    pool and the index."""
    from routerkit import FakeWorker, router_config

    from splitserve.router.router import Router

    workers = [loop.run(FakeWorker(tokenizer=tokenizer).start()) for _ in range(2)]
    router = Router(router_config(), tokenizer=tokenizer, discovery=StaticDiscovery([]))

    async def steps():
        await router._on_workers({workers[0].address, workers[1].address})
        await router.wait_ready(10, num_decode=2)
        await router._on_workers({workers[1].address})
        assert set(router.pool.workers) == {workers[1].address}
        assert router.pool.num_healthy() == 1
        await router.stop()

    loop.run(steps())
    for w in workers:
        loop.run(w.stop())
