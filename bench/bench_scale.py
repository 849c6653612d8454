"""Scale benchmark: large directories, bursts and many resources, as the kubelet sees them. By hand:

    .venv/bin/python bench/bench_scale.py [--sizes 10000 50000] [--burst 5000] [--resources 10]
        [--preferred-sizes 1 100 1000 50000] (none: skip that figure)
        [--grpc-preferred 10000 50000] [--grpc-calls 50] [--preferred-only]

The plugin runs as a subprocess (`python -m gopherplug serve`, from bytecode); the kubelet is
bench_gopherplug's grpcio Registration server, which dials back and reads ListAndWatch (grpcio's
receive limit is 4 MiB per message, like the kubelet's). It prints one line per figure:
  - N entries: start -> first full list at the kubelet; one entry added -> update seen (p50, p99);
    the size of the ListAndWatch message
  - a burst of B files created then deleted in one go: the final list exact or not, messages sent
  - R resources in one process: registrations, idle CPU over the idle window, RSS
  - GetPreferredAllocation over 50,000 offered IDs, in-process (no gRPC): the median time of
    gp.preferred_allocation_response per allocation size, for replicas packed and spread, plain
    devices on two NUMA nodes and without topology; and the same with the order the service keeps
    per device set (gp._PreferredOrder, its making timed alone). Everything else on the plugin's
    one event loop waits this long.
  - the kubelet's sequence over gRPC at 10,000 and 50,000 plain devices (--grpc-preferred): every
    ID available to GetPreferredAllocation for a pod that wants 2, then Allocate of those, from
    grpcio and, when grpc_go_client.go builds, from grpc-go (the kubelet's library).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import trio

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import Kubelet, build_go_client, cpu_seconds, end_run, ms, percentile, rss_mib  # noqa: E402

import gopherplug as gp  # noqa: E402

RESOURCE = "example.com/gopher"


class Node:
    """A temporary node: the kubelet's directory, device directories, a config, the plugin process."""

    def __init__(self, resources):
        self.root = tempfile.mkdtemp(prefix="gps-", dir="/tmp")
        self.plugin_dir = os.path.join(self.root, "dp")
        os.mkdir(self.plugin_dir)
        self.dirs = {}
        lines = [f"device_plugin_dir: {self.plugin_dir}", "resources:"]
        for i in range(resources):
            name = RESOURCE if i == 0 else f"example.com/gopher{i}"
            self.dirs[name] = os.path.join(self.root, f"dev{i}")
            os.mkdir(self.dirs[name])
            lines += [f"  - name: {name}", f"    directory: {self.dirs[name]}"]
        self.config = os.path.join(self.root, "config.yaml")
        Path(self.config).write_text("\n".join(lines) + "\n")
        self.kubelet = Kubelet(self.plugin_dir)
        self.plugin = None

    def start(self):
        env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE / "gopherplug.py")], check=True, env=env)
        self.kubelet.start()
        started = time.perf_counter()
        self.plugin = subprocess.Popen(
            [sys.executable, "-m", "gopherplug", "serve", "--config", self.config, "--log-level", "warning"],
            cwd=HERE,
            env=env,
        )
        return started

    def close(self):
        end_run(self.plugin, self.kubelet, self.root)


def make_entries(directory, count, prefix="g"):
    for i in range(count):
        os.close(os.open(os.path.join(directory, f"{prefix}{i}"), os.O_CREAT | os.O_WRONLY, 0o644))


def size_of_list(count, prefix="g"):
    ids = [f"{prefix}{i}" for i in range(count)]
    message = gp.v1beta1.ListAndWatchResponse(devices=[gp.v1beta1.Device(ID=i, health=gp.HEALTHY) for i in ids])
    return message.ByteSize()


def large_directory(count, additions):
    node = Node(1)
    try:
        make_entries(node.dirs[RESOURCE], count)
        started = node.start()
        first = node.kubelet.wait_for(lambda ids: len(ids) == count, timeout=60) - started
        seen = []
        for i in range(additions):
            name = f"n{i}"
            start = time.perf_counter()
            Path(node.dirs[RESOURCE], name).touch()
            seen.append(node.kubelet.wait_for(lambda ids, name=name: name in ids, timeout=30) - start)
        size = size_of_list(count)
        print(
            f"{count} entries: start -> first full list {ms(first)} (includes starting Python); one added -> "
            f"update seen p50 {ms(percentile(seen, 0.5))}, p99 {ms(percentile(seen, 0.99))} (n={additions}); "
            f"ListAndWatch message {size / 1024:.0f} KiB; plugin RSS {rss_mib(node.plugin.pid):.1f} MiB"
        )
    finally:
        node.close()


