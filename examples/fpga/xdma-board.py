#!/usr/bin/env python3
"""Xilinx XDMA FPGA boards for gopherplug: `describe` (each board's firmware version) and `pre_start`.

    describe: ["python3.11", "/opt/gopherplug/xdma-board.py", "describe"]
    pre_start: ["python3.11", "/opt/gopherplug/xdma-board.py", "reset"]

The XDMA driver gives a board five nodes or more (/dev/xdma0_user, _control, _h2c_0, _c2h_0,
_events_0, ...), which the configs' id_pattern makes one device, ID xdma<N>; sysfs says nothing of
the bitstream loaded into it. The board's tooling (the unit that loads the bitstream at boot, or
after a reflash) writes what it loaded to a status file, one per board, the version alone:

    /run/fpga/xdma0/firmware-version        2.4.1   (a leading "v" is dropped)

`describe` reads it for each board gopherplug names (GOPHERPLUG_DEVICES) and prints
{"xdma0": {"attributes": {"firmwareVersion": {"version": "2.4.1"}}}}. While a board's file is not
written yet (its bitstream still loading) it exits 1 naming the board: gopherplug offers the
boards without the version, says so in one line, and runs describe again (after 5 s, then less
often, up to every 5 minutes) until every board has one.

`reset` runs before each container (device plugin: PreStartContainer) or before a claim's
containers (DRA: NodePrepareResources), with the container's boards in FPGA_DEVICES: a board whose
firmware is not loaded refuses it (exit 1, one line: the kubelet shows it in the pod's events);
the others are reset, a PCI function-level reset through sysfs (the PCI function behind the
board's user node), so that a container starts on a board in a known state.

FPGA_STATUS_DIR (default /run/fpga) and FPGA_SYSFS (default /sys) say where the two are. Python's
standard library only: it runs in gopherplug's image as it is.
"""

from __future__ import annotations

import json
import os
import re
import sys

STATUS_DIR = os.environ.get("FPGA_STATUS_DIR", "/run/fpga")
SYSFS = os.environ.get("FPGA_SYSFS", "/sys")
SEMVER = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")


def firmware_version(board: str) -> str:
    """The board's firmware version, as its status file says; OSError or ValueError saying why not."""
    path = os.path.join(STATUS_DIR, board, "firmware-version")
    try:
        with open(path, encoding="ascii") as file:
            text = file.read(64).strip().removeprefix("v")
    except FileNotFoundError:
        raise OSError(f"{board}: {path} is not written yet (its bitstream is still loading?)") from None
    if not SEMVER.fullmatch(text):
        raise ValueError(f"{board}: {path} holds {text!r}, not a version MAJOR.MINOR.PATCH")
    return text


def describe(boards: list[str]) -> int:
    try:
        described = {b: {"attributes": {"firmwareVersion": {"version": firmware_version(b)}}} for b in boards}
    except (OSError, ValueError) as error:
        print(f"xdma-board: {error}", file=sys.stderr)
        return 1
    print(json.dumps(described))
    return 0


def reset(boards: list[str]) -> int:
    for board in boards:
        path = os.path.join(SYSFS, "class", "xdma", f"{board}_user", "device", "reset")
        try:
            firmware_version(board)
        except (OSError, ValueError) as error:
            print(f"xdma-board: {error}", file=sys.stderr)
            return 1
        try:
            with open(path, "w", encoding="ascii") as file:
                file.write("1")
        except OSError as error:
            print(f"xdma-board: {board}: cannot reset it through {path}: {error.strerror}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["describe"]:
        return describe([b for b in os.environ.get("GOPHERPLUG_DEVICES", "").split(",") if b])
    if argv[1:] == ["reset"]:
        return reset([b for b in os.environ.get("FPGA_DEVICES", "").split(",") if b])
    print("usage: xdma-board.py describe|reset", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
