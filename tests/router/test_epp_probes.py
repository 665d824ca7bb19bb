"""The EPP's endpoint probes (router/epp/probes.py) against small HTTP servers on 127.0.0.1.

The probe keeps one connection per endpoint and asks /ready on it every round, so an idle pool
costs no connection setup per probe; an endpoint that stops answering is still dropped as soon
as before: refused at once, a connection the endpoint closed retried once on a new one, a hung
endpoint after SLOW_PROBES_DOWN timeouts.
"""

from __future__ import annotations

import asyncio

from splitserve.router.epp.probes import SLOW_PROBES_DOWN, EndpointProbe


class Endpoint:
    """An HTTP/1.1 server answering GET with `status`; counts connections; can close each
    connection after `answers_per_connection` answers (a keep-alive timeout), or hang."""

    def __init__(self, status: int = 200, answers_per_connection: int = 0, chunked: bool = False):
        self.status, self.per_connection, self.chunked = status, answers_per_connection, chunked
        self.connections = self.answers = 0
        self.hang = False
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer):
        self.connections += 1
        self.writers.add(writer)
        answered = 0
        try:
            while await reader.readline():
                while (await reader.readline()) not in (b"\r\n", b""):
                    pass
                if self.hang:
                    await asyncio.sleep(3600)
                self.answers += 1
                answered += 1
                body = b'{"status": "ready"}'
                if self.chunked:
                    head = b"HTTP/1.1 %d X\r\ntransfer-encoding: chunked\r\n\r\n" % self.status
                    writer.write(head + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
                else:
                    writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (self.status, len(body), body))
                await writer.drain()
                if self.per_connection and answered >= self.per_connection:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def rounds(probe: EndpointProbe, n: int) -> None:
    for _ in range(n):
        await probe.probe_once()


async def probed(endpoint: Endpoint, n: int) -> bool:
    """Probe one endpoint for n rounds; whether it reads ready after them (both ends closed)."""
    address = await endpoint.start()
    probe = EndpointProbe(lambda: {address})
    await rounds(probe, n)
    ready = probe.is_ready(address)
    await probe.close()
    await endpoint.stop()
    return ready


def test_one_connection_serves_every_round():
    endpoint = Endpoint()
    ready = asyncio.run(probed(endpoint, 10))
    assert (ready, endpoint.connections, endpoint.answers) == (True, 1, 10)


def test_a_connection_the_endpoint_closed_is_retried_without_a_not_ready_round():
    async def run():
        endpoint = Endpoint(answers_per_connection=2)
        address = await endpoint.start()
        probe = EndpointProbe(lambda: {address})
        seen = []
        for _ in range(6):
            await probe.probe_once()
            await asyncio.sleep(0.01)  # the close reaches the probe's side
            seen.append(probe.is_ready(address))
        await probe.close()
        await endpoint.stop()
        return seen, endpoint.answers

    seen, answers = asyncio.run(run())
    assert seen == [True] * 6 and answers == 6


def test_a_chunked_answer_still_reads_as_its_status():
    assert asyncio.run(probed(Endpoint(chunked=True), 3))


def test_a_gone_endpoint_is_not_ready_at_the_next_round_and_a_503_is_not_ready():
    async def run():
        gone, unready = Endpoint(), Endpoint(status=503)
        a, b = await gone.start(), await unready.start()
        probe = EndpointProbe(lambda: {a, b})
        await probe.probe_once()
        before = probe.is_ready(a)
        await gone.stop()
        await probe.probe_once()
        after = probe.is_ready(a)
        await probe.close()
        await unready.stop()
        return before, after, probe.is_ready(b)

    assert asyncio.run(run()) == (True, False, False)


def test_a_hung_endpoint_is_dropped_after_the_slow_probes():
    async def run():
        endpoint = Endpoint()
        address = await endpoint.start()
        probe = EndpointProbe(lambda: {address})
        await probe.probe_once()
        endpoint.hang = True
        seen = []
        for _ in range(SLOW_PROBES_DOWN):
            await probe.probe_once()
            seen.append(probe.is_ready(address))
        await probe.close()
        await endpoint.stop()
        return seen

    assert asyncio.run(run()) == [True] * (SLOW_PROBES_DOWN - 1) + [False]
