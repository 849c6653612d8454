"""Benchmark gopherplug the way the kubelet sees it. Run by hand, not by CI:

    .venv/bin/python bench/bench_gopherplug.py [--idle-seconds 30]

The plugin runs as a real subprocess (`python -m gopherplug serve`) on a temporary node directory. This
script plays the kubelet with grpcio (C core, like the kubelet's grpc-go): a Registration server on
kubelet.sock that dials the plugin back inside Register and keeps a ListAndWatch stream open, plus
Allocate callers. It prints one line per figure: device added -> update seen; kubelet restart ->
re-registered with a fresh list; unary and Allocate latency at concurrency 1 and 4; idle RSS and CPU.

grpcio's Python layer costs the caller about 0.5 ms per call, which a latency measured from Python
counts as the plugin's. The kubelet calls with grpc-go, so when a Go toolchain and grpc-go are at
hand (Debian: `apt-get install golang-go golang-google-grpc-dev`), Allocate is also timed from
`grpc_go_client.go`, built into a temporary directory; without them those lines say "skipped".

With ``--zipapp PYZ`` the plugin is the one-file build (.ci/zipapp): `python PYZ serve`.
"""

from __future__ import annotations

import argparse
import os
import py_compile
import queue
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

GO_SOURCES = "/usr/share/gocode"  # where Debian's golang-*-dev packages put Go libraries

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
import gopherplug as gp  # noqa: E402

RESOURCE = "example.com/gopher"


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ms(seconds):
    return f"{seconds * 1e3:.2f} ms"


