"""gopherplug beside a Go device plugin, the kubelet's library calling both, in one run. By hand:

    .venv/bin/python bench/bench_side_by_side.py [REV ...] [--rounds 2] [--calls 2000]
        [--preferred-calls 30] [--log-level LEVEL] [--sizes 8,10000,50000]

REV: git revisions of gopherplug.py to measure ("tree": the work tree's; default: tree), or
zipapp=PYZ: a one-file build (.ci/zipapp), served as `python PYZ serve`. Needs a Go
toolchain and grpc-go in GOPATH form (Debian: `apt-get install golang-go golang-google-grpc-dev`,
go 1.19 and grpc-go 1.33 here): bench/go_plugin.go and bench/grpc_go_client.go are built into a
temporary directory (GO111MODULE=off, GOPATH=/usr/share/gocode), nothing else is fetched.

The plugins, one at a time on the same directory of N plain files: bench/go_plugin.go (grpc-go, the
kubelet's own test stub's way to serve, messages by hand: see its header) twice, as "go" (no log
line) and "go-log" (a line per call on stderr, to a file, as the stub logs each request), and gopherplug
(`python -m gopherplug serve` from bytecode, as the images run it, registered with
bench_gopherplug's grpcio kubelet, at serve's default log level unless --log-level says otherwise,
its log written to a file). Both answer Allocate alike: the env var and one DeviceSpec per device
(gopherplug configured with `device_specs: [{host_path: "{path}", container_path: "{path}"}]`).

The caller: grpc_go_client.go (grpc-go, one connection, 1 caller, as the kubelet), dialing each
plugin's socket directly. Per plugin:
  - 10,000 and 50,000 devices: GetPreferredAllocation p50, every ID available (shuffled, as the
    kubelet's Go set gives them), allocation size 2, nothing to include;
  - 10,000: the kubelet's sequence for one container, GetPreferredAllocation then Allocate of the 2;
  - 8 and 10,000: Allocate p50 of 2 devices, 1 caller;
and the plugin's CPU per call (/proc/PID/stat over the calls and their warm-up), steadier than wall
times on a shared machine. Each round measures every plugin in turn (Go first, then the revisions in
the order given); a table per round gives each figure and its ratios to go's and go-log's p50 of the
same round (and its CPU's to go's).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import Kubelet, build_go_program, cpu_seconds, revision_module  # noqa: E402

import gopherplug as gp  # noqa: E402

RESOURCE = "example.com/gopher"
ENV = gp.default_env_name(RESOURCE)
SIZES = (8, 10_000, 50_000)
# The targets: a figure divided by Go's of the same round.
TARGETS = {"preferred": 2.0, "sequence": 2.0, "allocate": 3.0}
# The Go plugins: go writes no log line; go-log one per call, as the kubelet's test stub does
# (klog.InfoS of every request), and as gopherplug does of every Allocate at its default level.
GO = {"go": [], "go-log": ["log"]}


class Plugin:
    """One plugin serving a directory of ``count`` files: Go's, or gopherplug at a revision."""

    def __init__(self, root: str, what: str, count: int, go_plugin: str, modules: dict[str, Path], log_level: str):
        self.root = tempfile.mkdtemp(prefix="gpsbs-", dir=root)
        self.what, self.count = what, count
        self.devices = os.path.join(self.root, "dev")
        os.mkdir(self.devices)
        for i in range(count):
            os.close(os.open(os.path.join(self.devices, f"g{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
        self.plugin_dir = os.path.join(self.root, "dp")
        os.mkdir(self.plugin_dir)
        self.log = open(os.path.join(self.root, "log"), "wb")
        self.kubelet = None
        if what in GO:
            self.socket = os.path.join(self.plugin_dir, "go.sock")
            self.process = subprocess.Popen(
                [go_plugin, self.socket, self.devices, ENV, *GO[what]], stdout=subprocess.PIPE, stderr=self.log
            )
            assert self.process.stdout.readline() == b"serving\n"
            return
        config = Path(self.root, "config.yaml")
        config.write_text(
            f"device_plugin_dir: {self.plugin_dir}\nresources:\n  - name: {RESOURCE}\n"
            f"    directory: {self.devices}\n"
            '    device_specs: [{host_path: "{path}", container_path: "{path}"}]\n'
        )
        self.kubelet = Kubelet(self.plugin_dir)
        self.kubelet.start()
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        env.pop("GOPHERPLUG_LOG_LEVEL", None)
        level = ["--log-level", log_level] if log_level else []  # none: serve's default
        start = [str(modules[what])] if what.startswith("zipapp=") else ["-m", "gopherplug"]
        self.process = subprocess.Popen(
            [sys.executable, *start, "serve", "--config", str(config), *level],
            cwd=modules[what].parent,
            env=env,
            stderr=self.log,
        )
        self.kubelet.wait_for(lambda ids: len(ids) == count, timeout=120)
        self.socket = next(
            os.path.join(self.plugin_dir, n) for n in os.listdir(self.plugin_dir) if n.startswith("gopherplug-")
        )

    def close(self):
        self.process.terminate()
        self.process.wait(10)
        if self.kubelet is not None:
            self.kubelet.stop()
        self.log.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def call(self, client: str, methods: list[str], requests: list[bytes], calls: int, warmup: int):
        """p50 of ``calls`` timed calls (each the methods in turn) from grpc-go, and the plugin's CPU per call."""
        arguments = []
        for i, request in enumerate(requests):
            if len(request) > 30_000:  # its hex would pass one argument's 128 KiB: a file
                path = os.path.join(self.root, f"request{i}.hex")
                Path(path).write_text(request.hex())
                arguments.append(f"@{path}")
            else:
                arguments.append(request.hex())
        method_names = ",".join(f"/v1beta1.DevicePlugin/{method}" for method in methods)
        cpu0 = cpu_seconds(self.process.pid)
        out = subprocess.run(
            [client, self.socket, method_names, ",".join(arguments), str(calls), "1", str(warmup)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        cpu = (cpu_seconds(self.process.pid) - cpu0) / (calls + warmup)
        return float(out[0]), cpu


def requests(count: int):
    ids = [f"g{i}" for i in range(count)]
    random.Random(0).shuffle(ids)
    preferred = gp.v1beta1.PreferredAllocationRequest()
    preferred.container_requests.add(available_deviceIDs=ids, allocation_size=2)
    allocate = gp.v1beta1.AllocateRequest()
    allocate.container_requests.add(devices_ids=["g0", "g1"])
    return preferred.SerializeToString(), allocate.SerializeToString()


def measure(plugin: Plugin, client: str, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """The figures this plugin's device count is measured for: name -> (p50 s, plugin CPU s per call)."""
    preferred, allocate = requests(plugin.count)
    figures = {}
    if plugin.count >= 10_000:
        # 20 warm-up calls: the first request after a device set changes orders it (gopherplug)
        figures[f"preferred {plugin.count}"] = plugin.call(
            client, ["GetPreferredAllocation"], [preferred], args.preferred_calls, 20
        )
    if plugin.count == 10_000:
        figures[f"sequence {plugin.count}"] = plugin.call(
            client, ["GetPreferredAllocation", "Allocate"], [preferred, allocate], args.preferred_calls, 20
        )
    if plugin.count <= 10_000:
        figures[f"allocate {plugin.count}"] = plugin.call(client, ["Allocate"], [allocate], args.calls, 200)
    return figures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("revisions", nargs="*", default=["tree"], help='gopherplug.py revisions; "tree": the work tree')
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000, help="Allocate calls per figure")
    parser.add_argument("--preferred-calls", type=int, default=30, help="GetPreferredAllocation calls per figure")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="device counts, comma-separated")
    parser.add_argument("--log-level", default="", help="gopherplug's --log-level (default: serve's own default)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="gpsbs-", dir="/tmp")
    try:
        go_plugin, why_not = build_go_program(root, "go_plugin")
        client, why_not_client = build_go_program(root, "grpc_go_client")
        if go_plugin is None or client is None:
            sys.exit(f"cannot build the Go programs: {why_not or why_not_client}")
        modules = {
            rev: Path(rev[len("zipapp=") :]).resolve()
            if rev.startswith("zipapp=")
            else revision_module(rev, os.path.join(root, f"rev-{i}"))
            for i, rev in enumerate(args.revisions)
        }
        level = args.log_level or "serve's default"
        print(
            f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, Python {sys.version.split()[0]}, "
            f"{subprocess.run(['go', 'version'], capture_output=True, text=True).stdout.strip()}; "
            f"gopherplug log level: {level}"
        )
        for round_number in range(1, args.rounds + 1):
            results: dict[str, dict[str, tuple[float, float]]] = {}
            for what in [*GO, *args.revisions]:
                results[what] = {}
                for count in map(int, args.sizes.split(",")):
                    plugin = Plugin(root, what, count, go_plugin, modules, args.log_level)
                    try:
                        results[what].update(measure(plugin, client, args))
                    finally:
                        plugin.close()
            report(round_number, results, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(round_number: int, results: dict[str, dict[str, tuple[float, float]]], args: argparse.Namespace) -> None:
    print(f"\nround {round_number} (load {os.getloadavg()[0]:.1f}): p50 from grpc-go, 1 caller; plugin CPU per call")
    names = list(results)
    print("| figure | target | " + " | ".join(names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    for figure in results["go"]:
        go_p50, go_cpu = results["go"][figure]
        cells = []
        logging_p50 = results["go-log"][figure][0]
        for what in names:
            p50, cpu = results[what][figure]
            ratio = ""
            if what not in GO:  # to go's, then to go-log's p50
                ratio = f" (x{p50 / go_p50:.1f}, x{p50 / logging_p50:.1f} go-log; CPU x{cpu / go_cpu:.1f})"
            cells.append(f"{p50 * 1e3:.3f} ms, CPU {cpu * 1e3:.3f} ms{ratio}")
        target = f"≤ {TARGETS[figure.split()[0]]:g} x Go"
        print(f"| {figure} | {target} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
