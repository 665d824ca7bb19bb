"""Fault injection for disruption tests; every switch is off unless its variable is set.

SPLITSERVE_FAULT_KILL_AFTER_LAYERS=N  a prefill worker SIGKILLs itself right after sending
                                      layer N-1 of a transfer (dies mid-transfer)
SPLITSERVE_FAULT_PREFILL_HANG=1       a prefill worker accepts Prefill calls and never answers
SPLITSERVE_FAULT_ADAPTER_READ_S=X     re-reading an evicted LoRA adapter takes X more seconds (a slow disk)
SPLITSERVE_FAULT_TAMPER_PULL=1        a worker serving a pull alters one value of every layer it sends
                                      after computing that layer's digest (a payload changed on the way)
"""

from __future__ import annotations

import os
import signal
import time

KILL_AFTER_LAYERS = int(os.environ.get("SPLITSERVE_FAULT_KILL_AFTER_LAYERS", "0"))
PREFILL_HANG = os.environ.get("SPLITSERVE_FAULT_PREFILL_HANG", "") == "1"
ADAPTER_READ_S = float(os.environ.get("SPLITSERVE_FAULT_ADAPTER_READ_S", "0"))
TAMPER_PULL = os.environ.get("SPLITSERVE_FAULT_TAMPER_PULL", "") == "1"


def after_layer_sent(layer: int) -> None:
    if KILL_AFTER_LAYERS and layer + 1 >= KILL_AFTER_LAYERS:
        os.kill(os.getpid(), signal.SIGKILL)


def adapter_read() -> None:
    if ADAPTER_READ_S:
        time.sleep(ADAPTER_READ_S)


def tamper_pull(payload):
    """The payload as sent by a pull's holder: altered under SPLITSERVE_FAULT_TAMPER_PULL."""
    if not TAMPER_PULL:
        return payload
    payload = payload.clone()
    payload.view(-1)[0] += 1
    return payload
