"""The disaggregation modes on the wire: the one table between their names and the proto enum.

A mode says whether a decode worker hands a prompt to a prefill worker: "conditional" (only when
the tokens it would compute reach min_prefill_tokens), "always" or "never". The router writes the
enum into each GenerateRequest (router/core/worker_messages.py); the decode worker reads it back, and an unset
field (DISAGGREGATION_MODE_UNSPECIFIED) means the worker's own configured mode.
"""

from __future__ import annotations

from splitserve.platform.wire import worker_pb2 as pb

# name -> proto enum value; the names are the ones configs and CLIs accept.
DISAGGREGATION_MODES = {
    "conditional": pb.DISAGGREGATION_MODE_CONDITIONAL,
    "always": pb.DISAGGREGATION_MODE_ALWAYS,
    "never": pb.DISAGGREGATION_MODE_NEVER,
}
_NAMES = {value: name for name, value in DISAGGREGATION_MODES.items()}


def mode_name(value: int, default: str) -> str:
    """The name of a proto enum value; `default` for UNSPECIFIED (or a value from a newer peer)."""
    return _NAMES.get(value, default)
