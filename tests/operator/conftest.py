"""Fixtures for the operator tests: a fresh emulated Kubernetes API per test (kmock, see
opkit_emulator) in a background thread, a client for it, and a namespace."""

from __future__ import annotations

import itertools

import pytest
from opkit_emulator import ClusterThread

from splitserve.planner.kube import KubeClient, load_configuration

_namespaces = itertools.count()


@pytest.fixture
def cluster(tmp_path) -> ClusterThread:
    with ClusterThread() as c:
        c.kubeconfig_path = c.kubeconfig(str(tmp_path / "kubeconfig"))
        yield c


@pytest.fixture
def kube(cluster) -> KubeClient:
    return KubeClient(load_configuration(cluster.kubeconfig_path))


@pytest.fixture
def namespace() -> str:
    return f"ns{next(_namespaces)}"
