"""Benchmark gopherplug's DRA driver the way the kubelet and the API server see it. Run by hand, not by CI:

    .venv/bin/python bench/bench_dra.py [--additions 50] [--claims 200] [--idle-seconds 10] [--devices 8]
        [--memory-only] [--stages] [--tls] [--plugin-dir DIR] [--python PYTHON]

The plugin runs as a real subprocess (`python -m gopherplug serve`, from bytecode, at the image's
default log level, info) on a temporary node directory. This script plays, in one trio process,
the API server (gopherplug.ApiServerSimulator, plain HTTP with a bearer token, reached through a
kubeconfig in KUBECONFIG), the kubelet's plugin watcher and DRA manager
(gopherplug.DraKubeletSimulator, which also keeps the NodeWatchResources stream open when the
plugin serves DRAResourceHealth) and, for the comparison, the device manager
(gopherplug.KubeletSimulator). It prints one line per figure:
  - idle RSS (VmRSS) and CPU over the idle window of the plugin with the same devices served
    through `api: device-plugin` only, then through `api: dra`, each once settled (registered,
    first list sent / slices written), and the difference
  - with --stages, the API client's memory step by step in a fresh process of its own (STAGES):
    its imports, KubeApi.connect, the first requests, what gc and malloc_trim give back; with
    --tls, the API server is HTTPS and the kubeconfig names its CA and a token file, as a pod's
    service account does (the client then loads that one CA, not the system's)
  - device file created -> the ResourceSlice updated on the API server (p50, p99, max), one file
    at a time, each after the last update was seen
  - NodePrepareResources of one claim, first time (the plugin GETs the ResourceClaim and writes its
    checkpoint with fsync) and again (answered from the checkpoint); NodeUnprepareResources; and an
    empty NodePrepareResources, which is what the call itself costs from here: the simulated
    kubelet opens a connection per call (gopherplug.call_unary), where the kubelet keeps one
  - where that time goes, in this process once the plugin has stopped: the plugin's API client
    (gopherplug.KubeApi) getting a claim and replacing a slice on the same simulator; its
    ClaimCheckpoint adding and removing claims one by one on the same disk; one bare fsync; the
    CDI spec written again, as it is at every device added or removed

At the end, the plugin's log lines at WARNING and above, if any (--show-log prints all of it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
import yaml

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import cpu_seconds, ms, percentile, rss_mib  # noqa: E402

import gopherplug as gp  # noqa: E402
import gopherplug_standins as standins  # noqa: E402

RESOURCE = "example.com/gopher"
DRIVER = "gopherplug.example.com"
NODE = "node-1"
POOL = f"{NODE}/{RESOURCE}"
TOKEN = "t"
WAIT = 30  # seconds: the bound of any one wait
NOTABLE = ("WARNING", "ERROR", "CRITICAL", "Traceback")


#: Run by ``--stages`` in a fresh process (cwd: the plugin's directory, KUBECONFIG: the simulator's):
#: the DRA driver's API client step by step, as serve makes it, VmRSS after each step (a line each,
#: "label<TAB>MiB"; an indented label is a part of the next total, its figure over the line before),
#: the last after the garbage is collected and glibc's free pages are returned.
STAGES = r"""
import ctypes, gc, sys

def rss():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))

def report(label):
    print(f"{label}\t{rss():.2f}", flush=True)

import gopherplug as gp
import trio
report("import gopherplug (the interpreter, the five, the module)")
if hasattr(gp, "_leave_unloaded"):  # before any of what follows imports one of them
    gp._leave_unloaded(gp.API_CLIENT_UNUSED)
import importlib.metadata
report("  importlib.metadata (httpx2's and httpcore2's version(): email.parser, zipfile...)")
import email.message, http.cookiejar, urllib.request
report("  http.cookiejar, urllib.request, email.message (httpx2's models and cookies)")
import msgspec
report("  msgspec (lightkube's models; decimal, uuid)")
import httpx2
report("  httpx2")
imports = getattr(gp, "_import_api_client", None)
if imports is not None:
    imports()
else:  # a revision before it: what its KubeApi.connect imports first
    import httpx2, lightkube, lightkube.generic_resource
report("  lightkube")
report("the API client's imports (lightkube, httpx2)")
import httpcore2
report("  httpcore2, h11 (httpx2's transport imports them)")
import ssl
ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
report("  OpenSSL's first SSL context, dropped (its one-time set-up)")
api = gp.KubeApi.connect(node_name="node-1")
report("  KubeApi.connect: the kubeconfig, the client, its SSL context")
report("KubeApi.connect (httpcore2, the SSL context, the client)")

