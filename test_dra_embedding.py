"""DRA for embedders: serve_dra_devices and the pieces a program composes."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import types
import uuid
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
import yaml
from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

import gopherplug as gp
import gopherplug_standins as standins
from gopherplug import v1beta1
from testsupport import (
    DEBUG,
    DRIVER,
    HERE,
    NODE_UID,
    PRIORITIZED_REQUESTS,
    RESOURCE,
    SHARE_1,
    TIMEOUT,
    WARNING,
    WIDGET,
    DraNode,
    claim,
    dra_config,
    gopher_pod,
    logged,
    read_spec,
    run_cli_async,
    shipped_device_class,
    stopped,
    streaming,
)

# DRA for embedders: serve_dra_devices, on the devices a program gives serve_devices.

WIDGET_POOL = "node-1/example.com/widget"


def widget(name, directory, container_path="/dev/{id}", **fields):
    """An embedding program's DeviceEntry: a node under ``directory``, /dev/<id> in the container."""
    path = str(directory / name)
    return gp.DeviceEntry(name, path, device_specs=(gp.DeviceSpecTemplate(path, container_path),), **fields)


def widget_claim(driver, device):
    """ResourceClaim default/c1 (uid-1), its request "widget" allocated ``device`` of the widget pool."""
    requests = [{"name": "widget", "exactly": {"deviceClassName": "widget"}}]
    return claim("c1", "uid-1", ("widget", driver, WIDGET_POOL, device), requests=requests)


async def serve_dra_widgets(dra_node, devices, resource=None, **options):
    """serve_dra_devices in process, as an embedding program calls it, against the node's API server
    (through a kubeconfig) and DRA kubelet; returns its cancel scope and what it started with."""
    resource = resource or gp.resource_config("example.com/widget", env="WIDGETS")
    scope = trio.CancelScope()
    options = {
        "driver": DRIVER,
        "node_name": "node-1",
        "kubeconfig": str(dra_node.kubeconfig),
        "kubelet_dir": str(dra_node.kubelet_dir),
        "cdi_dir": str(dra_node.root / "cdi"),  # never the machine's /var/run/cdi
        **options,
    }

    async def run(task_status):
        with scope:
            await gp.serve_dra_devices(resource, devices, **options, task_status=task_status)

    return scope, await dra_node.nursery.start(run)


async def test_dra_embedded_devices_carry_the_resources_attributes_their_own_and_describes(dra_node, caplog):
    """Resource_config takes attributes, capacity and describe as the file does; with
    serve_dra_devices, a device's slice entry has the literals, what the program's DeviceEntry
    carries itself, and what describe (run as the program's devices come) says, none replacing
    another. A new device is described again."""
    widgets = dra_node.root / "widgets"
    script = dra_node.root / "describe"
    script.write_text(
        f"#!{sys.executable}\nimport json, os\n"
        "ids = os.environ['GOPHERPLUG_DEVICES'].split(',')\n"
        "print(json.dumps({i: {'attributes': {'uuid': 'U-' + i, 'serial': 'not-this'}} for i in ids}))\n"
    )
    script.chmod(0o755)
    resource = gp.resource_config(
        "example.com/widget",
        env="WIDGETS",
        attributes={"model": "W-1"},
        capacity={"memory": "1Gi"},
        describe=[str(script)],
    )
    own = {"attributes": (("serial", "string", "S0"), ("bad-name", "string", "x")), "capacity": (("lanes", "16"),)}
    devices = gp.Watched({"w0": widget("w0", widgets, **own)})

    def entries():
        return {d["name"]: d for s in dra_node.api.slices.values() for d in s["spec"]["devices"]}

    with trio.fail_after(TIMEOUT), caplog.at_level("INFO", logger="gopherplug"):
        await serve_dra_widgets(dra_node, devices, resource)
        while "uuid" not in entries().get("w0", {}).get("attributes", {}):
            await dra_node.api.changed.wait_touched()
        devices.set({**devices.value, "w1": widget("w1", widgets)})
        while "uuid" not in entries().get("w1", {}).get("attributes", {}):
            await dra_node.api.changed.wait_touched()
    w0 = entries()["w0"]
    assert {name: w0["attributes"][name] for name in ("model", "serial", "uuid")} == {
        "model": {"string": "W-1"},
        "serial": {"string": "S0"},  # the program's, not describe's
        "uuid": {"string": "U-w0"},
    }
    assert w0["capacity"] == {"memory": {"value": "1Gi"}, "lanes": {"value": "16"}}
    assert entries()["w1"]["attributes"]["serial"] == {"string": "not-this"}  # w1 has none of its own
    assert "bad-name" not in w0["attributes"]  # the device's own, checked too: left out, said once
    assert len([line for line in caplog.messages if "device w0: attributes.bad-name: the device's own" in line]) == 1
    assert [standins.resource_slice_causes(item) for item in dra_node.api.slices.values()] == [[]]


async def test_dra_embedded_device_metadata_can_be_turned_off(dra_node):
    """serve_dra_devices(device_metadata=False) is dra: {device_metadata: false}: the claim's devices
    get their own CDI device alone, and no metadata file is written."""
    widgets = dra_node.root / "widgets"
    devices = gp.Watched({"w1": widget("w1", widgets)})
    kind = gp.dra_cdi_kind(DRIVER, "example.com/widget")
    with trio.fail_after(TIMEOUT):
        scope, driver = await serve_dra_widgets(dra_node, devices, device_metadata=False)
        assert driver.config.device_metadata is False
        await dra_node.registered()
        await dra_node.wait_for_slices(["w1"], WIDGET_POOL)
        dra_node.api.put_claim(widget_claim(DRIVER, "w1"))
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert [(d.device_name, list(d.cdi_device_ids)) for d in answer.devices] == [
            ("w1", [f"{kind}=w1", f"{kind}=uid-1_widget"])
        ]
        scope.cancel()
    assert not (dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata").exists() or not any(
        (dra_node.kubelet_dir / "plugins" / DRIVER / "dra-device-metadata").iterdir()
    )


async def test_dra_embedded_devices_are_published_prepared_and_their_health_followed(dra_node):
    """The devices a program sets are the pool's, a claim prepared gets their CDI devices, a device
    the program calls unhealthy is tainted in the slice and reported so in the health stream, one
    it removes leaves both; entries that a directory's checks would skip are skipped, and said."""
    widgets = dra_node.root / "widgets"
    good = {name: widget(name, widgets) for name in ("w0", "w1")}
    bad = {
        "w/2": widget("w/2", widgets),  # not a device ID
        "w3": widget("w4", widgets),  # under another ID than its own
        "w5": widget("w5", widgets, "/dev/widget{index}"),  # a container path per allocation
    }
    devices = gp.Watched({**good, **bad})
    kind = gp.dra_cdi_kind(DRIVER, "example.com/widget")

    def healths(report):
        assert {d.device.pool_name for d in report.devices} == {WIDGET_POOL}
        return {d.device.device_name: (d.health, d.message) for d in report.devices}

    def taints():
        (item,) = dra_node.api.slices.values()
        return {d["name"]: [(t["key"], t["value"]) for t in d.get("taints", [])] for d in item["spec"]["devices"]}

    ok = (gp.drahealth.HEALTHY, "")
    with trio.fail_after(TIMEOUT), logged("skipping") as skipped:
        scope, driver = await serve_dra_widgets(dra_node, devices)
        assert driver.config.registration_socket == str(
            dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
        )
        await dra_node.registered()
        await dra_node.wait_for_slices(["w0", "w1"], WIDGET_POOL)
        dra_node.api.put_claim(widget_claim(DRIVER, "w1"))
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        metadata = f"{DRIVER}/metadata=uid-1_widget"  # on by default in serve_dra_devices too
        assert [(d.device_name, list(d.cdi_device_ids)) for d in answer.devices] == [
            ("w1", [f"{kind}=w1", f"{kind}=uid-1_widget", metadata])
        ]
        spec = read_spec(dra_node.root / "cdi" / f"{kind.replace('/', '-')}.json")
        assert {d["name"]: d["containerEdits"] for d in spec["devices"]} == {
            name: {
                "env": [f"WIDGETS_{name.upper()}={name}"],
                "deviceNodes": [{"path": f"/dev/{name}", "hostPath": str(widgets / name), "permissions": "rw"}],
            }
            for name in ("w0", "w1")
        }
        async with dra_node.kubelet.watch_health(DRIVER) as reports:
            assert healths(await reports.__anext__()) == {"w0": ok, "w1": ok}
            devices.set({**devices.value, "w0": widget("w0", widgets, health=gp.UNHEALTHY, problem="overheated")})
            while (now := healths(await reports.__anext__()))["w0"] == ok:
                pass
        assert now == {"w0": (gp.drahealth.UNHEALTHY, "overheated"), "w1": ok}
        while taints() != {"w0": [(f"{DRIVER}/unhealthy", "overheated")], "w1": []}:
            await dra_node.api.changed.wait_touched()
        devices.set({"w1": good["w1"]})
        await dra_node.wait_for_slices(["w1"], WIDGET_POOL)
        assert [d["name"] for d in read_spec(dra_node.root / "cdi" / f"{kind.replace('/', '-')}.json")["devices"]] == [
            "w1"
        ]
        await dra_node.kubelet.unprepare(DRIVER, [("default", "uid-1", "c1")])
        scope.cancel()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
    assert (
        skipped.lines
        == [  # each once, though the devices were set again with them
            f"{WIDGET}: skipping 'w/2': a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'",
            f"{WIDGET}: skipping 'w3': the key must be its DeviceEntry's id, 'w4'",
            WIDGET + ": skipping 'w5': container path '/dev/widget{index}': a CDI device is described once, not per "
            "allocation: only {id} and {path} can be filled in",
        ]
    )
    assert os.listdir(dra_node.kubelet_dir / "plugins_registry") == []


@pytest.mark.parametrize(
    ("resource_options", "options", "message"),
    [
        (
            {},
            {"driver": "Widget_Driver"},
            "driver: 'Widget_Driver': must be a lower-case DNS subdomain of at most 63 characters, "
            "e.g. gopherplug.example.com",
        ),
        (
            {},
            {"node_name": None},
            "node_name: is required: this node's name (default: NODE_NAME, in a DaemonSet from the downward API: "
            "valueFrom.fieldRef.fieldPath: spec.nodeName)",
        ),
        ({}, {"node_name": "Node_1"}, "node_name: 'Node_1' is not a node's name (a lower-case DNS subdomain)"),
        ({}, {"kubelet_dir": "var/lib/kubelet"}, "kubelet_dir: 'var/lib/kubelet' must be an absolute path"),
        (
            {},
            {"unhealthy_taint": "Evict"},
            "unhealthy_taint: 'Evict': must be NoSchedule (keep new claims off an unhealthy device) or NoExecute "
            "(also evict)",
        ),
        (
            {},
            {"pod_uid": "a/b"},
            "pod_uid: 'a/b' is not a pod UID: set it from the downward API (valueFrom.fieldRef.fieldPath: "
            "metadata.uid), or leave it unset",
        ),
        ({}, {"cdi_dir": "cdi"}, "cdi_dir: 'cdi' must be an absolute path"),
        (
            {},
            {"cdi_kind": "widgets"},
            "cdi_kind: 'widgets': must be vendor/class, e.g. example.com/gopher (a DNS name, then 2 to 63 of "
            "A-Z a-z 0-9 _ . -; each beginning with a letter)",
        ),
        (
            {"annotations": {"widget": "{id}"}},
            {},
            "annotations: is for the device-plugin API, and this resource has api: dra (devices reach containers "
            "only as CDI devices)",
        ),
        (
            {"env": "LD"},
            {},
            "env: 'LD': with cdi, each device sets LD_<ID>, which could name a variable the shell or the dynamic "
            "loader give meaning to: choose another name",
        ),
    ],
)
async def test_serve_dra_devices_refuses_arguments_a_configuration_file_would_refuse(
    resource_options, options, message, sockdir, monkeypatch
):
    """One line each, naming the keyword, before anything starts (no socket, no API client)."""
    monkeypatch.delenv("NODE_NAME", raising=False)
    resource = gp.resource_config("example.com/widget", **resource_options)
    arguments = {"driver": DRIVER, "node_name": "node-1", "kubelet_dir": str(sockdir), "cdi_dir": str(sockdir)}
    with trio.fail_after(TIMEOUT), pytest.raises(gp.ConfigError) as info:
        await gp.serve_dra_devices(resource, gp.Watched({}), **{**arguments, **options})
    assert str(info.value) == f"serve_dra_devices('example.com/widget'): {message}"
    assert os.listdir(sockdir) == []


