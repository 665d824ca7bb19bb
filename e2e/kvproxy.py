"""A TCP proxy between a prefill worker and a decode worker's KV listener, for fault injection.

The decode worker binds its KV port on 127.0.0.2 and advertises 127.0.0.1 (`--host 127.0.0.2
--advertise-host 127.0.0.1`); this proxy listens on 127.0.0.1 at the same port and forwards.
`mode` switches at any time: `pass`, `delay` (each chunk held `delay_s` before it is forwarded)
or `drop` (every open connection is cut and new ones are closed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class KVProxy:
    def __init__(self, listen_port: int, target_host: str = "127.0.0.2", delay_s: float = 0.2):
        self.listen_port, self.target_host, self.delay_s = listen_port, target_host, delay_s
        self.mode = "pass"
        self.num_connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-proxy")

    def start(self) -> KVProxy:
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("kv proxy did not start")
        return self

    def set_mode(self, mode: str) -> None:
        if mode not in ("pass", "delay", "drop"):
            raise ValueError(f"mode={mode!r}; allowed: pass, delay, drop")
        self.mode = mode
        if mode == "drop":
            self._loop.call_soon_threadsafe(self._cut_all)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.listen_port))
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    def _cut_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader, writer) -> None:
        if self.mode == "drop":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.listen_port)
        except OSError:
            writer.transport.abort()
            return
        self.num_connections += 1
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers -= {writer, up_writer}

    async def _pipe(self, reader, writer) -> None:
        try:
            while data := await reader.read(1 << 16):
                if self.mode == "delay":
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()
