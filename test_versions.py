"""Each flow a user meets, against each Kubernetes release gopherplug supports."""

from __future__ import annotations

import base64
import importlib.util
import itertools
import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import time

import grpc
import pytest
import trio
import trio.socket
import trio.testing
import yaml
from grpc_tools import protoc

import gopherplug as gp
import gopherplug_standins as standins
from testsupport import (
    DRIVER,
    HERE,
    MINIMAL,
    NODE_UID,
    TIMEOUT,
    DraNode,
    _free_loopback_port,
    _healthz,
    check,
    claim,
    dra_config,
    gopher_pod,
    helm_template,
    in_thread,
    run_cli_async,
    shipped_device_class,
    shipped_device_classes,
)

DRA_V1ALPHA1 = "v1alpha1.DRAResourceHealth"


# ------------------------------------------------------------------------------------------------
# Versions: each flow a user meets, against each Kubernetes release gopherplug supports, with the
# ------------------------------------------------------------------------------------------------


VERSIONS = standins.KUBERNETES_VERSIONS


def test_versions_each_release_has_its_default_feature_gates():
    """The stand-ins' releases and their default gates, as kube_features.go has them (docs/dra.md's version
    table): what every versioned test below stands on."""
    table = {version: standins.release(version).gates for version in VERSIONS}
    on_from = {
        "DRAPrioritizedList": "1.34",
        "DRAAdminAccess": "1.34",
        "DRAResourceClaimDeviceStatus": "1.34",
        "DRADeviceTaints": "1.36",
        "DRAConsumableCapacity": "1.36",
        "DRAExtendedResource": "1.36",
        "ResourceHealthStatus": "1.36",
        "KubeletPodResourcesDynamicResources": "1.34",
        "KubeletPodResourcesGet": "1.34",
    }
    assert table == {
        version: {gate: VERSIONS.index(version) >= VERSIONS.index(since) for gate, since in on_from.items()}
        for version in VERSIONS
    }
    assert standins.gate_spec("DRADeviceTaints", "1.35") == ("alpha", False, False)
    assert standins.gate_spec("DRAExtendedResource", "1.37") == ("GA", True, True)
    assert standins.gate_spec("DRAResourceClaimDeviceStatus", "1.36") == ("beta", True, False)
    assert standins.gate_spec("DRAResourceClaimDeviceStatus", "1.37") == ("GA", True, True)


def test_versions_an_admin_turns_gates_on_as_the_components_allow():
    """Alpha gates can be turned on (``--feature-gates``); a gate locked to its default cannot be
    changed, an unknown one is refused, in the words of k8s.io/component-base featuregate."""
    assert standins.release("1.35", DRADeviceTaints=True).enabled("DRADeviceTaints")
    assert not standins.release("1.36", ResourceHealthStatus=False).enabled("ResourceHealthStatus")
    with pytest.raises(ValueError, match=r"^cannot set feature gate DRAExtendedResource to false, feature is locked"):
        standins.release("1.37", DRAExtendedResource=False)
    assert not standins.release("1.36", DRAResourceClaimDeviceStatus=False).enabled("DRAResourceClaimDeviceStatus")
    with pytest.raises(ValueError, match=r"^cannot set feature gate DRAResourceClaimDeviceStatus to false, feature is"):
        standins.release("1.37", DRAResourceClaimDeviceStatus=False)
    with pytest.raises(ValueError, match=r"^unrecognized feature gate: DRAMagic$"):
        standins.release("1.36", DRAMagic=True)
    with pytest.raises(ValueError, match=r"^Kubernetes 1.33: the stand-ins speak for 1.34, 1.35, 1.36, 1.37$"):
        standins.release("1.33")


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_versions_the_api_server_drops_extended_resource_name_without_its_gate(version):
    """A DeviceClass's extendedResourceName is dropped on write while DRAExtendedResource is off
    (1.34, 1.35), kept from 1.36, and kept on a class that had it (deviceclass/strategy.go); the
    scheduler then sends a pod's resources.limits to DRA only from 1.36."""
    api = standins.ApiServerSimulator(version=version)
    stored = api.put_device_class(shipped_device_class())
    on = version >= "1.36"
    assert ("extendedResourceName" in stored["spec"]) is on
    turned_on = standins.ApiServerSimulator(version=standins.release(version, DRAExtendedResource=True))
    turned_on.put_device_class(shipped_device_class())
    turned_on.disabled_gates.add("DRAExtendedResource")  # the gate turned off again: a class that has it keeps it
    assert "extendedResourceName" in turned_on.put_device_class(shipped_device_class())["spec"]
    scheduler = standins.SchedulerSimulator(api)
    assert (scheduler.device_class("example.com/gopher") is not None) is on


def ordinary_claim(name, count=1, device_class="gopher.example.com", **exactly):
    """A claim as a user's ResourceClaimTemplate makes it: ``count`` devices of ``device_class``."""
    request = {"name": "gopher", "exactly": {"deviceClassName": device_class, "count": count, **exactly}}
    return claim(name, f"uid-{name}", requests=[request])


@pytest.mark.slow
async def test_dra_claims_select_by_capacity_and_attribute_through_the_charts_device_classes(dra_node, helm):
    """Devices that differ by what their files say (a model, a memory size) are told apart
    by claims: through the chart's dra.extraDeviceClasses, rendered by helm, the scheduler stand-in's
    CEL (with the Kubernetes quantity library) gives a claim of the "80Gi or more" class the one
    device with 80Gi, one of the "H100" class the H100, and a claim selecting by capacity itself
    (device.capacity[...].memory.compareTo(quantity(...))) the right one too."""
    info = dra_node.root / "info"
    for name, model, memory in (("gopher0", "H100", "40Gi"), ("gopher1", "H200", "80Gi"), ("gopher2", "H100", "64Gi")):
        (dra_node.devices / name).touch()
        (info / name).mkdir(parents=True)
        (info / name / "model").write_text(model + "\n")
        (info / name / "memory").write_text(memory + "\n")
    declared = {
        "attributes": {"productName": {"file": str(info / "{id}" / "model")}, "vendor": "NVIDIA"},
        "capacity": {"memory": {"file": str(info / "{id}" / "memory")}},
    }
    capacity = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("80Gi")) >= 0'
    values = dra_node.root / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "mode": "dra",
                "config": {
                    "resources": [{"name": "example.com/gopher", "directory": "/dev/g", "api": "dra", **declared}]
                },
                "dra": {
                    "driver": DRIVER,
                    "extraDeviceClasses": [
                        {"name": "big.gopher.example.com", "resource": "example.com/gopher", "selector": capacity},
                        {
                            "name": "h100.gopher.example.com",
                            "resource": "example.com/gopher",
                            "selector": f'device.attributes["{DRIVER}"].productName == "H100"',
                        },
                    ],
                },
            }
        )
    )
    rendered = helm_template(helm, str(values))
    assert rendered.returncode == 0, rendered.stderr
    classes = [item for item in yaml.safe_load_all(rendered.stdout) if item and item["kind"] == "DeviceClass"]
    assert [c["metadata"]["name"] for c in classes] == [
        "gopher.example.com",
        "gopher.example.com-admin",
        "big.gopher.example.com",
        "h100.gopher.example.com",
    ]
    scheduler = standins.SchedulerSimulator(dra_node.api, classes)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(**declared))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])

    def allocated(made):
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        return [result["device"] for result in made["status"]["allocation"]["devices"]["results"]]

    assert allocated(ordinary_claim("big", device_class="big.gopher.example.com")) == ["gopher1"]
    with pytest.raises(standins.UnschedulableError, match="cannot allocate all claims"):
        allocated(ordinary_claim("bigger", device_class="big.gopher.example.com"))  # the one 80Gi is taken
    assert allocated(ordinary_claim("h100", count=2, device_class="h100.gopher.example.com")) == ["gopher0", "gopher2"]
    dra_node.api.claims.clear()
    at_least = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("60Gi")) >= 0 && '
    at_least += f'device.attributes["{DRIVER}"].productName == "H100"'
    own = ordinary_claim("own", selectors=[{"cel": {"expression": at_least}}])
    assert allocated(own) == ["gopher2"]