@pytest.mark.slow
async def test_embedding_dra_example_serves_widgets_and_leaves_only_the_kubelets_files_on_sigterm(dra_node, tmp_path):
    """examples/embedding/dra_driver.py, run as a user would outside a pod (NODE_NAME, KUBECONFIG,
    the directories as options) against the API server and DRA kubelet stand-ins: its widgets are
    published, a claim prepared gets a widget's CDI device, a widget removed leaves the pool, and
    SIGTERM stops it with its sockets gone (the checkpoint stays, for the next pod of the driver)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("widget0", "widget1", "other"):
        (dev / name).touch()
    driver, kind = "widget.example.com", "widget.example.com/widget"
    env = {**os.environ, "NODE_NAME": "node-1", "KUBECONFIG": str(dra_node.kubeconfig), "PYTHONPATH": str(HERE)}
    argv = [sys.executable, str(HERE / "examples" / "embedding" / "dra_driver.py")]
    argv += ["--kubelet-dir", str(dra_node.kubelet_dir), "--cdi-dir", str(tmp_path / "cdi"), "--dev-dir", str(dev)]
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await trio.lowlevel.open_process(argv, stderr=stderr, env=env)
    try:
        with trio.fail_after(TIMEOUT):
            await dra_node.kubelet.wait_until(lambda k: driver in k.drivers)
            await dra_node.wait_for_slices(["widget0", "widget1"], WIDGET_POOL)
            dra_node.api.put_claim(widget_claim(driver, "widget1"))
            answer = (await dra_node.kubelet.prepare(driver, [("default", "uid-1", "c1")])).claims["uid-1"]
            metadata = f"{driver}/metadata=uid-1_widget"  # the example's driver mounts device metadata
            assert (answer.error, [list(d.cdi_device_ids) for d in answer.devices]) == (
                "",
                [[f"{kind}=widget1", f"{kind}=uid-1_widget", metadata]],
            )
            (dev / "widget0").unlink()
            await dra_node.wait_for_slices(["widget1"], WIDGET_POOL)
            await dra_node.kubelet.unprepare(driver, [("default", "uid-1", "c1")])
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0, (tmp_path / "stderr").read_text()
            await dra_node.kubelet.wait_until(lambda k: driver not in k.drivers)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert os.listdir(dra_node.kubelet_dir / "plugins_registry") == []
    assert sorted(os.listdir(dra_node.kubelet_dir / "plugins")) == [driver]
    assert sorted(os.listdir(dra_node.kubelet_dir / "plugins" / driver)) == [
        "checkpoint.json",
        "dra-device-metadata",
        "serialize.lock",
    ]
    assert os.listdir(dra_node.kubelet_dir / "plugins" / driver / "dra-device-metadata") == []  # the claim's went
    assert "Traceback" not in (tmp_path / "stderr").read_text()


@pytest.fixture
def publishers(monkeypatch):
    """Every SlicePublisher the plugin makes in this test, in the order made (one per DRA pod)."""
    made = []

    class Recorded(gp.SlicePublisher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(gp, "SlicePublisher", Recorded)
    return made


async def seen_by(publisher, names):
    """Until ``publisher``'s watch has brought it the pool's slices with these devices (then what it
    does of them runs on the event loop: wait_all_tasks_blocked sees it done; a scan in a worker
    thread it would not)."""
    while sorted(d["name"] for s in publisher.known.values() for d in s["spec"]["devices"]) != names:
        await publisher.known_changed.wait_touched()


@pytest.mark.slow
async def test_dra_two_pods_of_a_rolling_update_do_not_fight_over_the_slices(dra_node, publishers):
    """During the overlap both pods keep the node's slices, and the new one may see the devices
    otherwise (here: its configuration takes every gopher, the old one's only gopher0). The newest
    pod writes them; the old one leaves them to it, even as the new one's writes reach its watch,
    rather than writing its own view back (a new generation each time, until the old pod is gone).
    Once the new pod is gone (a rollback), the old one writes them again."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    new_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b")
    with trio.fail_after(3 * TIMEOUT):  # events all through; the bound stops a hang of two pods' start-ups
        await dra_node.start(
            gp.with_pod_uid(dra_node.config(pattern="gopher0"), "0a1b2c3d-0000-4000-8000-00000000001a")
        )
        await dra_node.wait_for_slices(["gopher0"])
        with logged("the slices are left to it") as left:
            new = await dra_node.start(new_config)
            old_publisher, new_publisher = publishers
            while old_publisher.deferring.value != new_config.dra.registration_socket:
                await old_publisher.deferring.wait_touched()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        await seen_by(old_publisher, ["gopher0", "gopher1"])
        await trio.testing.wait_all_tasks_blocked()
        writes = len(dra_node.api.writes)
        (dra_node.devices / "gopher2").touch()  # the new pod writes it; the old one, its watch woken, does not undo it
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        await seen_by(old_publisher, ["gopher0", "gopher1", "gopher2"])
        await trio.testing.wait_all_tasks_blocked()
        assert dra_node.slice_devices()[0] == ["gopher0", "gopher1", "gopher2"]
        assert len(dra_node.api.writes) - writes == 1
        assert new_publisher.deferring.value == ""
        new.cancel()  # the new pod goes, say the rollout is undone: the old one writes its view again
        await dra_node.wait_for_slices(["gopher0"])
        assert old_publisher.deferring.value == ""
    assert left.lines == [
        f"DRA: a newer pod of driver {DRIVER} serves ({new_config.dra.registration_socket}): the slices are left to it"
    ]

    # Counted from the old pod's stepping aside (deferring), an event: how often it wrote its view
    # back before depends on how soon its peer check saw the new pod answer, which is time.


@pytest.mark.slow
async def test_dra_a_newer_pod_counts_once_it_answers_and_the_kubelet_registered_it(dra_node, publishers, monkeypatch):
    """The kubelet calls the newest pod of a driver that is registered and
    connected, not one whose socket merely accepts. A wedged newer pod (its socket accepts into the
    backlog, nothing answers) is no newer pod at all: the old one keeps writing the slices and
    prepares new claims. A running newer pod the kubelet has not registered (here: it refused it)
    writes the slices, but the kubelet calls the old pod, which must prepare; once the kubelet
    registers the new pod, the old one hands new claims over."""
    monkeypatch.setattr(gp, "DRA_PEER_TIMEOUT", 0.3)
    monkeypatch.setattr(gp, "DRA_PEER_RECHECK", (0.05, 0.2))
    (dra_node.devices / "gopher0").touch()
    for index in range(3):
        dra_node.api.put_claim(claim(f"c{index}", f"uid-{index}", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    old_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000002b")
    old_socket, new_socket = old_config.dra.registration_socket, new_config.dra.registration_socket
    wedged = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-0a1b2c3d-0000-4000-8000-00000000003c-reg.sock"
    kubelet = dra_node.kubelet

    async def until(predicate):
        while not predicate():
            await peers.changed.wait_touched()

    with trio.fail_after(TIMEOUT):
        await dra_node.start(old_config)
        await dra_node.registered()
        (publisher,) = publishers
        peers = publisher.peers
        with socket.socket(socket.AF_UNIX) as stuck:
            stuck.bind(str(wedged))
            stuck.listen()  # accepts, never answers
            await until(lambda: peers.newer() == ("", True) and peers.newer(registered=True) == ("", True))
            answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
            assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
            assert publisher.deferring.value == ""
        wedged.unlink()
        kubelet.versions = []  # this kubelet refuses the new pod's registration
        await dra_node.start(new_config)
        await kubelet.wait_until(lambda k: any(new_socket == path for _, path in k.events))
        await until(lambda: peers.newer()[0] == new_socket and peers.newer(registered=True) == ("", True))
        while publisher.deferring.value != new_socket:  # the slices are the running new pod's
            await publisher.deferring.wait_touched()
        assert kubelet.drivers[DRIVER].registration_socket == old_socket
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
        kubelet.versions = ["v1.DRAPlugin"]
        kubelet.order = lambda names: sorted(names, key=lambda name: name == os.path.basename(old_socket))
        kubelet.restart()  # both registered, the old pod last: the kubelet calls it
        await kubelet.wait_until(lambda k: k.starts == 2 and len(k.plugins.get(DRIVER, [])) == 2)
        await until(lambda: peers.newer(registered=True)[0] == new_socket)
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-2", "c2")])).claims["uid-2"]
    assert answer.error == (
        f"a newer pod of DRA driver {DRIVER} serves on this node ({new_socket}): it prepares new claims, and the "
        "kubelet asks again"
    )


def spec_env(path):
    """The CDI spec's devices, each as (name, its env)."""
    return [(device["name"], device["containerEdits"]["env"]) for device in read_spec(path)["devices"]]


@pytest.mark.slow
async def test_dra_only_the_newest_pod_of_a_rolling_update_writes_the_cdi_spec(dra_node, publishers):
    """The old and the new pod of a rolling update share the CDI spec
    (<vendor>-<class>.json), each with its own configuration (here env: OLD, then NEW). The newest
    pod writes it; the old one, seeing a device the new one does not take (its pattern is wider),
    leaves the spec as the new one wrote it, rather than its own settings reaching the containers
    the new pod prepares. Once the new pod is gone (a rollback), the old one writes its own again."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    spec = dra_node.root / "cdi" / "example.com-gopher.json"
    old_config = gp.with_pod_uid(dra_node.config(env="OLD"), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(
        dra_node.config(env="NEW", pattern="gopher[01]"), "0a1b2c3d-0000-4000-8000-00000000002b"
    )
    with trio.fail_after(TIMEOUT):
        await dra_node.start(old_config)
        assert spec_env(spec) == [("gopher0", ["OLD_GOPHER0=gopher0"]), ("gopher1", ["OLD_GOPHER1=gopher1"])]
        new = await dra_node.start(new_config)
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"]), ("gopher1", ["NEW_GOPHER1=gopher1"])]
        old_devices = publishers[0].resources.served["example.com/gopher"][1]
        with logged("the CDI spec") as left:
            (dra_node.devices / "gopher2").touch()  # the old pod's device only
            while "gopher2" not in old_devices.value:  # its spec, were it to write it, is written by now
                await old_devices.wait_touched()
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"]), ("gopher1", ["NEW_GOPHER1=gopher1"])]
        assert left.lines == [
            f"{RESOURCE}: a newer pod of the DRA driver serves ({new_config.dra.registration_socket}): the CDI spec "
            f"{spec} is "
            "left to it"
        ]
        with logged("writing the CDI spec") as again:
            new.cancel()  # the rollout undone: the old pod is the newest again
            await again.wait()
    assert again.lines == [
        f"{RESOURCE}: no newer pod of the DRA driver serves any more: writing the CDI spec {spec} again"
    ]
    assert spec_env(spec) == [
        ("gopher0", ["OLD_GOPHER0=gopher0"]),
        ("gopher1", ["OLD_GOPHER1=gopher1"]),
        ("gopher2", ["OLD_GOPHER2=gopher2"]),
    ]


@pytest.mark.slow
async def test_dra_an_old_pod_that_stops_leaves_the_cdi_spec_and_the_slices_to_the_new_one(dra_node, publishers):
    """At the end of a rolling update the old pod stops, its registration socket
    first. It must not take the turn back then (its own socket gone, no newer one would be seen):
    the CDI spec (env) and the slices (pattern) stay the new pod's, and the old pod writes neither.
    Here the old pod left both to the new one (a device came during the overlap) before it stops."""
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    spec = dra_node.root / "cdi" / "example.com-gopher.json"
    old_config = gp.with_pod_uid(
        dra_node.config(env="OLD", pattern="gopher[02]"), "0a1b2c3d-0000-4000-8000-00000000001a"
    )
    new_config = gp.with_pod_uid(dra_node.config(env="NEW"), "0a1b2c3d-0000-4000-8000-00000000002b")
    new_socket = new_config.dra.registration_socket
    new_env = [(f"gopher{n}", [f"NEW_GOPHER{n}=gopher{n}"]) for n in range(3)]
    with trio.fail_after(TIMEOUT):
        old = await dra_node.start(old_config)
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.start(new_config)
        await dra_node.kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
        old_publisher, _ = publishers
        while old_publisher.deferring.value != new_socket:
            await old_publisher.deferring.wait_touched()
        old_devices = old_publisher.resources.served["example.com/gopher"][1]
        with logged("is left to it") as left:
            (dra_node.devices / "gopher2").touch()  # both pods' device: the old one leaves its spec to the new
            await left.wait()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        assert "gopher2" in old_devices.value and spec_env(spec) == new_env
        await seen_by(old_publisher, ["gopher0", "gopher1", "gopher2"])
        await trio.testing.wait_all_tasks_blocked()
        writes = len(dra_node.api.writes)
        with logged("again") as again:
            old.cancel()  # the DaemonSet controller deletes the old pod
            await dra_node.ended[old].wait()
        await trio.testing.wait_all_tasks_blocked()
    assert again.lines == []
    assert spec_env(spec) == new_env
    assert dra_node.slice_devices()[0] == ["gopher0", "gopher1", "gopher2"]
    assert dra_node.api.writes[writes:] == []


async def test_a_pod_that_takes_the_cdi_turn_writes_its_spec_again(nursery, tmp_path):
    """A pod of a rolling update writes the CDI spec as it starts, before its registration socket
    listens: until then the old pod does not see it, and may write its own spec over it (a device
    came in between). So once the socket listens (CDISpecTurn.take), the new pod writes its spec
    again, under the flock the old one asks for the newer pod under."""
    (tmp_path / "devs").mkdir()
    (tmp_path / "devs" / "gopher0").touch()
    cdi = {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")}
    config = gp.parse_config(dra_config(tmp_path / "devs", "/k", env="NEW", cdi=cdi), "cfg.yaml")
    (resource,) = config.resources
    turn = gp.CDISpecTurn()
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.watch_devices, resource, gp.Watched({}), "/sys", "/dev", turn)
        spec = tmp_path / "cdi" / "example.com-gopher.json"
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]
        stale = gp.cdi_spec(dataclasses.replace(resource, env="OLD"), gp.scan_directory(resource).devices)
        gp.write_cdi_spec(resource.cdi, stale)  # an older pod, before it saw this one
        with gp.DirectoryWatch(str(tmp_path / "cdi"), inotify_flags.MOVED_TO) as watch:
            turn.take(lambda: "")
            async with contextlib.aclosing(watch.batches()) as batches:
                async for events, _, _ in batches:
                    if any(name == spec.name for name, _ in events):
                        break
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]
        # A newer pod named under the flock: nothing is written, and who it is comes back.
        assert gp.write_cdi_spec(resource.cdi, stale, lambda: "/k/plugins_registry/newer-reg.sock") == (
            "/k/plugins_registry/newer-reg.sock"
        )
        assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]


@pytest.mark.slow
async def test_dra_kubelet_stand_in_registers_at_start_in_random_order_and_keeps_a_connection(dra_node):
    """The kubelet registers the sockets it finds at start in no set order
    (a Go map), and a plugin is "connected" while the connection the kubelet keeps to it is up, not
    when its endpoint would accept one. The stand-in's order is a seeded shuffle, the same for one
    seed; its connection ends when the plugin's server closes it, with no call made."""
    names = [f"{DRIVER}-{index}-reg.sock" for index in range(8)]
    orders = {
        tuple(standins.DraKubeletSimulator(str(dra_node.kubelet_dir), seed=seed).order(names)) for seed in range(8)
    }
    assert len(orders) > 1 and all(sorted(order) == names for order in orders)
    first = standins.DraKubeletSimulator(str(dra_node.kubelet_dir), seed=3).order(names)
    assert standins.DraKubeletSimulator(str(dra_node.kubelet_dir), seed=3).order(names) == first
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        pod = await dra_node.start(gp.with_pod_uid(dra_node.config(), "0a1b2c3d-0000-4000-8000-00000000001a"))
        await kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 1)
        (plugin,) = kubelet.plugins[DRIVER]
        assert plugin.connected
        pod.cancel()
        await kubelet.wait_until(lambda k: not plugin.connected)


@pytest.mark.slow
async def test_dra_kubelet_stand_in_connects_again_when_it_calls_a_plugin_not_connected(dra_node):
    """A registered plugin whose connection ended (here: closed from the kubelet's side) stays
    registered; with no plugin of the driver connected, a call goes to the newest, and connects it
    again, as an RPC on an idle gRPC channel does."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c0", "uid-0", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        (plugin,) = kubelet.plugins[DRIVER]
        plugin.connection.cancel()
        await kubelet.wait_until(lambda k: not plugin.connected)
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
        assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
        await kubelet.wait_until(lambda k: plugin.connected)
    assert kubelet.plugins[DRIVER] == [plugin]


@pytest.mark.slow
async def test_dra_an_older_pod_the_kubelet_calls_hands_the_claim_over_to_the_newest(dra_node, publishers):
    """After a kubelet restart during a rolling update, the
    kubelet may register the old pod last, and then calls it (the newest registered and connected
    plugin). The old pod's configuration (env OLD) is not the new one's, whose CDI spec is on the
    node: it refuses the claim it has not prepared, naming the newer pod, and writes nothing; the
    kubelet asks again, and once the old pod is gone, the new one prepares it with its own settings."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c0", "uid-0", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    old_config = gp.with_pod_uid(dra_node.config(env="OLD"), "0a1b2c3d-0000-4000-8000-00000000001a")
    new_config = gp.with_pod_uid(dra_node.config(env="NEW"), "0a1b2c3d-0000-4000-8000-00000000002b")
    old_socket, new_socket = old_config.dra.registration_socket, new_config.dra.registration_socket
    spec = dra_node.root / "cdi" / "example.com-gopher.json"
    kubelet = dra_node.kubelet
    with trio.fail_after(TIMEOUT):
        old = await dra_node.start(old_config)
        await dra_node.start(new_config)
        await kubelet.wait_until(lambda k: len(k.plugins.get(DRIVER, [])) == 2)
        kubelet.order = lambda names: sorted(names, key=lambda name: name == os.path.basename(old_socket))
        kubelet.restart()  # the new pod's socket registered first, the old one's last
        await kubelet.wait_until(lambda k: k.starts == 2 and len(k.plugins.get(DRIVER, [])) == 2)
        assert [p.registration_socket for p in kubelet.plugins[DRIVER]] == [new_socket, old_socket]
        assert all(p.connected for p in kubelet.plugins[DRIVER])
        assert kubelet.drivers[DRIVER].registration_socket == old_socket  # the kubelet calls the old pod
        peers = publishers[0].peers
        while peers.newer(registered=True)[0] != new_socket:  # the old pod has seen the kubelet register it
            await peers.changed.wait_touched()
        with logged("cannot prepare ResourceClaim") as refused:
            answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]
        assert (answer.error, list(answer.devices)) == (
            f"a newer pod of DRA driver {DRIVER} serves on this node ({new_socket}): it prepares new claims, and the "
            "kubelet asks again",
            [],
        )
        assert refused.lines == [f"cannot prepare ResourceClaim default/c0 (uid-0): {answer.error}"]
        checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
        assert not checkpoint.exists()  # nothing prepared
        old.cancel()  # the rollout goes on: the old pod is deleted
        await kubelet.wait_until(lambda k: [p.registration_socket for p in k.plugins.get(DRIVER, [])] == [new_socket])
        answer = (await kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])).claims["uid-0"]  # the kubelet's retry
    assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
    assert kubelet.cdi_devices("uid-0") == ["example.com/gopher=gopher0", "example.com/gopher=uid-0_gopher"]
    assert spec_env(spec) == [("gopher0", ["NEW_GOPHER0=gopher0"])]
    # The request's env is the newest pod's too (env: NEW).
    assert spec_env(spec.with_name("example.com-gopher_uid-0.json")) == [("uid-0_gopher", ["NEW=gopher0"])]