async def requests():
    await api.get_node("node-1")
    report("first request: GET its Node (the connection, TLS)")
    items, version = await api.list_slices("node-1", "%(driver)s")
    for i in range(%(slices)d):
        await api.create_slice(%(slice)s | {"metadata": {"name": f"stage-{i}"}})
    report("LIST and CREATE ResourceSlices")
    await api.aclose()

trio.run(requests)
gc.collect()
gp._release_freed_memory()
report("then gc.collect() and malloc_trim(0)")
gc.freeze()  # every object into the permanent generation: never traversed again, nothing freed
gc.collect()
gp._release_freed_memory()
report("then gc.freeze(), gc.collect() and malloc_trim(0)")
"""


def spread(values):
    return f"p50 {ms(percentile(values, 0.5))}, p99 {ms(percentile(values, 0.99))}, max {ms(max(values))}"


def ends(values):
    """The p50 of the first and of the last tenth: whether a figure grows as the run goes on."""
    tenth = max(1, len(values) // 10)
    first, last = percentile(values[:tenth], 0.5), percentile(values[-tenth:], 0.5)
    return f"first {tenth} p50 {ms(first)}, last {tenth} p50 {ms(last)}"


def claim(name, uid, device):
    """A ResourceClaim allocated one device of this node's pool, as the API server returns it."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gopher", "exactly": {"deviceClassName": "gopher"}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gopher", "driver": DRIVER, "pool": POOL, "device": device}]}
            }
        },
    }