async def publish_unhealthy_and_healthy(dra_node):
    """gopherplug publishes gopher0 (unhealthy: a dangling link) and gopher1 (healthy), and is registered."""
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_an_unhealthy_device_never_goes_to_an_ordinary_claim(dra_node, caplog):
    """On every release, a claim of the shipped DeviceClass never gets an unhealthy device. Before
    1.36 (DRADeviceTaints off) the API server drops the unhealthy taint and the allocator ignores
    taints: only the class's selector on the ``healthy`` attribute keeps the device out (
    without it the pod held the broken device and never started). gopherplug
    says so once, naming the gate and the version the API server gave (its /version); and what the
    node's kubelet of that release cannot do, with the version it reports."""
    await publish_unhealthy_and_healthy(dra_node)
    tainted = [d.get("taints") is not None for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
    assert tainted == [dra_node.api.release.enabled("DRADeviceTaints"), False]
    said = [r.getMessage() for r in caplog.records if "DRADeviceTaints" in r.getMessage()]
    if dra_node.api.release.enabled("DRADeviceTaints"):
        assert said == []
    else:
        assert said == [
            f"DRA: the API server (v{dra_node.api.release.version}.0) dropped the taints of the unhealthy devices "
            "of example.com/gopher: its feature gate DRADeviceTaints is off (beta and on by default from "
            "Kubernetes 1.36). A DeviceClass that selects on the healthy attribute (the shipped ones do) still "
            "keeps them from claims; one that does not gives them out, and the pods that get them never start"
        ]
    # The node's kubelet (its Node's nodeInfo) is of the same release here: before 1.36 it opens no
    # health stream unless its gate is on, which is said once, with the version it reports.
    kubelet = [r.getMessage() for r in caplog.records if "'s kubelet is " in r.getMessage()]
    if dra_node.api.release.enabled("ResourceHealthStatus"):
        assert kubelet == []
    else:
        assert kubelet == [
            f"DRA: node node-1's kubelet is v{dra_node.api.release.version}.0: before 1.36 it opens the devices' "
            "health stream only with its feature gate ResourceHealthStatus on (off by default), so per-device "
            "health reaches the pods' status only then; unhealthy devices are still kept from claims by the "
            "slices' healthy attribute"
        ]
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    one = scheduler.allocate(ordinary_claim("one"), "node-1")
    assert [r["device"] for r in one["devices"]["results"]] == ["gopher1"]
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(ordinary_claim("two", count=2), "node-1")
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_an_admin_claim_reaches_an_unhealthy_device_and_one_in_use(dra_node):
    """On every release, an admin-access claim of the shipped ``-admin`` class is allocated an
    unhealthy device: the class selects every device, and the request's toleration of the unhealthy
    taint is what 1.36 and later need (before, there is no taint). Without the toleration, from 1.36
    the taint keeps it off; through the ordinary class, never on any release. And it gets a device
    an ordinary claim holds, which gopherplug prepares beside that claim. (Preparing an unhealthy
    device that is there needs a node root cannot fail to open: the runtime tier's
    test_dra_pod_taints_an_unhealthy_device_and_an_admin_claim_still_reaches_it.)"""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())

    def admin_claim(name, device, device_class="gopher.example.com-admin", **exactly):
        selectors = [{"cel": {"expression": f'device.attributes["{DRIVER}"].id == "{device}"'}}]
        return ordinary_claim(name, device_class=device_class, adminAccess=True, selectors=selectors, **exactly)

    tolerations = [{"key": f"{DRIVER}/unhealthy", "operator": "Exists"}]
    unhealthy = scheduler.allocate(admin_claim("admin", "gopher0", tolerations=tolerations), "node-1")
    assert [(r["device"], r.get("adminAccess")) for r in unhealthy["devices"]["results"]] == [("gopher0", True)]
    untolerated = admin_claim("untolerated", "gopher0")
    if dra_node.api.release.enabled("DRADeviceTaints"):
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(untolerated, "node-1")
    else:
        assert scheduler.allocate(untolerated, "node-1")["devices"]["results"][0]["device"] == "gopher0"
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(admin_claim("ordinary", "gopher0", "gopher.example.com", tolerations=tolerations), "node-1")
    for made in (ordinary_claim("holder"), admin_claim("monitor", "gopher1")):
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
    with trio.fail_after(TIMEOUT):
        response = await dra_node.kubelet.prepare(
            DRIVER, [("default", "uid-holder", "holder"), ("default", "uid-monitor", "monitor")]
        )
    assert {uid: (a.error, [d.device_name for d in a.devices]) for uid, a in response.claims.items()} == {
        "uid-holder": ("", ["gopher1"]),
        "uid-monitor": ("", ["gopher1"]),
    }
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_healthy_device_is_allocated_prepared_and_reaches_the_container(dra_node):
    """On every release: a claim of the shipped class gets the healthy device, gopherplug prepares
    it, and the container gets its CDI device and its request's env."""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    made = ordinary_claim("c1")
    made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
    dra_node.api.put_claim(made)
    with trio.fail_after(TIMEOUT):
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-c1", "c1")])).claims["uid-c1"]
    assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher1"])
    assert dra_node.kubelet.cdi_devices("uid-c1", "gopher") == [
        "example.com/gopher=gopher1",
        "example.com/gopher=uid-c1_gopher",  # the request's env: GOPHER_DEVICES=gopher1
    ]
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_prioritized_list_gets_its_first_subrequest_that_fits(dra_node):
    """On every release (DRAPrioritizedList is on from 1.34): a request with firstAvailable gets the
    first subrequest the node can give, here the second (no device is gopher9), as
    "<request>/<subrequest>"; gopherplug prepares it and the container naming the request gets it."""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    only = [{"cel": {"expression": f'device.attributes["{DRIVER}"].id == "gopher9"'}}]
    subrequests = [
        {"name": "best", "deviceClassName": "gopher.example.com", "selectors": only},
        {"name": "any", "deviceClassName": "gopher.example.com"},
    ]
    made = claim("listed", "uid-listed", requests=[{"name": "gopher", "firstAvailable": subrequests}])
    made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
    dra_node.api.put_claim(made)
    assert [(r["request"], r["device"]) for r in made["status"]["allocation"]["devices"]["results"]] == [
        ("gopher/any", "gopher1")
    ]
    with trio.fail_after(TIMEOUT):
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-listed", "listed")])).claims["uid-listed"]
    assert answer.error == ""
    assert dra_node.kubelet.cdi_devices("uid-listed", "gopher") == [
        "example.com/gopher=gopher1",
        "example.com/gopher=uid-listed_gopher",  # the request's env, "gopher/any" counted as "gopher"
    ]
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_shared_device_is_shared_from_1_36(dra_node, caplog):
    """``replicas: 2``: from 1.36 (DRAConsumableCapacity on) two claims share gopher0, each with a
    share of its own, both prepared; before, the API server stores the device unshared, the second
    claim finds no device, and gopherplug says once why."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=2))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    first, second = ordinary_claim("first"), ordinary_claim("second")
    first["status"] = {"allocation": scheduler.allocate(first, "node-1")}
    dra_node.api.put_claim(first)
    said = [r.getMessage() for r in caplog.records if "DRAConsumableCapacity is off" in r.getMessage()]
    if dra_node.api.release.enabled("DRAConsumableCapacity"):
        second["status"] = {"allocation": scheduler.allocate(second, "node-1")}
        dra_node.api.put_claim(second)
        with trio.fail_after(TIMEOUT):
            answer = await dra_node.kubelet.prepare(
                DRIVER, [("default", "uid-first", "first"), ("default", "uid-second", "second")]
            )
        shares = {uid: [(d.device_name, d.share_id) for d in a.devices] for uid, a in answer.claims.items()}
        assert {uid: [name for name, _ in devices] for uid, devices in shares.items()} == {
            "uid-first": ["gopher0"],
            "uid-second": ["gopher0"],
        }
        assert shares["uid-first"][0][1] != shares["uid-second"][0][1]
        assert said == []
    else:
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            scheduler.allocate(second, "node-1")
        assert len(said) == 1
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_claims_consume_a_shared_devices_declared_capacity_from_1_36(dra_node):
    """``replicas: 4`` and ``capacity: {memory: 80Gi}``: from 1.36 (DRAConsumableCapacity)
    claims share the device and each consumes the memory it asks for (capacity.requests), within the
    80Gi: 60Gi, then 30Gi does not fit, a claim asking for none still does (1 share, 0 memory).
    Before 1.36 the API server drops the sharing and the policy and keeps the value: the first claim
    has the device whole, and the capacity is what selectors see."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=4, capacity={"memory": "80Gi"}))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    assert [standins.resource_slice_causes(item) for item in dra_node.api.slices.values()] == [[]]

    def allocated(name, memory=None):
        made = ordinary_claim(name, **({"capacity": {"requests": {"memory": memory}}} if memory else {}))
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        dra_node.api.put_claim(made)
        return [r.get("consumedCapacity") for r in made["status"]["allocation"]["devices"]["results"]]

    if dra_node.api.release.enabled("DRAConsumableCapacity"):
        assert allocated("big", "60Gi") == [{"memory": "60Gi", "shares": "1"}]
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            allocated("more", "30Gi")
        assert allocated("none") == [{"memory": "0", "shares": "1"}]
    else:
        (device,) = [d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]]
        assert device["capacity"] == {"memory": {"value": "80Gi"}, "shares": {"value": "4"}}
        assert allocated("big") == [None]
        with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
            allocated("none")
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_a_pod_asking_through_limits_is_served_by_dra_from_1_36(dra_node):
    """A pod asking for example.com/gopher in resources.limits on a node without the device plugin:
    from 1.36 (DRAExtendedResource on) the scheduler makes its claim from the shipped class's
    extendedResourceName and the container gets the healthy device; before, the API server dropped
    the field and the pod fits nowhere here (it needs the device plugin on such a cluster)."""
    await publish_unhealthy_and_healthy(dra_node)
    scheduler = standins.SchedulerSimulator(dra_node.api, shipped_device_classes())
    pod = gopher_pod("p", ("consumer", {"example.com/gopher": "1"}))
    if not dra_node.api.release.enabled("DRAExtendedResource"):
        assert "extendedResourceName" not in dra_node.api.device_classes["gopher.example.com"]["spec"]
        with pytest.raises(standins.UnschedulableError, match=r"^cannot fit resource example.com/gopher$"):
            scheduler.schedule(pod, "node-1")
        dra_node.stop()
        return
    placement = scheduler.schedule(pod, "node-1")
    with trio.fail_after(TIMEOUT):
        await dra_node.kubelet.prepare_extended_resources(pod, placement.claim)
    assert dra_node.kubelet.extended_resource_cdi_devices(pod, placement.claim, "consumer") == [
        "example.com/gopher=gopher1",
        f"example.com/gopher={placement.claim['metadata']['uid']}_container-0-request-0",
    ]
    dra_node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("dra_node", VERSIONS, indirect=True)
async def test_versions_the_kubelet_watches_health_only_from_1_36(dra_node):
    """The health stream (pods' status.allocatedResourcesStatus): kubelets open NodeWatchResources
    only with ResourceHealthStatus (on from 1.36; dra_plugin_manager.go), in v1alpha1 up to 1.36
    and the newest gopherplug lists from 1.37. Before 1.36 they never call it: health reaches
    nobody but the slices' healthy attribute and the log."""
    await publish_unhealthy_and_healthy(dra_node)
    expected = {"1.36": f"/{DRA_V1ALPHA1}/NodeWatchResources", "1.37": "/v1.DRAResourceHealth/NodeWatchResources"}
    with trio.fail_after(TIMEOUT):
        if dra_node.version not in expected:
            with pytest.raises(gp.RPCError, match="ResourceHealthStatus off never opens NodeWatchResources"):
                async with dra_node.kubelet.watch_health(DRIVER):
                    pass
        else:
            async with dra_node.kubelet.watch_health(DRIVER) as reports:
                report = await reports.__anext__()
            assert [(d.device.device_name, d.health) for d in report.devices] == [
                ("gopher0", gp.drahealth.UNHEALTHY),
                ("gopher1", gp.drahealth.HEALTHY),
            ]
    assert dra_node.kubelet.health_paths == ([expected[dra_node.version]] if dra_node.version in expected else [])
    dra_node.stop()


