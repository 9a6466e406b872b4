"""How every long-running kvroute command (serve, emulate, controller) waits to be told to stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable


async def until_stopped(on_hangup: Callable[[], None] | None = None) -> None:
    """Return when the process gets SIGTERM or SIGINT, so the caller can drain and clean up
    (exit 0, not a KeyboardInterrupt traceback); while waiting, SIGHUP calls ``on_hangup`` if given."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_hangup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    await stop.wait()
