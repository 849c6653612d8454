"""Memory at scale: the plugin's RSS after a busy life with 10,000 devices, at several revisions in one run.

    .venv/bin/python bench/bench_memory.py [--devices 10000] [--updates 10] [--allocates 1000]
        [--restarts 20] [--runs 3] [REV ...]        # default revisions: daca4ee and the work tree

Each revision's gopherplug.py (``git show REV:gopherplug.py``; "tree": the work tree's) runs alone,
compiled to bytecode as the images ship it, as `python -m gopherplug serve` (from that bytecode) on
a temporary node directory with one resource of ``--devices`` files. With ``--source`` it runs as
`python gopherplug.py serve` with no bytecode anywhere (PYTHONDONTWRITEBYTECODE=1), as a copy of the
file in a read-only image runs: Python then compiles the module at every start. bench_gopherplug's
grpcio kubelet (which dials back inside Register and keeps a ListAndWatch stream, as the kubelet
does) takes the first list; then, in order: ``--updates`` files added one at a time, each waited for
in the kubelet's stream; ``--allocates`` Allocate calls of one device each (round-robin over the
devices); ``--restarts`` kubelet restarts (every socket of the directory deleted, kubelet.sock
served anew, as a restarting kubelet does), each waited for until the plugin registered again and
its new stream delivered the full list. Printed per revision and run: VmRSS fresh (after the first
list), after the whole scenario, and VmHWM (the peak). The revisions take turns, run by run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import Kubelet, end_run, revision_module, rss_mib  # noqa: E402

import gopherplug as gp  # noqa: E402

RESOURCE = "example.com/gopher"


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scenario(
    module: Path, devices: int, updates: int, allocates: int, restarts: int, from_source: bool
) -> tuple[float, float, float]:
    root = tempfile.mkdtemp(prefix="gpm-", dir="/tmp")
    plugin = None
    kubelet = Kubelet(os.path.join(root, "dp"))
    try:
        os.mkdir(kubelet.plugin_dir)
        directory = os.path.join(root, "dev")
        os.mkdir(directory)
        for i in range(devices):
            os.close(os.open(os.path.join(directory, f"g{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
        config = Path(root, "config.yaml")
        config.write_text(
            f"device_plugin_dir: {kubelet.plugin_dir}\nresources:\n  - name: {RESOURCE}\n    directory: {directory}\n"
        )
        kubelet.start()
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        if from_source:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        # `python gopherplug.py` compiles the file at every start (a script's bytecode is never
        # cached); `python -m gopherplug` loads the bytecode, as the images' console script does.
        start = [str(module)] if from_source else ["-m", "gopherplug"]
        argv = [sys.executable, *start, "serve", "--config", str(config), "--log-level", "warning"]
        plugin = subprocess.Popen(argv, cwd=module.parent, env=env)
        count = devices
        kubelet.wait_for(lambda ids: len(ids) == count, timeout=120)
        _, endpoint = kubelet.registered.get(timeout=10)
        fresh = rss_mib(plugin.pid)
        for i in range(updates):
            Path(directory, f"n{i}").touch()
            count += 1
            kubelet.wait_for(lambda ids, count=count: len(ids) == count, timeout=60)
        with grpc.insecure_channel(f"unix:{os.path.join(kubelet.plugin_dir, endpoint)}") as channel:
            allocate = channel.unary_unary(
                "/v1beta1.DevicePlugin/Allocate",
                request_serializer=gp.v1beta1.AllocateRequest.SerializeToString,
                response_deserializer=gp.v1beta1.AllocateResponse.FromString,
            )
            for i in range(allocates):
                request = gp.v1beta1.AllocateRequest(
                    container_requests=[gp.v1beta1.ContainerAllocateRequest(devices_ids=[f"g{i % devices}"])]
                )
                allocate(request, timeout=30)
        for _ in range(restarts):
            kubelet.stop()
            kubelet.wipe()
            kubelet.start()
            kubelet.registered.get(timeout=60)
            kubelet.wait_for(lambda ids, count=count: len(ids) == count, timeout=60)
        # Let what the restarts left behind (ended streams, closed connections) be collected as it
        # would be on a quiet node: the plugin is idle from here on.
        time.sleep(2)
        return fresh, rss_mib(plugin.pid), peak_mib(plugin.pid)
    finally:
        end_run(plugin, kubelet, root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("revs", nargs="*", default=["daca4ee", "tree"])
    parser.add_argument("--devices", type=int, default=10000)
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--allocates", type=int, default=1000)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--source", action="store_true", help="run `python gopherplug.py` (compiled at start)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpm-src-") as place:
        modules = {}
        for rev in args.revs:
            directory = Path(place, rev.replace("/", "_").replace("~", "-"))
            modules[rev] = revision_module(rev, directory, bytecode=not args.source)
        results: dict[str, list[tuple[float, float, float]]] = {rev: [] for rev in args.revs}
        for run in range(args.runs):
            for rev, module in modules.items():
                figures = scenario(module, args.devices, args.updates, args.allocates, args.restarts, args.source)
                results[rev].append(figures)
                fresh, after, peak = figures
                print(
                    f"run {run + 1} {rev}: fresh {fresh:.1f} MiB, after {after:.1f} MiB, peak {peak:.1f} MiB",
                    flush=True,
                )
        for rev, figures in results.items():
            fresh, after, peak = (statistics.median(f[i] for f in figures) for i in range(3))
            print(f"{rev}: median of {args.runs}: fresh {fresh:.1f} MiB, after {after:.1f} MiB, peak {peak:.1f} MiB")


if __name__ == "__main__":
    main()
