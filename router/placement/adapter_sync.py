"""Declared LoRA adapters: follow a file, report what each pool has loaded.

The operator renders an InferenceService's spec.adapters into the key `adapters.yaml` of the
router's ConfigMap, which the router pod mounts as a folder. Kubernetes refreshes a mounted
ConfigMap in place (the kubelet swaps the folder's `..data` link within its sync period, about a
minute), so a change reaches the router without a new pod; only `router.yaml` is hashed into
the router's pod template. The file:

    adapters:
      - {name: sql, path: /models/adapters/sql}

Two loops, both level-based:

- `follow_file` re-reads the file every `poll_s`; a new content goes to
  `AdapterCatalog.declare`, whose reconcile (after each worker's load report) loads what a worker
  lacks and unloads what is no longer declared. A file that does not parse is logged and the last
  good set is kept; an empty file is such an error (an empty set is `adapters: []`).
- `report_loop` (with `adapters.report_configmap`) computes `pool_report` every `poll_s` and,
  when it differs from what it last wrote, merge-patches it as JSON into one annotation of the
  router's ConfigMap: {"prefill": {"workers": 1, "adapters": {"sql": 1}}, "decode": {...}} —
  per pool the connected workers and, per adapter, how many of them report it. The operator
  folds it into status.<pool>.adapters. The router's Role may get and patch that one ConfigMap.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import yaml

from splitserve.platform.errors import ConfigError
from splitserve.router.config import AdaptersConfig
from splitserve.router.placement.adapters import AdapterCatalog
from splitserve.router.placement.pool import WorkerPool

log = logging.getLogger(__name__)

NAME = re.compile(r"^[^\s,]{1,128}$")


def parse_declared(text: str, where: str = "adapters file") -> dict[str, str]:
    """name -> folder from the file's text; ConfigError naming what is wrong."""
    data = yaml.safe_load(text)
    # An empty file is an error, not an empty set: a half-written file must not unload everything.
    if not isinstance(data, dict) or set(data) != {"adapters"}:
        raise ConfigError(f"{where}: expected a mapping with the one key 'adapters' (an empty set is 'adapters: []')")
    entries = data.get("adapters") or []
    if not isinstance(entries, list):
        raise ConfigError(f"{where}: 'adapters' must be a list of {{name, path}}")
    out: dict[str, str] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"name", "path"}:
            raise ConfigError(f"{where}: each adapter is {{name, path}}, got {entry!r}")
        name, path = entry["name"], entry["path"]
        if not isinstance(name, str) or not NAME.match(name) or not isinstance(path, str) or not path:
            raise ConfigError(
                f"{where}: adapter {entry!r}: name is 1-128 characters without spaces or commas, path a folder"
            )
        if name in out:
            raise ConfigError(f"{where}: adapter {name!r} is declared twice")
        out[name] = path
    return out


def read_declared(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse_declared(f.read(), path)
    except OSError as exc:
        raise ConfigError(f"cannot read the adapters file {path} ({exc.strerror})") from None


async def follow_file(catalog: AdapterCatalog, config: AdaptersConfig) -> None:
    """Declare the file's adapters after every change (runs until cancelled; the router declared
    the file's first content when it started)."""
    last = catalog.declared
    while True:
        await asyncio.sleep(config.poll_s)
        try:
            declared = await asyncio.to_thread(read_declared, config.file)
        except (ConfigError, yaml.YAMLError) as exc:
            log.warning("keeping the declared adapters as they were: %s", exc)
        else:
            if declared != last:
                log.info("declared LoRA adapters: %s", ", ".join(f"{n}={p}" for n, p in declared.items()) or "none")
                catalog.declare(declared)
                last = declared


def pool_report(pool: WorkerPool) -> dict[str, dict]:
    """Per worker role: how many workers are connected, and per adapter how many report it."""
    out: dict[str, dict] = {}
    for w in sorted(pool.workers.values(), key=lambda w: w.address):
        if not w.is_connected or w.incompatible or not w.role:
            continue
        entry = out.setdefault(w.role, {"workers": 0, "adapters": {}})
        entry["workers"] += 1
        for a in w.load.adapters if w.load is not None else ():
            entry["adapters"][a.name] = entry["adapters"].get(a.name, 0) + 1
    for entry in out.values():
        entry["adapters"] = dict(sorted(entry["adapters"].items()))
    return out


class ConfigMapReporter:
    """Writes pool_report into one annotation of one ConfigMap (the Kubernetes API, in a thread)."""

    def __init__(self, config: AdaptersConfig):
        from kubernetes import client
        from kubernetes import config as kube_config

        cfg = client.Configuration()
        try:
            kube_config.load_incluster_config(client_configuration=cfg)
        except kube_config.ConfigException:
            kube_config.load_kube_config(client_configuration=cfg)
        self.api = client.CoreV1Api(client.ApiClient(cfg))
        self.config = config

    def write(self, report: dict) -> None:
        body = {"metadata": {"annotations": {self.config.report_annotation: json.dumps(report, sort_keys=True)}}}
        self.api.patch_namespaced_config_map(
            self.config.report_configmap,
            self.config.report_namespace,
            body,
            _content_type="application/merge-patch+json",
            _request_timeout=10,
        )


async def report_loop(pool: WorkerPool, config: AdaptersConfig, reporter: ConfigMapReporter | None = None) -> None:
    """Write the report whenever it changes (runs until cancelled; a failed write is retried)."""
    reporter = reporter or ConfigMapReporter(config)
    written = None
    while True:
        report = pool_report(pool)
        if report != written:
            try:
                await asyncio.to_thread(reporter.write, report)
                written = report
            except Exception as exc:  # noqa: BLE001 - the API being away must not stop the router
                log.warning(
                    "cannot report the loaded adapters to ConfigMap %s/%s: %s",
                    config.report_namespace,
                    config.report_configmap,
                    exc,
                )
        await asyncio.sleep(config.poll_s)