async def test_dra_a_pool_rewrite_keeps_the_unhealthy_taints_time_added(dra_node):
    """The eviction clock: NoExecute evicts at timeAdded + tolerationSeconds, and the API server sets
    timeAdded to now on every write of a taint without one (SetDefaults_DeviceTaint). A pool
    rewritten for another device (gopher2 added) keeps gopher0's taint's timeAdded, as the Go
    helper does (copyTaintTimeAdded in k8s.io/dynamic-resource-allocation resourceslice); a taint
    that is new gets the server's now."""
    times = iter([1_700_000_000, 1_700_000_600])
    now = next(times)
    dra_node.api.clock = lambda: now
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()

    def taint_times():
        return {
            device["name"]: [taint["timeAdded"] for taint in device.get("taints", [])]
            for item in dra_node.api.slices.values()
            for device in item["spec"]["devices"]
        }

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        first = taint_times()
        assert first == {"gopher0": ["2023-11-14T22:13:20Z"], "gopher1": []}
        now = next(times)  # ten minutes later
        (dra_node.devices / "gopher2").symlink_to("node2")  # a new unhealthy device: the pool is rewritten
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update"]
    assert taint_times() == {"gopher0": ["2023-11-14T22:13:20Z"], "gopher1": [], "gopher2": ["2023-11-14T22:23:20Z"]}
    dra_node.stop()


class ScriptedSliceApi:
    """The slice and Node requests of KubeApi, scripted: the slices' watch yields what the test
    sends down ``events``; create_slice answers only once ``before_answer`` (awaited with the item)
    returns. The Node is there, and its watch brings nothing."""

    def __init__(self, before_answer):
        self.events_in, self.events = trio.open_memory_channel(10)
        self.before_answer = before_answer
        self.created = []

    async def list_slices(self, node_name, driver, version="0"):
        return [], "1"

    async def watch_slices(self, node_name, driver, version):
        async for event in self.events:
            yield event

    async def list_node(self, name, version):
        return [{"metadata": {"name": name, "uid": NODE_UID, "resourceVersion": "1"}}], "1"

    async def watch_node(self, name, version):
        await trio.sleep_forever()
        yield  # an async generator, as the real one is

    async def server_version(self):
        return ""  # as KubeApi answers when /version cannot be had

    async def create_slice(self, item):
        self.created.append(item)
        item = {**item, "metadata": {**item["metadata"], "resourceVersion": str(len(self.created) * 10)}}
        await self.before_answer(item)
        return item


async def test_dra_a_write_answered_after_the_watch_saw_it_deleted_is_not_believed(nursery):
    """The race behind a slice that was never written again: the API server stores our slice, someone
    deletes it at once, and the watch brings both events before our create's answer arrives. That
    answer is history; believing it would leave the publisher sure that the slice exists."""
    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(gp.resource_config("example.com/gopher"), gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")}))

    async def deleted_before_the_answer(item):
        if len(api.created) == 1:
            await api.events_in.send(("ADDED", item))
            await api.events_in.send(("DELETED", {**item, "metadata": {**item["metadata"], "resourceVersion": "11"}}))
            while publisher._seen < 11:  # the watch has taken both in
                await publisher.known_changed.wait_touched()

    api = ScriptedSliceApi(deleted_before_the_answer)
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        while len(api.created) < 2:
            await publisher.synced.wait_touched()
    name = gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 0)
    assert [item["metadata"]["name"] for item in api.created] == [name] * 2
    nursery.cancel_scope.cancel()


async def test_dra_a_deletion_older_than_our_write_leaves_the_written_slice_known(nursery):
    """The other order: a slice's name was deleted (an earlier pod's slice, the kubelet's wipe) just
    before our create, and the watch brings that DELETED only after our create's answer. The
    deletion is of the earlier slice: the one we wrote lives on. Before, the publisher dropped it
    from what it knew, created it again, and got 409 AlreadyExists and a backoff."""
    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(gp.resource_config("example.com/gopher"), gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")}))

    async def answered_at_once(item):
        pass

    api = ScriptedSliceApi(answered_at_once)
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        while publisher.synced.value < 1:
            await publisher.synced.wait_touched()
        (written,) = api.created  # answered with resourceVersion 10
        passes = publisher.synced.value
        earlier = {**written, "metadata": {**written["metadata"], "resourceVersion": "5"}}
        await api.events_in.send(("DELETED", earlier))
        while publisher._seen < 5:
            await publisher.known_changed.wait_touched()
        while publisher.synced.value == passes:  # the pass the event woke
            await publisher.synced.wait_touched()
    assert len(api.created) == 1
    assert publisher.known[written["metadata"]["name"]]["metadata"]["resourceVersion"] == "10"
    nursery.cancel_scope.cancel()


async def test_dra_writes_that_succeed_and_are_undone_at_once_are_rate_limited(nursery, autojump_clock):
    """Someone deletes each slice as soon as it is written (another writer, a webhook, a cleanup
    that thinks the driver gone): every write succeeds and is needed again. Without a bound that is
    a hot loop against the API server; with it, DRA_WRITES_PER_SECOND after a burst."""
    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(gp.resource_config("example.com/gopher"), gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")}))

    async def deleted_at_once(item):
        deleted = {**item, "metadata": {**item["metadata"], "resourceVersion": str(len(api.created) * 10 + 1)}}
        await api.events_in.send(("DELETED", deleted))
        if len(api.created) >= 1000:
            scope.cancel()  # a hot loop: enough seen

    api = ScriptedSliceApi(deleted_at_once)
    publisher = gp.SlicePublisher(resources, api)
    seconds = 10  # virtual: the autojump clock
    with trio.move_on_after(seconds) as scope:
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        await trio.sleep_forever()
    assert len(api.created) <= gp.DRA_WRITE_BURST + seconds * gp.DRA_WRITES_PER_SECOND + 1
    assert len(api.created) >= seconds * gp.DRA_WRITES_PER_SECOND  # and it kept trying
    nursery.cancel_scope.cancel()


async def test_dra_fields_the_api_server_drops_are_said_once_and_not_written_again(nursery, caplog):
    """An API server whose feature gates are off stores a slice without the fields it does not
    know, on every write. Compared with what was written, the slice would be written again forever;
    what the server stored counts as written, and it is said once."""
    resources = gp.DraResources(DRIVER, "node-1")
    devices = gp.Watched({"g0": gp.DeviceEntry("g0", "/g/g0")})
    resources.attach(gp.resource_config("example.com/gopher"), devices)

    def stored(item):
        """The item as a server that does not know the attribute "healthy" stores it."""
        item = json.loads(json.dumps(item))
        for device in item["spec"]["devices"]:
            device["attributes"].pop("healthy", None)
        item["metadata"]["resourceVersion"] = str(10 * (len(api.created) + len(api.replaced)))
        return item

    class Dropping(ScriptedSliceApi):
        def __init__(self):
            super().__init__(None)
            self.replaced = []

        async def create_slice(self, item):
            self.created.append(item)
            kept = stored(item)
            await self.events_in.send(("ADDED", kept))
            return kept

        async def replace_slice(self, item):
            self.replaced.append(item)
            kept = stored(item)
            await self.events_in.send(("MODIFIED", kept))
            return kept

    api = Dropping()
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        # The pass that wrote, then the one the watch's ADDED woke (it began after the event).
        while publisher.synced.value < 2:
            await publisher.synced.wait_touched()
        assert (len(api.created), len(api.replaced)) == (1, 0)
        count = publisher.synced.value
        devices.set({**devices.value, "g1": gp.DeviceEntry("g1", "/g/g1")})  # a real change: written
        while publisher.synced.value < count + 2:  # the same two passes again
            await publisher.synced.wait_touched()
    assert (len(api.created), len(api.replaced)) == (1, 1)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "without some of what was written" in warnings[0]
    nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_dra_taints_an_api_server_without_device_taints_drops_are_not_written_again(dra_node, caplog):
    """An API server whose DRADeviceTaints gate is off drops the taints of every write: the slice
    with the unhealthy device is written once (said once), not again and again; the healthy
    attribute still says it."""
    dra_node.api.disabled_gates.add("DRADeviceTaints")
    (dra_node.devices / "gopher0").symlink_to("node0")  # dangling: unhealthy from the start
    (dra_node.devices / "gopher1").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        (item,) = dra_node.api.slices.values()
        assert [d.get("taints") for d in item["spec"]["devices"]] == [None, None]
        assert [d["attributes"]["healthy"]["bool"] for d in item["spec"]["devices"]] == [False, True]
        (dra_node.devices / "gopher2").touch()  # a real change, written; and the watch's events after it
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
    with trio.move_on_after(1):  # a write loop would write many times in a second (DRA_WRITES_PER_SECOND)
        while True:
            await dra_node.api.changed.wait_touched()
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update"]
    warnings = [r.getMessage() for r in caplog.records if "without some of what was written" in r.getMessage()]
    assert len(warnings) == 1
    dra_node.stop()


@pytest.mark.slow
async def test_dra_shares_an_api_server_without_consumable_capacity_drops_are_said_once(dra_node, caplog):
    """An API server whose DRAConsumableCapacity gate is off (before 1.36, or turned off) drops
    allowMultipleAllocations and the requestPolicy, keeping the capacity's value: the slice is
    written once, and the log says, once, that the devices are not shared."""
    dra_node.api.disabled_gates.add("DRAConsumableCapacity")
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=2))
        await dra_node.wait_for_slices(["gopher0"])
        (item,) = dra_node.api.slices.values()
        [device] = item["spec"]["devices"]
        assert "allowMultipleAllocations" not in device and device["capacity"] == {"shares": {"value": "2"}}
        (dra_node.devices / "gopher1").touch()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
    with trio.move_on_after(1):  # a write loop would write many times in a second (DRA_WRITES_PER_SECOND)
        while True:
            await dra_node.api.changed.wait_touched()
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "update"]
    said = [r.getMessage() for r in caplog.records if "DRAConsumableCapacity" in r.getMessage()]
    assert said == [
        "DRA: the API server (v1.36.0) dropped allowMultipleAllocations from the devices of example.com/gopher: its "
        "feature gate DRAConsumableCapacity is off (beta and on by default from Kubernetes 1.36): each device goes "
        "to one claim at a time, and its replicas share nothing until the gate is on"
    ]
    dra_node.stop()