class Node:
    """A temporary node: device directory, kubelet directories, the simulators, the plugin process."""

    def __init__(self, devices, plugin_dir=HERE, python=sys.executable, tls=False):
        self.plugin_dir, self.python = plugin_dir, python  # whose gopherplug.py runs, and with what
        self.root = Path(tempfile.mkdtemp(prefix="gpd-", dir="/tmp"))  # short: unix socket paths
        self.devices = self.root / "dev"
        self.devices.mkdir()
        for i in range(devices):
            (self.devices / f"g{i}").touch()
        self.device_plugin_dir = self.root / "dp"
        self.device_plugin_dir.mkdir()
        self.kubelet_dir = self.root / "k"
        self.cluster = {}  # the kubeconfig's cluster, but for its server
        self.user = {"token": TOKEN}
        context = None
        if tls:  # as in a pod: HTTPS, the cluster's CA in a file of its own, the token in a file
            import ssl

            import trustme

            ca = trustme.CA()
            ca.cert_pem.write_to_path(str(self.root / "ca.crt"))
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ca.issue_cert("127.0.0.1").configure_cert(context)
            (self.root / "token").write_text(TOKEN)
            self.cluster = {"certificate-authority": str(self.root / "ca.crt")}
            self.user = {"tokenFile": str(self.root / "token")}
        self.api = standins.ApiServerSimulator(ssl_context=context, tokens={TOKEN})
        self.api.put_node(NODE, "0b6f8a5e-4c1d-4e0a-9f3b-2d7c1e9a8b01")  # its slices' owner, as on a cluster
        self.dra_kubelet = standins.DraKubeletSimulator(str(self.kubelet_dir))
        self.dp_kubelet = gp.KubeletSimulator(str(self.device_plugin_dir))
        self.plugin = None
        self.log = None
        self.health_messages = 0
        self.env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
        self.env.pop("KUBERNETES_SERVICE_HOST", None)  # KUBECONFIG's, not a pod's configuration
        self.env.update(NODE_NAME=NODE, KUBECONFIG=str(self.root / "kubeconfig"))

    async def start_servers(self, nursery):
        await nursery.start(self.api.run)
        await nursery.start(self.dra_kubelet.run)
        await nursery.start(self.dp_kubelet.run)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": self.api.url, **self.cluster}}],
            "users": [{"name": "u", "user": self.user}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
        Path(self.env["KUBECONFIG"]).write_text(yaml.safe_dump(kubeconfig))

    def config(self, api):
        resource = {"name": RESOURCE, "directory": str(self.devices), "api": api}
        top = {"device_plugin_dir": str(self.device_plugin_dir), "resources": [resource]}
        if api == "dra":
            resource["cdi"] = {"kind": "example.com/gopher", "spec_dir": str(self.root / "cdi")}
            top["dra"] = {"driver": DRIVER, "kubelet_dir": str(self.kubelet_dir)}
        path = self.root / f"config-{api}.yaml"
        path.write_text(yaml.safe_dump(top))
        return path

    async def start(self, api, log_level):
        config = self.config(api)
        gp.parse_config(config.read_text(), str(config))  # a mistake here, not in the plugin's log
        self.log = open(self.root / f"plugin-{api}.log", "wb")  # closed in stop()
        self.plugin = await trio.lowlevel.open_process(
            [self.python, "-m", "gopherplug", "serve", "--config", str(config), "--log-level", log_level],
            cwd=self.plugin_dir,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    async def stop(self):
        if self.plugin is None:
            return
        self.plugin.terminate()
        with trio.move_on_after(10) as waited:
            await self.plugin.wait()  # the trio loop serves the API server while the plugin stops
        if waited.cancelled_caught:
            self.plugin.kill()
            await self.plugin.wait()
        self.plugin = None
        self.log.close()

    def slice_devices(self):
        mine = [s for s in self.api.slices.values() if s["spec"]["pool"]["name"] == POOL]
        return {d["name"] for s in mine for d in s["spec"]["devices"]}

    async def wait_for_slices(self, predicate):
        """The time at which the API server held slices for which ``predicate(device names)`` holds."""
        with trio.fail_after(WAIT):
            while not predicate(self.slice_devices()):
                await self.api.changed.wait_touched()
        return time.perf_counter()


async def watch_health(node, *, task_status=trio.TASK_STATUS_IGNORED):
    """Keep the NodeWatchResources stream open, as the kubelet does, when the plugin serves
    DRAResourceHealth (from 16598f9); count its messages in ``node.health_messages``."""
    kubelet = node.dra_kubelet
    versions = getattr(kubelet.drivers[DRIVER], "supported_versions", ())
    if getattr(gp, "DRA_HEALTH_VERSION", None) not in versions:
        task_status.started(False)
        return
    with contextlib.suppress(gp.RPCError):  # the stream ends with the plugin
        async with kubelet.watch_health(DRIVER) as responses:
            task_status.started(True)
            async for _ in responses:
                node.health_messages += 1


async def settle_and_idle(node, label, idle_seconds):
    await trio.sleep(2)  # the last writes, watches and logs of the start are done
    pid = node.plugin.pid
    cpu0, wall0 = cpu_seconds(pid), time.perf_counter()
    await trio.sleep(idle_seconds)
    cpu, wall = cpu_seconds(pid) - cpu0, time.perf_counter() - wall0
    rss = rss_mib(pid)
    print(f"idle {idle_seconds:.0f} s, {label}: RSS {rss:.1f} MiB, CPU {cpu:.2f} s ({100 * cpu / wall:.2f} %)")
    return rss


async def memory_device_plugin(node, args):
    await node.start("device-plugin", args.log_level)
    try:
        with trio.fail_after(WAIT):
            await node.dp_kubelet.wait_until(
                lambda k: RESOURCE in k.resources and len(k.resources[RESOURCE].devices) == args.devices
            )
        return await settle_and_idle(node, "api: device-plugin", args.idle_seconds)
    finally:
        await node.stop()


async def main_async(args):
    node = Node(args.devices, args.plugin_dir, args.python, args.tls)
    try:
        async with trio.open_nursery() as nursery:
            await node.start_servers(nursery)
            print(f"machine: {os.cpu_count()} cores; the plugin: {args.python}, {args.plugin_dir / 'gopherplug.py'}")

            try:
                await figures(node, args, nursery)
            finally:
                with trio.CancelScope(shield=True):
                    await node.stop()  # while the API server still answers
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await node.stop()
        for log in sorted(node.root.glob("plugin-*.log")):
            lines = log.read_text(errors="replace").splitlines()
            shown = lines if args.show_log else [line for line in lines if any(w in line for w in NOTABLE)]
            if shown:
                print(f"--- {log.name}: {len(shown)} of {len(lines)} lines")
                print("\n".join(shown))
        shutil.rmtree(node.root, ignore_errors=True)


async def figures(node, args, nursery):
    # 3. Memory and idle CPU: the same devices through the device-plugin API, then DRA.
    rss_dp = await memory_device_plugin(node, args)
    start = time.perf_counter()
    await node.start("dra", args.log_level)
    with trio.fail_after(WAIT):
        await node.dra_kubelet.wait_until(lambda k: DRIVER in k.drivers)
    registered = time.perf_counter() - start
    if await nursery.start(watch_health, node):
        print("the simulated kubelet keeps a NodeWatchResources stream open (DRAResourceHealth)")
    wanted = {f"g{i}" for i in range(args.devices)}
    published = await node.wait_for_slices(lambda names: names == wanted) - start
    print(f"start -> DRA driver registered {ms(registered)}, slices written {ms(published)} (includes Python's start)")
    health = node.health_messages
    rss_dra = await settle_and_idle(node, "api: dra", args.idle_seconds)
    if node.health_messages:
        print(f"  NodeWatchResources messages while settling and idle: {node.health_messages - health}")
    print(f"DRA costs {rss_dra - rss_dp:+.1f} MiB of RSS over the device-plugin API alone")
    if args.stages:
        await stages(node, args)
    if args.memory_only:
        return
    await slice_latency(node, args)
    await prepare_latency(node, args)
    print(f"after all that: RSS {rss_mib(node.plugin.pid):.1f} MiB")
    await node.stop()
    await breakdown(node, args)


async def stages(node, args):
    """The API client's memory step by step, in a fresh process of its own (STAGES)."""
    (name,) = [name for name, item in node.api.slices.items() if item["spec"]["pool"]["name"] == POOL]
    item = node.api.slices[name]
    body = {key: item[key] for key in ("apiVersion", "kind", "spec")}
    script = STAGES % {"driver": DRIVER, "slices": 1, "slice": repr(body)}
    done = await trio.run_process(
        [args.python, "-c", script], cwd=args.plugin_dir, env=node.env, capture_stdout=True, check=False
    )
    last = total = None  # the previous line's figure; the previous total's (a line not indented)
    for line in done.stdout.decode().splitlines():
        label, _, mib = line.partition("\t")
        mib = float(mib)
        before = last if label.startswith(" ") else total
        print(f"  {label}: {mib:.1f} MiB" + (f" ({mib - before:+.1f})" if before is not None else ""))
        last = mib
        if not label.startswith(" "):
            total = mib
    if done.returncode:
        print(f"  the stages' process failed ({done.returncode})")


async def breakdown(node, args):
    """Where the time goes, in this process with the plugin stopped: the plugin's own API client
    (gopherplug.KubeApi, lightkube) against the same simulator, and its checkpoint on the same disk."""
    os.environ["KUBECONFIG"] = node.env["KUBECONFIG"]
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    api = gp.KubeApi.connect()
    try:
        took = []
        for i in range(args.claims):
            began = time.perf_counter()
            with trio.fail_after(WAIT):
                await api.get_claim("default", f"c{i}")
            took.append(time.perf_counter() - began)
        print(f"  KubeApi.get_claim, in-process, same simulator: {spread(took)} (n={len(took)})")
        (name,) = [name for name, item in node.api.slices.items() if item["spec"]["pool"]["name"] == POOL]
        took = []
        for _ in range(args.additions):
            item = node.api.slices[name]
            began = time.perf_counter()
            with trio.fail_after(WAIT):
                await api.replace_slice(item)
            took.append(time.perf_counter() - began)
        devices = len(node.api.slices[name]["spec"]["devices"])
        print(f"  KubeApi.replace_slice ({devices} devices), in-process: {spread(took)} (n={len(took)})")
    finally:
        await api.aclose()
    checkpoint = gp.ClaimCheckpoint(str(node.root / "ck" / "checkpoint.json"))
    device = gp.drapb.Device(
        request_names=["gopher"], pool_name=POOL, device_name="g0", cdi_device_ids=["example.com/gopher=g0"]
    )
    added, removed = [], []
    for i in range(args.claims):
        began = time.perf_counter()
        await checkpoint.add(gp.drapb.Claim(namespace="default", uid=f"uid-{i}", name=f"c{i}"), [device])
        added.append(time.perf_counter() - began)
    for i in range(args.claims):
        began = time.perf_counter()
        await checkpoint.remove(f"uid-{i}")
        removed.append(time.perf_counter() - began)
    print(
        f"  ClaimCheckpoint.add (write, fsync, rename, fsync dir), 1 to {args.claims} claims: "
        f"{spread(added)}; {ends(added)}"
    )
    print(f"  ClaimCheckpoint.remove, {args.claims} to 0 claims: {spread(removed)}; {ends(removed)}")
    fd = os.open(node.root / "fsync", os.O_WRONLY | os.O_CREAT, 0o600)
    took = []
    try:
        for _ in range(args.claims):
            began = time.perf_counter()
            os.write(fd, b"x" * 100)
            os.fsync(fd)
            took.append(time.perf_counter() - began)
    finally:
        os.close(fd)
    print(f"  one fsync of a small write on the same disk: {spread(took)}")
    # The CDI spec is written again (whole, json.dump) at every device added or removed, before
    # the devices reach the slices: the spec the plugin last wrote, written again here.
    cdi = gp.CDIConfig("example.com/gopher", str(node.root / "cdi"))
    spec = json.loads(Path(cdi.spec_file).read_text())
    took = []
    for _ in range(args.additions):
        began = time.perf_counter()
        gp.write_cdi_spec(cdi, spec)
        took.append(time.perf_counter() - began)
    print(f"  write_cdi_spec, {len(spec['devices'])} devices: {spread(took)}")


async def slice_latency(node, args):
    """1. Device file created -> the ResourceSlice updated on the API server."""
    writes = len(node.api.writes)
    seen = []
    for i in range(args.additions):
        name = f"n{i}"
        await trio.sleep(args.pause)
        began = time.perf_counter()
        (node.devices / name).touch()
        seen.append(await node.wait_for_slices(lambda names, name=name: name in names) - began)
    await trio.sleep(0.5)
    extra = len(node.api.writes) - writes - args.additions
    print(
        f"device created -> ResourceSlice updated: {spread(seen)} (n={len(seen)}, "
        f"{args.pause * 1e3:.0f} ms apart; {extra} writes more than files)"
    )


async def prepare_latency(node, args):
    """2. NodePrepareResources and NodeUnprepareResources, one claim a call."""
    kubelet = node.dra_kubelet
    claims = [(f"c{i}", f"uid-{i}") for i in range(args.claims)]
    for i, (name, uid) in enumerate(claims):
        node.api.put_claim(claim(name, uid, f"g{i % args.devices}"))

    async def timed(call, which):
        began = time.perf_counter()
        with trio.fail_after(WAIT):
            answer = await call(DRIVER, which)
        took = time.perf_counter() - began
        for uid, one in answer.claims.items():
            if one.error:
                raise RuntimeError(f"claim {uid}: {one.error}")
        return took

    for _ in range(20):  # warm up both ends of the call
        await timed(kubelet.prepare, [])
    empty = [await timed(kubelet.prepare, []) for _ in range(args.claims)]
    print(f"NodePrepareResources, no claim (the call's own cost from here): {spread(empty)} (n={len(empty)})")
    for label in ("first time (GET + checkpoint)", "again (from the checkpoint)"):
        took = [await timed(kubelet.prepare, [("default", uid, name)]) for name, uid in claims]
        print(f"NodePrepareResources, 1 claim, {label}: {spread(took)} (n={len(took)}; {ends(took)})")
    size = (node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json").stat().st_size
    took = [await timed(kubelet.unprepare, [("default", uid, name)]) for name, uid in claims]
    print(
        f"NodeUnprepareResources, 1 claim: {spread(took)} (n={len(took)}; {ends(took)}; "
        f"checkpoint {size / 1024:.0f} KiB with {args.claims} claims)"
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--additions", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.02, help="seconds between two device files")
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--idle-seconds", type=float, default=10)
    parser.add_argument("--log-level", default="info", help="the plugin's (default info, as the image runs it)")
    parser.add_argument("--show-log", action="store_true", help="print the plugin's whole log at the end")
    parser.add_argument("--memory-only", action="store_true", help="stop after the memory figures")
    parser.add_argument(
        "--stages", action="store_true", help="then the API client's memory step by step, in a fresh process"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="the API server over HTTPS, its CA and the token in files as a pod's (default: plain HTTP, a token)",
    )
    parser.add_argument(
        "--plugin-dir",
        type=Path,
        default=HERE,
        help="the directory whose gopherplug.py the plugin runs (default: this checkout's)",
    )
    parser.add_argument("--python", default=sys.executable, help="the plugin's interpreter (default: this one)")
    args = parser.parse_args()
    # Run as the image runs it: imported, from bytecode.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([args.python, "-m", "compileall", "-q", str(args.plugin_dir / "gopherplug.py")], check=True, env=env)
    trio.run(main_async, args)


if __name__ == "__main__":
    main()
