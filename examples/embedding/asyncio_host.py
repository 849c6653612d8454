"""An asyncio program that offers its devices to the kubelet through gopherplug.

gopherplug is written for trio. An asyncio program runs it in trio's guest mode: trio's scheduler
runs inside asyncio's event loop, in the same thread (trio.lowlevel.start_guest_run), so neither
side needs a thread of its own and both see the same process's signals.

The asyncio side decides which devices exist. Here it reads them from standard input, one line
per change: the IDs of the widgets there now, "!" after one that is unhealthy ("w0 w1!"). A real
program would follow its hardware the same way. Between the two sides, one rule: gopherplug's
objects (the Watched that holds the devices) are touched only from trio, so the asyncio side hands
each change over with TrioToken.run_sync_soon.

It stops as `gopherplug serve` does: SIGTERM or Ctrl-C, through serve_until_signalled, which
removes the plugin's socket and lock file. The end of the input stops it too, from the asyncio
side: it cancels the trio side, and the same cleanup runs.

    GOPHERPLUG_DEVICE_PLUGIN_DIR=/var/lib/kubelet/device-plugins python asyncio_host.py
    w0 w1
    w1 w2!
"""

import asyncio
import logging
import sys
from typing import Any

import trio
from outcome import Outcome

import gopherplug

resource = gopherplug.resource_config("example.com/widget", env="WIDGETS")


def widgets(line: str) -> dict[str, gopherplug.DeviceEntry]:
    """The devices one line of input names: "w0 w1!" is w0, healthy, and w1, unhealthy."""
    found: dict[str, gopherplug.DeviceEntry] = {}
    for word in line.split():
        name = word.removesuffix("!")
        if word.endswith("!"):
            found[name] = gopherplug.DeviceEntry(name, f"/dev/{name}", health=gopherplug.UNHEALTHY, problem="said so")
        else:
            found[name] = gopherplug.DeviceEntry(name, f"/dev/{name}")
    return found


async def follow_input(token: trio.lowlevel.TrioToken, devices: gopherplug.Watched) -> None:
    """The asyncio side: each line of standard input is the devices there now, until its end."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        token.run_sync_soon(devices.set, widgets(line.decode()))  # set() runs in trio, as it must


async def main() -> None:
    loop = asyncio.get_running_loop()
    devices = gopherplug.Watched({})
    started: asyncio.Future[trio.lowlevel.TrioToken] = loop.create_future()  # trio's token, once it runs
    finished: asyncio.Future[Outcome[None]] = loop.create_future()  # the trio side's outcome
    stop = trio.CancelScope()  # the asyncio side's way to stop the trio side

    async def trio_side() -> None:
        started.set_result(trio.lowlevel.current_trio_token())
        with stop:
            await gopherplug.serve_until_signalled(gopherplug.serve_devices, resource, devices)

    trio.lowlevel.start_guest_run(
        trio_side,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        done_callback=finished.set_result,
        host_uses_signal_set_wakeup_fd=True,  # trio's guest-mode advice for asyncio
    )
    token = await started
    reading = asyncio.ensure_future(follow_input(token, devices))
    either: list[asyncio.Future[Any]] = [reading, finished]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if not finished.done():  # the input ended first: stop gopherplug from here
        token.run_sync_soon(stop.cancel)
    outcome = await finished  # the trio side has stopped: its socket and lock file are gone
    reading.cancel()
    outcome.unwrap()  # an error of gopherplug's (no permission for its socket, say) is raised here
    if reading.done() and not reading.cancelled():
        reading.result()  # an error of the input side's


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