async def test_dra_a_restart_that_finds_the_devices_in_another_order_writes_nothing(nursery):
    """docs/dra.md promises that a restarted plugin leaves unchanged slices alone; a directory read
    in another order (or USB devices enumerated anew) must not count as a change."""
    resource = gp.resource_config("example.com/gopher")
    names = [f"g{i}" for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 12)]
    found = {name: gp.DeviceEntry(name, f"/g/{name}") for name in names}
    before = gp.resource_slices(DRIVER, "node-1", resource, found, 3, NODE_UID)
    shuffled = {name: found[name] for name in reversed(names)}
    assert gp.resource_slices(DRIVER, "node-1", resource, shuffled, 3, NODE_UID) == before
    for version, item in enumerate(before, 1):
        item["metadata"]["resourceVersion"] = str(version)

    class Restarted(ScriptedSliceApi):
        async def list_slices(self, node_name, driver, version):
            return [json.loads(json.dumps(item)) for item in before], "2"

        async def replace_slice(self, item):
            self.created.append(item)
            return item

    resources = gp.DraResources(DRIVER, "node-1")
    resources.attach(resource, gp.Watched(shuffled))
    api = Restarted(None)
    publisher = gp.SlicePublisher(resources, api)
    with trio.fail_after(TIMEOUT):
        await nursery.start(publisher.watch)
        await nursery.start(publisher.publish)
        while publisher.synced.value < 1:
            await publisher.synced.wait_touched()
    assert api.created == []
    nursery.cancel_scope.cancel()


async def test_dra_a_watch_that_expires_at_once_again_and_again_backs_off(nursery, autojump_clock, caplog):
    """One 410 is routine and listed again at once; a watch that expires again before it brings
    anything is not, and must not become a hot loop of lists: warned about, and backed off."""
    lists = []

    class Expiring(ScriptedSliceApi):
        async def list_slices(self, node_name, driver, version):
            lists.append(trio.current_time())
            if len(lists) >= 1000:
                scope.cancel()  # a hot loop: enough seen
            await trio.lowlevel.checkpoint()  # as a request would: cancellable
            return [], "1"

        async def watch_slices(self, node_name, driver, version):
            raise gp.ApiError(410, "watch ResourceSlices: 410 too old resource version: 1 (7)")
            yield  # an async generator, as the real one is

    publisher = gp.SlicePublisher(gp.DraResources(DRIVER, "node-1"), Expiring(None))
    with trio.move_on_after(30) as scope:  # virtual seconds: the autojump clock
        await nursery.start(publisher.watch)
        await trio.sleep_forever()
    # Two at once, then 0.8 s doubling, each wait jittered up to twice: about 7 lists, not thousands.
    assert 5 <= len(lists) <= 9
    assert lists[1] == lists[0] and lists[2] - lists[1] >= gp.DRA_WATCH_BACKOFF[0]
    assert "DRA: watching ResourceSlices: watch ResourceSlices: 410 too old resource version" in caplog.text
    nursery.cancel_scope.cancel()


async def test_dra_two_drivers_that_fail_together_do_not_retry_in_step(nursery, autojump_clock):
    """After an API server restart, every node's driver fails at the same moment; without jitter
    they would all retry, and list, at the same moments, for ever. Each wait is jittered as
    client-go's wait.Jitter: between the backoff and twice it."""
    tries = {1: [], 2: []}

    class Down(ScriptedSliceApi):
        def __init__(self, number):
            super().__init__(None)
            self.number = number

        async def list_slices(self, node_name, driver, version="0"):
            tries[self.number].append(trio.current_time())
            raise gp.ApiError(None, "list ResourceSlices: the API server did not answer")

    with trio.move_on_after(60):  # virtual seconds: the autojump clock
        for number in tries:
            await nursery.start(gp.SlicePublisher(gp.DraResources(DRIVER, f"node-{number}"), Down(number)).watch)
        await trio.sleep_forever()
    assert len(tries[1]) >= 5 and len(tries[2]) >= 5
    assert tries[1][0] == tries[2][0]  # failed together
    assert tries[1][1:5] != tries[2][1:5]  # and retried apart
    for times in tries.values():
        delay = gp.DRA_WATCH_BACKOFF[0]
        for before, after in itertools.pairwise(times):
            assert delay <= after - before <= delay * (1 + gp.DRA_JITTER)
            delay = min(delay * 2, gp.DRA_WATCH_BACKOFF[1])
    nursery.cancel_scope.cancel()


async def test_dra_a_watch_the_server_ends_at_once_every_time_is_backed_off(nursery, autojump_clock, caplog):
    """A server (or a proxy) that ends each watch as soon as it opens, with nothing in it, must not
    make a hot loop of watches: as the reflector's "very short watch", it counts as a failure,
    backed off and said."""
    watches = []

    class Ending(ScriptedSliceApi):
        async def watch_slices(self, node_name, driver, version):
            watches.append(trio.current_time())
            if len(watches) >= 1000:
                scope.cancel()  # a hot loop: enough seen
            await trio.lowlevel.checkpoint()
            return
            yield  # an async generator, as the real one is

    with trio.move_on_after(30) as scope:  # virtual seconds: the autojump clock
        await nursery.start(gp.SlicePublisher(gp.DraResources(DRIVER, "node-1"), Ending(None)).watch)
        await trio.sleep_forever()
    assert 4 <= len(watches) <= 7  # 0.8 s doubling, jittered: not thousands
    assert "DRA: watching ResourceSlices: watch ResourceSlices: ended by the server at once" in caplog.text
    nursery.cancel_scope.cancel()


async def test_dra_a_quiet_watch_is_opened_again_from_its_last_version_and_nothing_is_listed(
    nursery, autojump_clock, caplog
):
    """A watch whose connection died without a word brings nothing forever, not even the bookmark
    the API server sends about every minute: after DRA_WATCH_QUIET_SECONDS of that it is opened
    again, from the last version seen (a bookmark's), quietly. Nothing is listed again (before, the
    slices were listed again every 300 s)."""
    lists, watches = [], gp.Watched([])

    class SilentApi(ScriptedSliceApi):
        async def list_slices(self, node_name, driver, version="0"):
            lists.append(version)
            return [], "1"

        async def watch_slices(self, node_name, driver, version):
            watches.set([*watches.value, version])
            yield "BOOKMARK", {"kind": "ResourceSlice", "metadata": {"resourceVersion": "5"}}
            await trio.sleep_forever()  # the connection is dead

    publisher = gp.SlicePublisher(gp.DraResources(DRIVER, "node-1"), SilentApi(None))
    await nursery.start(publisher.watch)
    quiet = gp.DRA_WATCH_QUIET_SECONDS
    with trio.fail_after(quiet * (1 + gp.DRA_JITTER) * 3 + 1):  # the autojump clock: virtual seconds
        while len(watches.value) < 4:
            await watches.wait_touched()
    assert watches.value == ["1", "5", "5", "5"]
    assert lists == ["0"]  # once, from the watch cache
    assert trio.current_time() >= quiet * 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_dra_api_server_down_or_slow_keeps_the_plugin_serving(dra_node, caplog, monkeypatch):
    monkeypatch.setattr(gp, "API_REQUEST_TIMEOUT", 0.5)  # the test need not wait 10 s for it
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    with trio.fail_after(TIMEOUT * 3):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.down = True
        dra_node.api.changed.touch()  # ends the open watch: the server went away
        (dra_node.devices / "gopher1").touch()
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert answer.claims["uid-1"].error.startswith("get ResourceClaim default/c1: ")
        dra_node.api.down = False
        await dra_node.wait_for_slices(["gopher0", "gopher1"])  # written once it answers again
        dra_node.api.delay = gp.API_REQUEST_TIMEOUT + 1
        slow = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert slow.claims["uid-1"].error == f"the API server did not answer within {gp.API_REQUEST_TIMEOUT:g} s"
        dra_node.api.delay = 0
        ok = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
        assert ok.claims["uid-1"].devices[0].device_name == "gopher0"
    assert "DRA: writing ResourceSlices" in caplog.text or "DRA: watching ResourceSlices" in caplog.text


async def test_dra_api_client_trusts_the_configured_ca_alone_and_verifies_the_server_with_it(dra_node, tmp_path):
    """The client's SSL context holds the one CA the kubeconfig names (each CA loaded costs memory,
    and the system's 140-odd would let any public CA's certificate pass for the API server); a
    server whose certificate another CA signed is refused, however valid that certificate is."""
    import trustme

    api = gp.KubeApi.connect(kubeconfig=str(dra_node.kubeconfig))
    try:
        context = api._client._client._client._transport._pool._ssl_context  # lightkube 1.0.1, httpx2
        assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
        assert context.cert_store_stats()["x509_ca"] == 1
        ca_der = ssl.PEM_cert_to_DER_cert(dra_node.ca_file.read_text())
        assert context.get_ca_certs(binary_form=True) == [ca_der]
        dra_node.api.put_claim(claim("c1", "uid-1"))
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    other = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    trustme.CA().issue_cert("127.0.0.1").configure_cert(other)  # for the same address, by another CA
    impostor = standins.ApiServerSimulator(ssl_context=other, tokens={"token-1"})
    impostor.put_claim(claim("c1", "uid-1"))
    async with trio.open_nursery() as nursery:
        await nursery.start(impostor.run)
        kubeconfig = yaml.safe_load(dra_node.kubeconfig.read_text())
        kubeconfig["clusters"][0]["cluster"]["server"] = impostor.url
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        api = gp.KubeApi.connect(kubeconfig=str(tmp_path / "kubeconfig"))
        try:
            with trio.fail_after(TIMEOUT), pytest.raises(gp.ApiError) as refused:
                await api.get_claim("default", "c1")
        finally:
            await api.aclose()
        nursery.cancel_scope.cancel()
    assert refused.value.status is None
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value), str(refused.value)
    assert impostor.bearers == []  # the token never left: refused in the handshake


