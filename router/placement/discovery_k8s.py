"""Worker discovery from Kubernetes EndpointSlices (list, then watch from the list's version).

Contract with the operator (operator/render_services.py): one headless Service per worker pool;
its EndpointSlices carry the label `kubernetes.io/service-name=<service>` and a port named
`grpc` (configurable). A worker address is `<endpoint address>:<grpc port>` for every endpoint
that is not known to be unready (`conditions.ready` absent counts as ready, as the API says)
and not terminating. Roles are not read from Kubernetes: each worker says its own.

Algorithm: list the slices matching `kubernetes.io/service-name in (<services>)`, report the
address set, then watch from the list's resourceVersion and report the set again whenever an
ADDED / MODIFIED / DELETED event changes it. A watch that ends (server timeout) resumes from the
last seen resourceVersion; 410 Gone or any error relists after a backoff (1 s doubling to 30 s).

The Kubernetes client is synchronous, so the list and each watch stream run in a daemon thread
that hands events to the event loop. `SliceSource` is the seam: the tests drive the same
algorithm with an in-memory source (no API server can run here).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Protocol

from splitserve.router.placement.discovery import OnChange

log = logging.getLogger(__name__)

SERVICE_LABEL = "kubernetes.io/service-name"
_END = object()


class Gone(Exception):
    """The watch's resourceVersion is too old (HTTP 410): relist."""


class SliceSource(Protocol):
    def list(self, label_selector: str) -> tuple[list[dict], str]:
        """(EndpointSlices as API JSON dicts, the list's resourceVersion)."""

    def watch(self, label_selector: str, resource_version: str) -> Iterator[tuple[str, dict]]:
        """(event type, EndpointSlice dict) from `resource_version` on; raises Gone on 410."""


def label_selector(services) -> str:
    return f"{SERVICE_LABEL} in ({','.join(sorted(services))})"


def slice_addresses(obj: dict, port_name: str) -> set[str]:
    """The worker addresses one EndpointSlice names."""
    port = next((p.get("port") for p in obj.get("ports") or [] if p.get("name") == port_name), None)
    if port is None:
        return set()
    out = set()
    for endpoint in obj.get("endpoints") or []:
        conditions = endpoint.get("conditions") or {}
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        for address in (endpoint.get("addresses") or [])[:1]:
            out.add(f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
    return out


class EndpointSliceDiscovery:
    def __init__(
        self,
        source: SliceSource,
        services,
        port_name: str = "grpc",
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
    ):
        self.source = source
        self.selector = label_selector(services)
        self.port_name = port_name
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._slices: dict[str, set[str]] = {}  # "namespace/name" -> addresses
        self._reported: set[str] | None = None

    async def run(self, on_change: OnChange) -> None:
        backoff = self.backoff_initial_s
        while True:
            try:
                version = await self._relist(on_change)
                backoff = self.backoff_initial_s
                while True:
                    version = await self._watch(version, on_change)
            except Gone:
                log.info("EndpointSlice watch expired (410); relisting")
            except Exception as exc:  # noqa: BLE001 - any API failure: relist after a backoff
                log.warning("EndpointSlice discovery failed (%s); relisting in %.0f s", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)

    async def _relist(self, on_change: OnChange) -> str:
        items, version = await asyncio.to_thread(self.source.list, self.selector)
        self._slices = {_key(obj): slice_addresses(obj, self.port_name) for obj in items}
        await self._report(on_change)
        return version

    async def _watch(self, version: str, on_change: OnChange) -> str:
        """One watch stream; returns the last resourceVersion seen when the server ends it."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        stream = self.source.watch(self.selector, version)
        threading.Thread(target=_pump, args=(stream, loop, queue), daemon=True).start()
        while True:
            item = await queue.get()
            if item is _END:
                return version
            if isinstance(item, BaseException):
                raise item
            kind, obj = item
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if kind in ("ADDED", "MODIFIED"):
                self._slices[_key(obj)] = slice_addresses(obj, self.port_name)
            elif kind == "DELETED":
                self._slices.pop(_key(obj), None)
            await self._report(on_change)

    async def _report(self, on_change: OnChange) -> None:
        addresses = set().union(*self._slices.values()) if self._slices else set()
        if addresses != self._reported:
            log.info("EndpointSlices name %d worker(s): %s", len(addresses), ", ".join(sorted(addresses)) or "none")
            self._reported = addresses
            await on_change(set(addresses))


def _key(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _pump(stream, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
    try:
        for item in stream:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        loop.call_soon_threadsafe(queue.put_nowait, _END)
    except BaseException as exc:  # noqa: BLE001 - handed to the event loop, which decides
        try:
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class KubernetesSliceSource:
    """The real API server, through the `kubernetes` client (in-cluster config, else kubeconfig)."""

    def __init__(self, namespace: str, watch_timeout_s: int = 300):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.namespace = namespace
        self.watch_timeout_s = watch_timeout_s
        self.api = client.DiscoveryV1Api()
        self.serialize = client.ApiClient().sanitize_for_serialization

    def list(self, label_selector: str) -> tuple[list[dict], str]:
        result = self.api.list_namespaced_endpoint_slice(self.namespace, label_selector=label_selector)
        return [self.serialize(item) for item in result.items], result.metadata.resource_version

    def watch(self, label_selector: str, resource_version: str) -> Iterator[tuple[str, dict]]:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        try:
            for event in watch.Watch().stream(
                self.api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=label_selector,
                resource_version=resource_version,
                timeout_seconds=self.watch_timeout_s,
                allow_watch_bookmarks=True,
            ):
                raw = event.get("raw_object") or {}
                if event["type"] == "ERROR":
                    if raw.get("code") == 410:
                        raise Gone(raw.get("message", "410 Gone"))
                    raise RuntimeError(f"watch error: {raw}")
                yield event["type"], raw
        except ApiException as exc:
            if exc.status == 410:
                raise Gone(str(exc)) from None
            raise