def test_dra_api_server_stand_in_refuses_claims_a_cluster_cannot_have():
    """A result must name a request of the claim, or a subrequest of one with firstAvailable, as
    the API server checks when the scheduler writes the allocation."""
    api = standins.ApiServerSimulator()
    ok = ("gpu/small", DRIVER, DraNode.POOL, "gopher0")
    serial = ("serial", DRIVER, DraNode.POOL, "gopher1")
    api.put_claim(claim("c1", "uid-1", ok, serial, requests=PRIORITIZED_REQUESTS))
    for bad, field in [
        (("gpu/huge", DRIVER, DraNode.POOL, "gopher0"), "request"),  # no such subrequest
        (("serial/x", DRIVER, DraNode.POOL, "gopher0"), "request"),  # serial has no firstAvailable
        (("gpu/small", DRIVER, DraNode.POOL, "Gopher0"), "device"),  # not a DNS label
    ]:
        with pytest.raises(ValueError) as refused:
            api.put_claim(claim("c2", "uid-2", ok, bad, requests=PRIORITIZED_REQUESTS))
        where = f"status.allocation.devices.results[1].{field}"
        assert str(refused.value).startswith(f'ResourceClaim.resource.k8s.io "c2" is invalid: {where}: Invalid value: ')
    assert sorted(api.claims) == [("default", "c1")]


@pytest.mark.slow
async def test_dra_a_prioritized_list_result_reaches_the_container_that_names_its_request(dra_node):
    """A container names the main request ("gpu"); results of a subrequest say "gpu/small". The
    kubelet gives each container the CDI devices whose request names contain its request, so the
    answer must name "gpu". Another driver's result is that driver's; an admin-access result is
    prepared like any other."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    results = [
        ("gpu/small", DRIVER, DraNode.POOL, "gopher0"),
        ("gpu/small", DRIVER, DraNode.POOL, "gopher1"),
        ("gpu/small", "gpu.example.com", "node-1", "gpu0"),
        ("serial", DRIVER, DraNode.POOL, "gopher2"),
        ("monitor", DRIVER, DraNode.POOL, "gopher0", {"adminAccess": True}),
    ]
    dra_node.api.put_claim(claim("c1", "uid-1", *results, requests=PRIORITIZED_REQUESTS))
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
    assert answer.error == ""
    assert [(list(d.request_names), d.device_name) for d in answer.devices] == [
        (["gpu"], "gopher0"),
        (["gpu"], "gopher1"),
        (["serial"], "gopher2"),
        (["monitor"], "gopher0"),
    ]
    cdi = dra_node.kubelet.cdi_devices
    # Each request's devices, and its env named with its first device.
    assert cdi("uid-1", "gpu") == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-1_gpu",
        "example.com/gopher=gopher1",
    ]
    assert cdi("uid-1", "serial") == ["example.com/gopher=gopher2", "example.com/gopher=uid-1_serial"]
    assert cdi("uid-1", "monitor") == ["example.com/gopher=gopher0", "example.com/gopher=uid-1_monitor"]
    assert cdi("uid-1", "gpu/small") == []  # no container can name a subrequest
    assert len(cdi("uid-1")) == 7  # a container that names the claim alone gets them all


def test_the_runtime_stand_in_resolves_cdi_devices_as_the_cdi_library_does(tmp_path):
    """cdi_container_env, the unit tests' container runtime: a device named in two spec files of one
    directory is a conflict and resolves to nothing; of two directories, the later's; a file that is
    not .json or .yaml (a spec being written) is not read; a spec's own edits come before its first
    device's; an ID given twice counts once; a variable set again keeps its place, the last value."""
    low, high = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    low.mkdir()
    high.mkdir()

    def spec(path, devices, **top):
        devices = [{"name": name, "containerEdits": {"env": env}} for name, env in devices.items()]
        path.write_text(json.dumps({"cdiVersion": "0.3.0", "kind": "example.com/g", "devices": devices, **top}))

    spec(low / "a.json", {"a": ["X=low"], "c": ["Y=c"]})
    spec(high / "a.json", {"a": ["X=high"]}, containerEdits={"env": ["S=spec", "X=spec"]})
    spec(high / "b1.json", {"b": ["Z=1"]})
    spec(high / "b2.json", {"b": ["Z=2"]})
    spec(high / "d.json.tmp", {"d": ["W=1"]})
    env = standins.cdi_container_env([str(low), str(high)], ["example.com/g=a", "example.com/g=c", "example.com/g=a"])
    assert env == ["S=spec", "X=high", "Y=c"]  # X: the spec's, then its device's, in its first place
    assert standins.cdi_container_env([str(low), str(high)], ["example.com/g=c"], ["Y=pod", "P=1"]) == ["Y=c", "P=1"]
    for unresolved in ("b", "d", "e"):
        with pytest.raises(standins.CDIInjectionError, match=rf"^unresolvable CDI devices example.com/g={unresolved}$"):
            standins.cdi_container_env([str(low), str(high)], ["example.com/g=a", f"example.com/g={unresolved}"])


@pytest.mark.slow
async def test_dra_each_requests_containers_get_the_env_allocate_gives_through_the_claims_own_cdi_device(dra_node):
    """The device plugin's env contract under DRA. A claim of two requests, "gpu"
    (its subrequest "gpu/small" chose gopher2, then gopher0) and "serial" (gopher1): a container
    naming "gpu" gets GOPHER_DEVICES=gopher2,gopher0, the string Allocate gives a container
    allocated those devices in that order, through the claim's own CDI device for the request, as
    the runtime applies the spec files (cdi_container_env), over the pod's own GOPHER_DEVICES; one
    naming "serial" gets its list. Each device's <ENV>_<ID> is there too. A container naming the
    whole claim gets both requests' env devices, and the runtime keeps the last value: "serial"'s
    list (the docs say so), with every <ENV>_<ID>. Unprepared, the env devices resolve to nothing."""
    for name in ("gopher0", "gopher1", "gopher2"):
        (dra_node.devices / name).touch()
    results = [
        ("gpu/small", DRIVER, DraNode.POOL, "gopher2"),
        ("gpu/small", DRIVER, DraNode.POOL, "gopher0"),
        ("serial", DRIVER, DraNode.POOL, "gopher1"),
    ]
    dra_node.api.put_claim(claim("c1", "uid-1", *results, requests=PRIORITIZED_REQUESTS))
    config = dra_node.config()
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1", "gopher2"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert answer.error == ""
        spec_dirs = [dra_node.cdi["spec_dir"]]
        cdi = dra_node.kubelet.cdi_devices
        own = ["GOPHER_DEVICES=the pod's own", "PATH=/bin"]
        gpu = standins.cdi_container_env(spec_dirs, cdi("uid-1", "gpu"), own)
        serial = standins.cdi_container_env(spec_dirs, cdi("uid-1", "serial"), own)
        whole = standins.cdi_container_env(spec_dirs, cdi("uid-1"), own)
        gone = await dra_node.kubelet.unprepare(DRIVER, [("default", "uid-1", "c1")])
        assert gone.claims["uid-1"].error == ""
        with pytest.raises(
            standins.CDIInjectionError, match=r"^unresolvable CDI devices example.com/gopher=uid-1_gpu$"
        ):
            standins.cdi_container_env(spec_dirs, [f"example.com/gopher={n}" for n in ("gopher2", "uid-1_gpu")])
        dra_node.stop()
    # What the device plugin's Allocate gives a container allocated gopher2 and gopher0, in that order.
    [resource] = config.resources
    devices = {d.id: d for d in gp.scan_directory(resource).devices}
    request = v1beta1.AllocateRequest(container_requests=[{"devices_ids": ["gopher2", "gopher0"]}])
    allocated = gp.allocate_response(resource, devices, request).container_responses[0].envs
    assert dict(allocated) == {"GOPHER_DEVICES": "gopher2,gopher0"}
    assert gpu == [
        "GOPHER_DEVICES=gopher2,gopher0",  # the pod's own replaced, in its place
        "PATH=/bin",
        "GOPHER_DEVICES_GOPHER2=gopher2",
        "GOPHER_DEVICES_GOPHER0=gopher0",
    ]
    assert serial == ["GOPHER_DEVICES=gopher1", "PATH=/bin", "GOPHER_DEVICES_GOPHER1=gopher1"]
    assert whole == [
        "GOPHER_DEVICES=gopher1",
        "PATH=/bin",
        "GOPHER_DEVICES_GOPHER2=gopher2",
        "GOPHER_DEVICES_GOPHER0=gopher0",
        "GOPHER_DEVICES_GOPHER1=gopher1",
    ]
    # No device's own CDI device sets GOPHER_DEVICES: the request's list is the only value of it.
    spec = read_spec(Path(dra_node.cdi["spec_dir"]) / "example.com-gopher.json")
    assert [e for d in spec["devices"] for e in d["containerEdits"]["env"] if e.startswith("GOPHER_DEVICES=")] == []


@pytest.mark.slow
async def test_dra_two_resources_in_one_request_each_give_their_own_env(dra_node):
    """A DeviceClass may select devices of two resources of one driver, and one request then holds
    both: each resource's <ENV> lists its own devices, each through its own kind's env device in
    the claim's spec of that kind, as two device-plugin resources give a container an env each."""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").touch()
    (dra_node.devices / "ttyS0").touch()
    spec_dir = dra_node.cdi["spec_dir"]
    text = dra_config(dra_node.devices, dra_node.kubelet_dir, {"device_plugin_dir": str(dra_node.root / "dp")})
    document = yaml.safe_load(text)
    gopher = {**document["resources"][0], "pattern": "gopher*", "cdi": dra_node.cdi}
    serial = {
        **gopher,
        "name": "example.com/serial",
        "pattern": "ttyS*",
        "cdi": {"kind": "example.com/serial", "spec_dir": spec_dir},
    }
    document["resources"] = [gopher, serial]
    config = gp.parse_config(yaml.safe_dump(document), "cfg.yaml")
    results = [
        ("gpu", DRIVER, DraNode.POOL, "gopher1"),
        ("gpu", DRIVER, "node-1/example.com/serial", "ttys0-45b83132"),
        ("gpu", DRIVER, DraNode.POOL, "gopher0"),
    ]
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gopher", "count": 3}}]
    dra_node.api.put_claim(claim("c1", "uid-1", *results, requests=requests))
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        await dra_node.wait_for_slices(["ttys0-45b83132"], "node-1/example.com/serial")
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        assert answer.error == ""
        ids = dra_node.kubelet.cdi_devices("uid-1", "gpu")
        env = standins.cdi_container_env([spec_dir], ids)
        dra_node.stop()
    assert ids == [
        "example.com/gopher=gopher1",
        "example.com/gopher=uid-1_gpu",
        "example.com/serial=ttyS0",
        "example.com/serial=uid-1_gpu",
        "example.com/gopher=gopher0",
    ]
    assert env == [
        "GOPHER_DEVICES_GOPHER1=gopher1",
        "GOPHER_DEVICES=gopher1,gopher0",
        "SERIAL_DEVICES_TTYS0=ttyS0",
        "SERIAL_DEVICES=ttyS0",
        "GOPHER_DEVICES_GOPHER0=gopher0",
    ]


ADMIN_REQUESTS = [
    {"name": "gopher", "exactly": {"deviceClassName": "gopher"}},
    {"name": "monitor", "exactly": {"deviceClassName": "gopher", "adminAccess": True, "count": 2}},
]


