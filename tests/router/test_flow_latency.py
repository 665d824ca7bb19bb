"""The default running cap (router/flow/latency.py): a worker's step-time line fitted from the gaps
the router sees, the cap it gives, exploration before the line is known, an explicit cap winning;
flow control turned on by a key file that sets priorities; and the step times of a real gateway's
streams reaching the detector (the official openai client, a fake worker on real gRPC)."""

from __future__ import annotations

import logging

import openai
import pytest
import yaml
from routerkit import FakeWorker, RouterServer, router_config
from test_flow_units import Worker

from splitserve.router.config import GatewayConfig
from splitserve.router.config.file import from_dict
from splitserve.router.config.flow import FlowControlConfig
from splitserve.router.flow.latency import StepFit, band_limit
from splitserve.router.flow.saturation import SaturationDetector


def fitted(a: float, b: float, batches=(1, 2, 3, 4), rounds: int = 50) -> StepFit:
    fit = StepFit()
    for _ in range(rounds):
        for n in batches:
            fit.observe(n, a + b * n)
    return fit


def test_the_line_and_the_cap_follow_the_step_time():
    fit = fitted(0.02, 0.01)
    a, b = fit.line()
    assert a == pytest.approx(0.02) and b == pytest.approx(0.01)
    # target 1.5 * t(1) = 0.045 s: t(2) = 0.04 fits, t(3) = 0.05 does not
    assert fit.max_running(0.5) == 2
    assert (band_limit(2, False), band_limit(2, True)) == (1, 2)
    assert fit.max_running(0.5, itl_target_s=0.065) == 4  # an absolute target instead
    assert fitted(0.02, 0.001).max_running(0.5) == 6  # hardly growing: two above the batch seen


def test_a_flat_step_time_gets_a_cap_that_climbs_one_batch_at_a_time():
    fit = fitted(0.03, 0.0, batches=(4, 8), rounds=64)  # 8 steps of 8 streams: batch 8 is measured
    assert fit.max_n == 8 and fit.max_running(0.5) == 10  # the batch bands may run 9: one more
    for _ in range(8 * 9 - 1):
        fit.observe(9, 0.03)
    assert fit.max_running(0.5) == 10  # 9 is not measured for 8 steps yet
    fit.observe(9, 0.03)
    assert fit.max_running(0.5) == 11


def test_a_line_tilted_below_zero_by_noise_goes_through_the_origin():
    fit = StepFit()
    for _ in range(20):
        fit.observe(1, 0.001)
        fit.observe(2, 0.05)
    a, b = fit.line()
    assert a == 0.0 and b > 0


def test_before_the_line_is_known_the_cap_explores_upward():
    fit = StepFit()
    assert fit.line() is None and band_limit(fit.max_running(0.5), False) == 1
    for _ in range(8):
        fit.observe(1, 0.03)
    assert fit.line() is None and band_limit(fit.max_running(0.5), False) == 2
    fit.observe(0, 0.03)  # no batch, no sample
    fit.observe(2, float("nan"))
    assert fit.max_n == 1


def test_the_detector_uses_the_fit_and_an_explicit_cap_wins():
    worker = Worker(num_inflight=1)
    detector = SaturationDetector(FlowControlConfig(enabled=True), lambda: [worker])
    detector.clock = lambda: 100.0
    for _ in range(50):
        for n in (1, 2, 3):
            worker.num_inflight = n
            detector.observe_step(worker, 0.02 + 0.01 * n)
    worker.num_inflight = 1
    assert not detector.has_room(0, 1) and detector.has_room(10, 1, 1)  # batch 1, one more for band >= 1
    worker.num_inflight = 2
    assert not detector.has_room(10, 2, 2)
    worker.num_inflight = 9  # over the cap (it dropped): a reserved band's own slot, while it is free
    assert detector.has_room(10, 9, 1) and not detector.has_room(10, 10, 2) and not detector.has_room(0, 9)
    worker.num_inflight = 2
    explicit = SaturationDetector(FlowControlConfig(enabled=True, max_running_per_worker=4), lambda: [worker])
    explicit.clock = lambda: 100.0
    assert explicit.has_room(0, 2)


def keys_file(tmp_path, keys) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": keys}))
    return str(path)


def test_a_key_file_with_priorities_turns_flow_control_on(tmp_path, caplog):
    with_priority = keys_file(tmp_path, [{"id": "b", "key": "sk-b", "priority": 10}])
    assert from_dict({"gateway": {"api_keys_file": with_priority}}).flow_control.enabled is True
    plain = tmp_path / "plain"
    plain.mkdir()
    assert (
        from_dict({"gateway": {"api_keys_file": keys_file(plain, [{"id": "a", "key": "k"}])}}).flow_control.enabled
        is False
    )
    assert from_dict({}).flow_control.enabled is False
    with caplog.at_level(logging.WARNING):
        off = from_dict({"gateway": {"api_keys_file": with_priority}, "flow_control": {"enabled": False}})
    assert off.flow_control.enabled is False and "they do nothing" in caplog.text


def test_a_gateways_streams_feed_the_workers_step_time(loop, tokenizer):
    worker = loop.run(FakeWorker(tokenizer=tokenizer, token_delay_s=0.01).start())
    config = router_config([worker.address], flow_control=FlowControlConfig(enabled=True), gateway=GatewayConfig())
    server = RouterServer(loop, config, tokenizer=tokenizer).start(num_decode=1)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        assert sum(1 for _ in stream) > 1
        detector = server.server.config.app.state.gateway.flow.detector
        fit = detector.fits[worker.address]
        assert fit.s0 > 0 and fit.s1 / fit.s0 == pytest.approx(1.0) and fit.sy / fit.s0 >= 0.005
    finally:
        server.stop()
        loop.run(worker.stop())