def burst(count):
    node = Node(1)
    try:
        make_entries(node.dirs[RESOURCE], 3)
        node.start()
        node.kubelet.wait_for(lambda ids: len(ids) == 3, timeout=30)
        directory = node.dirs[RESOURCE]
        start = time.perf_counter()
        make_entries(directory, count, prefix="b")
        for i in range(count):
            os.unlink(os.path.join(directory, f"b{i}"))
        Path(directory, "last").touch()
        final = {"g0", "g1", "g2", "last"}
        messages, largest = 0, 0
        while True:
            arrived, ids = node.kubelet.updates.get(timeout=60)
            messages += 1
            largest = max(largest, len(ids))
            if ids == final:
                break
        print(
            f"burst of {count} created, {count} deleted, 1 created ({2 * count + 1} events): final list exact "
            f"{ms(arrived - start)} after the first file; {messages} ListAndWatch messages (largest {largest} devices)"
        )
    finally:
        node.close()


def many_resources(count, idle_seconds):
    node = Node(count)
    try:
        for directory in node.dirs.values():
            make_entries(directory, 4)
        node.start()
        for _ in range(count):
            node.kubelet.registered.get(timeout=30)
        time.sleep(1)  # let the start-up work settle before the idle window
        cpu0 = cpu_seconds(node.plugin.pid)
        time.sleep(idle_seconds)
        cpu = cpu_seconds(node.plugin.pid) - cpu0
        print(
            f"{count} resources in one process: {count} registered; idle {idle_seconds:.0f} s: CPU {cpu:.2f} s, "
            f"RSS {rss_mib(node.plugin.pid):.1f} MiB"
        )
    finally:
        node.close()


def preferred_allocation(sizes, runs):
    """Time gp.preferred_allocation_response in-process: 50,000 IDs offered, nothing must be included."""
    cases = []
    for policy in ("packed", "spread"):
        # 12,500 devices x 4 replicas: 50,000 IDs "g<i>::<n>", no NUMA topology.
        resource = gp.ResourceConfig(name=RESOURCE, directory="/g", env="G", replicas=4, preferred=policy)
        devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}") for i in range(12_500)}
        ids = [kubelet_id for device_id in devices for kubelet_id in resource.replica_ids(device_id)]
        cases.append((f"12,500 devices x 4 replicas, {policy}", resource, devices, ids))
    # 50,000 plain devices, alternately on NUMA node 0 and 1: a pick must skip the other node's half.
    resource = gp.ResourceConfig(name=RESOURCE, directory="/g", env="G")
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=i % 2) for i in range(50_000)}
    cases.append(("50,000 devices on 2 NUMA nodes, packed", resource, devices, list(devices)))
    # 50,000 plain devices without topology: files in a directory, the usual large resource.
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}") for i in range(50_000)}
    cases.append(("50,000 devices, no topology", resource, devices, list(devices)))
    for name, resource, devices, ids in cases:
        random.Random(0).shuffle(ids)  # the kubelet sends a Go set's unsorted list
        # The service keeps one _PreferredOrder per device set, made at the first request after a
        # change: its making is timed alone, then each request with it (None: it cannot answer).
        start = time.perf_counter()
        order = gp._PreferredOrder(resource, devices) if hasattr(gp, "_PreferredOrder") else None  # an older revision
        made = time.perf_counter() - start
        figures, with_order = [], []
        for size in sizes:
            request = gp.v1beta1.PreferredAllocationRequest()
            request.container_requests.add(available_deviceIDs=ids, allocation_size=size)
            times, ordered = [], []
            for _ in range(runs):
                start = time.perf_counter()
                answer = gp.preferred_allocation_response(resource, devices, request)
                times.append(time.perf_counter() - start)
                if order is not None:
                    start = time.perf_counter()
                    fast = gp.preferred_allocation_response(resource, devices, request, order=order)
                    ordered.append(time.perf_counter() - start)
                    assert fast == answer
            assert len(answer.container_responses[0].deviceIDs) == min(size, len(ids))
            figures.append(f"size {size}: {ms(statistics.median(times))}")
            with_order.append(f"{ms(statistics.median(ordered))}" if ordered else "-")
        print(f"GetPreferredAllocation, {len(ids)} IDs offered, {name} (median of {runs}): " + "; ".join(figures))
        if order is None:
            continue
        answers = "answers" if order.order is not None else "cannot answer, _pick does"
        print(f"  with the service's order ({answers}; made in {ms(made)}): " + " / ".join(with_order))