async def test_dra_in_cluster_configuration_rereads_a_rotated_token(dra_node, monkeypatch, tmp_path):
    """The service account's files as the kubelet projects them: ..data a symlink to a timestamped
    directory, swapped atomically when the token rotates."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    first = account / "..2026_11_23_01"
    first.mkdir()
    (first / "token").write_text("token-1")
    (first / "ca.crt").write_text(dra_node.ca_file.read_text())
    (first / "namespace").write_text("gopherplug")
    (account / "..data").symlink_to(first.name)
    for name in ("token", "ca.crt", "namespace"):
        (account / name).symlink_to(f"..data/{name}")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(dra_node.api.port))
    dra_node.api.put_claim(claim("c1", "uid-1"))
    api = gp.KubeApi.connect(str(account))
    try:
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            second = account / "..2026_11_23_02"
            shutil.copytree(first, second)
            (second / "token").write_text("token-2")
            (account / "..data_tmp").symlink_to(second.name)
            os.replace(account / "..data_tmp", account / "..data")
            dra_node.api.tokens = {"token-2"}  # the old one expired
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert dra_node.api.refused_tokens == 1  # refused once, then the file was read again


def projected_account(directory, ca_text, token):
    """A service account directory as the kubelet projects it: ..data a symlink to a timestamped
    directory; ``rotate(token)`` swaps in a new one atomically, as the kubelet does."""
    directory.mkdir()
    generation = iter(range(1, 100))

    def rotate(token):
        files = directory / f"..2026_11_24_{next(generation):02}"
        files.mkdir()
        (files / "token").write_text(token)
        (files / "ca.crt").write_text(ca_text)
        (files / "namespace").write_text("gopherplug")
        (directory / "..data_tmp").symlink_to(files.name)
        os.replace(directory / "..data_tmp", directory / "..data")

    rotate(token)
    for name in ("token", "ca.crt", "namespace"):
        (directory / name).symlink_to(f"..data/{name}")
    return rotate


def in_cluster_client(dra_node, monkeypatch, tmp_path):
    """A KubeApi as a pod connects, token-1 in its projected service account (the API server
    takes token-1 and token-2), and claim c1 on the server: the account's rotate() and the client."""
    rotate = projected_account(tmp_path / "serviceaccount", dra_node.ca_file.read_text(), "token-1")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(dra_node.api.port))
    dra_node.api.put_claim(claim("c1", "uid-1"))
    dra_node.api.tokens = {"token-1", "token-2"}
    return rotate, gp.KubeApi.connect(str(tmp_path / "serviceaccount"))


async def test_dra_a_token_refused_with_403_is_read_again(dra_node, monkeypatch, tmp_path):
    """The manifest's admission policy answers 403, not 401, to a token that names no node (one
    issued before an API server upgrade). lightkube reads the file again only after a 401, so the
    refused token was sent forever although the kubelet had already replaced it."""
    rotate, api = in_cluster_client(dra_node, monkeypatch, tmp_path)
    try:
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            rotate("token-2")
            dra_node.api.forbidden_tokens = {
                "token-1": "gopherplug-dra writes ResourceSlices only with a token that names its node"
            }
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            # A 403 for the token the file still holds is the answer: sent once, not twice.
            dra_node.api.forbidden_tokens = {"token-2": "resourceclaims is forbidden"}
            with pytest.raises(gp.ApiError) as refused:
                await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    assert refused.value.status == 403
    assert dra_node.api.bearers == ["token-1", "token-1", "token-2", "token-2"]


async def test_dra_a_token_file_is_read_again_every_minute(dra_node, monkeypatch, tmp_path):
    """client-go reads a token file again every minute, refused or not: a token the kubelet replaced
    is not used until it expires, or until the API server starts refusing it."""
    rotate, api = in_cluster_client(dra_node, monkeypatch, tmp_path)
    try:
        with trio.fail_after(TIMEOUT):
            await api.get_claim("default", "c1")
            rotate("token-2")
            await api.get_claim("default", "c1")  # within the minute: the token read before
            monkeypatch.setattr(gp, "TOKEN_REREAD_SECONDS", 0.0)  # the minute is over
            await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    assert dra_node.api.bearers == ["token-1", "token-1", "token-2"]
    assert dra_node.api.refused_tokens == 0


#: A client-go credential plugin for the tests: it records each run (the KUBERNETES_EXEC_INFO it was
#: given, its args, the kubeconfig's env var, whether stdin is /dev/null, its PID) as a line of
#: ``runs`` beside it, and answers with the entry of ``answers.json`` for that run (the last one once
#: they run out): what it prints on stdout and stderr and its exit status, or it hangs (``hang``).
EXEC_PLUGIN = """#!{python}
import json, os, signal, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "runs"), "a+") as runs:
    runs.seek(0)
    count = len(runs.readlines())
    seen = {{
        "info": json.loads(os.environ["KUBERNETES_EXEC_INFO"]),
        "args": sys.argv[1:],
        "env": os.environ.get("GOPHER_EXEC_ENV"),
        "stdin": os.stat(0).st_rdev == os.stat(os.devnull).st_rdev,
        "pid": os.getpid(),
    }}
    runs.write(json.dumps(seen) + "\\n")
with open(os.path.join(here, "answers.json")) as file:
    answers = json.load(file)
answer = answers[min(count, len(answers) - 1)]
if answer.get("hang"):
    signal.pause()
sys.stdout.write(answer.get("stdout", ""))
sys.stderr.write(answer.get("stderr", ""))
sys.exit(answer.get("exit", 0))
"""


EXEC_V1 = "client.authentication.k8s.io/v1"


def exec_answer(token, expires=None, version=EXEC_V1, **status):
    """An answer of the plugin: an ExecCredential with this token (None: none) and expiry."""
    if token is not None:
        status["token"] = token
    if expires is not None:
        status["expirationTimestamp"] = expires
    return {"stdout": json.dumps({"apiVersion": version, "kind": "ExecCredential", "status": status})}


class ExecPlugin:
    """EXEC_PLUGIN in tmp_path/bin, and a kubeconfig in tmp_path for dra_node's API server whose user
    runs it by a path relative to the kubeconfig (``./bin/credential-plugin``), with ``answers``."""

    def __init__(self, dra_node, tmp_path, answers, **exec_fields):
        (tmp_path / "bin").mkdir()
        self.path = tmp_path / "bin" / "credential-plugin"
        self.path.write_text(EXEC_PLUGIN.format(python=sys.executable))
        self.path.chmod(0o755)
        self.runs_file = tmp_path / "bin" / "runs"
        (tmp_path / "bin" / "answers.json").write_text(json.dumps(answers))
        self.exec = {
            "apiVersion": EXEC_V1,
            "command": "./bin/credential-plugin",
            "args": ["get-token", "--cluster", "c"],
            "env": [{"name": "GOPHER_EXEC_ENV", "value": "from the kubeconfig"}],
            "interactiveMode": "IfAvailable",
            **exec_fields,
        }
        kubeconfig = yaml.safe_load(dra_node.kubeconfig.read_text())
        kubeconfig["users"] = [{"name": "u", "user": {"exec": self.exec}}]
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig))

    def runs(self):
        """What each run was given, in order."""
        if not self.runs_file.exists():
            return []
        return [json.loads(line) for line in self.runs_file.read_text().splitlines()]

    def connect(self):
        return gp.KubeApi.connect(kubeconfig=str(self.kubeconfig))


async def test_dra_exec_credential_plugin_token_is_sent_until_it_expires(dra_node, tmp_path):
    """lightkube ran a kubeconfig's exec plugin through asyncio, which has no event loop under trio:
    the first request failed with "no running event loop". Run under trio, as client-go runs it: the
    command relative to the kubeconfig, its args and env, KUBERNETES_EXEC_INFO (not interactive, no
    cluster without provideClusterInfo), stdin /dev/null; its token used until its expiry (one
    already past: run again at the next request)."""
    dra_node.api.tokens = {"token-1", "token-2"}
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(
        dra_node,
        tmp_path,
        [exec_answer("token-1", "2000-01-01T00:00:00Z"), exec_answer("token-2", "2999-01-01T00:00:00.123456789Z")],
    )
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            for _ in range(3):
                assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert dra_node.api.bearers == ["token-1", "token-2", "token-2"]
    request = {"apiVersion": EXEC_V1, "kind": "ExecCredential", "spec": {"interactive": False}}
    given = {"info": request, "args": ["get-token", "--cluster", "c"], "env": "from the kubeconfig", "stdin": True}
    assert [{k: v for k, v in run.items() if k != "pid"} for run in plugin.runs()] == [given, given]


@pytest.mark.slow
async def test_dra_exec_credential_plugin_runs_again_after_a_401_once_per_request(dra_node, tmp_path):
    """A 401 runs the plugin again and sends the request once more with the new token; a 401 for the
    token the plugin gives again is the answer. provideClusterInfo: spec.cluster in KUBERNETES_EXEC_INFO
    (the CA as base64 data, the cluster's exec extension as config). Concurrent requests share one run."""
    kubeconfig = yaml.safe_load(dra_node.kubeconfig.read_text())
    extension = {"name": "client.authentication.k8s.io/exec", "extension": {"audience": "gophers"}}
    kubeconfig["clusters"][0]["cluster"]["extensions"] = [extension]
    dra_node.kubeconfig.write_text(yaml.safe_dump(kubeconfig))
    dra_node.api.tokens = {"token-1"}
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-1"), exec_answer("token-2")], provideClusterInfo=True)
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:  # three at once: one run
                for _ in range(3):
                    nursery.start_soon(api.get_claim, "default", "c1")
            assert len(plugin.runs()) == 1
            dra_node.api.tokens = {"token-2"}  # token-1 revoked
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
            dra_node.api.tokens = {"token-3"}  # and token-2, which the plugin still gives
            with pytest.raises(gp.ApiError) as refused:
                await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    assert refused.value.status == 401
    assert dra_node.api.bearers == ["token-1"] * 3 + ["token-1", "token-2"] + ["token-2"]
    assert len(plugin.runs()) == 3
    ca = base64.b64encode(dra_node.ca_file.read_bytes()).decode()
    cluster = {"server": dra_node.api.url, "certificate-authority-data": ca, "config": {"audience": "gophers"}}
    assert plugin.runs()[0]["info"]["spec"] == {"interactive": False, "cluster": cluster}