@pytest.mark.slow
async def test_dra_admin_access_reaches_a_device_in_use_and_an_unhealthy_one(dra_node):
    """KEP-5018: the scheduler gives an adminAccess request devices other claims hold, and
    unhealthy ones; the driver prepares them, where a claim without admin access is refused the
    unhealthy device. The kubelet passes only the claim's name (pkg/kubelet/cm/dra): the result's
    adminAccess is the driver's to read. An unhealthy device whose node is gone has nothing to give:
    the runtime would start the admin pod without it, so even admin access is refused it, saying so.
    (An unhealthy device that is there, which root here cannot make: the runtime tier's
    test_dra_pod_taints_an_unhealthy_device_and_an_admin_claim_still_reaches_it.)"""
    (dra_node.devices / "gopher0").touch()
    (dra_node.devices / "gopher1").symlink_to("gone")  # dangling: unhealthy, and nothing to give
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0"), requests=ADMIN_REQUESTS))
    admin = {"adminAccess": True}
    dra_node.api.put_claim(
        claim("c2", "uid-2", ("monitor", DRIVER, DraNode.POOL, "gopher0", admin), requests=ADMIN_REQUESTS)
    )
    dra_node.api.put_claim(claim("c3", "uid-3", ("gopher", DRIVER, DraNode.POOL, "gopher1"), requests=ADMIN_REQUESTS))
    dra_node.api.put_claim(
        claim("c4", "uid-4", ("monitor", DRIVER, DraNode.POOL, "gopher1", admin), requests=ADMIN_REQUESTS)
    )
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1"), ("default", "uid-2", "c2")])
        refused = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-3", "c3")])).claims["uid-3"]
        gone = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-4", "c4")])).claims["uid-4"]
    assert {uid: (a.error, [d.device_name for d in a.devices]) for uid, a in answer.claims.items()} == {
        "uid-1": ("", ["gopher0"]),
        "uid-2": ("", ["gopher0"]),  # beside c1
    }
    assert dra_node.kubelet.cdi_devices("uid-2", "monitor") == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-2_monitor",
    ]
    assert refused.error.startswith("ResourceClaim default/c3: device gopher1 of example.com/gopher is unhealthy: ")
    assert not refused.devices
    gopher1 = dra_node.devices / "gopher1"
    assert gone.error == (
        f"ResourceClaim default/c4: device gopher1 of example.com/gopher is unhealthy ({gopher1} is a symlink to "
        f"gone, which does not exist) and {gopher1} is not there: nothing to give a container, even with admin access"
    )
    assert not gone.devices


@pytest.mark.slow
async def test_dra_prepare_writes_the_claims_device_status(dra_node):
    """KEP-4817: after preparing, the driver applies status.devices for its own results (driver,
    pool, device, and the device's paths as data) to the claim's status subresource, as the example
    driver does (kubernetes-sigs/dra-example-driver status_updater.go). Another driver's result
    gets no entry from it, and another driver's entry stays (each applies its own)."""
    (dra_node.devices / "gopher0").touch()
    results = [("gopher", DRIVER, DraNode.POOL, "gopher0"), ("gopher", "gpu.example.com", "node-1", "gpu0")]
    dra_node.api.put_claim(claim("c1", "uid-1", *results))
    theirs = {"driver": "gpu.example.com", "pool": "node-1", "device": "gpu0", "data": {"uuid": "GPU-1"}}
    dra_node.api.claims["default", "c1"]["status"]["devices"] = [theirs]
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        while not dra_node.api.status_writes:  # written after the answer, which it must not delay
            await dra_node.api.changed.wait_touched()
    assert answer.error == ""
    assert dra_node.api.status_writes == [("default", "c1", DRIVER)]
    assert dra_node.api.claims["default", "c1"]["status"]["devices"] == [
        theirs,
        {
            "driver": DRIVER,
            "pool": DraNode.POOL,
            "device": "gopher0",
            "data": {"id": "gopher0", "paths": [str(dra_node.devices / "gopher0")]},
        },
    ]


@pytest.mark.slow
@pytest.mark.parametrize("status", [403, 500])
async def test_dra_a_device_status_that_cannot_be_written_never_fails_the_prepare(dra_node, status):
    """Refused (RBAC without resourceclaims/status) or failed: the claim is prepared all the same,
    and the log says what was not written."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    dra_node.api.fail("status", "c1", status)
    with trio.fail_after(TIMEOUT), logged("its device status is not written") as warned:
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        await warned.wait()  # written after the answer
    assert (answer.error, [d.device_name for d in answer.devices]) == ("", ["gopher0"])
    assert len(warned.lines) == 1
    assert "devices" not in dra_node.api.claims["default", "c1"]["status"]


@pytest.mark.slow
async def test_dra_a_device_status_the_api_server_does_not_answer_delays_no_prepare(dra_node):
    """The kubelet waits for NodePrepareResources' answer, and the pod's start with it: the status
    is written after the answer, so an API server that never answers that write delays nothing."""
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    dra_node.api.fail("status", "c1", 0)  # no answer, until the driver gives up
    with trio.fail_after(TIMEOUT), logged("its device status is not written") as warned:
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
        unanswered = warned.lines[:]  # the write is still waiting for its answer
    assert (answer.error, [d.device_name for d in answer.devices], unanswered) == ("", ["gopher0"], [])


def test_dra_api_server_stand_in_refuses_device_status_as_the_real_one_does():
    """validateDeviceStatus (pkg/apis/resource/validation/validation.go): an entry must be an
    allocated device of the claim; data a JSON object of at most 10 KiB."""
    allocated = claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0"))
    ok = {"driver": DRIVER, "pool": DraNode.POOL, "device": "gopher0", "data": {"id": "gopher0"}}
    assert standins.resource_claim_status_causes(allocated, [ok]) == []
    other = {**ok, "device": "gopher1"}
    listed = {**ok, "data": ["gopher0"]}
    big = {**ok, "data": {"x": "y" * gp.DRA_STATUS_DATA_MAX_LENGTH}}
    assert [
        (c["field"], c["reason"]) for c in standins.resource_claim_status_causes(allocated, [other, listed, big])
    ] == [
        ("status.devices[0]", "FieldValueInvalid"),
        ("status.devices[1].data", "FieldValueInvalid"),
        ("status.devices[2]", "FieldValueDuplicate"),
        ("status.devices[2].data", "FieldValueTooLong"),
    ]
    assert standins.resource_claim_status_causes(allocated, [other])[0]["message"] == (
        f'Invalid value: "{DRIVER}/{DraNode.POOL}/gopher1": must be an allocated device in the claim'
    )


async def test_dra_a_claim_prepared_by_an_earlier_version_is_answered_without_its_subrequest(dra_node):
    """The checkpoint of an earlier gopherplug holds "gpu/small": answered from it again after an
    upgrade, the claim must name "gpu", or the restarted container gets nothing."""
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    device = {
        "request_names": ["gpu/small"],
        "pool_name": DraNode.POOL,
        "device_name": "gopher0",
        "cdi_device_ids": ["example.com/gopher=gopher0"],
    }
    old = {"namespace": "default", "name": "c1", "devices": [device]}
    checkpoint.write_text(json.dumps({"version": 1, "claims": {"uid-1": old}}))
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        answer = (await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])).claims["uid-1"]
    assert [list(d.request_names) for d in answer.devices] == [["gpu"]]
    assert dra_node.kubelet.cdi_devices("uid-1", "gpu") == ["example.com/gopher=gopher0"]


@pytest.mark.slow
async def test_dra_a_claim_listed_twice_in_one_request_is_answered_once(dra_node):
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    c1 = ("default", "uid-1", "c1")
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        first = (await dra_node.kubelet.prepare(DRIVER, [c1, c1])).claims["uid-1"]
        again = (await dra_node.kubelet.prepare(DRIVER, [c1, c1])).claims["uid-1"]  # from the checkpoint
    assert [d.device_name for d in first.devices] == ["gopher0"]
    assert [d.device_name for d in again.devices] == ["gopher0"]
    assert dra_node.kubelet.cdi_devices("uid-1", "gopher") == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-1_gopher",
    ]


async def test_dra_two_pods_sharing_the_checkpoint_keep_each_others_claims(tmp_path):
    """The old and the new pod of a rolling update each prepare and unprepare claims in one file,
    in either order: each change is made to the file as it is now, under the flock, so neither
    writes over what the other added, and one unprepares what the other prepared."""
    path = str(tmp_path / "plugins" / DRIVER / "checkpoint.json")
    old, new = gp.ClaimCheckpoint(path), gp.ClaimCheckpoint(path)

    def device(name):
        return gp.drapb.Device(request_names=["gopher"], pool_name=DraNode.POOL, device_name=name)

    with trio.fail_after(TIMEOUT):
        await old.add(gp.drapb.Claim(namespace="default", uid="uid-0", name="c0"), [device("gopher0")])
        await new.add(gp.drapb.Claim(namespace="default", uid="uid-1", name="c1"), [device("gopher1")])
        await old.add(gp.drapb.Claim(namespace="default", uid="uid-2", name="c2"), [device("gopher2")])
        assert sorted(json.loads(Path(path).read_text())["claims"]) == ["uid-0", "uid-1", "uid-2"]
        # Asked for a claim the other prepared, each answers what the other told the kubelet.
        assert [d.device_name for d in old.answer("uid-1")] == ["gopher1"]
        assert [d.device_name for d in new.answer("uid-0")] == ["gopher0"]
        # The same claim prepared by both (the new one asked the API server before the old one wrote):
        # the answer written first stands.
        answered = await new.add(gp.drapb.Claim(namespace="default", uid="uid-2", name="c2"), [device("gopher9")])
        assert [d.device_name for d in answered] == ["gopher2"]
        assert await new.remove("uid-0") and await old.remove("uid-1")
        assert not await old.remove("uid-0")  # gone already: the other pod unprepared it
    assert sorted(json.loads(Path(path).read_text())["claims"]) == ["uid-2"]
    assert sorted(os.listdir(os.path.dirname(path))) == ["checkpoint.json", "serialize.lock"]


@pytest.mark.slow
async def test_dra_an_unreadable_checkpoint_is_kept_aside_and_the_driver_serves_on(dra_node, caplog):
    """A checkpoint cut short (a full disk, a hand edit) must neither stop the driver nor be
    overwritten: the claims in it are for a person to look at."""
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text('{"version": 1, "claims": {"uid-0": ')
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
    assert answer.claims["uid-1"].devices[0].cdi_device_ids == [
        "example.com/gopher=gopher0",
        "example.com/gopher=uid-1_gopher",
    ]
    aside = checkpoint.with_name("checkpoint.json.unreadable")
    assert aside.read_text() == '{"version": 1, "claims": {"uid-0": '
    assert sorted(json.loads(checkpoint.read_text())["claims"]) == ["uid-1"]
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert line.startswith(f"{checkpoint} is unreadable (") and line.endswith(
        f"moved to {aside}; starting with no prepared claims"
    )


async def test_dra_reload_adds_and_removes_a_resources_pool(dra_node):
    other_devices = dra_node.root / "others"
    other_devices.mkdir()
    (other_devices / "o0").touch()
    (dra_node.devices / "gopher0").touch()
    cdi_dir = str(dra_node.root / "cdi")  # not the default /var/run/cdi another test run may hold
    other = {
        "name": "example.com/other",
        "directory": str(other_devices),
        "api": "dra",
        "cdi": {"kind": f"{DRIVER}/other", "spec_dir": cdi_dir},
    }

    def config(*extra):
        top = {"device_plugin_dir": str(dra_node.root / "dp")}
        cdi = {"kind": f"{DRIVER}/gopher", "spec_dir": cdi_dir}
        data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=cdi))
        data["resources"] = [*data["resources"], *extra]
        return gp.parse_config(yaml.safe_dump(data), "cfg.yaml")

    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    with trio.fail_after(TIMEOUT), logged("added example.com/other") as added, logged("removed") as removed:
        await dra_node.start(config(), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0"])
        await send.send(config(other))
        await dra_node.wait_for_slices(["o0"], pool="node-1/example.com/other")
        both = config(other)
        await send.send(dataclasses.replace(both, resources=both.resources[1:]))  # example.com/gopher removed
        await dra_node.wait_for_slices(None)
        await added.wait()
        await removed.wait()
    assert dra_node.slice_devices("node-1/example.com/other")[0] == ["o0"]
    assert added.lines == ["cfg.yaml: configuration reloaded: added example.com/other"]
    assert removed.lines == ["cfg.yaml: configuration reloaded: removed example.com/gopher"]


@pytest.mark.slow
async def test_dra_reload_updates_a_pool_in_place_without_deleting_its_slices(dra_node):
    # Stopping and starting the resource would take its pool away for a moment: the publisher
    # could delete its slices, and the scheduler would see no device of it until written again.
    for name in ("gopher0", "gopher1"):
        (dra_node.devices / name).touch()
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    cdi = {"kind": "example.com/gopher", "spec_dir": str(dra_node.root / "cdi")}
    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await dra_node.start(dra_node.config(cdi=cdi), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0", "gopher1"])
        await dra_node.registered()
        writes = len(dra_node.api.writes)
        other_cdi = {"kind": "example.com/other", "spec_dir": str(dra_node.root / "cdi")}
        await send.send(dra_node.config(cdi=other_cdi, pattern="gopher1", env="GOPHERS"))
        await dra_node.wait_for_slices(["gopher1"])
        await reloaded.wait()
        dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher1")))
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
    assert [verb for verb, _ in dra_node.api.writes[writes:]] == ["update"], "the slice was rewritten, never deleted"
    assert reloaded.lines == ["cfg.yaml: configuration reloaded: updated in place example.com/gopher"]
    assert answer.claims["uid-1"].devices[0].cdi_device_ids == [
        "example.com/other=gopher1",
        "example.com/other=uid-1_gopher",
    ]
    assert spec_env(dra_node.root / "cdi" / "example.com-other_uid-1.json") == [("uid-1_gopher", ["GOPHERS=gopher1"])]
    spec = read_spec(dra_node.root / "cdi" / "example.com-other.json")
    assert [d["name"] for d in spec["devices"]] == ["gopher1"]
    assert spec["devices"][0]["containerEdits"]["env"] == ["GOPHERS_GOPHER1=gopher1"]


async def test_dra_only_reload_that_adds_a_device_plugin_resource_starts_the_kubelet_watch(dra_node, caplog):
    """A DRA-only start neither looks for kubelet.sock nor watches its directory; a reload that
    adds a device-plugin resource does, where that configuration says."""
    (dra_node.devices / "gopher0").touch()
    plugin_dir = dra_node.root / "dp"
    plugin_dir.mkdir()
    cdi = {"kind": "example.com/gopher", "spec_dir": str(dra_node.root / "cdi")}  # never the machine's /var/run/cdi
    dra_only = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, cdi=cdi))
    both = {
        **dra_only,
        "device_plugin_dir": str(plugin_dir),
        "resources": [*dra_only["resources"], {"name": "example.com/other", "directory": str(dra_node.devices)}],
    }
    send, receive = trio.open_memory_channel(1)

    async def updates():
        async for new in receive:
            yield new

    with trio.fail_after(TIMEOUT), logged("configuration reloaded: ") as reloaded:
        await dra_node.start(gp.parse_config(yaml.safe_dump(dra_only), "cfg.yaml"), updates=lambda _: updates())
        await dra_node.wait_for_slices(["gopher0"])
        assert "kubelet.sock" not in caplog.text
        simulator = await dra_node.nursery.start(gp.KubeletSimulator(str(plugin_dir)).run)
        await send.send(gp.parse_config(yaml.safe_dump(both), "cfg.yaml"))
        await simulator.wait_until(lambda s: streaming(s, "example.com/other") == {"gopher0": gp.HEALTHY})
        await reloaded.wait()
    assert reloaded.lines == ["cfg.yaml: configuration reloaded: added example.com/other"]
    assert "take effect at the next start" not in caplog.text


@pytest.mark.slow
async def test_dra_resources_whose_names_read_alike_get_slices_of_their_own(dra_node):
    """example.com/foo-bar and example.com-foo/bar: once their slices shared a name, and the API
    server refused, on every write, to move that slice from one pool to the other."""
    others = dra_node.root / "others"
    others.mkdir()
    (others / "o0").touch()
    (dra_node.devices / "gopher0").touch()
    top = {"device_plugin_dir": str(dra_node.root / "dp")}
    data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top))
    cdi_dir = str(dra_node.root / "cdi")
    data["resources"] = [
        {**data["resources"][0], "name": "example.com/foo-bar", "cdi": {"kind": f"{DRIVER}/aa", "spec_dir": cdi_dir}},
        {
            "name": "example.com-foo/bar",
            "directory": str(others),
            "api": "dra",
            "cdi": {"kind": f"{DRIVER}/bb", "spec_dir": cdi_dir},
        },
    ]
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.parse_config(yaml.safe_dump(data), "cfg.yaml"))
        await dra_node.wait_for_slices(["gopher0"], pool="node-1/example.com/foo-bar")
        await dra_node.wait_for_slices(["o0"], pool="node-1/example.com-foo/bar")
    assert len(dra_node.api.slices) == 2
    assert dra_node.api.refused == []


@pytest.mark.slow
async def test_dra_a_pool_of_several_slices_is_updated_whole(dra_node):
    """A pool over DRA_MAX_DEVICES_PER_SLICE devices is several slices; a change rewrites them
    all under one new generation, and a pool that shrinks deletes the slices it no longer needs."""
    limit = gp.DRA_MAX_DEVICES_PER_SLICE
    names = [f"g{i}" for i in range(limit + 2)]
    for name in names:
        (dra_node.devices / name).touch()

    def pool():
        mine = [s for s in dra_node.api.slices.values() if s["spec"]["pool"]["name"] == DraNode.POOL]
        return sorted(
            (len(s["spec"]["devices"]), s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in mine
        )

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(names)
        assert pool() == [(2, 1, 2), (limit, 1, 2)]
        (dra_node.devices / "g-new").touch()
        await dra_node.wait_for_slices([*names, "g-new"])
        assert pool() == [(3, 2, 2), (limit, 2, 2)]
        for name in names[:10]:
            (dra_node.devices / name).unlink()
        await dra_node.wait_for_slices([*names[10:], "g-new"])
    assert pool() == [(limit - 7, 3, 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("status", "retry_after"), [(409, 0), (429, 1), (500, 0), (0, 0)])
async def test_dra_a_pool_whose_second_slice_failed_is_written_again_whole(dra_node, status, retry_after):
    """A pool of two slices changes in its first only: both go to a new generation, and the write of
    the second fails (a conflict, the API server's 429 with Retry-After, a 500, no answer). The
    scheduler keeps only a pool's newest generation and counts it incomplete without both slices:
    the pool must be written again, however equal the second slice's devices look."""
    names = [f"g{i}" for i in range(gp.DRA_MAX_DEVICES_PER_SLICE + 2)]
    for name in names[1:]:
        (dra_node.devices / name).touch()
    target = dra_node.root / "target"
    target.touch()
    (dra_node.devices / "g0").symlink_to(target)
    second = gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 1)

    def pool():
        """(generations of the pool's slices, whether g0 is healthy in them)"""
        mine = [s for s in dra_node.api.slices.values() if s["spec"]["pool"]["name"] == DraNode.POOL]
        g0 = [d for s in mine for d in s["spec"]["devices"] if d["name"] == "g0"]
        return {s["spec"]["pool"]["generation"] for s in mine}, g0[0]["attributes"]["healthy"]["bool"]

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(names)
        assert pool() == ({1}, True)
        dra_node.api.fail("update", second, status, retry_after=retry_after)
        target.unlink()  # g0, in the first slice, turns unhealthy
        if status == 0:  # no answer: once the write is in, its connection is cut (the client's
            # timeout, 10 s, would end it the same way: the write failed, its outcome unknown)
            while (second, 0) not in [(name, answer) for _, _, name, answer in dra_node.api.attempts]:
                await dra_node.api.changed.wait_touched()
            dra_node.api.cut_unanswered()
        while not (len(pool()[0]) == 1 and pool()[1] is False):
            await dra_node.api.changed.wait_touched()
    (generation,) = pool()[0]
    assert generation == 3  # the failed pass's generation 2, then the whole pool again
    tries = [
        (time, answer) for time, verb, name, answer in dra_node.api.attempts if name == second and verb == "update"
    ]
    assert [answer for _, answer in tries] == [status, 200]
    assert tries[1][0] - tries[0][0] >= retry_after  # Retry-After is honoured


