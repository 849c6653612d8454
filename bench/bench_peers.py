"""Memory with peers that never read: the serve process's RSS with many ListAndWatch peers that open
their flow-control windows and then read nothing, and after they leave.

    .venv/bin/python bench/bench_peers.py [--peers 100] [--devices 2000] [--runs 3] [--label NAME]

Each run starts `python -m gopherplug serve` (the work tree's) with one resource of ``--devices``
files named like "accelerator-card-00000-of-a-rack" (a ListAndWatch message of about 90 KiB) and
gopherplug's kubelet simulator in this process, as test_hostile.py does. Then ``--peers`` peers each
open a connection to the plugin's socket, announce windows of 2^31-1 (connection and stream), start
one ListAndWatch and read nothing more; a device is added, so every stream has a new list to send.
Printed per run, in MiB: VmRSS before the peers, VmHWM (the peak, reset through clear_refs before
the peers came), VmRSS once it has settled with the peers there, and VmRSS after they have left and
the process settled again (memory given back to the system, or kept by the allocator); then the
medians as a row of RESULTS.md's table, named ``--label``. Another revision: run the script from a
copy of the tree with that revision's gopherplug.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import h2.settings
import trio

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from test_hostile import Peer, grpc_message, headers_for, settled, start_serving  # noqa: E402

MiB = 2**20


async def one_run(peers: int, devices: int) -> tuple[float, float, float, float]:
    root = Path(tempfile.mkdtemp(prefix="gpb-", dir="/tmp"))
    try:
        async with trio.open_nursery() as nursery:
            served = await start_serving(nursery, root, [f"accelerator-card-{i:05d}-of-a-rack" for i in range(devices)])
            try:
                await settled(served)
                before = served.reset_peak()
                opened = []
                for _ in range(peers):
                    peer = await Peer.open(
                        served.socket_path, {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1}
                    )
                    peer.h2.increment_flow_control_window(2**31 - 1 - 65535)
                    peer.h2.send_headers(1, headers_for("ListAndWatch"))
                    peer.h2.send_data(1, grpc_message(b""), end_stream=True)
                    await peer.flush()  # and from now on, nothing is read
                    opened.append(peer)
                (served.root / "dev" / "added").touch()
                await settled(served)
                peak = served.status()["VmHWM"] * 1024
                during = served.status()["VmRSS"] * 1024
                for peer in opened:
                    await peer.aclose()
                await settled(served)
                after = served.status()["VmRSS"] * 1024
                return before / MiB, peak / MiB, during / MiB, after / MiB
            finally:
                served.process.kill()
                await served.process.wait()
                nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--label", default="work tree")
    args = parser.parse_args()
    rows = []
    for run in range(args.runs):
        figures = trio.run(one_run, args.peers, args.devices)
        rows.append(figures)
        before, peak, during, after = figures
        print(
            f"run {run + 1}: before {before:.1f}, peak {peak:.1f}, with the peers {during:.1f}, after {after:.1f} MiB"
        )
    median = [statistics.median(column) for column in zip(*rows, strict=True)]
    line = (
        f"| {args.label} | {args.peers} | {args.devices} | {median[0]:.1f} | {median[1]:.1f} | {median[2]:.1f} "
        f"| {median[3]:.1f} |"
    )
    print(line)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
