"""How the chaos soak (e2e/chaos.py) judges one reply, on replies and faults written out (no
process is started): token ids against the reference, a cut explained only by a fault on the
request's own path while it ran (a kill of the *other* router replica does not explain it), a
cut's tokens a prefix of the reference, and each outcome's cause."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from chaos import SETTLE_S, FaultEvent, Soak  # noqa: E402
from chaos_load import Reply  # noqa: E402

REF = [10, 11, 12, 13, 14]


@pytest.fixture
def soak(tmp_path):
    s = Soak(minutes=1, seed=1, logdir=str(tmp_path), secure=False)
    s.reference = {spec: REF for spec in s.specs}
    return s


def fault(soak, kind, target, began, ended):
    event = FaultEvent(kind, target)
    event.began, event.ended = began, ended
    soak.fault_log.append(event)


def reply(soak, kind, token_ids, router="router-a", decode="decode-tcp", prefill="", t=(100.0, 105.0)):
    address = {w.name: w.address for w in soak.workers}
    return Reply(
        kind,
        "detail",
        list(token_ids),
        router=router,
        decode=address.get(decode, ""),
        prefill=address.get(prefill, ""),
        started=t[0],
        ended=t[1],
    )


def judge(soak, r):
    return soak.classify(soak.specs[0], r)


def test_answers_are_compared_by_token_id(soak):
    assert judge(soak, reply(soak, "answer", REF))[0] == "ok"
    outcome, detail, cause = judge(soak, reply(soak, "answer", REF[:4] + [99]))
    assert outcome == "wrong" and "expected [10, 11, 12, 13, 14]" in detail and cause == "no fault during the request"


def test_a_cut_is_explained_only_by_a_fault_on_its_own_path(soak):
    fault(soak, "router_sigkill", "router-b", 101.0, 103.0)  # the other replica
    outcome, detail, cause = judge(soak, reply(soak, "cut", REF[:2], router="router-a"))
    assert (outcome, cause) == ("cut_unexplained", "no fault on its path") and "router_sigkill on router-b" in detail
    fault(soak, "router_sigkill", "router-a", 104.0, 106.0)  # its own replica, while it ran
    assert judge(soak, reply(soak, "cut", REF[:2], router="router-a"))[::2] == ("cut", "router_sigkill on router-a")


def test_a_fault_on_the_decode_worker_or_its_kv_path_explains_a_cut(soak):
    fault(soak, "worker_sigkill", "decode-tcp", 90.0, 96.0)  # ended 4 s before: within SETTLE_S
    assert judge(soak, reply(soak, "cut", REF[:3]))[::2] == ("cut", "worker_sigkill on decode-tcp")
    soak.fault_log.clear()
    fault(soak, "kv_drop", "kv:decode-tcp", 101.0, 104.0)
    assert judge(soak, reply(soak, "cut", [], prefill="prefill-tcp"))[0] == "cut"
    assert judge(soak, reply(soak, "cut", []))[0] == "cut_unexplained"  # prefilled locally: no KV path


def test_a_fault_that_ended_before_the_settle_time_explains_nothing(soak):
    fault(soak, "worker_sigkill", "decode-tcp", 80.0, 100.0 - SETTLE_S - 1)
    assert judge(soak, reply(soak, "cut", REF[:1]))[0] == "cut_unexplained"


def test_a_cut_whose_tokens_are_not_the_references_prefix_is_wrong(soak):
    fault(soak, "router_sigkill", "router-a", 101.0, 103.0)
    assert judge(soak, reply(soak, "cut", [10, 99]))[0] == "wrong"


def test_errors_hangs_and_losses_carry_their_cause(soak):
    assert judge(soak, reply(soak, "error", []))[2] == "no fault during the request"
    fault(soak, "redis_restart", "redis", 101.0, 102.0)
    assert judge(soak, reply(soak, "error", []))[::2] == ("error", "redis_restart on redis")
    fault(soak, "worker_sigstop", "decode-tcp", 101.0, 109.0)
    assert judge(soak, reply(soak, "hung", []))[::2] == ("hung", "worker_sigstop on decode-tcp")  # on its path first


def test_fault_events_last_until_they_end():
    event = FaultEvent("worker_sigstop", "decode-ucx")
    assert event.overlaps(time.monotonic() + 1000, time.monotonic() + 1001)  # still going
    event.ended = event.began + 1
    assert not event.overlaps(event.ended + SETTLE_S + 1, event.ended + SETTLE_S + 2)
