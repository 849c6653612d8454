"""Lesson 5, claims: the user's side of DRA, and the scheduler's.

Lesson 4's driver (gopher_dra.py: read it first) publishes ResourceSlices. Nobody names a device:
an admin writes a DeviceClass, a user writes a ResourceClaim whose request names that class and
says in CEL what the device must be, the scheduler finds devices in the slices that match and
writes them into the claim, and the kubelet has the driver prepare them. Read it top to bottom:

  1. DeviceClass    the admin's: which devices are gophers at all
  2. ResourceClaim  the user's: how many, of which class, CEL on attributes and capacity
  3. The scheduler  what it checks, and what it writes
  4. The demo       `python gopher_claims.py --demo`: the strict API server and the scheduler of
                    gopherplug_standins (the dra extra, and the cel extra for CEL), narrated
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import trio
from gopher_devices import need, say
from gopher_dra import DRIVER, Driver
from gopher_plugin import plug

# 1. DeviceClass. Cluster-scoped, an admin's (kubectl apply): the devices a class offers are
# those every one of its selectors accepts. A claim must name one, so a user never has to know
# the driver's name. (With extendedResourceName, pods may also ask for the class in
# resources.limits, as in lesson 3: the DRAExtendedResource feature gate, alpha and off by
# default in Kubernetes 1.34 and 1.35, beta and on from 1.36.)
DEVICE_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": "gopher.example.com"},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}

# 2. ResourceClaim. Namespaced, the user's. Each request asks "exactly" a count of devices of a
# class, with its own CEL selectors besides the class's: all must be true. CEL sees a device as
# the slice has it: device.driver, device.attributes["<domain>"].<name> (a name published without
# a domain is the driver's) and device.capacity["<domain>"].<name>, a quantity compared with
# compareTo(quantity("2Gi")). An attribute a device lacks is a runtime error, not false: the
# claim cannot be allocated at all (ask `"model" in device.attributes["gopher.example.com"]`
# first when some devices lack it). A pod uses the claim by name:
#
#   spec:
#     resourceClaims: [{name: gopher, resourceClaimName: big-gopher}]
#     containers: [{name: app, image: ..., resources: {claims: [{name: gopher}]}}]
BIG_GOPHER = (
    'device.attributes["gopher.example.com"].model == "giant" && '
    'device.capacity["gopher.example.com"].memory.compareTo(quantity("4Gi")) >= 0'
)


def resource_claim(name: str, selector: str, count: int = 1, namespace: str = "default") -> dict[str, Any]:
    exactly = {"deviceClassName": DEVICE_CLASS["metadata"]["name"], "count": count, "allocationMode": "ExactCount"}
    exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},  # the API server's, really
        "spec": {"devices": {"requests": [{"name": "gopher", "exactly": exactly}]}},
    }


# 3. The scheduler. Its DynamicResources plugin (kubernetes/kubernetes
# pkg/scheduler/framework/plugins/dynamicresources, with the allocator of
# k8s.io/dynamic-resource-allocation structured/), for a pod with claims: on each node it takes
# the devices of the node's ResourceSlices (of each pool only the newest generation), keeps
# those every selector of the class and of the request accepts and that no other claim holds,
# and needs `count` of them; a node without them is filtered out ("cannot allocate all claims"),
# and with none left the pod stays Pending. A selector's CEL error is no filter: Filter returns an
# error that aborts the whole attempt (FailedScheduling with the error), retried with back-off
# until the claim or its class changes (Filter in dynamicresources.go). On the chosen node it
# writes the claim's status.allocation: per device the request, driver, pool and device name,
# and a nodeSelector that binds the claim to the node. Only then does the pod start there: the
# kubelet reads the claim and calls NodePrepareResources on the driver (lesson 4).


async def demo() -> None:
    need("h11", "dra")
    need("celpy", "cel")
    from gopherplug_standins import (
        ApiServerSimulator,
        DraKubeletSimulator,
        SchedulerSimulator,
        UnschedulableError,
        cdi_container_env,
    )

    with tempfile.TemporaryDirectory(prefix="lesson-claims-") as root:
        kubelet_dir, gophers, cdi = (os.path.join(root, name) for name in ("kubelet", "gophers", "cdi"))
        for directory in (os.path.join(kubelet_dir, "plugins_registry"), cdi):
            os.makedirs(directory)
        plug(root, "gopher0", "gopher1", "gopher2", "gopher3")  # pocket 1Gi, pocket 2Gi, giant 3Gi, giant 4Gi
        async with trio.open_nursery() as nursery:
            apiserver = await nursery.start(ApiServerSimulator().run)
            kubelet = DraKubeletSimulator(kubelet_dir, wipe=lambda name: apiserver.delete_node_slices("node-1", name))
            await nursery.start(kubelet.run)
            await nursery.start(Driver(gophers, "node-1", apiserver.url, cdi).serve, kubelet_dir)
            with trio.fail_after(10):
                await kubelet.wait_until(lambda k: DRIVER in k.drivers)  # GetInfo, NotifyRegistrationStatus
                while sum(len(s["spec"]["devices"]) for s in apiserver.slices.values()) < 4:
                    await apiserver.changed.wait_touched()
            for device in next(iter(apiserver.slices.values()))["spec"]["devices"]:
                model, memory = device["attributes"]["model"]["string"], device["capacity"]["memory"]["value"]
                say("apiserver", f"ResourceSlice device {device['name']}: model {model}, memory {memory}")
            scheduler = SchedulerSimulator(apiserver, [DEVICE_CLASS])
            selector = DEVICE_CLASS["spec"]["selectors"][0]["cel"]["expression"]
            say("admin", f"DeviceClass {DEVICE_CLASS['metadata']['name']}: devices where {selector}")
            claim = resource_claim("big-gopher", BIG_GOPHER)
            say("user", f"ResourceClaim default/big-gopher: 1 gopher where {BIG_GOPHER}")
            claim["status"] = {"allocation": scheduler.allocate(claim, "node-1")}
            apiserver.put_claim(claim)
            chosen = [result["device"] for result in claim["status"]["allocation"]["devices"]["results"]]
            say("scheduler", f"ResourceClaim default/big-gopher, status.allocation: {', '.join(chosen)} of pool node-1")
            prepared = (await kubelet.prepare(DRIVER, [("default", "uid-big-gopher", "big-gopher")])).claims
            cdi_ids = [cdi_id for device in prepared["uid-big-gopher"].devices for cdi_id in device.cdi_device_ids]
            say("kubelet", f"NodePrepareResources(default/big-gopher) -> CDI {', '.join(cdi_ids)}")
            env = cdi_container_env([cdi], cdi_ids)
            say("runtime", f"the CDI spec gives the container: {', '.join(env)}")
            await kubelet.unprepare(DRIVER, [("default", "uid-big-gopher", "big-gopher")])
            say("kubelet", "NodeUnprepareResources(default/big-gopher): the pod is gone")
            huge = resource_claim("huge-gopher", BIG_GOPHER.replace("4Gi", "8Gi"))
            say("user", "ResourceClaim default/huge-gopher: the same, with 8Gi")
            try:
                scheduler.allocate(huge, "node-1")
            except UnschedulableError as error:
                say("scheduler", f"ResourceClaim default/huge-gopher: {error}: its pod stays Pending")
            nursery.cancel_scope.cancel()
        say("demo", "done")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", action="store_true", required=True, help="run against gopherplug's stand-ins")
    parser.parse_args()
    trio.run(demo)


if __name__ == "__main__":
    main()
