"""Constants the control plane shares with the data plane (API group, version, ports)."""

API_GROUP = "serving.splitserve.io"
API_VERSION = "v1alpha1"