@pytest.mark.parametrize(
    ("answer", "fields", "said"),
    [
        (
            {},
            {"command": "gopherplug-no-such-plugin", "installHint": "install it:\n  pip install gopher-auth"},
            "gopherplug-no-such-plugin not found on PATH: install it: pip install gopher-auth",
        ),
        (
            {"stderr": "reading the SSO cache\nthe SSO session has expired: run aws sso login\n", "exit": 255},
            {},
            "exited with 255: the SSO session has expired: run aws sso login (first: reading the SSO cache)",
        ),
        (
            {"stdout": "token-1\n"},
            {},
            "printed 8 bytes, not ExecCredential JSON (Expecting value: line 1 column 1 (char 0)); not shown here, "
            "as it may be a credential",
        ),
        (
            exec_answer("token-1", version="client.authentication.k8s.io/v1beta1"),
            {},
            "answered apiVersion 'client.authentication.k8s.io/v1beta1', the kubeconfig asks for "
            "client.authentication.k8s.io/v1: set exec.apiVersion to the one the plugin speaks",
        ),
        (exec_answer(None), {}, "printed an ExecCredential without status.token"),
        (
            exec_answer(None, clientCertificateData="-----BEGIN CERTIFICATE-----", clientKeyData="-----BEGIN KEY"),
            {},
            "answered a client certificate (status.clientCertificateData), which gopherplug does not use: "
            "have the plugin print a token, or put the certificate in the kubeconfig (client-certificate-data "
            "and client-key-data)",
        ),
        (
            exec_answer("token-1", "tomorrow"),
            {},
            "status.expirationTimestamp 'tomorrow' is not an RFC 3339 time (Invalid isoformat string: 'tomorrow')",
        ),
    ],
    ids=["missing", "exit", "not-json", "api-version", "no-token", "certificate", "expiry"],
)
async def test_dra_exec_credential_plugin_failure_is_one_line(dra_node, tmp_path, answer, fields, said):
    """Each way a plugin gives no token: the request fails with one line naming the kubeconfig user,
    the command and what went wrong (the install hint, the last line of stderr), and nothing is sent."""
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [answer], **fields)
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT), pytest.raises(gp.ApiError) as failed:
            await api.get_claim("default", "c1")
    finally:
        await api.aclose()
    command = plugin.exec["command"]
    assert str(failed.value) == (
        f"get ResourceClaim default/c1: kubeconfig user 'u': exec credential plugin {command}: {said}"
    )
    assert failed.value.status is None
    assert dra_node.api.bearers == []
    assert len(plugin.runs()) == (0 if "installHint" in fields else 1)


@pytest.mark.slow
async def test_dra_exec_credential_plugin_that_prints_a_bare_token_never_logs_it(dra_node, tmp_path, caplog):
    """A plugin that prints its token bare, not in an ExecCredential (`gcloud auth print-access-token`
    used as an exec plugin): every request fails with one line saying so, and no log line at any
    level, no error message, carries any part of the token, however many times it is retried. The
    kubeconfig's own contents neither: one the plugin cannot use names the file, not its text."""
    secret = "ya29.SeCrEt-" + "x7Q" * 20
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [{"stdout": secret + "\n", "stderr": ""}])
    caplog.set_level(logging.DEBUG)
    api = plugin.connect()
    failures = []
    try:
        with trio.fail_after(TIMEOUT):
            for _ in range(3):
                with pytest.raises(gp.ApiError) as failed:
                    await api.get_claim("default", "c1")
                failures.append(failed.value)
    finally:
        await api.aclose()
    broken = tmp_path / "broken-kubeconfig"
    broken.write_text(plugin.kubeconfig.read_text() + f"  token: {secret}\n - [\n")
    with pytest.raises(gp.GopherplugError) as unreadable:
        gp.KubeApi.connect(kubeconfig=str(broken))
    said = [record.getMessage() for record in caplog.records] + [str(error) for error in (*failures, unreadable.value)]
    said += [caplog.text]
    assert len(plugin.runs()) == 3
    assert "not ExecCredential JSON" in str(failures[0])
    pieces = {secret[i : i + 8] for i in range(len(secret) - 8)}  # no 8 characters of it in a row
    assert [line for line in said if any(piece in line for piece in pieces)] == []


def test_a_kubeconfig_without_contexts_is_one_line_saying_what_it_lacks(tmp_path):
    """lightkube reads the section by key: without this, the whole message was 'contexts'."""
    kubeconfig = tmp_path / "kubeconfig"
    cluster = {"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}
    document = {"apiVersion": "v1", "kind": "Config", "current-context": "x"}
    kubeconfig.write_text(yaml.safe_dump({**document, "clusters": [cluster], "users": [{"name": "u", "user": {}}]}))
    with pytest.raises(gp.GopherplugError) as caught:
        gp.KubeApi.connect(kubeconfig=str(kubeconfig))
    assert str(caught.value) == (
        f"no Kubernetes API configuration: {kubeconfig} has no 'contexts' section; a kubeconfig lists clusters, "
        "users and contexts, and names its current-context (kubectl config view shows it)"
    )


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            {"interactiveMode": "Always"},
            "interactiveMode Always needs a terminal to prompt at, and gopherplug runs the plugin without one: "
            "log in with the plugin first (its cached login is used) or give it a non-interactive way to get "
            "the token, and set interactiveMode: Never",
        ),
        (
            {"apiVersion": "client.authentication.k8s.io/v1alpha1"},
            "exec.apiVersion 'client.authentication.k8s.io/v1alpha1' is not one client-go accepts: use "
            "client.authentication.k8s.io/v1 or client.authentication.k8s.io/v1beta1",
        ),
    ],
    ids=["interactive", "api-version"],
)
async def test_dra_exec_credential_plugin_a_kubeconfig_cannot_use_is_refused(dra_node, tmp_path, fields, said):
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-1")], **fields)
    with pytest.raises(gp.GopherplugError) as refused:
        plugin.connect()
    assert str(refused.value) == f"kubeconfig user 'u': exec credential plugin ./bin/credential-plugin: {said}"
    assert plugin.runs() == []


@pytest.mark.slow
async def test_dra_exec_credential_plugin_that_hangs_is_killed(dra_node, tmp_path, monkeypatch):
    """client-go waits for a plugin forever; a driver cannot: past EXEC_CREDENTIAL_TIMEOUT the plugin
    is killed and the request fails with that line. The next request runs it again."""
    monkeypatch.setattr(gp, "EXEC_CREDENTIAL_TIMEOUT", 0.5)
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [{"hang": True}, exec_answer("token-1")])
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            with pytest.raises(gp.ApiError) as failed:
                await api.get_claim("default", "c1")
            [hung] = plugin.runs()
            with pytest.raises(ProcessLookupError):  # killed, and reaped
                os.kill(hung["pid"], 0)
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert str(failed.value) == (
        "get ResourceClaim default/c1: kubeconfig user 'u': exec credential plugin ./bin/credential-plugin: "
        "did not finish within 0.5 s (killed)"
    )
    assert dra_node.api.bearers == ["token-1"]


async def test_dra_exec_credential_plugin_steps_aside_for_the_users_token(dra_node, tmp_path):
    """A user with a token file and an exec plugin: the token file's token, as client-go sends it
    (its exec authenticator does nothing for a user with another credential); the plugin never runs."""
    dra_node.api.put_claim(claim("c1", "uid-1"))
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-2")])
    kubeconfig = yaml.safe_load(plugin.kubeconfig.read_text())
    kubeconfig["users"][0]["user"]["tokenFile"] = str(dra_node.token_file)
    plugin.kubeconfig.write_text(yaml.safe_dump(kubeconfig))
    api = plugin.connect()
    try:
        with trio.fail_after(TIMEOUT):
            assert (await api.get_claim("default", "c1"))["metadata"]["uid"] == "uid-1"
    finally:
        await api.aclose()
    assert dra_node.api.bearers == ["token-1"]
    assert plugin.runs() == []


@pytest.mark.slow
async def test_dra_driver_authenticates_with_an_exec_credential_plugin(dra_node, tmp_path):
    """The defect as a user met it: serve with KUBECONFIG naming a user with an exec plugin. The
    driver publishes its slices, every request with the plugin's token."""
    (dra_node.devices / "gopher0").touch()
    beta = "client.authentication.k8s.io/v1beta1"  # as `aws eks update-kubeconfig` writes it
    plugin = ExecPlugin(dra_node, tmp_path, [exec_answer("token-1", version=beta)], apiVersion=beta)
    dra_node.kubeconfig = plugin.kubeconfig  # start() sets KUBECONFIG to it
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    dra_node.stop()
    assert dra_node.api.bearers and set(dra_node.api.bearers) == {"token-1"}
    assert len(plugin.runs()) == 1


async def test_dra_needs_the_node_name(dra_node):
    with trio.fail_after(TIMEOUT), pytest.raises(gp.GopherplugError) as info:
        await dra_node.start(node_name="")
    assert str(info.value).startswith("NODE_NAME is not set: DRA needs this node's name")


@pytest.mark.slow
async def test_probe_shows_the_dra_driver_as_the_kubelet_sees_it(dra_node):
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").symlink_to("gone")  # dangling: unhealthy
    config = dra_node.root / "cfg.yaml"
    config.write_text(
        dra_config(dra_node.devices, dra_node.kubelet_dir, {"device_plugin_dir": str(dra_node.root)}, cdi=dra_node.cdi)
    )
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.load_config(str(config)))
        await dra_node.registered()
        result = await run_cli_async("probe", "--config", str(config))
    assert (result.returncode, result.stderr) == (0, b"")
    k = dra_node.kubelet_dir
    assert result.stdout.decode() == (
        f"DRA driver {DRIVER}: {k}/plugins_registry/{DRIVER}-reg.sock -> {k}/plugins/{DRIVER}/dra.sock: "
        "2 devices, 1 healthy; registered yes, kubelet health streams none\n"
        "  POOL                       DEVICE   HEALTH\n"
        f"  {DraNode.POOL}  gopher0  HEALTHY\n"
        f"  {DraNode.POOL}  gopher1  UNHEALTHY\n"
    )


async def dra_status(dra_node):
    """gopherplug's status on the DRAPlugin socket, as the probe reads it."""
    endpoint = str(dra_node.kubelet_dir / "plugins" / DRIVER / "dra.sock")
    return await gp.call_unary(endpoint, gp.GET_STATUS, gp.v1beta1.Empty(), timeout=TIMEOUT)