class Kubelet:
    """A grpcio Registration server that dials back and streams ListAndWatch into a queue."""

    def __init__(self, plugin_dir):
        self.plugin_dir = plugin_dir
        self.updates: queue.Queue = queue.Queue()  # (arrival time, set of IDs)
        self.registered: queue.Queue = queue.Queue()  # (time, endpoint)
        self.server = None
        self.streams = []

    def start(self):
        handler = grpc.method_handlers_generic_handler(
            "v1beta1.Registration",
            {
                "Register": grpc.unary_unary_rpc_method_handler(
                    self._register,
                    request_deserializer=gp.v1beta1.RegisterRequest.FromString,
                    response_serializer=gp.v1beta1.Empty.SerializeToString,
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers([handler])
        self.server.add_insecure_port(f"unix:{os.path.join(self.plugin_dir, gp.KUBELET_SOCKET)}")
        self.server.start()

    def stop(self):
        for call, channel in self.streams:
            call.cancel()
            channel.close()
        self.streams.clear()
        self.server.stop(None).wait()

    def wipe(self):
        for entry in os.scandir(self.plugin_dir):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                os.unlink(entry.path)

    def _register(self, request, context):
        channel = grpc.insecure_channel(f"unix:{os.path.join(self.plugin_dir, request.endpoint)}")
        channel.unary_unary(
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            request_serializer=gp.v1beta1.Empty.SerializeToString,
            response_deserializer=gp.v1beta1.DevicePluginOptions.FromString,
        )(gp.v1beta1.Empty(), timeout=10)
        call = channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch",
            request_serializer=gp.v1beta1.Empty.SerializeToString,
            response_deserializer=gp.v1beta1.ListAndWatchResponse.FromString,
        )(gp.v1beta1.Empty())
        self.streams.append((call, channel))
        threading.Thread(target=self._read, args=(call,), daemon=True).start()
        self.registered.put((time.perf_counter(), request.endpoint))
        return gp.v1beta1.Empty()

    def _read(self, call):
        try:
            for response in call:
                self.updates.put((time.perf_counter(), {d.ID for d in response.devices}))
        except grpc.RpcError:
            pass

    def wait_for(self, predicate, timeout=10):
        deadline = time.perf_counter() + timeout
        while True:
            arrived, ids = self.updates.get(timeout=max(0.001, deadline - time.perf_counter()))
            if predicate(ids):
                return arrived


def end_run(plugin, kubelet, root):
    """Stop a measured run: the plugin (a Popen, or None if it never started) with SIGTERM, its
    simulated kubelet, and the run's temporary directory."""
    if plugin is not None:
        plugin.terminate()
        plugin.wait(30)
    kubelet.stop()
    shutil.rmtree(root, ignore_errors=True)


def cpu_seconds(pid):
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def revision_module(rev, directory, bytecode=True):
    """gopherplug.py as git revision ``rev`` has it ("tree": the work tree's), alone in ``directory``
    (made here), compiled to bytecode as the images ship it unless ``bytecode`` is false; its path."""
    if rev == "tree":
        text = (HERE / "gopherplug.py").read_text()
    else:
        show = ["git", "show", f"{rev}:gopherplug.py"]
        text = subprocess.run(show, cwd=HERE, capture_output=True, text=True, check=True).stdout
    module = Path(directory) / "gopherplug.py"
    module.parent.mkdir(parents=True, exist_ok=True)
    module.write_text(text)
    if bytecode:
        cached = module.parent / "__pycache__" / f"gopherplug.{sys.implementation.cache_tag}.pyc"
        py_compile.compile(str(module), cfile=str(cached))
    return module


def rss_mib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def unary_latency(stub, request, calls, concurrency):
    latencies = []
    lock = threading.Lock()

    def worker(count):
        mine = []
        for _ in range(count):
            start = time.perf_counter()
            stub(request, timeout=10)
            mine.append(time.perf_counter() - start)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, args=(calls // concurrency,)) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return percentile(latencies, 0.5), percentile(latencies, 0.99), len(latencies) / elapsed


def build_go_client(root):
    """Build grpc_go_client.go (GOPATH mode, Debian's grpc-go); return its path, or why not."""
    return build_go_program(root, "grpc_go_client")


def build_go_program(root, name):
    """Build bench/NAME.go into ``root`` (GOPATH mode, Debian's grpc-go); return its path, or why not."""
    if shutil.which("go") is None or not os.path.isdir(os.path.join(GO_SOURCES, "src/google.golang.org/grpc")):
        return None, "no go toolchain or grpc-go sources (apt-get install golang-go golang-google-grpc-dev)"
    binary = os.path.join(root, name)
    env = dict(os.environ, GO111MODULE="off", GOPATH=GO_SOURCES, GOCACHE=os.path.join(root, "gocache"))
    built = subprocess.run(
        ["go", "build", "-o", binary, str(HERE / "bench" / f"{name}.go")],
        env=env,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        return None, f"go build failed: {built.stderr.strip().splitlines()[-1]}"
    return binary, None


def go_latency(binary, endpoint, request, calls, concurrency):
    out = subprocess.run(
        [
            binary,
            endpoint,
            "/v1beta1.DevicePlugin/Allocate",
            request.SerializeToString().hex(),
            str(calls),
            str(concurrency),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), float(out[2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-seconds", type=float, default=30)
    parser.add_argument("--additions", type=int, default=200)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--zipapp", help="serve from this one-file build (.ci/zipapp)")
    parser.add_argument(
        "--dev-root",
        action="store_true",
        help="dev_root: the run's directory, so that Allocate examines the devices on the event loop "
        "(as in /dev); without it, in a worker thread (as anywhere a mount may hang)",
    )
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="gpb-", dir="/tmp")
    plugin_dir, devices = os.path.join(root, "dp"), os.path.join(root, "dev")
    os.mkdir(plugin_dir)
    os.mkdir(devices)
    for i in range(4):
        Path(devices, f"g{i}").touch()
    config = Path(root, "config.yaml")
    dev_root = f"dev_root: {root}\n" if args.dev_root else ""
    config.write_text(
        f"device_plugin_dir: {plugin_dir}\n{dev_root}resources:\n  - name: {RESOURCE}\n    directory: {devices}\n"
    )
    kubelet = Kubelet(plugin_dir)
    kubelet.start()
    # Run as the image runs it: imported, from bytecode. (`python gopherplug.py` compiles the
    # module at every start, which leaves about 3 MB more in RSS.)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE / "gopherplug.py")], check=True, env=env)
    start = [os.path.abspath(args.zipapp)] if args.zipapp else ["-m", "gopherplug"]
    plugin = subprocess.Popen(
        [sys.executable, *start, "serve", "--config", str(config), "--log-level", "warning"],
        cwd=HERE,
        env=env,
    )
    try:
        kubelet.registered.get(timeout=30)
        kubelet.wait_for(lambda ids: len(ids) == 4)
        print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, gopherplug {gp.__version__}")

        # 1. Device added -> ListAndWatch update seen by the kubelet: isolated additions (20 ms
        # apart, as devices appear on a node), then back to back (each as soon as the last is
        # seen), where the plugin's 10 ms minimum between two messages of a stream shows.
        for label, pause in (("isolated", 0.02), ("back to back", 0)):
            seen = []
            for i in range(args.additions):
                name = f"n{label[0]}{i}"
                time.sleep(pause)
                start = time.perf_counter()
                Path(devices, name).touch()
                seen.append(kubelet.wait_for(lambda ids, name=name: name in ids) - start)
            print(
                f"device added ({label}) -> update seen: p50 {ms(percentile(seen, 0.5))}, "
                f"p99 {ms(percentile(seen, 0.99))} (n={len(seen)})"
            )

        # 2. Kubelet restart -> re-registered and a fresh list received.
        took = []
        for _ in range(args.restarts):
            kubelet.stop()
            while not kubelet.registered.empty():
                kubelet.registered.get()
            kubelet.wipe()
            kubelet.updates = queue.Queue()
            start = time.perf_counter()
            kubelet.start()
            kubelet.registered.get(timeout=30)
            took.append(kubelet.wait_for(lambda ids: len(ids) == 4 + 2 * args.additions) - start)
        print(
            f"kubelet restart -> re-registered, fresh list: p50 {ms(percentile(took, 0.5))}, "
            f"max {ms(max(took))} (n={len(took)})"
        )

        # 3. Unary and Allocate latency, from grpcio like the kubelet's grpc-go, one connection.
        endpoint = next(os.path.join(plugin_dir, n) for n in os.listdir(plugin_dir) if n.startswith("gopherplug-"))
        channel = grpc.insecure_channel(f"unix:{endpoint}")
        options = channel.unary_unary(
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            request_serializer=gp.v1beta1.Empty.SerializeToString,
            response_deserializer=gp.v1beta1.DevicePluginOptions.FromString,
        )
        allocate = channel.unary_unary(
            "/v1beta1.DevicePlugin/Allocate",
            request_serializer=gp.v1beta1.AllocateRequest.SerializeToString,
            response_deserializer=gp.v1beta1.AllocateResponse.FromString,
        )
        request = gp.v1beta1.AllocateRequest(
            container_requests=[gp.v1beta1.ContainerAllocateRequest(devices_ids=["g0", "g1"])]
        )
        unary_latency(options, gp.v1beta1.Empty(), 200, 1)  # warm up
        p50, p99, rate = unary_latency(options, gp.v1beta1.Empty(), args.calls, 1)
        print(f"GetDevicePluginOptions round trip, 1 caller: p50 {ms(p50)}, p99 {ms(p99)}, {rate:.0f} calls/s")
        for concurrency in (1, 4):
            p50, p99, rate = unary_latency(allocate, request, args.calls, concurrency)
            print(f"Allocate from grpcio, {concurrency} caller(s): p50 {ms(p50)}, p99 {ms(p99)}, {rate:.0f} calls/s")
        channel.close()
        go_client, why_not = build_go_client(root)
        for concurrency in (1, 4):
            if go_client is None:
                print(f"Allocate from grpc-go, {concurrency} caller(s): skipped: {why_not}")
                continue
            p50, p99, rate = go_latency(go_client, endpoint, request, args.calls, concurrency)
            print(f"Allocate from grpc-go, {concurrency} caller(s): p50 {ms(p50)}, p99 {ms(p99)}, {rate:.0f} calls/s")

        # 4. Idle: no device changes, the kubelet's stream open.
        time.sleep(1)  # let the last calls' work settle before the idle window
        cpu0, wall0 = cpu_seconds(plugin.pid), time.perf_counter()
        time.sleep(args.idle_seconds)
        cpu = cpu_seconds(plugin.pid) - cpu0
        print(
            f"idle {args.idle_seconds:.0f} s: RSS {rss_mib(plugin.pid):.1f} MiB, CPU {cpu:.2f} s "
            f"({100 * cpu / (time.perf_counter() - wall0):.2f} %)"
        )
    finally:
        end_run(plugin, kubelet, root)


if __name__ == "__main__":
    main()
