"""A user-space TCP delay proxy: a cross-region link on one machine.

The kernel here has no netem, so ``kvroute live`` puts one of these on every cross-region link:
it listens on 127.0.0.1, opens a connection to its target for every client connection, and
delivers every chunk it reads ``one_way_s`` after it arrived, in each direction. Bytes keep their
order, and a chunk waits only for its own delay — never for the chunks behind it to be written,
and never longer because earlier chunks were delayed too (each chunk's due time is its arrival
time plus the delay, and arrival times only grow). A request therefore costs one RTT more than
on loopback: half on the way in, half on the way back.

Choices: opening the upstream connection is not delayed (kvroute's clients and gateways keep
connections alive, so a handshake RTT would be paid once per connection, not per request);
half-closes travel with the same delay as data; a reset on either side closes both at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("kvroute.live")


@dataclass
class LinkStats:
    """What crossed a link, for reports and tests."""

    connections: int = 0
    bytes_forward: int = 0  # client → target
    bytes_back: int = 0  # target → client


@dataclass
class DelayProxy:
    """One link: ``127.0.0.1:port`` → ``target`` with ``one_way_s`` added each way.

    ``target`` may be set after the proxy starts listening (``kvroute live`` opens every link
    before the gateways behind them have ports); connections made before it is set are refused.
    """

    one_way_s: float
    target: tuple[str, int] | None = None
    name: str = "link"
    host: str = "127.0.0.1"
    stats: LinkStats = field(default_factory=LinkStats)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def port(self) -> int:
        """The listening port (after ``start``)."""
        assert self._server is not None, "proxy not started"
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:port``: where to send what should cross this link."""
        return f"http://{self.host}:{self.port}"

    async def start(self, port: int = 0) -> int:
        """Listen; returns the bound port."""
        self._server = await asyncio.start_server(self._accept, self.host, port, reuse_address=True)
        return self.port

    async def stop(self) -> None:
        """Stop listening and cut every open connection."""
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(c_reader, c_writer)
        except asyncio.CancelledError:
            pass  # stop() cut this connection; asyncio's own callback would report a cancelled handler
        finally:
            self._tasks.discard(task)

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        if self.target is None:
            c_writer.close()
            return
        try:
            t_reader, t_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()  # the far side is down: the client sees a closed connection
            return
        self.stats.connections += 1
        pipes = [asyncio.create_task(self._pipe(c_reader, t_writer, True)),
                 asyncio.create_task(self._pipe(t_reader, c_writer, False))]
        try:
            done, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done if not t.cancelled()):
                for t in pending:
                    t.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
        finally:
            for t in pipes:
                t.cancel()
            for w in (c_writer, t_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, forward: bool) -> None:
        """Copy one direction: a reader stamps chunks with their due time, a writer delivers them
        when due. Two tasks, so reading never waits for the delay of what was read before."""
        loop = asyncio.get_running_loop()
        due: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()

        async def deliver() -> None:
            while True:
                while not due:
                    ready.clear()
                    await ready.wait()
                at, chunk = due.popleft()
                wait = at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:  # the sender half-closed
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        deliverer = asyncio.create_task(deliver())
        try:
            while True:
                chunk = await reader.read(65536)
                due.append((loop.time() + self.one_way_s, chunk))
                ready.set()
                if not chunk:
                    break
                if forward:
                    self.stats.bytes_forward += len(chunk)
                else:
                    self.stats.bytes_back += len(chunk)
            await deliverer
        except (ConnectionError, OSError):
            deliverer.cancel()
            raise
        finally:
            if not deliverer.done():
                deliverer.cancel()
