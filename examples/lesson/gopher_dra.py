"""Lesson 4, DRA: the gophers of lesson 1 (gopher_devices.py), served as a DRA driver.

With Dynamic Resource Allocation the kubelet no longer picks devices: the driver publishes them to
the API server as ResourceSlices, the scheduler writes its choice into a ResourceClaim, and the
kubelet asks the driver to prepare that claim before the pod's containers start (Kubernetes 1.34 or
later: resource.k8s.io/v1). gopherplug.py is the real thing (docs/dra.md).

  1. Slices         the devices, with attributes and capacity -> this node's ResourceSlice
  2. CDI            the spec of lesson 3 (gopher_allocation.py): what the runtime gives a container
  3. Registration   plugins_registry/<driver>-reg.sock: GetInfo, NotifyRegistrationStatus
  4. DRAPlugin      NodePrepareResources: read the claim, answer CDI device IDs
  5. The demo       `python gopher_dra.py --demo`: gopherplug's DRA kubelet and API server, narrated

Lesson 5 (gopher_claims.py) is the user's side: a DeviceClass, a ResourceClaim whose CEL selector
reads the attributes and capacity published here, and the scheduler's choice. Exercise 3 is here.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import urllib.error
import urllib.request
from typing import Any

import trio
from gopher_allocation import CDI_KIND, write_cdi_spec
from gopher_devices import Gopher, need, say, scan, watch_devices
from gopher_plugin import plug

import gopherplug as gp

DRIVER = "gopher.example.com"
DRA_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"  # "v1.DRAPlugin" in supported_versions


# 1. Slices. The API server speaks JSON over HTTP (`kubectl proxy` here; in a pod, HTTPS with the
# service account's token and the cluster's CA). A thread per request keeps the event loop free.
async def api(server: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    def call() -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(server + path, data, {"Content-Type": "application/json"}, method=method)
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as error:
            return error.code, None

    return await trio.to_thread.run_sync(call, abandon_on_cancel=True)  # a stop need not wait for it


class Driver:
    def __init__(self, directory: str, node: str, server: str, cdi_dir: str) -> None:
        self.directory, self.node, self.server, self.cdi_dir = directory, node, server, cdi_dir
        self.devices = gp.Watched(scan(directory))
        self.generation, self.version = 0, ""  # the pool's generation; the slice's resourceVersion
        self.name = f"{node}-{DRIVER}"  # one slice: a pool of more than 128 devices needs several

    def slice(self) -> dict[str, Any]:
        # Only healthy devices are published: the scheduler allocates what it sees. (gopherplug
        # publishes every device with a `healthy` attribute and taints the unhealthy ones.) A
        # device's name must be a DNS label: gopherplug maps other IDs to one. Its attributes (a
        # string, int, bool or semantic version each) and its capacity (quantities) are what a
        # claim's CEL selector reads: device.attributes["gopher.example.com"].model, and
        # device.capacity["gopher.example.com"].memory. A name without a domain is the driver's.
        healthy = (
            (device_id, gopher) for device_id, gopher in self.devices.value.items() if gopher.health == "Healthy"
        )
        devices = [{"name": device_id, **self.describe(gopher)} for device_id, gopher in healthy]
        # The pool's generation grows with every change: the scheduler trusts only the newest one.
        pool = {"name": self.node, "generation": self.generation, "resourceSliceCount": 1}
        spec = {"driver": DRIVER, "nodeName": self.node, "pool": pool, "devices": devices}
        metadata = {"name": self.name, "resourceVersion": self.version} if self.version else {"name": self.name}
        return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata, "spec": spec}

    def describe(self, gopher: Gopher) -> dict[str, Any]:
        attributes = {"model": {"string": gopher.properties.get("model", "gopher")}}  # exercise 3: numaNode
        return {"attributes": attributes, "capacity": {"memory": {"value": gopher.properties.get("memory", "0")}}}

    async def publish(self) -> None:
        self.generation += 1
        path = "/apis/resource.k8s.io/v1/resourceslices"
        # Update in place (never delete and create: the scheduler would see no device in between).
        code, written = (
            await api(self.server, "PUT", f"{path}/{self.name}", self.slice()) if self.version else (404, {})
        )
        if code == 404:  # not written yet, or deleted by a starting kubelet
            self.version = ""
            code, written = await api(self.server, "POST", path, self.slice())
        if not written:  # refused (RBAC, a conflict): gopherplug retries with a backoff
            raise RuntimeError(f"writing ResourceSlice {self.name}: {code}")
        self.version = written["metadata"]["resourceVersion"]
        names = ", ".join(device["name"] for device in written["spec"]["devices"])
        say("plugin", f"ResourceSlice {self.name} generation {self.generation}: {names}")

    # 2. CDI. A DRA driver gives a container nothing itself: it names CDI devices, and the runtime
    # applies their edits from the spec files in /var/run/cdi (lesson 3's). The spec first, then the
    # slice: once a device is in a slice, a claim may get it and a container start with it.

    async def keep_published(self) -> None:
        while True:
            touched = self.devices.next_touch()  # taken first: a change made while we write is not missed
            write_cdi_spec(self.directory, self.devices.value, self.cdi_dir)
            await self.publish()
            await touched.wait()  # a change of the devices, or a registration (after a kubelet's wipe)

    # 3. Registration. The kubelet watches plugins_registry with inotify and calls GetInfo on every
    # socket that appears; there is no kubelet.sock to call. A restarted kubelet walks it again.

    async def GetInfo(self, request: Any) -> Any:  # noqa: N802 - the RPC's name
        say("plugin", f"GetInfo: the kubelet found {DRIVER}-reg.sock")
        info = {"type": "DRAPlugin", "name": DRIVER, "endpoint": self.endpoint, "supported_versions": ["v1.DRAPlugin"]}
        return gp.pluginregistration.PluginInfo(**info)

    async def NotifyRegistrationStatus(self, status: Any) -> Any:  # noqa: N802
        say("plugin", f"NotifyRegistrationStatus: {'registered' if status.plugin_registered else status.error}")
        # A starting kubelet deletes this node's slices, then registers the drivers: write them again.
        # (gopherplug also watches its slices, and writes again any that anyone deletes.)
        self.devices.touch()
        return gp.pluginregistration.RegistrationStatusResponse()

    # 4. DRAPlugin. Before a pod's containers start, the kubelet asks for all its claims of this
    # driver in one call. An error belongs to its claim, in the answer: the kubelet retries.

    async def NodePrepareResources(self, request: Any) -> Any:  # noqa: N802
        answers = {}
        for claim in request.claims:
            path = f"/apis/resource.k8s.io/v1/namespaces/{claim.namespace}/resourceclaims/{claim.name}"
            code, found = await api(self.server, "GET", path)
            answer = gp.drapb.NodePrepareResourceResponse()
            if found is None or found["metadata"]["uid"] != claim.uid:  # deleted, or a new one by that name
                answer.error = f"ResourceClaim {claim.namespace}/{claim.name} ({claim.uid}): {code}"
                found = {"status": {"allocation": {"devices": {"results": []}}}}
            for result in found["status"]["allocation"]["devices"]["results"]:
                if result["driver"] != DRIVER or result["pool"] != self.node:
                    continue  # another driver's device: the kubelet asks that driver
                gopher = self.devices.value.get(result["device"])
                if gopher is None or gopher.health != "Healthy":  # gone since the scheduler chose it
                    answer.error = f"device {result['device']} is not there, or unhealthy"
                    break
                name, cdi = result["device"], [f"{CDI_KIND}={result['device']}"]
                answer.devices.add(
                    request_names=[result["request"]], pool_name=self.node, device_name=name, cdi_device_ids=cdi
                )
            answers[claim.uid] = answer
        return gp.drapb.NodePrepareResourcesResponse(claims=answers)

    async def NodeUnprepareResources(self, request: Any) -> Any:  # noqa: N802
        # Nothing to undo here: the spec describes every device. (gopherplug checkpoints what it
        # prepared, so that a restarted driver answers the same, and removes per-claim specs.)
        done = {claim.uid: gp.drapb.NodeUnprepareResourceResponse() for claim in request.claims}
        return gp.drapb.NodeUnprepareResourcesResponse(claims=done)

    def service(self, name: str, methods: list[str]) -> Any:
        import purerpc  # after gopherplug, whose glue lets purerpc 0.8 run on h2 4

        service = purerpc.Service(name)
        for method in methods:
            service.add_method(method, getattr(self, method), gp.DRA_METHODS[f"/{name}/{method}"].signature)
        return service

    async def serve(self, kubelet_dir: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.endpoint = os.path.join(kubelet_dir, "plugins", DRIVER, "dra.sock")
        os.makedirs(os.path.dirname(self.endpoint), exist_ok=True)
        registration = os.path.join(kubelet_dir, "plugins_registry", f"{DRIVER}-reg.sock")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_devices, self.directory, self.devices)
            nursery.start_soon(self.keep_published)
            plugin = self.service(DRA_SERVICE, ["NodePrepareResources", "NodeUnprepareResources"])
            await nursery.start(gp.serve_grpc, self.endpoint, [plugin])  # first: GetInfo names it
            info = self.service("pluginregistration.Registration", ["GetInfo", "NotifyRegistrationStatus"])
            await nursery.start(gp.serve_grpc, registration, [info])
            task_status.started()


# 5. The demo: gopherplug's DRA kubelet and a lenient API server, and this driver.


async def demo() -> None:
    need("h11", "dra")  # the API server stand-in speaks HTTP/1.1 with h11
    with tempfile.TemporaryDirectory(prefix="lesson-dra-") as root:
        kubelet_dir, gophers, cdi = (os.path.join(root, name) for name in ("kubelet", "gophers", "cdi"))
        for directory in (os.path.join(kubelet_dir, "plugins_registry"), cdi):
            os.makedirs(directory)
        plug(root, "gopher0", "gopher1", "gopher2")
        async with trio.open_nursery() as nursery:
            apiserver = await nursery.start(gp.LenientApiServer().run)
            kubelet = gp.DraKubeletSimulator(
                kubelet_dir, wipe=functools.partial(apiserver.delete_node_slices, "node-1")
            )
            await nursery.start(kubelet.run)

            async def until(what: str, check: Any) -> None:
                with trio.fail_after(10):
                    while not check():
                        await apiserver.changed.wait_touched()
                say("apiserver", f"{what}: {', '.join(published())}")

            def published() -> list[str]:
                return [d["name"] for s in apiserver.slices.values() for d in s["spec"]["devices"]]

            await nursery.start(Driver(gophers, "node-1", apiserver.url, cdi).serve, kubelet_dir)
            with trio.fail_after(10):
                await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            await until("this node's ResourceSlice", lambda: len(published()) == 3)
            device = next(d for s in apiserver.slices.values() for d in s["spec"]["devices"] if d["name"] == "gopher1")
            say("apiserver", f"  gopher1: attributes {device['attributes']}, capacity {device['capacity']}")
            open(os.path.join(gophers, "gopher3"), "x").close()  # nothing known of it: memory 0
            say("demo", "created gophers/gopher3")
            await until("the ResourceSlice, updated", lambda: "gopher3" in published())
            results = [{"request": "gopher", "driver": DRIVER, "pool": "node-1", "device": "gopher1"}]
            metadata = {"namespace": "default", "name": "my-gopher", "uid": "uid-1"}
            apiserver.put_claim({"metadata": metadata, "status": {"allocation": {"devices": {"results": results}}}})
            say("scheduler", "ResourceClaim default/my-gopher, allocated: gopher1 of pool node-1 (lesson 5: how)")
            answer = (await kubelet.prepare(DRIVER, [("default", "uid-1", "my-gopher")])).claims["uid-1"]
            say("kubelet", f"NodePrepareResources(default/my-gopher) -> CDI {answer.devices[0].cdi_device_ids[0]}")
            with open(os.path.join(cdi, "example.com-gopher.json"), encoding="utf-8") as file:
                edits = next(d["containerEdits"] for d in json.load(file)["devices"] if d["name"] == "gopher1")
            mounted = edits["mounts"][0]["containerPath"]
            say("runtime", f"CDI spec example.com/gopher=gopher1: env {edits['env'][0]}, mount {mounted}")
            await kubelet.unprepare(DRIVER, [("default", "uid-1", "my-gopher")])
            say("kubelet", "NodeUnprepareResources(default/my-gopher): the pod is gone")
            writes = len(apiserver.writes)
            kubelet.restart()
            say("demo", "the kubelet restarts: it deletes this node's slices, walks plugins_registry again")
            await until(
                "the ResourceSlice, written again", lambda: ("create", f"node-1-{DRIVER}") in apiserver.writes[writes:]
            )
            nursery.cancel_scope.cancel()
        say("demo", "done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", help="run against gopherplug's DRA kubelet and API server")
    parser.add_argument("--directory", default="/dev/gophers", help="the devices: one per entry")
    parser.add_argument("--kubelet-dir", default="/var/lib/kubelet")
    parser.add_argument("--api-server", default="http://127.0.0.1:8001", help="e.g. `kubectl proxy`'s")
    parser.add_argument("--cdi-dir", default="/var/run/cdi")
    args = parser.parse_args()
    driver = Driver(args.directory, os.environ.get("NODE_NAME", os.uname().nodename), args.api_server, args.cdi_dir)
    trio.run(demo) if args.demo else trio.run(driver.serve, args.kubelet_dir)


if __name__ == "__main__":
    main()
