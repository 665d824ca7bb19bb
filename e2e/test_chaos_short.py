"""The chaos soak's short form (e2e/chaos.py): each fault kind injected once, in turn, under load
(the eight kinds take about a minute with their restarts; `minutes` only bounds a longer
random tail, so it is set below that; about 2 minutes in all with start-up and quiescing), on the real
stack (Redis, two router replicas, UCX and TCP prefill/decode workers of the real model), secured
as `splitserve up` is: mTLS between routers and workers, authenticated KV transfers. Fails on
any wrong, hung or lost request, any leak, a worker that serves a plaintext client, or a fault
kind not injected. Answers are compared by token id; cuts must be explained by a fault on the
request's own path; admission, open worker calls and KV blocks are checked empty at the end."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from chaos import FAULT_KINDS, Soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_short_chaos_soak_accounts_for_every_request(tmp_path, capsys):
    soak = Soak(minutes=0.2, seed=17, logdir=str(tmp_path), num_clients=2)
    status = soak.run()
    report = capsys.readouterr().out
    print(report)
    t = soak.tally
    assert soak.security.is_on and "mTLS and KV-transfer authentication on" in report, report
    assert all(t.faults[k] >= 1 for k in FAULT_KINDS) and len(FAULT_KINDS) == 8, report
    assert t.outcomes["ok"] > 0, report
    assert t.outcomes["wrong"] == t.outcomes["hung"] == t.outcomes["lost"] == t.outcomes["cut_unexplained"] == 0, report
    assert "compared by token id" in report and "checked empty at the end" in report, report
    assert status == 0, report