def preferred_over_grpc(counts, calls, go_binary=None):
    """The kubelet's sequence over gRPC against the plugin process: GetPreferredAllocation with every
    one of ``count`` plain devices available (shuffled, as the kubelet's Go set gives them) for a
    pod that wants 2, then Allocate of those 2. From grpcio (one connection, as the kubelet keeps
    one), and from grpc-go (grpc_go_client.go, the request read from a file) when it is built."""
    for count in counts:
        node = Node(1)
        try:
            make_entries(node.dirs[RESOURCE], count)
            node.start()
            node.kubelet.wait_for(lambda ids, count=count: len(ids) == count, timeout=120)
            endpoint = next(
                os.path.join(node.plugin_dir, n) for n in os.listdir(node.plugin_dir) if n.startswith("gopherplug-")
            )
            ids = [f"g{i}" for i in range(count)]
            random.Random(0).shuffle(ids)
            request = gp.v1beta1.PreferredAllocationRequest()
            request.container_requests.add(available_deviceIDs=ids, allocation_size=2)
            allocate = gp.v1beta1.AllocateRequest()
            channel = grpc.insecure_channel(f"unix:{endpoint}", options=[("grpc.max_send_message_length", 16 * 2**20)])
            prefer = channel.unary_unary(
                "/v1beta1.DevicePlugin/GetPreferredAllocation",
                request_serializer=gp.v1beta1.PreferredAllocationRequest.SerializeToString,
                response_deserializer=gp.v1beta1.PreferredAllocationResponse.FromString,
            )
            allocate_call = channel.unary_unary(
                "/v1beta1.DevicePlugin/Allocate",
                request_serializer=gp.v1beta1.AllocateRequest.SerializeToString,
                response_deserializer=gp.v1beta1.AllocateResponse.FromString,
            )
            picked = list(prefer(request, timeout=30).container_responses[0].deviceIDs)
            assert picked == ["g0", "g1"], picked
            allocate.container_requests.add(devices_ids=picked)
            cpu0 = cpu_seconds(node.plugin.pid)
            alone, sequence = [], []
            for _ in range(calls):
                start = time.perf_counter()
                prefer(request, timeout=30)
                middle = time.perf_counter()
                allocate_call(allocate, timeout=30)
                sequence.append(time.perf_counter() - start)
                alone.append(middle - start)
            cpu = (cpu_seconds(node.plugin.pid) - cpu0) / calls
            channel.close()
            line = (
                f"{count} devices, over gRPC from grpcio (n={calls}): GetPreferredAllocation p50 "
                f"{ms(percentile(alone, 0.5))}; preferred then Allocate p50 {ms(percentile(sequence, 0.5))}; "
                f"the plugin's CPU {ms(cpu)} per sequence"
            )
            if go_binary is not None:
                with tempfile.NamedTemporaryFile("w", suffix=".hex", delete=False) as file:
                    file.write(request.SerializeToString().hex())
                try:
                    p50, _, _ = go_call(go_binary, endpoint, "GetPreferredAllocation", f"@{file.name}", calls)
                finally:
                    os.unlink(file.name)
                a50, _, _ = go_call(go_binary, endpoint, "Allocate", allocate.SerializeToString().hex(), calls)
                line += f"; from grpc-go: GetPreferredAllocation p50 {ms(p50)}, Allocate p50 {ms(a50)}"
            print(line)
        finally:
            node.close()


