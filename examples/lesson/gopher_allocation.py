"""Lesson 3, allocation: what a pod may ask, and what a plugin may offer besides Allocate.

Lesson 2's plugin (gopher_plugin.py: read it first) answers the three RPCs every plugin must.
v1beta1 has two more, which the kubelet calls only if GetDevicePluginOptions asks for them, and
two fields that tell the kubelet more than an ID: a device's NUMA node and its CDI name. This
plugin serves all of it. Read it top to bottom:

  1. What a pod asks        resources.limits, integers, no overcommit: who counts, who picks
  2. TopologyInfo           each device's NUMA node, in ListAndWatch
  3. GetPreferredAllocation the plugin's say in which devices a container gets
  4. Allocate with CDI      a device named, and the spec file the container runtime reads
  5. PreStartContainer      the last look before each start of a container
  6. The demo               `python gopher_allocation.py --demo`

Exercises 1 and 2 (EXERCISES.md) are about this file; `python check.py 1` checks the first.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from typing import Any

import trio
from gopher_devices import Gopher, say
from gopher_plugin import RESOURCE, GopherPlugin, plug, said, serve

from gopherplug import KubeletSimulator, RPCError, v1beta1

# 1. What a pod asks. Gophers are an extended resource, asked for in a container's
# resources.limits (`example.com/gopher: 2`). Whole numbers only: a device does not divide, and
# the API server refuses "500m". Requests, when given, must equal limits: an extended resource
# is never overcommitted. The scheduler only counts (NodeResourcesFit: the node's allocatable,
# our healthy devices, less what its pods hold); which two gophers, the kubelet decides on the
# node as it admits the pod, with the help of everything below.

CDI_KIND = "example.com/gopher"  # the CDI device gopher1 is "example.com/gopher=gopher1"


class GopherAllocator(GopherPlugin):
    RPCS = (*GopherPlugin.RPCS, "GetPreferredAllocation", "PreStartContainer")
    cdi_dir = "/var/run/cdi"  # where containerd and CRI-O look for CDI specs
    lock_dir = "/var/lock"  # where serial programs take their UUCP locks (LCK..ttyUSB0): exercise 2

    async def GetDevicePluginOptions(self, empty: Any) -> Any:  # noqa: N802 - the RPC's name
        # Both: the kubelet may now call GetPreferredAllocation as it picks a container's devices
        # (section 3 says when), and calls PreStartContainer before each start of one with ours.
        return v1beta1.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)

    # 2. TopologyInfo. With a Topology Manager policy (the kubelet's --topology-manager-policy:
    # best-effort, restricted, single-numa-node), the kubelet asks its hint providers (the CPU,
    # memory and device managers) which NUMA nodes could serve a container and settles on one;
    # `restricted` and `single-numa-node` reject a pod that fits no one node (TopologyAffinityError).
    # It takes that node's devices first; where they are too few (`none`, `best-effort`) it adds
    # devices of other nodes, then those without topology, which fit everywhere. Unknown is said
    # by leaving it out: node 0 by default would be a claim the kubelet acts on.

    def device(self, device_id: str, gopher: Gopher) -> Any:
        device = super().device(device_id, gopher)
        if gopher.numa is not None:
            device.topology.nodes.add(ID=gopher.numa)
        return device

    # 3. GetPreferredAllocation. Per container, before Allocate, when there is a choice: of
    # available_deviceIDs (healthy, not held by a pod, of the Topology Manager's node when it
    # chose one), which allocation_size would we like? must_include_deviceIDs must be in the
    # answer (devices the container holds already, e.g. from an init container). No call when
    # those cover the request, nor when the node's devices are exactly as many as asked (the
    # kubelet takes them all); too few, and it asks about the others for the rest. It is advice:
    # the kubelet keeps what is available of it and picks any missing ones itself
    # (devicesToAllocate in kubernetes/kubernetes pkg/kubelet/cm/devicemanager/manager.go). The
    # place for what only the plugin knows: GPUs joined by NVLink, ports on one hub.

    async def GetPreferredAllocation(self, request: Any) -> Any:  # noqa: N802
        answers = [
            v1beta1.ContainerPreferredAllocationResponse(
                deviceIDs=self.prefer(
                    list(container.available_deviceIDs),
                    list(container.must_include_deviceIDs),
                    container.allocation_size,
                )
            )
            for container in request.container_requests
        ]
        return v1beta1.PreferredAllocationResponse(container_responses=answers)

    def prefer(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        # No preference yet: what must be in, then by name. (Exercise 1: keep to one NUMA node.)
        chosen = list(must_include)
        for device_id in sorted(available):
            if len(chosen) < size and device_id not in chosen:
                chosen.append(device_id)
        return chosen

    # 4. Allocate with CDI. The Container Device Interface names a device ("example.com/gopher=
    # gopher1") and leaves the how (device nodes, mounts, env, hooks) to a spec file the runtime
    # reads. The kubelet hands cdi_devices to the runtime in CreateContainer (Kubernetes 1.31:
    # DevicePluginCDIDevices); containerd 2 and CRI-O apply them, containerd 1.7 with enable_cdi.
    # A runtime without CDI ignores them: lesson 2's DeviceSpecs and env stay for it.

    def allocate_container(self, device_ids: list[str]) -> Any:
        answer = super().allocate_container(device_ids)
        # The spec before the answer: the runtime reads it at CreateContainer, which comes after.
        write_cdi_spec(self.directory, self.devices.value, self.cdi_dir)
        for device_id in device_ids:
            answer.cdi_devices.add(name=f"{CDI_KIND}={device_id}")
        return answer

    # 5. PreStartContainer. Before each start of a container that has our devices, restarts
    # included: the last moment to get a device ready (reset it, load its firmware), or to say
    # that it is not. An error does not fail the pod: this start fails (an event of reason Failed,
    # "Error: ..."; the container waits with reason CreateContainerConfigError) and the kubelet
    # tries again with its back-off. The kubelet waits 30 s at most (callPreStartContainerIfNeeded
    # in manager.go, KubeletPreStartContainerRPCTimeoutInSecs; startContainer in kuberuntime).

    async def PreStartContainer(self, request: Any) -> Any:  # noqa: N802
        for device_id in request.devices_ids:
            self.check(device_id)  # still there, still healthy (exercise 2: and not busy)
        return v1beta1.PreStartContainerResponse()


def write_cdi_spec(directory: str, devices: Mapping[str, Gopher], cdi_dir: str) -> str:
    """One CDI spec for every device; its path. A device node for a character device; for the
    demo's plain files a read-only bind mount. Each gets its env var too."""
    entries = []
    for device_id in devices:
        path = os.path.realpath(os.path.join(directory, device_id))
        edits: dict[str, Any] = {"env": [f"GOPHER_{device_id.upper()}={device_id}"]}
        try:
            character = stat.S_ISCHR(os.stat(path).st_mode)
        except OSError:
            continue  # gone meanwhile: not in the spec, and a container asking for it fails to start
        if character:
            edits["deviceNodes"] = [{"path": f"/dev/{device_id}", "hostPath": path}]
        else:
            edits["mounts"] = [
                {"hostPath": path, "containerPath": f"/run/gophers/{device_id}", "options": ["ro", "bind"]}
            ]
        entries.append({"name": device_id, "containerEdits": edits})
    spec = {"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": entries}
    file = os.path.join(cdi_dir, "example.com-gopher.json")
    with open(file + ".tmp", "w", encoding="utf-8") as out:
        json.dump(spec, out)
    os.replace(file + ".tmp", file)  # atomic: the runtime never reads half a spec
    return file