@pytest.mark.slow
async def test_dra_a_pool_the_api_server_keeps_refusing_blocks_no_other(dra_node, caplog):
    """Each pool is written on its own, with its own backoff: one whose writes keep failing must
    not keep another's devices, or the deletion of a stale slice, from the API server."""
    others = dra_node.root / "others"
    others.mkdir()
    (others / "o0").touch()
    (dra_node.devices / "gopher0").touch()
    top = {"device_plugin_dir": str(dra_node.root / "dp")}
    data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    other_cdi = {**dra_node.cdi, "kind": "example.com/other"}
    data["resources"].append({"name": "example.com/other", "directory": str(others), "api": "dra", "cdi": other_cdi})
    other_pool = "node-1/example.com/other"
    (stale,) = gp.resource_slices(DRIVER, "node-1", gp.resource_config("example.com/gone"), {}, 1, NODE_UID)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(gp.parse_config(yaml.safe_dump(data), "cfg.yaml"))
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.wait_for_slices(["o0"], pool=other_pool)
        refused = gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 0)
        dra_node.api.fail("update", refused, 500, times=1000)  # example.com/gopher: refused from now on
        (dra_node.devices / "gopher1").touch()
        (others / "o1").touch()
        dra_node.api.put_slice(stale)  # a pool this driver no longer has, e.g. from a removed resource
        await dra_node.wait_for_slices(["o0", "o1"], pool=other_pool)
        await dra_node.wait_for_slices(None, pool="node-1/example.com/gone")
    assert dra_node.slice_devices()[0] == ["gopher0"]  # still refused, retried on its own
    assert "DRA: writing ResourceSlices: update ResourceSlice " + refused + ": 500 " in caplog.text


async def test_dra_a_watch_that_expired_is_listed_again_quietly(dra_node, caplog):
    """The API server ends a watch with 410 Gone when its resourceVersion left the history: routine.
    The slices are listed again at once (a slice deleted after it is written again), no warning;
    the Node's watch too. One list each, then watches again."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1 or dra_node.api.count("watch", "resourceslices") < 1:
            await dra_node.api.changed.wait_touched()  # a watch opened after this would not expire
        dra_node.api.expire_watches()
        (name,) = dra_node.api.slices
        dra_node.api.delete_slice(name)
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 2 or dra_node.api.count("watch", "resourceslices") < 2:
            await dra_node.api.changed.wait_touched()  # each listed again, and watched from there
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert (dra_node.api.count("list", "resourceslices"), dra_node.api.count("list", "nodes")) == (2, 2)


@pytest.mark.slow
async def test_dra_every_watch_asks_for_bookmarks_and_resumes_where_the_last_one_ended(dra_node):
    """The API server ends every watch after a while (--min-request-timeout, here a short one), with
    a bookmark just before if asked: the driver opens the next one from that bookmark's version, so
    ends of watches cost one request each and never a list. Before, each watch lasted 300 s, asked
    for no bookmarks, and was followed by a list."""
    dra_node.api.min_request_timeout = 0.2
    dra_node.api.bookmark_seconds = 0.05
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.put_node("node-2", "uid-2")  # another node's change: a newer version, nothing selected
        newest = str(dra_node.api._version)
        while (
            not {"resourceslices", "nodes"}
            <= {resource for (verb, resource, _), _ in dra_node.api.requests.items() if verb == "watch"}
            or sum(watch["resourceVersion"] == newest for watch in dra_node.api.watches) < 2
        ):
            await dra_node.api.changed.wait_touched()
        dra_node.api.compact()  # the history before now is gone: nothing resumes from before it
        started = len(dra_node.api.watches)
        while len(dra_node.api.watches) < started + 4:
            await dra_node.api.changed.wait_touched()
    assert all(watch["allowWatchBookmarks"] == "true" for watch in dra_node.api.watches)
    assert not any("timeoutSeconds" in watch for watch in dra_node.api.watches)
    assert (dra_node.api.count("list", "resourceslices"), dra_node.api.count("list", "nodes")) == (1, 1)


@pytest.mark.slow
async def test_dra_after_an_api_server_restart_each_watch_lists_once(dra_node, caplog):
    """An API server restart cuts every watch, and the new one's watch cache starts after the
    versions the driver saw: each watch, opened again, is answered 410 Gone, and leads to exactly
    one list; the slices stay as they were (nothing written)."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1 or dra_node.api.count("watch", "resourceslices") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.restart()
        while dra_node.api.count("watch", "nodes") < 3 or dra_node.api.count("watch", "resourceslices") < 3:
            await dra_node.api.changed.wait_touched()  # cut, answered 410, and watched after the list
    assert (dra_node.api.count("list", "resourceslices"), dra_node.api.count("list", "nodes")) == (2, 2)
    assert [verb for verb, _ in dra_node.api.writes] == ["create"]
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert all(message.startswith("DRA: watching ") for message in said)  # the cut watches, retried


@pytest.mark.slow
async def test_dra_a_relist_the_api_server_finds_too_new_for_its_cache_falls_back_to_a_quorum_list(dra_node, caplog):
    """A watch answered 410 is followed by a list at the last version seen; an API server whose
    watch cache is behind that version (another of an HA control plane, or one just restarted)
    answers it 504 "Too large resource version", and would for as long as its cache lags. As
    client-go's reflector, the driver lists at "" then (a quorum read), and watches on from there.
    Before, it asked for the same version again and again, backed off, and saw nothing meanwhile."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.hold_cache()
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)  # the watch brought a version newer than the cache holds
        seen = dra_node.api.nodes["node-1"]["metadata"]["resourceVersion"]
        dra_node.api.expire_watches()
        while dra_node.api.count("watch", "nodes") < 2:
            await dra_node.api.changed.wait_touched()  # listed, and watched again
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "0"})
        await dra_node.wait_for_slices(["gopher0"])  # and that watch works
    node_lists = [
        query.get("resourceVersion", "") for query in dra_node.api.lists if "metadata.name" in query["fieldSelector"]
    ]
    assert node_lists == ["0", seen, ""]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [HELD_BACK.format(1)]


async def test_dra_requests_name_gopherplug_its_version_and_the_node(dra_node):
    """The API server's audit log and per-client metrics tell gopherplug's requests apart by their
    user agent, in client-go's form. Before, they said python-httpx2/<version>."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
    expected = f"gopherplug/{gp.__version__} (linux/{arch}) node/node-1"
    assert {agent for _, _, agent in dra_node.api.requests} == {expected}
    assert gp.user_agent("node-1") == expected


def failing_fsync(monkeypatch):
    """A disk that fails: os.fsync raises EIO while the returned switch's ``failing`` is true."""
    disk = types.SimpleNamespace(failing=False)
    fsync = os.fsync

    def sometimes_failing_fsync(fd):
        if disk.failing:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", sometimes_failing_fsync)
    return disk


async def test_dra_a_checkpoint_that_cannot_be_written_prepares_nothing(dra_node, monkeypatch):
    """A disk that fails (EIO from fsync) fails the claim, and the claim is not remembered: asked
    again, it is tried again, not answered as prepared from a file that never got it. An unprepare
    that cannot be written keeps the claim."""
    disk = failing_fsync(monkeypatch)
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    c1 = [("default", "uid-1", "c1")]
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        disk.failing = True
        for _ in range(2):
            answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
            assert (answer.error, list(answer.devices)) == (
                f"cannot write the checkpoint {checkpoint}: Input/output error",
                [],
            )
        disk.failing = False
        answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
        assert [d.device_name for d in answer.devices] == ["gopher0"]
        disk.failing = True
        gone = (await dra_node.kubelet.unprepare(DRIVER, c1)).claims["uid-1"]
        assert gone.error.startswith(f"cannot write the checkpoint {checkpoint}: ")
        assert sorted(json.loads(checkpoint.read_text())["claims"]) == ["uid-1"]
        disk.failing = False
        gone = (await dra_node.kubelet.unprepare(DRIVER, c1)).claims["uid-1"]
        assert gone.error == ""
    assert json.loads(checkpoint.read_text())["claims"] == {}


async def test_dra_a_share_whose_checkpoint_cannot_be_written_leaves_no_cdi_device_behind(dra_node, monkeypatch):
    """A share's CDI spec is written before the checkpoint: when the checkpoint then fails, the
    claim is not prepared, and its spec goes too (nothing would ever remove it: the checkpoint
    does not name it). Asked again, it is prepared, spec and all."""
    disk = failing_fsync(monkeypatch)
    disk.failing = True
    (dra_node.devices / "gopher0").touch()
    dra_node.api.put_claim(claim("c1", "uid-1", ("gopher", DRIVER, DraNode.POOL, "gopher0", {"shareID": SHARE_1})))
    c1 = [("default", "uid-1", "c1")]
    spec = Path(dra_node.cdi["spec_dir"]) / "example.com-gopher_uid-1.json"
    with trio.fail_after(TIMEOUT):
        await dra_node.start(dra_node.config(replicas=2))
        await dra_node.registered()
        answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
        assert answer.error.startswith("cannot write the checkpoint ")
        assert not spec.exists()
        disk.failing = False
        answer = (await dra_node.kubelet.prepare(DRIVER, c1)).claims["uid-1"]
    assert list(answer.devices[0].cdi_device_ids) == [
        f"example.com/gopher=gopher0-{SHARE_1}",
        "example.com/gopher=uid-1_gopher",
    ]
    assert [d["name"] for d in read_spec(spec)["devices"]] == ["uid-1_gopher", f"gopher0-{SHARE_1}"]


