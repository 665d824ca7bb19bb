"""The inference-gateway chaos run's short form (e2e/chaos_epp.py): the real model behind Envoy,
`splitserve epp`, two sidecars, two decode workers and one prefill worker, under load, with a
sidecar, a decode worker, the prefill worker and the EPP each SIGKILLed once and restarted.
Fails when more than 1 % of the requests sent while a part was down end other than complete and
equal to their undisturbed answer (by token id), when any request is wrong, hangs or is lost,
when a request of the final round fails, or when a worker still holds a request or a KV block.
The full run (each part killed at least twice) is `python e2e/chaos_epp.py --minutes 5`."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from chaos_epp import PARTS, Soak  # noqa: E402

pytestmark = pytest.mark.slow


def test_killing_each_part_of_the_gateway_path_costs_no_request(tmp_path, capsys):
    soak = Soak(minutes=0.1, seed=23, logdir=str(tmp_path), num_clients=2, kills=1)
    status = soak.run()
    report = capsys.readouterr().out
    print(report)
    killed = {o.part for o in soak.outages}
    assert killed == set(PARTS), report
    tallies = soak.per_part()
    assert all(t.sent > 0 for t in tallies.values()), report  # requests were sent while each part was down
    assert "KV blocks checked empty at the end" in report, report
    assert status == 0, report