@pytest.mark.slow
async def test_probe_fails_a_dra_driver_the_kubelet_stopped_asking_after(dra_node, monkeypatch):
    """The kubelet says nothing when it drops a driver; the newest plugin watcher calls GetInfo on
    a registered one every 10 s, and stops. A driver that goes unasked for DRA_KUBELET_SILENCE is
    dropped, and the probe fails with the reason; one that is asked stays registered."""
    monkeypatch.setattr(gp, "DRA_KUBELET_SILENCE", 0.6)  # 30 GetInfo intervals: margin for a loaded CI machine
    dra_node.kubelet.info_interval = 0.02  # the newest kubelets' 10 s, sped up
    dra_node.kubelet.restart()
    registration = str(dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock")
    config = dra_node.root / "cfg.yaml"
    top = {"device_plugin_dir": str(dra_node.root)}
    config.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.load_config(str(config)))
        await dra_node.registered()
        await dra_node.kubelet.wait_until(lambda k: ("asked", registration) in k.events)
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # time itself is what is tested: asked all along
        assert (await dra_status(dra_node)).registered
        dra_node.kubelet.drop(DRIVER)
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # unasked for longer than the silence
        status = await dra_status(dra_node)
        result = await run_cli_async("probe", "--config", str(config), "--grace", "0")
    assert not status.registered
    assert re.fullmatch(r"it has not called GetInfo for \d+ s", status.dropped)
    assert result.returncode == 1
    assert re.fullmatch(
        rf"DRA driver {DRIVER}: FAILED: the kubelet registered it, then seems to have dropped it: it has not called "
        r"GetInfo for \d+ s\n",
        result.stdout.decode(),
    )


@pytest.mark.slow
async def test_dra_a_driver_whose_health_stream_the_kubelet_ended_counts_as_dropped(dra_node, monkeypatch):
    """A kubelet that does not call GetInfo again (up to 1.36) but streams health: the stream ending
    for good is the sign. A kubelet that did neither leaves the driver registered."""
    monkeypatch.setattr(gp, "DRA_KUBELET_SILENCE", 0.6)  # 30 GetInfo intervals: margin for a loaded CI machine
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # no sign either way: registered stays
        assert (await dra_status(dra_node)).registered
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            await reports.__anext__()
            await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)  # a stream open all along: registered
            assert (await dra_status(dra_node)).registered
        await trio.sleep(2 * gp.DRA_KUBELET_SILENCE)
        status = await dra_status(dra_node)
    assert not status.registered
    assert re.fullmatch(r"its health stream ended \d+ s ago", status.dropped)


@pytest.mark.slow
async def test_probe_fails_a_dra_driver_the_kubelet_refused_or_never_found(dra_node, nursery):
    refusing = dra_node.root / "refusing"
    old_kubelet = await nursery.start(standins.DraKubeletSimulator(str(refusing), versions=["v9.DRAPlugin"]).run)
    unwatched = dra_node.root / "unwatched"  # e.g. microk8s's kubelet root, with the default in the config
    results = {}
    for kubelet_dir in (refusing, unwatched):
        config = dra_node.root / f"{kubelet_dir.name}.yaml"
        top = {"device_plugin_dir": str(dra_node.root)}
        config.write_text(dra_config(dra_node.devices, kubelet_dir, top, cdi=dra_node.cdi))
        with trio.fail_after(TIMEOUT):
            await dra_node.start(gp.load_config(str(config)))
            if kubelet_dir == refusing:  # refused once NotifyRegistrationStatus told the plugin so
                await old_kubelet.wait_until(lambda k: any(e.startswith("refused") for e, _ in k.events))
            results[kubelet_dir.name] = await run_cli_async("probe", "--config", str(config), "--grace", "0")
        dra_node.stop()
    assert [r.returncode for r in results.values()] == [1, 1]
    assert results["refusing"].stdout.decode() == (
        f"DRA driver {DRIVER}: FAILED: the kubelet refused the driver: none of the versions "
        "['v1.DRAPlugin', 'v1beta1.DRAPlugin', 'v1.DRAResourceHealth', 'v1beta1.DRAResourceHealth', "
        "'v1alpha1.DRAResourceHealth'] is supported\n"
    )
    assert re.fullmatch(
        rf"DRA driver {DRIVER}: FAILED: no kubelet has registered it in \d+ s: is {unwatched} the kubelet's "
        r"root directory\?\n",
        results["unwatched"].stdout.decode(),
    )


@pytest.mark.slow
async def test_liveness_check_of_a_dra_driver_passes_registered_and_fails_refused(dra_node, nursery):
    """GET /healthz of a DRA driver: 200 once the kubelet registered it; a kubelet that refused it
    (none of its versions known) makes the check fail, with the kubelet's reason."""
    refusing = dra_node.root / "refusing"
    old_kubelet = await nursery.start(standins.DraKubeletSimulator(str(refusing), versions=["v9.DRAPlugin"]).run)
    answers = {}
    for kubelet_dir in (dra_node.kubelet_dir, refusing):
        port = _free_loopback_port()
        top = {"device_plugin_dir": str(dra_node.root), "health_address": f"127.0.0.1:{port}"}
        config = gp.parse_config(dra_config(dra_node.devices, kubelet_dir, top, cdi=dra_node.cdi), "cfg.yaml")
        with trio.fail_after(TIMEOUT):
            await dra_node.start(config)
            if kubelet_dir == refusing:
                await old_kubelet.wait_until(lambda k: any(e.startswith("refused") for e, _ in k.events))
            else:
                await dra_node.registered()
            answers[kubelet_dir.name] = await _healthz(port)
        dra_node.stop()
    assert answers[dra_node.kubelet_dir.name] == (200, "ok\n")
    code, said = answers["refusing"]
    assert code == 503
    assert said.startswith(f"DRA driver {DRIVER}: the kubelet refused it: none of the versions ['v1.DRAPlugin'")
    assert said.endswith(" is supported\n") and said.count("\n") == 1


@pytest.mark.slow
def test_lightkube_is_imported_only_for_dra(tmp_path):
    program = (
        "import sys, gopherplug; gopherplug.parse_config(open(sys.argv[1]).read()); "
        "print('lightkube' in sys.modules, 'httpx2' in sys.modules)"
    )
    (tmp_path / "cfg.yaml").write_text(MINIMAL)
    result = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path / "cfg.yaml")], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kubelet_versions", "path"),
    [
        # the kubelet's main branch (planned for 1.37): the newest the driver lists
        (
            ["v1.DRAResourceHealth", "v1beta1.DRAResourceHealth", DRA_V1ALPHA1],
            "/v1.DRAResourceHealth/NodeWatchResources",
        ),
        (["v1beta1.DRAResourceHealth", DRA_V1ALPHA1], "/v1beta1.DRAResourceHealth/NodeWatchResources"),
        ([DRA_V1ALPHA1], f"/{DRA_V1ALPHA1}/NodeWatchResources"),  # 1.34 to 1.36
    ],
)
async def test_dra_health_is_served_in_the_newest_version_a_kubelet_speaks(dra_node, kubelet_versions, path):
    """GetInfo lists DRAResourceHealth v1, v1beta1 and v1alpha1, newest first; each kubelet streams
    health in the version it prefers, and gets every device."""
    (dra_node.devices / "gopher0").touch()
    dra_node.kubelet.health_versions = kubelet_versions
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        listed = dra_node.kubelet.drivers[DRIVER].supported_versions
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            report = await reports.__anext__()
    assert [v for v in listed if v.endswith(".DRAResourceHealth")] == [
        "v1.DRAResourceHealth",
        "v1beta1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    assert dra_node.kubelet.health_paths == [path]
    assert [(d.device.device_name, d.health) for d in report.devices] == [("gopher0", gp.drahealth.HEALTHY)]


@pytest.mark.slow
async def test_dra_health_stream_follows_the_devices_and_is_sent_again(dra_node, monkeypatch):
    """NodeWatchResources: every device at once, a device turning unhealthy (with why) at once,
    and everything again after DRA_HEALTH_RESEND with nothing changed: the kubelet forgets a report
    DRA_HEALTH_TIMEOUT after it came, and the device would read Unknown in the pod's status."""
    monkeypatch.setattr(gp, "DRA_HEALTH_RESEND", 0.2)  # the test need not wait 10 s for the repeat
    (dra_node.devices / "node0").touch()
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()

    def healths(report):
        assert {d.device.pool_name for d in report.devices} == {DraNode.POOL}
        assert {d.health_check_timeout_seconds for d in report.devices} == {gp.DRA_HEALTH_TIMEOUT}
        assert all(abs(d.last_updated_time - time.time()) < TIMEOUT for d in report.devices)
        return {d.device.device_name: (d.health, d.message) for d in report.devices}

    ok = (gp.drahealth.HEALTHY, "")
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(pattern="gopher*", cdi=dra_node.cdi))
        await dra_node.registered()
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            assert healths(await reports.__anext__()) == {"gopher0": ok, "gopher1": ok}
            (dra_node.devices / "node0").unlink()
            while (now := healths(await reports.__anext__()))["gopher0"] == ok:
                pass
            assert now == {
                "gopher0": (
                    gp.drahealth.UNHEALTHY,
                    f"{dra_node.devices}/gopher0 is a symlink to node0, which does not exist",
                ),
                "gopher1": ok,
            }
            assert healths(await reports.__anext__()) == now  # nothing changed: the same, sent again

        def healthy_in_slices():
            (item,) = dra_node.api.slices.values()
            return {d["name"]: d["attributes"]["healthy"]["bool"] for d in item["spec"]["devices"]}

        while healthy_in_slices() != {"gopher0": False, "gopher1": True}:  # the slice says so too
            await dra_node.api.changed.wait_touched()


@pytest.mark.slow
async def test_dra_an_unhealthy_device_is_tainted_in_its_slice_until_it_recovers(dra_node):
    """An unhealthy device carries a NoSchedule taint under the driver's domain: the scheduler
    allocates it only to a claim that tolerates the taint. The reason, a sentence, is no label
    value: the value is a fixed word, the reason in the health stream. Healthy again: no taint."""
    (dra_node.devices / "node0").touch()
    (dra_node.devices / "gopher0").symlink_to("node0")
    (dra_node.devices / "gopher1").touch()

    def taints():
        if len(dra_node.api.slices) != 1:
            return None
        (item,) = dra_node.api.slices.values()
        return {d["name"]: d.get("taints") for d in item["spec"]["devices"]}

    async def until(wanted):
        while taints() != wanted:
            await dra_node.api.changed.wait_touched()

    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(pattern="gopher*", cdi=dra_node.cdi))
        await until({"gopher0": None, "gopher1": None})
        (dra_node.devices / "node0").unlink()
        while not (taints() or {}).get("gopher0"):
            await dra_node.api.changed.wait_touched()
        (taint,) = taints()["gopher0"]
        assert taint["timeAdded"]  # the API server adds it
        wanted = {"key": f"{DRIVER}/unhealthy", "value": "unhealthy", "effect": "NoSchedule"}
        assert {k: v for k, v in taint.items() if k != "timeAdded"} == wanted
        assert taints()["gopher1"] is None
        (dra_node.devices / "node0").touch()
        await until({"gopher0": None, "gopher1": None})


