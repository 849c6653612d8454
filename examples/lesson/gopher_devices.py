"""Lesson 1, the devices: what a device plugin knows before the kubelet asks it anything.

Every entry of a directory is one device ("a gopher") of the resource example.com/gopher: here
the plugin finds them, judges their health, reads what the node knows of each (its NUMA node,
its memory) and keeps all of it current with inotify, also when the directory is missing at
start or goes away and comes back, as /dev/serial/by-id does when its last adapter is unplugged.
The later lessons (docs/protocol.md lists them in order) import this one; gopher_plugin.py's
demo runs it. Read it top to bottom:

  1. A device       its health by access(), never open(); its properties from sysfs
  2. The directory  a scan: device ID -> Gopher
  3. Watching       inotify on the directory; while it is missing, on its nearest ancestor

say() and need() first: every lesson's demo narrates with them.
"""

from __future__ import annotations

import importlib
import os
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import trio
from inotify_simple import INotify, flags

from gopherplug import Watched

START = time.monotonic()


def say(who: str, what: str) -> None:
    """The lessons' narration: milliseconds since start, who acts, what it did."""
    print(f"{(time.monotonic() - START) * 1e3:8.1f} ms  {who:<8} {what}", flush=True)


def need(module: str, extra: str) -> None:
    """A demo's stand-ins come with one of gopherplug's extras: without it, one line, not a traceback."""
    try:
        importlib.import_module(module)
    except ImportError as error:
        raise SystemExit(
            f"{os.path.basename(sys.argv[0])} --demo needs the {extra} extra ({error}): "
            f"pip install '.[{extra}]' in a checkout of gopherplug"
        ) from None


# 1. A device. The kubelet sees its ID and its health, "Healthy" or "Unhealthy" (the words of
# v1beta1), and, from lesson 3 on, its NUMA node. Only healthy devices count in the node's
# allocatable, and only those are given to a pod.


@dataclass(frozen=True)
class Gopher:
    health: str
    properties: dict[str, str] = field(default_factory=dict)  # e.g. {"numa": "1", "memory": "2Gi"}

    @property
    def numa(self) -> int | None:
        """The NUMA node the device hangs off, None if unknown (sysfs says -1 on a one-node machine)."""
        node = self.properties.get("numa", "-1")
        return int(node) if node.isdigit() else None


def health(path: str) -> str:
    # Healthy: a container given this entry could use it. Ask the kernel with access(), which
    # follows the symlink and checks the mode, but never open() the device to find out: opening a
    # serial port raises DTR and RTS (an Arduino resets), opening a tape drive may rewind it, and a
    # device that admits one opener at a time would refuse the very container we vouch for while
    # we hold it. A symlink to nothing, or a mode that forbids read and write, is Unhealthy, and
    # Healthy again once fixed. gopherplug asks access() too.
    return "Healthy" if os.access(path, os.R_OK | os.W_OK) else "Unhealthy"


def properties(path: str) -> dict[str, str]:
    # What the node knows of a device comes from sysfs, not from the device: a character device's
    # NUMA node is /sys/dev/char/<major>:<minor>/device/numa_node. The demo's gophers are plain
    # files, so their lines play sysfs ("numa=1", "memory=2Gi"); reading a plain file has no side
    # effect, reading a device would have.
    try:
        info = os.stat(path)
        if stat.S_ISCHR(info.st_mode):
            rdev = f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
            with open(f"/sys/dev/char/{rdev}/device/numa_node", encoding="ascii") as sysfs:
                return {"numa": sysfs.read().strip()}
        if stat.S_ISREG(info.st_mode):
            with open(path, encoding="utf-8") as plain:
                return dict(line.split("=", 1) for line in plain.read().split() if "=" in line)
    except (OSError, ValueError):
        pass  # gone meanwhile, or no sysfs entry: nothing known
    return {}


# 2. The directory. A device's ID is its entry's name. Hidden entries are not devices (editors'
# and our own temporary files start with a dot).


def scan(directory: str) -> dict[str, Gopher]:
    """The devices now, by ID; none while the directory is missing."""
    try:
        names = sorted(name for name in os.listdir(directory) if not name.startswith("."))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {}
    for name in names:
        path = os.path.join(directory, name)
        found[name] = Gopher(health(path), properties(path))
    return found


# 3. Watching. inotify, not a rescan every few seconds: the kubelet hears of a new device in
# milliseconds, and an idle plugin costs nothing. Any event means "rescan": reading a directory is
# cheap, and a burst of events (udev makes several links per device) becomes one new list.

# ATTRIB is a chmod (health can change while the entry stays); CLOSE_WRITE, a gopher's file rewritten.
DEVICE_EVENTS = flags.CREATE | flags.DELETE | flags.MOVED_FROM | flags.MOVED_TO | flags.ATTRIB | flags.CLOSE_WRITE


async def read_events(inotify: INotify) -> list[Any]:
    """The next batch of inotify events, waited for without a thread or polling."""
    await trio.lowlevel.wait_readable(inotify.fileno())
    return list(inotify.read(timeout=0))


def watch_directory(inotify: INotify, directory: str) -> tuple[int | None, str]:
    """Watch ``directory``: its watch, and itself. While it is missing: None, and the nearest
    ancestor that exists, watched instead, whose CREATE says that the next step is there."""
    for _ in range(2):
        try:
            return inotify.add_watch(directory, DEVICE_EVENTS | flags.ONLYDIR), directory
        except (FileNotFoundError, NotADirectoryError):
            ancestor = os.path.dirname(directory)
            while not os.path.isdir(ancestor):
                ancestor = os.path.dirname(ancestor)
            inotify.add_watch(ancestor, flags.CREATE | flags.MOVED_TO | flags.ONLYDIR)
            # Then look once more: made between our try and our watch, it would have gone unseen.
    return None, ancestor


async def watch_devices(directory: str, devices: Watched) -> None:
    """Keep ``devices`` (a Watched dict of ID -> Gopher) current until cancelled.

    A watch is on an inode, not on a name: when the directory is deleted, its watch ends
    (IN_IGNORED), and the directory made again under the same name is a new inode nobody
    watches. udev deletes /dev/serial/by-id with the last serial adapter, and makes it again at
    the next plug: a plugin that watched it once never sees another device. So when the watch
    ends, or the directory is missing at start, its nearest existing ancestor is watched, and
    each time the directory appears, it is watched again.
    """
    directory, watch, waited_on = os.path.abspath(directory), None, ""
    with INotify() as inotify:
        while True:
            if watch is None:
                watch, ancestor = watch_directory(inotify, directory)
                if watch is None and not waited_on:
                    say("plugin", f"{directory} is missing: no devices until it comes (inotify on {ancestor})")
                elif watch is not None and waited_on:
                    say("plugin", f"{directory} appeared: watching it")
                waited_on = ancestor if watch is None else ""
            devices.set(scan(directory))  # wakes every ListAndWatch stream, if anything changed
            if any(event.wd == watch and event.mask & flags.IGNORED for event in await read_events(inotify)):
                watch = None  # deleted (or its filesystem unmounted): its watch went with it
