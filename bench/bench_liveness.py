"""The liveness check's cost, old (exec probe) against new (httpGet of the running plugin). By hand:

    .venv/bin/python bench/bench_liveness.py [--resources 3] [--devices 8] [--execs 10] [--gets 2000]

One plugin process (`python -m gopherplug serve`, from bytecode as the images run it) serves
``--resources`` resources of ``--devices`` files each, with health_address on loopback; the kubelet is
bench_gopherplug's grpcio Registration server (it dials back and keeps a ListAndWatch stream per
resource, as the kubelet does). Then:

  - old: ``--execs`` runs of `python -m gopherplug probe --config FILE`, what the exec probe ran in
    the container every period: each child's CPU (user + system, from wait4()) and peak RSS (its
    VmHWM, which it reports at exit), all of it beyond the plugin's own (a second process in the
    pod's cgroup);
  - new: ``--gets`` GETs of /healthz as the kubelet's prober makes them (a TCP connection each,
    HTTP/1.1, Connection: close): the plugin's own CPU over them (/proc/PID/stat) divided by their
    count, and its RSS before and after; the client's round trip p50;
  - both as millicores at the manifests' period (30 s): CPU per check / period;
  - how soon the check fails once the kubelet goes: its kubelet.sock and every plugin socket removed
    (a restarting kubelet's wipe, before its new socket), then GETs until the first 503.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import Kubelet, cpu_seconds, ms, percentile, rss_mib  # noqa: E402

import gopherplug as gp  # noqa: E402

PERIOD = 30.0  # the manifests' periodSeconds

#: `python -m gopherplug probe --config FILE`, reporting its own peak RSS (VmHWM) on stderr at exit.
#: Not wait4()'s ru_maxrss: Linux keeps the larger of the forked image's and the program's, and the
#: forked image is this benchmark (grpcio and all), not what the kubelet's exec would start.
PROBE_REPORTING_PEAK = """
import runpy, sys
sys.argv = ["gopherplug", "probe", "--config", sys.argv[1]]
try:
    runpy.run_module("gopherplug", run_name="__main__", alter_sys=True)
finally:
    peak = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
    sys.stderr.write(peak[0])
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(port: int, path: str = "/healthz") -> tuple[int, bytes]:
    """One GET as the kubelet's prober sends it; (status code, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUser-Agent: kube-probe/1.34\r\nAccept: */*\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        answer = b""
        while chunk := connection.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resources", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--execs", type=int, default=10)
    parser.add_argument("--gets", type=int, default=2000)
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="gpl-", dir="/tmp")
    plugin_dir = os.path.join(root, "dp")
    os.mkdir(plugin_dir)
    port = free_port()
    lines = [f"device_plugin_dir: {plugin_dir}", f'health_address: "127.0.0.1:{port}"', "resources:"]
    for r in range(args.resources):
        directory = os.path.join(root, f"dev{r}")
        os.mkdir(directory)
        for d in range(args.devices):
            Path(directory, f"g{d}").touch()
        lines += [f"  - name: example.com/gopher{r}", f"    directory: {directory}"]
    config = os.path.join(root, "config.yaml")
    Path(config).write_text("\n".join(lines) + "\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(HERE / "gopherplug.py")], check=True, env=env)
    kubelet = Kubelet(plugin_dir)
    kubelet.start()
    plugin = subprocess.Popen(
        [sys.executable, "-m", "gopherplug", "serve", "--config", config, "--log-level", "warning"], cwd=HERE, env=env
    )
    try:
        for _ in range(args.resources):
            kubelet.registered.get(timeout=30)
        deadline = time.monotonic() + 30
        while True:  # registered and streaming: the check passes (a bench may poll)
            try:
                if get(port)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the plugin's /healthz never answered 200")
            time.sleep(0.01)
        own_rss = rss_mib(plugin.pid)

        # Old: the exec probe, a second process each time.
        cpu, peak, wall = [], [], []
        for _ in range(args.execs):
            started = time.perf_counter()
            child = subprocess.Popen(
                [sys.executable, "-c", PROBE_REPORTING_PEAK, config],
                cwd=HERE,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            _, status, usage = os.wait4(child.pid, 0)
            wall.append(time.perf_counter() - started)
            said = child.stderr.read().decode()
            child.stderr.close()
            assert os.waitstatus_to_exitcode(status) == 0, f"gopherplug probe failed: {said}"
            cpu.append(usage.ru_utime + usage.ru_stime)
            peak.append(int(said.split("VmHWM:")[1].split()[0]) / 1024)
        old_cpu = statistics.median(cpu)
        print(
            f"old: exec `gopherplug probe`, {args.resources} resources, median of {args.execs}: CPU "
            f"{old_cpu * 1e3:.0f} ms a check, peak RSS {statistics.median(peak):.1f} MiB beyond the plugin's "
            f"{own_rss:.1f} MiB, wall {ms(statistics.median(wall))}; {old_cpu / PERIOD * 1e3:.1f} millicores "
            f"at a {PERIOD:.0f} s period"
        )

        # New: GET /healthz of the running plugin.
        rss_before, cpu_before = rss_mib(plugin.pid), cpu_seconds(plugin.pid)
        trips = []
        for _ in range(args.gets):
            started = time.perf_counter()
            code, _ = get(port)
            trips.append(time.perf_counter() - started)
            assert code == 200
        per_check = (cpu_seconds(plugin.pid) - cpu_before) / args.gets
        rss_after = rss_mib(plugin.pid)
        print(
            f"new: GET /healthz, {args.resources} resources, {args.gets} checks: the plugin's CPU "
            f"{per_check * 1e3:.3f} ms a check, RSS {rss_before:.1f} -> {rss_after:.1f} MiB "
            f"(+{rss_after - rss_before:.1f}); round trip p50 {ms(percentile(trips, 0.5))}, "
            f"p99 {ms(percentile(trips, 0.99))}; {per_check / PERIOD * 1e3:.4f} millicores at a {PERIOD:.0f} s period"
        )

        # The kubelet goes (a restart's wipe, before its new socket): how soon does the check fail?
        started = time.perf_counter()
        kubelet.stop()
        kubelet.wipe()
        for name in os.listdir(plugin_dir):
            if name == gp.KUBELET_SOCKET:
                os.unlink(os.path.join(plugin_dir, name))
        while (answer := get(port))[0] != 503:
            pass
        print(
            f"kubelet gone (sockets wiped) -> first 503: {ms(time.perf_counter() - started)}; it said: "
            + " | ".join(answer[1].decode().strip().splitlines())
        )
    finally:
        plugin.terminate()
        plugin.wait(10)
        kubelet.server.stop(None)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
