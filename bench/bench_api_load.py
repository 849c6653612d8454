"""What one DRA driver asks of the API server, by phase, and what that makes for a fleet. Run by hand:

    .venv/bin/python bench/bench_api_load.py [--timeout 2] [--idle-hours 10] [--nodes 5000]

The driver (gopherplug.serve_plugin with its KubeApi, in this process) runs against the API server
stand-in (gopherplug_standins.ApiServerSimulator, plain HTTP with a bearer token, through a
kubeconfig) and the DRA kubelet stand-in, on a temporary node directory with one resource of 4
devices. The stand-in counts every request by verb, resource and user agent, as the real one's
audit log and apiserver_request_total do; each phase's count is the difference across it:

  start         the driver starts: lists, watches, slices written
  idle          --idle-hours simulated hours with nothing happening: only the watches' ends
  device        a device file created, then removed: the slices follow
  wipe          the kubelet's wipe: this node's slices deleted (a kubelet restart), written again
  apiserver     the API server restarts: every watch cut, its history gone (410 on resume)
  driver        the driver restarts (a rolling update): a new client, lists and watches
  held          the Node's allocatable counts the resource (a device plugin serves it), then 0

Time is scaled for the idle hours, which run last. The real API server ends a watch that asks for
no timeoutSeconds after a random time between --min-request-timeout (1800 s by default) and twice
that; for the idle phase the stand-in does so with --timeout seconds instead (its
min_request_timeout), so one second here stands for 1800 / --timeout seconds, and an idle hour
takes 2 x --timeout seconds. Bookmarks (every minute on a real server) come every --timeout / 10 s,
and the driver's quiet bound (3 minutes, a dead connection) is --timeout / 2 s: both only need to
lie between this machine's stalls and the timeout, and neither is a request. The other phases run
before, with watches that do not end by themselves (an hour each), so that their counts are theirs
alone. Nothing else in the driver is timed: no periodic list, no Node read, no token request (a
token file is read from disk).

It prints one line per phase as it goes, then the table bench/RESULTS.md has.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio
import yaml

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

import gopherplug as gp  # noqa: E402
import gopherplug_standins as standins  # noqa: E402

RESOURCE = "example.com/gopher"
DRIVER = "gopherplug.example.com"
NODE = "node-1"
NODE_UID = "0b6f8a5e-4c1d-4e0a-9f3b-2d7c1e9a8b01"
POOL = f"{NODE}/{RESOURCE}"
TOKEN = "t"
WAIT = 60  # seconds: the bound of any one wait
#: The real API server's --min-request-timeout by default, which --timeout stands for.
REAL_TIMEOUT = standins.MIN_REQUEST_TIMEOUT


class Node:
    """A temporary node: a device directory, the kubelet's, the stand-ins, the driver in this process."""

    def __init__(self, devices):
        self.root = Path(tempfile.mkdtemp(prefix="gpl-", dir="/tmp"))  # short: unix socket paths
        self.devices = self.root / "dev"
        self.devices.mkdir()
        for i in range(devices):
            (self.devices / f"g{i}").touch()
        self.kubelet_dir = self.root / "k"
        self.api = standins.ApiServerSimulator(tokens={TOKEN})
        self.api.put_node(NODE, NODE_UID, allocatable={"cpu": "4"})
        self.kubelet = standins.DraKubeletSimulator(
            str(self.kubelet_dir), wipe=lambda driver: self.api.delete_node_slices(NODE, driver)
        )
        self.kubeconfig = self.root / "kubeconfig"
        self.scope = None
        self.client = None

    async def start_servers(self, nursery):
        self.nursery = nursery
        await nursery.start(self.api.run)
        await nursery.start(self.kubelet.run)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": {"server": self.api.url}}],
            "users": [{"name": "u", "user": {"token": TOKEN}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig))

    def config(self):
        resource = {"name": RESOURCE, "directory": str(self.devices), "api": "dra"}
        resource["cdi"] = {"kind": "example.com/gopher", "spec_dir": str(self.root / "cdi")}
        top = {"device_plugin_dir": str(self.root / "dp"), "resources": [resource]}
        top["dra"] = {"driver": DRIVER, "kubelet_dir": str(self.kubelet_dir)}
        return gp.parse_config(yaml.safe_dump(top), "bench")

    async def start(self):
        """Start the driver, with a new client (a new pod's); returns once it serves."""
        self.client = gp.KubeApi.connect(kubeconfig=str(self.kubeconfig), node_name=NODE)
        self.scope = trio.CancelScope()
        config = self.config()

        async def run(task_status):
            with self.scope:
                await gp.serve_plugin(config, node_name=NODE, api=self.client, task_status=task_status)

        await self.nursery.start(run)

    async def stop(self):
        self.scope.cancel()
        await self.client.aclose()

    def slice_devices(self):
        mine = [s for s in self.api.slices.values() if s["spec"]["pool"]["name"] == POOL]
        return sorted(d["name"] for s in mine for d in s["spec"]["devices"])

    async def until(self, predicate):
        with trio.fail_after(WAIT):
            while not predicate():
                await self.api.changed.wait_touched()

    def watching(self, since):
        """Whether both watches (slices, Node) were opened since the count ``since`` and are open:
        one more watch request of each than a list and a 410 of it would explain."""
        counts = self.counts()
        return all(counts[("watch", r)] > since[("watch", r)] for r in ("resourceslices", "nodes"))

    def counts(self):
        """Requests so far by (verb, resource), the driver's only (its user agent)."""
        agent = gp.user_agent(NODE)
        counted = collections.Counter()
        for (verb, resource, who), number in self.api.requests.items():
            if who == agent:
                counted[verb, resource] += number
        return counted


