"""Exercise 2's solution: PreStartContainer refuses a device a serial program holds.

`python check.py --solution 2` puts these methods in place of gopher_allocation.py's, in a copy.
"""

from __future__ import annotations

import os
from typing import Any

import gopher_allocation

from gopherplug import RPCError, StatusCode, v1beta1


class GopherAllocator(gopher_allocation.GopherAllocator):
    async def PreStartContainer(self, request: Any) -> Any:  # noqa: N802 - the RPC's name
        for device_id in request.devices_ids:
            self.check(device_id)  # still there, still healthy
            if (holder := self.holder(device_id)) is not None:
                raise RPCError(StatusCode.FAILED_PRECONDITION, f"device {device_id} is busy: process {holder} holds it")
        return v1beta1.PreStartContainerResponse()

    def holder(self, device_id: str) -> int | None:
        # minicom, picocom and the like take /var/lock/LCK..<name>: the holder's pid in ASCII. A
        # lock whose process is gone is stale (it crashed): not busy. os.kill(pid, 0) sends
        # nothing, and says whether the process exists (EPERM: it does, someone else's).
        try:
            with open(os.path.join(self.lock_dir, f"LCK..{device_id}"), encoding="ascii") as lock:
                pid = int(lock.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None  # no lock, or not one we can read
        if pid <= 0:  # kill(0) and kill(-1) would ask about groups of processes: a broken lock
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return pid