@pytest.mark.slow
async def test_dra_a_checkpoint_that_cannot_be_read_stops_the_start(dra_node, monkeypatch):
    """Starting without it would write over the claims in it: `gopherplug serve` exits 1 with one
    line naming it, and what to do."""
    checkpoint = dra_node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json"
    checkpoint.mkdir(parents=True)  # e.g. a hostPath volume made of the file's path by mistake
    config = dra_node.root / "cfg.yaml"
    top = {"device_plugin_dir": str(dra_node.root)}
    config.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    monkeypatch.setenv("NODE_NAME", "node-1")
    monkeypatch.setenv("KUBECONFIG", str(dra_node.kubeconfig))
    with trio.fail_after(TIMEOUT):
        result = await run_cli_async("serve", "--config", str(config))
    lines = result.stderr.decode().splitlines()  # the resource's "no device" warning came first
    assert result.returncode == 1
    assert [line for line in lines if " ERROR " in line] == lines[-1:]
    assert lines[-1].endswith(
        f" ERROR cannot read the checkpoint {checkpoint}: Is a directory: it holds the claims prepared on this "
        "node; make it readable, or move it away to start without them"
    )


@contextlib.asynccontextmanager
async def dra_serve(dra_node, tmp_path, *options, env=()):
    """`gopherplug serve` of a DRA-only configuration as the DaemonSet's (no device_plugin_dir), in a
    subprocess against the node's API server and DRA kubelet, with command-line ``options`` and
    environment variables ``env`` besides this process's; yields it once the kubelet registered it
    and its slice is published. Its stderr goes to tmp_path / "stderr"."""
    (dra_node.devices / "gopher0").touch()
    config = tmp_path / "cfg.yaml"
    cdi = {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")}  # never the machine's /var/run/cdi
    config.write_text(dra_config(dra_node.devices, dra_node.kubelet_dir, cdi=cdi))
    env = {**os.environ, "NODE_NAME": "node-1", "KUBECONFIG": str(dra_node.kubeconfig), **dict(env)}
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(config), *options],
            stderr=stderr,
            env=env,
        )
    try:
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def stop_trace(log_text):
    """The stop's trace in a log: (level, message) of each line whose message starts "stop: ", the
    milliseconds each part took left out ("done in 3 ms" reads "done")."""
    lines = (line.split(" ", 2) for line in log_text.splitlines() if " stop: " in line)
    return [(level, re.sub(r" in \d+ ms", "", message)) for _, level, message in lines]


#: The parts of the DRA driver, in the order they stop: the kubelet's side first, the API server's last.
DRA_PARTS = (
    "registration server",
    "DRAPlugin server",
    "claim status writer",
    "slice publisher",
    "slice watch",
    "peer watch",
)


async def test_parts_stop_one_at_a_time_the_last_started_first_each_within_its_bound(autojump_clock, caplog):
    """_Parts shields each part once it has started: a cancel from outside reaches none of them, and
    stop() ends them in turn, the last started first. A part that is slow to end where no cancel
    reaches (a thread; here a shielded sleep) is cut off at its bound with a warning naming it, and
    the next one stops meanwhile; the nursery still waits for it. One that overruns its bound
    where it cannot be cut off (the metrics server's thread) is named too."""
    caplog.set_level(logging.DEBUG, "gopherplug")
    ended = []

    async def part(name, lingers, *, task_status):
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(lingers)  # how long it takes to end once told to
            ended.append(name)

    with trio.CancelScope() as outside:
        async with trio.open_nursery() as nursery:
            parts = gp._Parts(nursery)
            try:
                for name, lingers in (("a", 0), ("b", 5), ("c", 0.2)):
                    await parts.start(name, part, name, lingers)
                outside.cancel()
                await trio.sleep_forever()
            finally:
                assert ended == []  # the cancel from outside reached none of them
                await parts.stop()

    async def overrun():
        with trio.CancelScope(shield=True):
            await trio.sleep(1.5)

    await gp._stop_part("metrics server", overrun)
    assert ended == ["c", "a", "b"]  # b ended in the end, on its own
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("stop: ")] == [
        ("DEBUG", "stop: c: waiting"),
        ("DEBUG", "stop: c: done in 200 ms"),
        ("DEBUG", "stop: b: waiting"),
        ("WARNING", "stop: b: not done after 1 s: stopping the rest without it"),
        ("DEBUG", "stop: a: waiting"),
        ("DEBUG", "stop: a: done in 0 ms"),
        ("DEBUG", "stop: metrics server: waiting"),
        ("WARNING", "stop: metrics server: done in 1500 ms, more than its 1 s"),
    ]


@pytest.mark.slow
async def test_dra_serve_stops_part_by_part_and_at_once_on_sigterm(dra_node, tmp_path):
    """Every second between SIGTERM and exit is added to each pod of a rollout; the device-plugin
    process takes ~0.06 s. The kubelet keeps its connection to the driver, and its health stream,
    open (grpc-go's kubelet does, for as long as the driver is registered): the stop does not wait
    for it. At debug level, the stop says when it starts waiting for each part, and when that part is
    done: one stop on a node where it is slow names the part that is."""
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, "--log-level", "debug") as process:
            async with dra_node.kubelet.watch_health(DRIVER) as health:
                await health.__anext__()
                sent = trio.current_time()
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0, (tmp_path / "stderr").read_text()
                elapsed = trio.current_time() - sent
    assert elapsed < 1.5, f"{elapsed:.2f} s"  # generous: 0.06 to 0.09 s measured here
    assert stop_trace((tmp_path / "stderr").read_text()) == [
        *stopped("configuration reloads"),
        (DEBUG, "stop: DRA driver: waiting"),
        *stopped(*DRA_PARTS),
        (DEBUG, "stop: DRA driver: done"),
        *stopped("example.com/gopher", "API client"),
        (DEBUG, "stop: done"),
    ]


@pytest.mark.slow
async def test_a_dra_driver_never_runs_what_lightkube_imports_for_others(dra_node, tmp_path):
    """lightkube imports asyncio (for exec credentials, which need an asyncio loop) and the core
    group's 500 models: 3 MiB a DRA driver never uses. A serve, to its slice, a prepared claim and its
    stop, runs none of API_CLIENT_UNUSED's code: an audit hook logs every module whose code runs
    (lightkube's own: the hook is seen to work). Then, in this process, a module left unloaded
    runs as soon as it is used, and is the module an import would have given. A program that
    embeds gopherplug gets every module imported as ever: only the command leaves any unloaded."""
    import importlib.util

    site = tmp_path / "site"
    site.mkdir()
    ran = tmp_path / "ran"
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"def hook(event, args, log=open({str(ran)!r}, 'a', buffering=1)):\n"
        "    if event == 'exec' and getattr(args[0], 'co_name', '') == '<module>':\n"
        "        log.write(args[0].co_filename + '\\n')\n"
        "sys.addaudithook(hook)\n"
    )
    allocated = ("gopher", DRIVER, DraNode.POOL, "gopher0")
    dra_node.api.put_claim(claim("c1", "uid-1", allocated))
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, env={"PYTHONPATH": str(site)}) as process:
            answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])
            assert answer.claims["uid-1"].devices[0].device_name == "gopher0"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    files = set(ran.read_text().splitlines())
    unused = {name: importlib.util.find_spec(name).origin for name in gp.API_CLIENT_UNUSED}
    assert importlib.util.find_spec("lightkube").origin in files
    assert [name for name, origin in unused.items() if origin in files] == []
    embedded = (
        "import sys, gopherplug as gp\n"
        "gp._import_api_client()\n"
        "print(any(isinstance(module, gp._UnloadedModule) for module in sys.modules.values()))\n"
    )
    result = await trio.run_process([sys.executable, "-c", embedded], cwd=HERE, capture_stdout=True)
    assert result.stdout.decode().splitlines() == ["False"]
    code = (
        "import sys, gopherplug as gp\n"
        "gp._OWNS_PROCESS = True  # as main() sets it, run as the command\n"
        "gp._import_api_client()\n"
        "print(all(isinstance(sys.modules[name], gp._UnloadedModule) for name in gp.API_CLIENT_UNUSED))\n"
        "import asyncio.subprocess, mimetypes, msgspec\n"
        "from lightkube.resources.core_v1 import Node\n"
        "print(asyncio.subprocess.PIPE, asyncio.sleep.__module__, Node._api_info.plural)\n"
        "print(mimetypes.guess_type('a.json')[0], msgspec.msgpack.decode(msgspec.msgpack.encode([1])))\n"
        "for name in gp.API_CLIENT_UNUSED:\n"
        "    hasattr(sys.modules[name], '__all__')  # any attribute it does not have yet runs it\n"
        "print(sorted({type(sys.modules[name]).__name__ for name in gp.API_CLIENT_UNUSED}))\n"
    )
    result = await trio.run_process([sys.executable, "-c", code], cwd=HERE, capture_stdout=True)
    assert result.stdout.decode().splitlines() == [
        "True",
        f"{subprocess.PIPE} asyncio.tasks nodes",
        "application/json [1]",
        "['module']",
    ]


@pytest.mark.slow
async def test_serve_stopped_ends_without_the_interpreters_teardown(dra_node, tmp_path):
    """Once everything is closed, the interpreter's teardown (30 to 150 ms of CPU here, collecting
    every module's objects) is skipped: what an atexit handler of the process would print, it never
    does."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import atexit, sys\natexit.register(lambda: print('the interpreter tore down', file=sys.stderr))\n"
    )
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, env={"PYTHONPATH": str(site)}) as process:
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    log_text = (tmp_path / "stderr").read_text()
    assert "the interpreter tore down" not in log_text
    assert " INFO SIGTERM received: stopping\n" in log_text  # the log flushed all the same


@pytest.mark.slow
async def test_dra_serve_stop_leaves_behind_a_part_that_never_ends_and_exits_in_time(dra_node, tmp_path, nursery):
    """A NodePrepareResources in flight waits for a thread that no cancellation interrupts: its
    checkpoint's flock, held by the other pod of a rolling update (here: for good, as a hung disk
    would). Its part of the stop is left behind after STOP_PART_TIMEOUT, with a warning naming it,
    while the others stop; the process exits 0 after STOP_TIMEOUT, its sockets gone. Neither the
    kubelet's health stream nor a claim status write the API server never answers holds up theirs."""
    for name, uid in (("c0", "uid-0"), ("c1", "uid-1")):
        dra_node.api.put_claim(claim(name, uid, ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    dra_node.api.fail("status", "c0", status=0)
    lock = dra_node.kubelet_dir / "plugins" / DRIVER / "serialize.lock"

    async def prepare():
        with contextlib.suppress(gp.RPCError):  # the connection breaks as the process exits
            await dra_node.kubelet.prepare(DRIVER, [("default", "uid-1", "c1")])

    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path, "--log-level", "debug") as process:
            async with dra_node.kubelet.watch_health(DRIVER) as health:
                await health.__anext__()
                answer = await dra_node.kubelet.prepare(DRIVER, [("default", "uid-0", "c0")])
                assert answer.claims["uid-0"].error == ""
                while ("status", "c0") not in [(verb, name) for _, verb, name, _ in dra_node.api.attempts]:
                    await dra_node.api.changed.wait_touched()  # the status write, never to be answered
                held = os.open(lock, os.O_RDWR)
                opened = INotify()
                try:
                    fcntl.flock(held, fcntl.LOCK_EX)
                    opened.add_watch(str(lock), inotify_flags.OPEN)
                    nursery.start_soon(prepare)
                    # The driver opens the lock file in the thread that then waits for the flock.
                    await trio.lowlevel.wait_readable(opened.fileno())
                    sent = trio.current_time()
                    process.send_signal(signal.SIGTERM)
                    assert await process.wait() == 0, (tmp_path / "stderr").read_text()
                    elapsed = trio.current_time() - sent
                finally:
                    trio.lowlevel.notify_closing(opened.fileno())
                    opened.close()
                    os.close(held)
    assert elapsed < gp.STOP_TIMEOUT + 1.5, f"{elapsed:.2f} s"  # generous: 3.02 s measured here
    assert stop_trace((tmp_path / "stderr").read_text()) == [
        *stopped("configuration reloads"),
        (DEBUG, "stop: DRA driver: waiting"),
        *stopped("registration server"),
        (DEBUG, "stop: DRAPlugin server: waiting"),
        (WARNING, "stop: DRAPlugin server: not done after 1 s: stopping the rest without it"),
        *stopped(*DRA_PARTS[2:]),
        (WARNING, "stop: DRA driver: not done after 2 s: stopping the rest without it"),
        *stopped("example.com/gopher", "API client"),
        (WARNING, "stop: not done after 3 s: exiting without waiting for the rest"),
    ]
    registration = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
    assert not registration.exists() and not (lock.parent / "dra.sock").exists()


@pytest.mark.slow
async def test_dra_only_never_looks_for_kubelet_sock(dra_node, tmp_path):
    # A DRA pod mounts no device-plugin directory: a warning that it has no kubelet.sock misleads.
    with trio.fail_after(TIMEOUT):
        async with dra_serve(dra_node, tmp_path) as process:
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    log_text = (tmp_path / "stderr").read_text()
    assert "the kubelet registered DRA driver" in log_text
    assert "kubelet.sock" not in log_text and "device-plugins" not in log_text


@pytest.mark.slow
async def test_dra_claims_that_are_not_this_nodes_get_an_error(dra_node):
    (dra_node.devices / "gopher0").touch()
    put = dra_node.api.put_claim
    put(claim("other-node", "u1", ("gopher", DRIVER, "node-2/example.com/gopher", "gopher0")))
    put(claim("other-driver", "u2", ("gopher", "gpu.example.com", DraNode.POOL, "gopher0")))
    put(claim("unallocated", "u3"))
    put(claim("replaced", "u4-new", ("gopher", DRIVER, DraNode.POOL, "gopher0")))
    put(claim("gone-device", "u5", ("gopher", DRIVER, DraNode.POOL, "gopher7")))
    asked = [
        ("other-node", "u1"),
        ("other-driver", "u2"),
        ("unallocated", "u3"),
        ("replaced", "u4"),
        ("gone-device", "u5"),
        ("missing", "u6"),
    ]
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        answer = await dra_node.kubelet.prepare(DRIVER, [("default", uid, name) for name, uid in asked])
    errors = {uid: entry.error for uid, entry in answer.claims.items()}
    assert errors == {
        "u1": "ResourceClaim default/other-node: device gopher0 is from pool node-2/example.com/gopher, "
        "not one of this node's",
        "u2": f"ResourceClaim default/other-driver has no device of driver {DRIVER}",
        "u3": "ResourceClaim default/unallocated is not allocated",
        "u4": "ResourceClaim default/replaced has UID u4-new, not u4: it was replaced",
        "u5": f"ResourceClaim default/gone-device: device gopher7 of pool {DraNode.POOL} is not there any more",
        "u6": "get ResourceClaim default/missing: 404 resourceclaims 'missing' not found",
    }
    assert all(not entry.devices for entry in answer.claims.values())


@pytest.mark.slow
async def test_dra_kubelet_restart_and_a_deleted_socket_register_again(dra_node):
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        # The kubelet deletes nothing in plugins_registry: it walks it again. But it wipes the
        # node's slices as it starts, and the driver writes them again.
        dra_node.kubelet.restart()
        await dra_node.kubelet.wait_until(lambda k: k.starts == 2 and DRIVER in k.drivers)
        assert dra_node.slice_devices() is None or dra_node.api.writes[-1][0] == "create"
        await dra_node.wait_for_slices(["gopher0"])
        registration = dra_node.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
        registration.unlink()
        await dra_node.kubelet.wait_until(lambda k: [e for e, _ in k.events].count("registered") == 3)
    events = [event for event, _ in dra_node.kubelet.events]
    assert events == ["wiped", "registered", "wiped", "registered", "deregistered", "registered"]
    assert stat.S_ISSOCK(registration.stat().st_mode)
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "create"]  # the second after the wipe