# 6. The demo: gopherplug's kubelet simulator, asking as the kubelet asks when the options say so.


async def demo() -> None:
    with tempfile.TemporaryDirectory(prefix="lesson-") as root:
        plugin_dir, gophers, cdi = (os.path.join(root, name) for name in ("device-plugins", "gophers", "cdi"))
        os.mkdir(plugin_dir)
        os.mkdir(cdi)
        GopherAllocator.cdi_dir = cdi
        plug(root, "gopher0", "gopher1", "gopher2", "gopher3")  # NUMA nodes 0, 1, 0, 1
        async with trio.open_nursery() as nursery:
            kubelet = await nursery.start(KubeletSimulator(plugin_dir).run)
            await nursery.start(serve, gophers, plugin_dir, GopherAllocator)
            with trio.fail_after(10):
                await kubelet.wait_until(lambda k: len(k.resources[RESOURCE].topology) == 4)
            resource = kubelet.resources[RESOURCE]
            say("kubelet", f"GetDevicePluginOptions, during Register: {said(resource.options)}")
            numa = {device_id: nodes[0] for device_id, nodes in resource.topology.items()}
            say("kubelet", "ListAndWatch, with TopologyInfo: " + ", ".join(f"{d} NUMA {n}" for d, n in numa.items()))
            say("pod", f"resources.limits: {{{RESOURCE}: 2}}; the scheduler counted 4 allocatable")
            available = kubelet.available(RESOURCE)
            chosen = await kubelet.preferred_allocation(RESOURCE, available, [], 2)
            nodes = " and ".join(sorted({str(numa[d]) for d in chosen}))
            say("kubelet", f"GetPreferredAllocation(2 of {', '.join(available)}) -> {', '.join(chosen)} (NUMA {nodes})")
            answer = (await kubelet.allocate(RESOURCE, chosen)).container_responses[0]
            say("kubelet", f"Allocate({', '.join(chosen)}) -> cdi_devices {[d.name for d in answer.cdi_devices]}")
            with open(os.path.join(cdi, "example.com-gopher.json"), encoding="utf-8") as file:
                spec = {device["name"]: device["containerEdits"] for device in json.load(file)["devices"]}
            edits = spec[chosen[0]]
            say(
                "runtime",
                f"CDI spec {CDI_KIND}={chosen[0]}: env {edits['env'][0]}, {edits['mounts'][0]['containerPath']}",
            )
            await kubelet.pre_start_container(RESOURCE, chosen)
            say("kubelet", f"PreStartContainer({', '.join(chosen)}): ready, the container starts")
            os.unlink(os.path.join(gophers, chosen[1]))
            say("demo", f"unplugged {chosen[1]}; the container exits, and the kubelet restarts it")
            try:
                await kubelet.pre_start_container(RESOURCE, chosen)
            except RPCError as error:
                say("kubelet", f"PreStartContainer({', '.join(chosen)}) -> {error.message}: not started, retried later")
            nursery.cancel_scope.cancel()
        say("demo", "done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run against gopherplug's kubelet simulator")
    parser.add_argument("--directory", default="/dev/gophers", help="the devices: one per entry")
    parser.add_argument("--device-plugin-dir", default="/var/lib/kubelet/device-plugins")
    args = parser.parse_args()
    trio.run(demo) if args.demo else trio.run(serve, args.directory, args.device_plugin_dir, GopherAllocator)


if __name__ == "__main__":
    main()