def go_call(binary, endpoint, method, request_hex, calls):
    out = subprocess.run(
        [binary, endpoint, f"/v1beta1.DevicePlugin/{method}", request_hex, str(calls), "1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), float(out[2])


def scanning(count, runs):
    """Time in-process what a start or a rescan costs for one directory of ``count`` entries, and
    one batch of ``count`` inotify events next to ``count`` symlink devices (what watch_devices does
    with it: _SourceTracker.update, then _DeviceSet.update). Also the same ``count`` entries made
    into devices of two members each by id_pattern, and spread over two ``match`` sources."""
    root = tempfile.mkdtemp(prefix="gps-", dir="/tmp")
    try:
        plain, links, targets = (os.path.join(root, name) for name in ("plain", "links", "targets"))
        for directory in (plain, links, targets):
            os.mkdir(directory)
        make_entries(plain, count)
        for i in range(count):
            Path(targets, f"t{i}").touch()
            os.symlink(os.path.join(targets, f"t{i}"), os.path.join(links, f"l{i}"))
        # The same count of files as devices of two members each ("g12" and "g12.b" are device 12),
        # and in two directories named by two match sources.
        pairs, halves = (os.path.join(root, name) for name in ("pairs", "halves"))
        os.mkdir(pairs)
        for i in range(count // 2):
            Path(pairs, f"g{i}").touch()
            Path(pairs, f"g{i}.b").touch()
        for half in ("a", "b"):
            os.makedirs(os.path.join(halves, half))
            make_entries(os.path.join(halves, half), count // 2, prefix=half)
        cases = (  # (what, the resource's keys, devices found)
            (f"{count} files", f"directory: {plain}", count),
            (f"{count} symlinks", f"directory: {links}, allowed_host_paths: [{targets}]", count),
            (
                f"{count} files, 2 per device by id_pattern",
                f"directory: {pairs}, id_pattern: 'g(?P<id>[0-9]+)(.b)?'",
                count // 2,
            ),
            (
                f"{count} files in 2 match sources",
                f"match: [{{directory: {halves}/a}}, {{directory: {halves}/b}}]",
                count,
            ),
        )
        for name, keys, devices in cases:
            resource = gp.parse_config(f"resources: [{{name: {RESOURCE}, {keys}}}]").resources[0]
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                scan = gp.scan_directory(resource)
                times.append(time.perf_counter() - start)
            assert len(scan.devices) == devices, len(scan.devices)
            print(f"scan of {name} (median of {runs}): {ms(statistics.median(times))}")

        make_entries(links, count, prefix="f")  # files arriving next to the symlinks
        text = f"resources: [{{name: {RESOURCE}, directory: {links}, allowed_host_paths: [{targets}]}}]"
        resource = gp.parse_config(text).resources[0]

        async def update():
            device_set = gp._DeviceSet(resource, gp.Watched({}))
            with gp.DirectoryWatch(links, gp._DIRECTORY_EVENTS) as watch:
                tracker = gp._SourceTracker(resource, 0, resource.sources[0], watch, "/sys", "/dev")
                await device_set.update(await tracker.rescan())
                start = time.perf_counter()
                await device_set.update(await tracker.update([f"f{i}" for i in range(count)]))
                return time.perf_counter() - start

        print(f"one batch of {count} events next to {count} symlink devices: {ms(trio.run(update))}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[10000, 50000])
    parser.add_argument("--additions", type=int, default=20)
    parser.add_argument("--burst", type=int, default=5000)
    parser.add_argument("--resources", type=int, default=10)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument(
        "--preferred-sizes", type=int, nargs="*", default=[1, 100, 1000, 50000], help="none: skip this figure"
    )
    parser.add_argument("--preferred-runs", type=int, default=5)
    parser.add_argument(
        "--grpc-preferred", type=int, nargs="*", default=[10000, 50000], help="device counts; none: skip that figure"
    )
    parser.add_argument("--grpc-calls", type=int, default=50)
    parser.add_argument("--preferred-only", action="store_true", help="only the GetPreferredAllocation figures")
    parser.add_argument("--scan", type=int, default=20000, help="entries for the in-process scan figures; 0: skip")
    parser.add_argument("--scan-only", action="store_true", help="only the in-process scan figures")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} cores, Python {sys.version.split()[0]}, gopherplug {gp.__version__}")
    if args.scan_only:
        scanning(args.scan, 5)
        return
    if args.preferred_only:
        preferred_figures(args)
        return
    for count in args.sizes:
        large_directory(count, args.additions)
    burst(args.burst)
    many_resources(args.resources, args.idle_seconds)
    preferred_figures(args)
    if args.scan:
        scanning(args.scan, 5)


def preferred_figures(args):
    if args.preferred_sizes:
        preferred_allocation(args.preferred_sizes, args.preferred_runs)
    if args.grpc_preferred:
        root = tempfile.mkdtemp(prefix="gpgo-", dir="/tmp")
        try:
            go_binary, why_not = build_go_client(root)
            if go_binary is None:
                print(f"grpc-go figures skipped: {why_not}")
            preferred_over_grpc(args.grpc_preferred, args.grpc_calls, go_binary)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