async def settle(node, seconds):
    """Let the driver finish what a phase started (writes, a watch opened again): nothing in it
    waits on a timer shorter than this but the watches' ends, which the idle phase counts."""
    await trio.sleep(seconds)


async def run(args):
    phases = []  # (name, what happened, Counter of (verb, resource))
    node = Node(4)
    gp.DRA_WATCH_QUIET_SECONDS = args.timeout / 2
    node.api.min_request_timeout = 3600.0  # until the idle phase: watches the events do not end
    node.api.bookmark_seconds = args.timeout / 10
    settle_seconds = min(0.5, args.timeout / 4)
    try:
        async with trio.open_nursery() as nursery:
            await node.start_servers(nursery)
            devices = node.slice_devices

            async def phase(name, what, action, done):
                before = node.counts()
                began = time.perf_counter()
                await action()
                await node.until(done)
                await settle(node, settle_seconds)
                took = time.perf_counter() - began
                phases.append((name, what, node.counts() - before, took))
                print(f"{name:10} {took:7.2f} s  {dict(phases[-1][2])}", flush=True)

            start_counts = node.counts()
            await phase(
                "start",
                "the driver starts, lists, watches, writes its slices",
                node.start,
                lambda: devices() == ["g0", "g1", "g2", "g3"] and node.watching(start_counts),
            )

            async def add():
                (node.devices / "g4").touch()
                await node.until(lambda: "g4" in devices())
                (node.devices / "g4").unlink()

            await phase("device", "a device added, then removed", add, lambda: "g4" not in devices())

            async def wipe():
                node.api.delete_node_slices(NODE, DRIVER)

            await phase("wipe", "the kubelet deletes this node's slices", wipe, lambda: len(devices()) == 4)

            restart_counts = {}

            async def restart():
                restart_counts.update(node.counts())
                node.api.restart()

            def relisted():
                counts = node.counts()
                return all(
                    counts[("list", r)] > restart_counts[("list", r)]
                    and counts[("watch", r)] >= restart_counts[("watch", r)] + 2
                    for r in ("resourceslices", "nodes")
                )

            await phase("apiserver", "the API server restarts (history gone)", restart, relisted)

            driver_counts = {}

            async def driver():
                await node.stop()
                driver_counts.update(node.counts())
                await node.start()

            await phase(
                "driver",
                "the driver restarts (a new pod)",
                driver,
                lambda: node.watching(driver_counts) and len(devices()) == 4,
            )

            async def held():
                node.api.put_node(NODE, NODE_UID, allocatable={"cpu": "4", RESOURCE: "1"})
                await node.until(lambda: devices() == [])
                node.api.put_node(NODE, NODE_UID, allocatable={"cpu": "4", RESOURCE: "0"})

            await phase("held", "held back (allocatable 1), then released (0)", held, lambda: len(devices()) == 4)

            # Idle: from now on the watches end as a real server's do, scaled; the open ones end now.
            node.api.min_request_timeout = args.timeout
            ended = node.counts()
            node.api.end_watches()
            await node.until(lambda: node.watching(ended))
            idle_seconds = args.idle_hours * 3600 / REAL_TIMEOUT * args.timeout

            async def idle():
                await trio.sleep(idle_seconds)

            await phase(
                "idle",
                f"{args.idle_hours:g} simulated hours with nothing happening",
                idle,
                lambda: True,
            )

            await node.stop()
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(node.root, ignore_errors=True)
    return phases


def describe(counter):
    """'2 watch nodes, 1 list resourceslices' style, in a fixed order."""
    order = ["get", "list", "watch", "create", "update", "patch", "delete"]
    parts = sorted(counter.items(), key=lambda kv: (order.index(kv[0][0]) if kv[0][0] in order else 9, kv[0][1]))
    return ", ".join(f"{n} {verb} {resource}" for (verb, resource), n in parts if n) or "none"


def report(args, phases):
    rows = []
    order = ["start", "idle", "device", "wipe", "apiserver", "driver", "held"]
    for name, what, counter, took in sorted(phases, key=lambda phase: order.index(phase[0])):
        total = sum(counter.values())
        if name == "idle":
            hours = took * REAL_TIMEOUT / args.timeout / 3600  # as measured: the wait and its settling
            per_hour = total / hours
            what = f"{hours:.1f} simulated hours with nothing happening"
            fleet = per_hour * args.nodes / 3600
            rows.append(
                (
                    name,
                    what,
                    describe(counter),
                    f"{total} ({per_hour:.2f} per node per hour)",
                    f"{fleet:.2f} requests/s, steady",
                )
            )
        else:
            rows.append((name, what, describe(counter), str(total), f"{total * args.nodes:,} requests once"))
    lines = [
        "| phase | what happens | requests of one node (verb resource) | total | 5,000 nodes |"
        if args.nodes == 5000
        else f"| phase | what happens | requests of one node (verb resource) | total | {args.nodes:,} nodes |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=2.0, help="the stand-in's min-request-timeout, seconds")
    parser.add_argument("--idle-hours", type=float, default=10.0, help="simulated idle hours")
    parser.add_argument("--nodes", type=int, default=5000, help="the fleet to project to")
    args = parser.parse_args(argv)
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    phases = trio.run(run, args)
    lines = report(args, phases)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