@pytest.mark.slow
async def test_dra_a_driver_back_in_time_keeps_its_slices_one_too_late_writes_them_again(dra_node):
    """The kubelet deletes a driver's slices DRA_WIPING_DELAY after it went, unless it registers again
    first: a plugin restart keeps them; a plugin away for longer finds them gone and writes them."""
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        await dra_node.registered()  # else "deregistered" below could be "not registered yet"
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: DRIVER not in k.drivers)
        await dra_node.start()
        await dra_node.registered()
        assert ("wiped", DRIVER) not in dra_node.kubelet.events
        dra_node.kubelet.wiping_delay = 0.05  # away for longer than the kubelet waits
        dra_node.stop()
        await dra_node.kubelet.wait_until(lambda k: ("wiped", DRIVER) in k.events)
        assert dra_node.slice_devices() is None
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "create"]


@pytest.mark.slow
async def test_dra_slices_deleted_by_someone_else_are_written_again(dra_node):
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        (name,) = dra_node.api.slices
        dra_node.api.delete_slice(name)  # e.g. the kubelet's cleanup after a plugin it thought gone
        await dra_node.wait_for_slices(["gopher0"])
    assert [verb for verb, _ in dra_node.api.writes] == ["create", "create"]


@pytest.mark.slow
async def test_dra_slices_named_by_an_earlier_version_are_replaced(dra_node):
    """Slices written by a version that named them without a digest ("<node>-<driver>-<pool>-0") are
    no longer wanted: the pool is written under the new names at a newer generation, and the old
    slice deleted, so the scheduler never sees two slices of one generation."""
    (dra_node.devices / "gopher0").touch()
    (old,) = gp.resource_slices(DRIVER, "node-1", gp.resource_config("example.com/gopher"), {}, 4, NODE_UID)
    old["metadata"]["name"] = f"node-1-{DRIVER}-example.com-gopher-0"
    dra_node.api.put_slice(old)
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while old["metadata"]["name"] in dra_node.api.slices:
            await dra_node.api.changed.wait_touched()
    (item,) = dra_node.api.slices.values()
    assert item["metadata"]["name"] == gp.dra_slice_name("node-1", DRIVER, "example.com/gopher", 0)
    assert item["spec"]["pool"]["generation"] == 5


async def test_dra_slices_are_owned_by_their_node_and_go_with_it(dra_node):
    """The Node owns its slices, as the Go helper makes it: deleting a Node (a node scaled away)
    lets the garbage collector delete them. A Node registered again under the same name is
    another object (another UID): the slices come back owned by it."""
    (dra_node.devices / "gopher0").touch()

    def owners():
        return [item["metadata"].get("ownerReferences") for item in dra_node.api.slices.values()]

    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        assert owners() == [[gp.node_owner("node-1", NODE_UID)]]
        assert gp.node_owner("node-1", NODE_UID) == {
            "apiVersion": "v1",
            "kind": "Node",
            "name": "node-1",
            "uid": NODE_UID,
            "controller": True,
        }
        dra_node.api.delete_node("node-1")
        assert dra_node.slice_devices() is None  # collected with their owner
        dra_node.api.put_node("node-1", "new-uid")  # the kubelet registers its Node again
        await dra_node.wait_for_slices(["gopher0"])
        while owners() != [[gp.node_owner("node-1", "new-uid")]]:
            await dra_node.api.changed.wait_touched()


@pytest.mark.slow
async def test_dra_slices_without_a_node_to_own_them_are_published_and_owned_later(dra_node, caplog):
    """A Node the driver cannot find (a NODE_NAME that names none, or a Node not registered yet)
    must not keep the devices from the scheduler: the slices go out unowned, with one warning, and
    get their owner once the Node's watch brings it; slices an older version wrote without an
    owner are rewritten the same way. The Node is never polled."""
    dra_node.api.delete_node("node-1")
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        (item,) = dra_node.api.slices.values()
        assert "ownerReferences" not in item["metadata"]
        dra_node.api.put_node("node-1", NODE_UID)
        while [i["metadata"].get("ownerReferences") for i in dra_node.api.slices.values()] != [
            [gp.node_owner("node-1", NODE_UID)]
        ]:
            await dra_node.api.changed.wait_touched()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "DRA: Node node-1 not found (is node-1 this node's name?); the ResourceSlices are published without the "
        "Node as their owner, so nothing deletes them with the Node"
    ]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("get", "nodes")) == (1, 0)


def two_resource_config(dra_node):
    """example.com/gopher over dra_node.devices, and example.com/other over others/ with o0 in it:
    a pass that wrote the other's pool has also weighed gopher's, so a test can tell "held back"
    from "not written yet"."""
    others = dra_node.root / "others"
    others.mkdir()
    (others / "o0").touch()
    top = {"device_plugin_dir": str(dra_node.root / "dp")}
    data = yaml.safe_load(dra_config(dra_node.devices, dra_node.kubelet_dir, top, cdi=dra_node.cdi))
    other_cdi = {**dra_node.cdi, "kind": "example.com/other"}
    data["resources"].append({"name": "example.com/other", "directory": str(others), "api": "dra", "cdi": other_cdi})
    return gp.parse_config(yaml.safe_dump(data), "cfg.yaml"), "node-1/example.com/other"


HELD_BACK = (
    "DRA: example.com/gopher: node node-1's allocatable still has {} of it: a device plugin serves it on this "
    "node, so its devices are held back from DRA until that is 0 (a node serves a resource through one API: "
    "stop the device plugin here, see docs/dra.md: Moving a resource from the device plugin to DRA)"
)


@pytest.mark.slow
async def test_dra_a_resource_the_nodes_allocatable_still_counts_is_held_back_until_it_is_0(dra_node, caplog):
    """A node serves a resource through one API. While the Node's allocatable still counts it (a
    device plugin serves it there, and pods that ask for it in resources.limits get its devices
    from that plugin), its slices are not published: the scheduler would give the same devices to
    claims. Once the kubelet reports 0 (the device plugin gone), they are, with no restart, and
    with no request but the Node's watch (before, the Node was read every 10 s meanwhile)."""
    dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "2"})
    (dra_node.devices / "gopher0").touch()
    config, other_pool = two_resource_config(dra_node)
    with trio.fail_after(TIMEOUT):
        await dra_node.start(config)
        await dra_node.wait_for_slices(["o0"], pool=other_pool)  # the pass that held gopher back
        assert dra_node.slice_devices() is None
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "0"})
        await dra_node.wait_for_slices(["gopher0"])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [HELD_BACK.format(2)]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("get", "nodes")) == (1, 0)


@pytest.mark.slow
async def test_dra_a_node_allocatable_that_changes_after_start_holds_back_and_releases_within_seconds(dra_node, caplog):
    """A device plugin that starts serving the resource on a node after the DRA driver (a rollback
    of the node-by-node switch, or the two DaemonSets' labels edited): the Node's allocatable counts
    it again, and the devices must leave the slices within seconds, or both APIs offer them and one
    device can be given twice. Released, they come back as fast. Before, the Node was read at start
    only, and the slices stayed."""
    caplog.set_level(logging.INFO, logger="gopherplug")
    dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4"})
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
    with trio.fail_after(5):  # the issue's bound: within 5 s
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)
    with trio.fail_after(5):
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "0"})
        await dra_node.wait_for_slices(["gopher0"])
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [HELD_BACK.format(1)]
    assert "DRA: example.com/gopher: node node-1's allocatable for it is 0 now: its devices are offered" in caplog.text
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("get", "nodes")) == (1, 0)


def test_dra_the_api_server_stand_ins_write_json_as_go_does():
    """Go's encoding/json, as the API server writes every answer and watch event: compact, UTF-8,
    every character raw but those below U+0020, U+2028, U+2029 and the HTML-safe <, >, &. Python's
    json.dumps escapes everything outside ASCII instead, which hid a client that splits lines on
    U+0085."""
    text = 'a\u0085b\u2028c\u2029d<e>f&g\nh\x7fi\u00e9\U0001f439"j\\k\x01'
    written = gp.go_json({"k": text, "n": [1, None, True]})
    assert written == (
        b'{"k":"a\xc2\x85b\\u2028c\\u2029d\\u003ce\\u003ef\\u0026g\\nh\x7fi\xc3\xa9\xf0\x9f\x90\xb9\\"j\\\\k'
        b'\\u0001","n":[1,null,true]}'
    )
    assert json.loads(written) == {"k": text, "n": [1, None, True]}
    assert written.count(b"\n") == 0


async def test_dra_a_node_annotation_holding_a_next_line_character_is_one_watch_event(dra_node, caplog):
    """The API server writes U+0085 (NEXT LINE) raw inside a watch event (Go escapes only U+2028 and
    U+2029 of the line breaks str.splitlines() knows), and anyone with patch on nodes can put one in
    an annotation. The watch stream is framed by the byte "\\n" alone, so the event is read whole.
    Before, the stream was split as str.splitlines() splits (httpx's line decoder): the event came
    in two halves, json.loads raised outside list_and_watch's handling, and the driver stopped."""
    odd = {"example.com/note": "first line\u0085second line, \u2028 and <&>"}
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "1"}, annotations=odd)
        await dra_node.wait_for_slices(None)  # the event was read: held back
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "0"}, annotations=odd)
        await dra_node.wait_for_slices(["gopher0"])  # and so was the next one of the same Node
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [HELD_BACK.format(1)]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("watch", "nodes")) == (1, 1)


@pytest.mark.slow
async def test_dra_a_watch_line_that_is_no_event_is_said_in_one_line_and_listed_again(dra_node, caplog):
    """Whatever a watch brings, the driver goes on: a line that is not an event (a proxy that
    mangles the stream) is said in one line, and the objects are listed again after the backoff,
    as what the lost event said is unknown. Before, json.loads raised out of the watch, and the
    driver stopped."""
    mangled = b'{"type":"MODIFIED","object":{"metadata":'
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("watch", "nodes") < 1 or dra_node.api.count("watch", "resourceslices") < 1:
            await dra_node.api.changed.wait_touched()
        dra_node.api.mangle_watches(mangled + b"\n")
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)  # the Node's change was seen, by the new list
        while dra_node.api.count("list", "resourceslices") < 2:
            await dra_node.api.changed.wait_touched()
    with pytest.raises(ValueError) as raised:
        json.loads(mangled)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said[-1] == HELD_BACK.format(1)
    assert sorted(message.rsplit("; again in ", 1)[0] for message in said[:-1]) == [
        f"DRA: watching {what}: watch {what}: a line that is not JSON ({raised.value}): {mangled.decode()}"
        for what in ("Node node-1", "ResourceSlices")
    ]
    assert (dra_node.api.count("list", "nodes"), dra_node.api.count("list", "resourceslices")) == (2, 2)


@pytest.mark.slow
async def test_dra_a_node_that_cannot_be_watched_is_polled_slowly_and_said_once(dra_node, monkeypatch, caplog):
    """An older manifest's ClusterRole gives get on nodes, not list and watch: the Node is read
    every DRA_NODE_POLL_SECONDS instead (jittered), said once however often it is read, and a change
    of its allocatable is still seen."""
    monkeypatch.setattr(gp, "DRA_NODE_POLL_SECONDS", 0.1)
    dra_node.api.forbidden = {("list", "nodes"), ("watch", "nodes")}
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)
        while dra_node.api.count("get", "nodes") < 5:
            await dra_node.api.changed.wait_touched()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        'DRA: list Node node-1: 403 nodes is forbidden: User "system:serviceaccount:kube-system:gopherplug-dra" '
        'cannot list resource "nodes" in API group "" at the cluster scope (the ClusterRole needs list and watch '
        "on nodes, as in daemonset-dra.yaml); Node node-1 is read every 0.1 to 0.2 s instead, and a change of its "
        "allocatable is seen that late; watching it is tried again from time to time",
        HELD_BACK.format(1),
    ]