async def test_dra_unhealthy_taint_noexecute_from_the_configuration(dra_node):
    """dra.unhealthy_taint: NoExecute taints an unhealthy device so that its pods are evicted; any
    other value is one clear error line."""
    text = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, {"device_plugin_dir": "/dp"}))
    assert gp.parse_config(yaml.safe_dump(text), "cfg.yaml").dra.unhealthy_taint == "NoSchedule"
    text["dra"]["unhealthy_taint"] = "Evict"
    with pytest.raises(gp.ConfigError) as info:
        gp.parse_config(yaml.safe_dump(text), "cfg.yaml")
    assert str(info.value) == (
        "cfg.yaml: dra.unhealthy_taint: 'Evict': must be NoSchedule (keep new claims off an unhealthy device) "
        "or NoExecute (also evict)"
    )
    text["dra"]["unhealthy_taint"] = "NoExecute"
    text["device_plugin_dir"] = str(dra_node.root / "dp")
    text["resources"][0]["cdi"] = dra_node.cdi
    config = gp.parse_config(yaml.safe_dump(text), "cfg.yaml")
    assert config.dra.unhealthy_taint == "NoExecute"
    (dra_node.devices / "gopher0").symlink_to("node0")  # dangling: unhealthy from the start
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.wait_for_slices(["gopher0"])
        (item,) = dra_node.api.slices.values()
        assert [t["effect"] for t in item["spec"]["devices"][0]["taints"]] == ["NoExecute"]


@pytest.mark.slow
async def test_dra_grpcio_kubelet_interoperates(dra_node, tmp_path):
    """The kubelet's side played by grpcio (C core) with protoc-generated messages: GetInfo on the
    registration socket, then NodePrepareResources on the endpoint, in v1 and in v1beta1, and
    NodeWatchResources in v1, v1beta1 and v1alpha1."""
    for name in ("pluginregistration.proto", "dra.proto", "dra_health.proto"):
        assert protoc.main(["protoc", f"-I{HERE}", f"--python_out={tmp_path}", name]) == 0
    modules = {}
    for name in ("pluginregistration_pb2", "dra_pb2", "dra_health_pb2"):
        spec = importlib.util.spec_from_file_location(f"grpcio_{name}", tmp_path / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    reg, dra_pb2, health_pb2 = modules["pluginregistration_pb2"], modules["dra_pb2"], modules["dra_health_pb2"]
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    config = dra_node.config(cdi={"kind": "example.com/gopher", "spec_dir": str(dra_node.root / "cdi")})

    def kubelet():
        with grpc.insecure_channel(f"unix://{config.dra.registration_socket}") as channel:
            get_info = channel.unary_unary(
                "/pluginregistration.Registration/GetInfo",
                request_serializer=reg.InfoRequest.SerializeToString,
                response_deserializer=reg.PluginInfo.FromString,
            )
            info = get_info(reg.InfoRequest(), timeout=5)
        answers = []
        with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
            for package in ("v1", "v1beta1"):
                prepare = channel.unary_unary(
                    f"/k8s.io.kubelet.pkg.apis.dra.{package}.DRAPlugin/NodePrepareResources",
                    request_serializer=dra_pb2.NodePrepareResourcesRequest.SerializeToString,
                    response_deserializer=dra_pb2.NodePrepareResourcesResponse.FromString,
                )
                request = dra_pb2.NodePrepareResourcesRequest(
                    claims=[dra_pb2.Claim(namespace="default", uid="uid-1", name="c1")]
                )
                answers.append(prepare(request, timeout=5))
            healths = []
            for version in ("v1", "v1beta1", "v1alpha1"):  # the same messages in each version
                watch = channel.unary_stream(
                    f"/{version}.DRAResourceHealth/NodeWatchResources",
                    request_serializer=health_pb2.NodeWatchResourcesRequest.SerializeToString,
                    response_deserializer=health_pb2.NodeWatchResourcesResponse.FromString,
                )
                reports = watch(health_pb2.NodeWatchResourcesRequest(), timeout=5)
                healths.append(next(reports))
                reports.cancel()
        return info, answers, healths

    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.wait_for_slices(["gopher0"])
        info, answers, healths = await in_thread(kubelet)
    assert (info.type, info.name, list(info.supported_versions)) == (
        "DRAPlugin",
        DRIVER,
        [
            "v1.DRAPlugin",
            "v1beta1.DRAPlugin",
            "v1.DRAResourceHealth",
            "v1beta1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        ],
    )
    assert info.endpoint == config.dra.endpoint
    for answer in answers:
        assert list(answer.claims["uid-1"].devices[0].cdi_device_ids) == [
            "example.com/gopher=gopher0",
            "example.com/gopher=uid-1_gopher",
        ]
    for health in healths:
        (device,) = health.devices
        assert (device.device.pool_name, device.device.device_name) == (DraNode.POOL, "gopher0")
        assert (device.health, device.health_check_timeout_seconds) == (health_pb2.HEALTHY, 30)


def test_dra_documents_the_kubernetes_version_its_api_client_needs():
    """KubeApi speaks resource.k8s.io/v1 only, GA in 1.34: what a user reads first says so, and
    nothing promises 1.32 or 1.33 (their API servers serve only the beta versions)."""
    readme = (HERE / "README.md").read_text()
    for where, text in [
        ("the module docstring", gp.__doc__),
        ("KubeApi", gp.KubeApi.__doc__),
        ("README.md", readme),
        ("docs/dra.md", (HERE / "docs" / "dra.md").read_text()),
        ("daemonset-dra.yaml", (HERE / "daemonset-dra.yaml").read_text()),
    ]:
        assert re.search(r"Kubernetes\s+1\.34\s+or\s+later|1\.34\+", text), where
    assert not re.search(r"1\.32 and 1\.33 with", readme)


def test_the_two_daemonsets_share_the_nodes_by_the_api_label():
    """A node serves a resource through one API: the device-plugin DaemonSet runs where the label
    gopherplug.example.com/api is not dra (so every node of an existing cluster keeps it), the DRA
    one only where it is; any value of the label runs exactly one of them."""

    def node_affinity(manifest):
        with open(HERE / manifest, encoding="utf-8") as file:
            (daemon_set,) = [item for item in yaml.safe_load_all(file) if item["kind"] == "DaemonSet"]
        required = daemon_set["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        (term,) = required["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        (requirement,) = term["matchExpressions"]
        return requirement

    def runs(term, labels):  # the NotIn and In of a node selector requirement (k8s.io/api core/v1)
        value = labels.get(term["key"])
        return value in term["values"] if term["operator"] == "In" else value not in term["values"]

    device_plugin, dra = node_affinity("daemonset.yaml"), node_affinity("daemonset-dra.yaml")
    assert device_plugin == {"key": "gopherplug.example.com/api", "operator": "NotIn", "values": ["dra"]}
    assert dra == {"key": "gopherplug.example.com/api", "operator": "In", "values": ["dra"]}
    for labels in ({}, {"gopherplug.example.com/api": "dra"}, {"gopherplug.example.com/api": "device-plugin"}):
        assert runs(device_plugin, labels) != runs(dra, labels), labels


@pytest.mark.slow
def test_dra_manifest_is_valid_and_agrees_with_its_configuration():
    for version in ("1.34.0", "1.37.0"):
        result = check("kubernetes-validate", "--strict", "-k", version, "daemonset-dra.yaml")
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count("passed") == 9
    with open(HERE / "daemonset-dra.yaml", encoding="utf-8") as file:
        objects = {item["kind"]: item for item in yaml.safe_load_all(file) if item["kind"] != "DeviceClass"}
    config = gp.parse_config(objects["ConfigMap"]["data"]["config.yaml"], "daemonset-dra.yaml ConfigMap")
    (resource,) = config.resources
    classes = {item["metadata"]["name"]: item["spec"] for item in shipped_device_classes()}
    assert list(classes) == ["gopher.example.com", "gopher.example.com-admin"]
    for spec in classes.values():
        expression = spec["selectors"][0]["cel"]["expression"]
        assert f'device.driver == "{config.dra.driver}"' in expression
        assert f'.resource == "{resource.name}"' in expression
    # Pods that ask for the resource in resources.limits are served by DRA where the driver runs,
    # through the ordinary class; it selects healthy devices only, which every version honours (the
    # unhealthy taint is dropped before 1.36), so admin-access claims have a class of their own.
    assert classes["gopher.example.com"]["extendedResourceName"] == resource.name
    assert classes["gopher.example.com"]["selectors"][0]["cel"]["expression"].endswith(
        f'device.attributes["{config.dra.driver}"].healthy'
    )
    assert "extendedResourceName" not in classes["gopher.example.com-admin"]
    assert "healthy" not in classes["gopher.example.com-admin"]["selectors"][0]["cel"]["expression"]
    rules = {tuple(rule["resources"]): set(rule["verbs"]) for rule in objects["ClusterRole"]["rules"]}
    assert rules == {
        ("resourceslices",): {"list", "watch", "create", "update", "delete"},
        ("resourceclaims",): {"get"},
        ("resourceclaims/status",): {"patch"},  # status.devices, by server-side apply
        ("resourceclaims/driver",): {"associated-node:patch"},  # 1.36+: the same write, for its driver
        ("nodes",): {"get", "list", "watch"},  # its Node, watched: the slices' owner, the allocatable
    }
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item for item in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # Zero-gap upgrades: the new pod next to the old one, its sockets named after its UID.
    assert env[gp.POD_UID_ENV]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.uid"
    strategy = objects["DaemonSet"]["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert {f"{config.dra.kubelet_dir}/plugins_registry", config.dra.plugin_dir} <= mounts
    assert f"{config.dra.kubelet_dir}/plugins" not in mounts  # its own directory only
    assert resource.cdi.spec_dir in mounts