@pytest.mark.slow
async def test_dra_a_node_read_for_want_of_rbac_is_watched_again_once_rbac_allows_it(dra_node, monkeypatch, caplog):
    """A 403 on the Node's list or watch (a ClusterRole without them) is not for the life of the
    process: the watch is tried again after a backoff, quietly while it is still refused, and once
    RBAC allows it (the ClusterRole applied) the Node is watched and no longer read. Before, one
    403 made the driver read the Node every minute until its restart."""
    caplog.set_level(logging.INFO, logger="gopherplug")
    monkeypatch.setattr(gp, "DRA_NODE_POLL_SECONDS", 0.1)
    monkeypatch.setattr(gp, "DRA_NODE_WATCH_RETRY", (0.2, 0.4), raising=False)  # absent before the fix
    dra_node.api.forbidden = {("list", "nodes"), ("watch", "nodes")}
    (dra_node.devices / "gopher0").touch()
    with trio.fail_after(TIMEOUT):
        await dra_node.start()
        await dra_node.wait_for_slices(["gopher0"])
        while dra_node.api.count("list", "nodes") < 3:  # tried again, and refused again
            await dra_node.api.changed.wait_touched()
        dra_node.api.forbidden = set()  # the ClusterRole of daemonset-dra.yaml applied
        while dra_node.api.count("watch", "nodes") < 1:
            await dra_node.api.changed.wait_touched()
        read = dra_node.api.count("get", "nodes")
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", "example.com/gopher": "1"})
        await dra_node.wait_for_slices(None)  # seen through the watch
    assert dra_node.api.count("get", "nodes") == read  # no more reads
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and warnings[0].startswith("DRA: list Node node-1: 403 ")  # once
    assert warnings[1] == HELD_BACK.format(1)
    assert "DRA: Node node-1 can be listed and watched again: it is watched instead of read" in caplog.text


def scheduler_on(node_allocatable, device_ids=("gopher0", "gopher1"), taints=None, classes=None):
    """A SchedulerSimulator over an API server stand-in (not serving: the scheduler reads its
    objects) whose node-1 has this allocatable and a slice of gopherplug's devices."""
    api = standins.ApiServerSimulator()
    api.put_node("node-1", NODE_UID, allocatable=node_allocatable)
    devices = {device_id: gp.DeviceEntry(device_id, f"/dev/{device_id}", health=gp.HEALTHY) for device_id in device_ids}
    resource = gp.resource_config("example.com/gopher")
    for item in gp.resource_slices(DRIVER, "node-1", resource, devices, 1, NODE_UID):
        for device in item["spec"]["devices"]:
            device["taints"] = (taints or {}).get(device["name"], [])
        api.put_slice(item)
    return standins.SchedulerSimulator(api, [shipped_device_class()] if classes is None else classes)


@pytest.mark.slow
async def test_the_same_pod_spec_is_served_by_the_device_plugin_then_by_dra_once_the_node_is_switched(dra_node):
    """Migration without touching pods: a pod asking for example.com/gopher in resources.limits gets
    its device from gopherplug's device plugin while the node runs it, and, once the node is switched
    (the device-plugin pod stopped, the DRA pod started: what the DaemonSets' node affinity does
    when the node is labelled gopherplug.example.com/api=dra), the same spec gets it through the
    claim the scheduler makes from the shipped DeviceClass's extendedResourceName."""
    (dra_node.devices / "gopher0").touch()
    kubelet = gp.KubeletSimulator(str(dra_node.root / "dp"))
    scheduler = standins.SchedulerSimulator(dra_node.api, [shipped_device_class()])
    device_plugin = {
        "device_plugin_dir": str(dra_node.root / "dp"),
        "resources": [{"name": "example.com/gopher", "directory": str(dra_node.devices), "env": "GOPHER"}],
    }

    def node_status():  # the kubelet's node status update
        dra_node.api.put_node("node-1", NODE_UID, allocatable={"cpu": "4", **kubelet.allocatable()})

    with trio.fail_after(TIMEOUT):
        await dra_node.nursery.start(kubelet.run)
        await dra_node.start(gp.parse_config(yaml.safe_dump(device_plugin), "daemonset.yaml ConfigMap"))
        await kubelet.wait_until(lambda k: k.allocatable() == {"example.com/gopher": "1"})
        node_status()
        first = gopher_pod("first", ("consumer", {"example.com/gopher": "1"}))
        placement = scheduler.schedule(first, "node-1")
        assert (placement.device_plugin, placement.claim) == ({"example.com/gopher": 1}, None)
        answer = await kubelet.allocate("example.com/gopher", ["gopher0"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER": "gopher0"}
        # The node is switched. The device manager reports 0 at once when the plugin's endpoint is gone.
        dra_node.stop()
        await kubelet.wait_until(lambda k: k.allocatable() == {"example.com/gopher": "0"})
        node_status()
        await dra_node.start(dra_node.config(env="GOPHER"))
        await dra_node.registered()
        await dra_node.wait_for_slices(["gopher0"])
        second = gopher_pod("second", ("consumer", {"example.com/gopher": "1"}))
        assert second["spec"]["containers"] == first["spec"]["containers"]  # the same spec
        placement = scheduler.schedule(second, "node-1")
        assert placement.device_plugin == {}
        await dra_node.kubelet.prepare_extended_resources(second, placement.claim)
        cdi = dra_node.kubelet.extended_resource_cdi_devices(second, placement.claim, "consumer")
        uid = placement.claim["metadata"]["uid"]
        assert cdi == ["example.com/gopher=gopher0", f"example.com/gopher={uid}_container-0-request-0"]


def test_scheduler_stand_in_leaves_a_name_the_nodes_allocatable_has_to_the_device_plugin():
    """The scheduler's rule for extended resources backed by DRA: where the node's allocatable has the
    name (a device plugin serves it), the pod is the device plugin's, however many devices DRA would
    have; DRA serves it only where the allocatable is 0 or absent."""
    scheduler = scheduler_on({"cpu": "4", "example.com/gopher": "1"})
    pod = gopher_pod("p", ("consumer", {"example.com/gopher": "1"}))
    placement = scheduler.schedule(pod, "node-1")
    assert (placement.device_plugin, placement.claim) == ({"example.com/gopher": 1}, None)
    assert "status" not in pod and scheduler.api.claims == {}
    # Two asked, one allocatable: noderesources fit refuses; the two devices in the slice do not help.
    with pytest.raises(standins.UnschedulableError, match=r"^Insufficient example.com/gopher$"):
        scheduler.schedule(gopher_pod("q", ("consumer", {"example.com/gopher": "2"})), "node-1")
    assert scheduler.api.claims == {}


def test_scheduler_stand_in_makes_the_pods_claim_when_the_allocatable_is_0():
    """Allocatable 0 (the device plugin gone) and a DeviceClass with the name: one claim for the pod,
    owned by it, a request per container and name as the scheduler names them, allocated from the
    node's slices; the pod's status maps each container to its request."""
    scheduler = scheduler_on({"cpu": "4", "example.com/gopher": "0"})
    pod = gopher_pod(
        "p", ("a", {"example.com/gopher": "1"}), ("b", {"cpu": "1", "example.com/gopher": "1"}), ("c", {"cpu": "1"})
    )
    placement = scheduler.schedule(pod, "node-1")
    claim = placement.claim
    assert placement.device_plugin == {}
    assert claim["metadata"]["name"].startswith("p-extended-resources-")
    assert claim["metadata"]["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
    assert claim["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "uid-p", "controller": True}
    ]
    exactly = {"deviceClassName": "gopher.example.com", "allocationMode": "ExactCount", "count": 1}
    assert claim["spec"]["devices"]["requests"] == [
        {"name": "container-0-request-0", "exactly": exactly},
        {"name": "container-1-request-1", "exactly": exactly},  # cpu sorts before example.com/gopher
    ]
    results = [(r["request"], r["pool"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]]
    assert results == [
        ("container-0-request-0", DraNode.POOL, "gopher0"),
        ("container-1-request-1", DraNode.POOL, "gopher1"),
    ]
    assert pod["status"]["extendedResourceClaimStatus"] == {
        "resourceClaimName": claim["metadata"]["name"],
        "requestMappings": [
            {"containerName": "a", "resourceName": "example.com/gopher", "requestName": "container-0-request-0"},
            {"containerName": "b", "resourceName": "example.com/gopher", "requestName": "container-1-request-1"},
        ],
    }
    assert scheduler.api.claims == {("default", claim["metadata"]["name"]): claim}
    # Both devices are now allocated: the next pod's claim cannot be.
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.schedule(gopher_pod("q", ("a", {"example.com/gopher": "1"})), "node-1")


def test_scheduler_stand_in_allocates_as_the_allocator_does():
    """A device another claim holds goes only to a request with admin access; a device tainted
    NoSchedule only to a request that tolerates the taint; the class's CEL selector is evaluated."""
    unhealthy = [{"key": f"{DRIVER}/unhealthy", "value": "gone", "effect": "NoSchedule"}]
    scheduler = scheduler_on({}, taints={"gopher1": unhealthy})
    held = claim("held", "uid-held", ("gopher", DRIVER, DraNode.POOL, "gopher0"))
    scheduler.api.put_claim(held)

    def wanted(name, **exactly):
        request = {"name": "r", "exactly": {"deviceClassName": "gopher.example.com", "count": 1, **exactly}}
        return claim(name, f"uid-{name}", requests=[request])

    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(wanted("plain"), "node-1")  # gopher0 held, gopher1 tainted
    toleration = {"key": f"{DRIVER}/unhealthy", "operator": "Exists"}
    tolerating = scheduler.allocate(wanted("tolerant", tolerations=[toleration]), "node-1")
    assert [r["device"] for r in tolerating["devices"]["results"]] == ["gopher1"]
    admin = scheduler.allocate(wanted("admin", adminAccess=True), "node-1")
    assert admin["devices"]["results"] == [
        {"request": "r", "driver": DRIVER, "pool": DraNode.POOL, "device": "gopher0", "adminAccess": True}
    ]
    # A class whose selector selects another resource's devices selects none of these.
    other = shipped_device_class()
    other["spec"]["selectors"][0]["cel"]["expression"] = other["spec"]["selectors"][0]["cel"]["expression"].replace(
        "example.com/gopher", "example.com/other"
    )
    scheduler.device_classes = [other]
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(wanted("admin2", adminAccess=True), "node-1")


def test_scheduler_stand_in_rounds_capacity_requests_as_the_allocator_does():
    """Consumable capacity (KEP-5075) on a hand-made slice, by the allocator's rules
    (consumable_capacity.go in k8s.io/dynamic-resource-allocation structured): a shared device goes
    to claim after claim, each a share with a UUID of its own; a request asking 2 of a step-1 range
    consumes 2, one asking nothing the policy's default; a capacity without a requestPolicy costs
    the whole value when not asked for, what is asked when asked; validValues round up; what would
    pass a value, a max or a capacity the device lacks is not allocated."""
    api = standins.ApiServerSimulator()
    policy = {"default": "1", "validRange": {"min": "1", "max": "3", "step": "1"}}
    devices = [
        {
            "name": "ranged",
            "allowMultipleAllocations": True,
            "capacity": {"shares": {"value": "4", "requestPolicy": policy}},
        },
        {"name": "plain", "allowMultipleAllocations": True, "capacity": {"bandwidth": {"value": "10"}}},
        {"name": "listed", "allowMultipleAllocations": True}
        | {
            "capacity": {"memory": {"value": "8Gi", "requestPolicy": {"default": "1Gi", "validValues": ["1Gi", "4Gi"]}}}
        },
    ]
    item = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-1-hand-made"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-1",
            "pool": {"name": "p", "generation": 1, "resourceSliceCount": 1},
        }
        | {"devices": devices},
    }
    assert standins.resource_slice_causes(item) == []  # a slice the API server takes
    api.put_slice(item)
    every = {
        "metadata": {"name": "every"},
        "spec": {"selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}]},
    }
    scheduler = standins.SchedulerSimulator(api, [every])

    def has(capacity):  # the CEL the allocator evaluates: device.capacity by domain, then name
        return [{"cel": {"expression": f'"{capacity}" in device.capacity["{DRIVER}"]'}}]

    def allocated(name, capacity, asked=None, **exactly):
        """The (device, consumedCapacity) of a claim asking ``asked`` of a device with ``capacity``."""
        request = {"name": "r", "exactly": {"deviceClassName": "every", "selectors": has(capacity), **exactly}}
        if asked is not None:
            request["exactly"]["capacity"] = {"requests": {capacity: asked}}
        made = claim(name, f"uid-{name}", requests=[request])
        made["status"] = {"allocation": scheduler.allocate(made, "node-1")}
        api.put_claim(made)
        [result] = made["status"]["allocation"]["devices"]["results"]
        assert str(uuid.UUID(result["shareID"])) == result["shareID"]  # a UUID, lower-case
        return result["device"], result["consumedCapacity"], result["shareID"]

    two = allocated("two", "shares", "2")
    assert two[:2] == ("ranged", {"shares": "2"})
    default = allocated("default", "shares")
    assert default[:2] == ("ranged", {"shares": "1"})
    assert two[2] != default[2]
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("over", "shares", "2")  # 2 + 1 held, 2 more would pass the value 4
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("above-max", "shares", "4")  # above validRange.max, whatever is free
    assert allocated("last", "shares")[:2] == ("ranged", {"shares": "1"})  # the fourth share fits
    assert allocated("half", "bandwidth", "3")[:2] == ("plain", {"bandwidth": "3"})  # no policy: as asked
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("whole", "bandwidth")  # no policy, nothing asked: the whole 10, and 3 are held
    assert allocated("rounded", "memory", "2Gi")[:2] == ("listed", {"memory": "4Gi"})
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        allocated("too-big", "memory", "5Gi")  # no valid value holds it
    unknown = {"deviceClassName": "every", "capacity": {"requests": {"cores": "1"}}}  # no device has it
    with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
        scheduler.allocate(claim("unknown", "uid-unknown", requests=[{"name": "r", "exactly": unknown}]), "node-1")
    # The CEL quantity library on device.capacity, as a selector may use it.
    # (A missing name is a runtime error that fails the allocation, in the allocator as here: test first.)
    memory = f'device.capacity["{DRIVER}"]'
    bigger = f'"memory" in {memory} && {memory}["memory"].compareTo(quantity("4Gi")) > 0'
    request = {"name": "r", "exactly": {"deviceClassName": "every", "selectors": [{"cel": {"expression": bigger}}]}}
    result = scheduler.allocate(claim("cel", "uid-cel", requests=[request]), "node-1")
    assert [r["device"] for r in result["devices"]["results"]] == ["listed"]


def test_scheduler_stand_in_finds_neither_api_unschedulable():
    """No DeviceClass maps the name and the node's allocatable lacks it: the pod fits nowhere on this
    node, with the dynamicresources plugin's reason; the implicit name of a class works without
    extendedResourceName."""
    without = shipped_device_class()
    del without["spec"]["extendedResourceName"]
    scheduler = scheduler_on({"cpu": "4"}, classes=[without])
    with pytest.raises(standins.UnschedulableError, match=r"^cannot fit resource example.com/gopher$"):
        scheduler.schedule(gopher_pod("p", ("a", {"example.com/gopher": "1"})), "node-1")
    implicit = gopher_pod("q", ("a", {"deviceclass.resource.kubernetes.io/gopher.example.com": "1"}))
    assert scheduler.schedule(implicit, "node-1").claim is not None
