"""Tests for gopherplug.

Rules:
- Real things only: real unix sockets in a short temporary directory (a socket path is limited to
  108 bytes, more than pytest's tmp_path sometimes leaves), real subprocesses, and on the other end
  of the wire an independent gRPC implementation, grpcio (C core), with message classes that protoc
  generates from gopherplug.proto for the test session.
- Every test that does I/O runs under a trio.fail_after bound, so a hang is a failure, not a stall.
- Nothing sleeps to synchronise: tests wait on events a handler sets, or on the peer's answer.
- grpcio calls block, and the server under test runs on the trio thread: they run in a worker
  thread (trio.to_thread.run_sync), never on the trio thread itself.
- Warnings are errors (pyproject.toml), except purerpc's documented unclosed-memory-stream one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import shutil
import socket
import stat
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
from google.protobuf import descriptor_pb2

import gopherplug as gp
from gopherplug import StatusCode, v1beta1
from testsupport import (
    RESOURCE,
    TIMEOUT,
    YUBIKEY,
    HeldBatches,
    dataclasses_replace_dir,
    devices_of,
    listed,
    listed_ids,
    logged,
    make_node,
    nothing_found,
    purerpc,
    start,
    streaming,
    usb_nodes,
    usb_tree,
)

# ------------------------------------------------------------------------------------------------
# The contract: gopherplug.proto and the module's messages never drift apart
# ------------------------------------------------------------------------------------------------


def test_descriptor_is_byte_identical_to_protoc(protoc_out):
    out, _ = protoc_out
    descriptor_set = descriptor_pb2.FileDescriptorSet.FromString((out / "set.bin").read_bytes())
    assert len(descriptor_set.file) == 1
    assert gp.FILE_DESCRIPTOR.SerializeToString() == descriptor_set.file[0].SerializeToString()


def test_messages_encode_like_protoc_generated_ones(pb2):
    ours = v1beta1.AllocateResponse(
        container_responses=[
            v1beta1.ContainerAllocateResponse(
                envs={"GOPHER": "a,b"},
                mounts=[v1beta1.Mount(container_path="/m", host_path="/h", read_only=True)],
                devices=[v1beta1.DeviceSpec(container_path="/dev/a", host_path="/dev/a", permissions="rw")],
                annotations={"k": "v"},
                cdi_devices=[v1beta1.CDIDevice(name="example.com/gopher=a")],
            )
        ]
    )
    theirs = pb2.AllocateResponse.FromString(ours.SerializeToString())
    assert theirs.container_responses[0].cdi_devices[0].name == "example.com/gopher=a"
    assert theirs.SerializeToString(deterministic=True) == ours.SerializeToString(deterministic=True)


def test_service_table_matches_the_kubelet_api():
    shapes = {
        path: (m.request_type.DESCRIPTOR.name, m.response_type.DESCRIPTOR.name, m.server_streaming)
        for path, m in gp.METHODS.items()
    }
    assert shapes == {
        "/v1beta1.Registration/Register": ("RegisterRequest", "Empty", False),
        "/v1beta1.DevicePlugin/GetDevicePluginOptions": ("Empty", "DevicePluginOptions", False),
        "/v1beta1.DevicePlugin/ListAndWatch": ("Empty", "ListAndWatchResponse", True),
        "/v1beta1.DevicePlugin/GetPreferredAllocation": (
            "PreferredAllocationRequest",
            "PreferredAllocationResponse",
            False,
        ),
        "/v1beta1.DevicePlugin/Allocate": ("AllocateRequest", "AllocateResponse", False),
        "/v1beta1.DevicePlugin/PreStartContainer": ("PreStartContainerRequest", "PreStartContainerResponse", False),
    }


# ------------------------------------------------------------------------------------------------
# The plugin end to end, against the kubelet simulator (the kubelet's behaviour as its sources show it)
# ------------------------------------------------------------------------------------------------


async def test_register_list_allocate(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        [request] = simulator.registrations
        assert (request.version, request.resource_name) == ("v1beta1", RESOURCE)
        assert request.endpoint == node.our_sockets()[0] == "gopherplug-example.com_gopher-1.sock"
        options = simulator.resources[RESOURCE].options  # what the dial-back inside Register got
        assert options == request.options == v1beta1.DevicePluginOptions(get_preferred_allocation_available=True)
        answer = await simulator.allocate(RESOURCE, ["g2", "g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g2,g1"}
        assert await simulator.preferred_allocation(RESOURCE, ["g2", "g1"], [], 1) == ["g1"]
        answer = await gp.call_unary(
            os.path.join(node.plugin_dir, request.endpoint),
            gp.METHODS["/v1beta1.DevicePlugin/PreStartContainer"],
            v1beta1.PreStartContainerRequest(devices_ids=["g1"]),
            timeout=5,
        )
        assert answer == v1beta1.PreStartContainerResponse()
    assert oct(stat.S_IMODE(os.stat(os.path.join(node.plugin_dir, request.endpoint)).st_mode)) == "0o600"


@pytest.mark.parametrize(
    ("available", "must_include"),
    [
        ([b"g1", b"g\xff"], []),  # an offered ID: the order cannot answer, _pick's path parses again
        ([b"g1", b"g2"], [b"\xc3"]),  # a must-include ID the order would skip: refused all the same
    ],
)
async def test_preferred_allocation_refuses_ids_that_are_no_utf8(nursery, node, available, must_include):
    """The service reads GetPreferredAllocation's IDs as bytes (_PreferredAllocationWire); an ID
    that is no UTF-8 is still refused as every request that a v1beta1 message cannot hold."""
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        endpoint = os.path.join(node.plugin_dir, simulator.registrations[0].endpoint)
        as_bytes = dataclasses.replace(
            gp.METHODS["/v1beta1.DevicePlugin/GetPreferredAllocation"], request_type=gp._PreferredAllocationWire
        )
        request = gp._PreferredAllocationWire()
        request.container_requests.add(
            available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=1
        )
        with pytest.raises(gp.RPCError) as info:
            await gp.call_unary(endpoint, as_bytes, request, timeout=5)
        assert info.value.code == StatusCode.INTERNAL
        assert info.value.message.startswith("cannot parse the request: Error parsing message")
        # The same request in UTF-8 is answered, from the order (both listed) and by _pick (one not).
        request.container_requests[0].must_include_deviceIDs[:] = []
        request.container_requests[0].available_deviceIDs[:] = [b"g2", b"g1"]
        answer = await gp.call_unary(endpoint, as_bytes, request, timeout=5)
        assert list(answer.container_responses[0].deviceIDs) == ["g1"]
        assert await simulator.preferred_allocation(RESOURCE, ["g2", "g10", "g1"], ["g10"], 2) == ["g10", "g1"]


async def test_allocate_unknown_ids_is_invalid_argument(nursery, node, caplog):
    """Refused, and said in the plugin's log too (one line: the kubelet shows it only in the pod's
    events); an Allocate answered logs no refusal."""
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        await simulator.allocate(RESOURCE, ["g1"])
        with pytest.raises(gp.RPCError) as info:
            await simulator.allocate(RESOURCE, ["g1", "g7"])
    assert (info.value.code, info.value.message) == (
        StatusCode.INVALID_ARGUMENT,
        "unknown example.com/gopher device IDs: g7",
    )
    refused = [(r.levelname, r.getMessage()) for r in caplog.records if "refused Allocate" in r.getMessage()]
    assert refused == [("WARNING", f"{RESOURCE}: refused Allocate of g1, g7: unknown {RESOURCE} device IDs: g7")]


async def test_device_changes_reach_the_kubelet(nursery, node, tmp_path):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        dev = Path(node.devices)
        (dev / "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        (dev / "g1").unlink()
        await simulator.wait_until(listed("g2", "g3"))
        (dev / "g3").rename(dev / "g4")  # rename within
        await simulator.wait_until(listed("g2", "g4"))
        (dev / "g4").rename(tmp_path / "g4")  # rename out
        await simulator.wait_until(listed("g2"))
        (tmp_path / "g4").rename(dev / "g5")  # rename in
        await simulator.wait_until(listed("g2", "g5"))
        (dev / ".g6").touch()  # hidden: never a device
        (dev / "bad name").touch()  # not a valid device ID: skipped with a warning
        (dev / "g7").touch()
        await simulator.wait_until(listed("g2", "g5", "g7"))


async def test_attribute_change_is_seen(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, pattern="g*")
        updates = simulator.resources[RESOURCE].updates
        os.chmod(os.path.join(node.devices, "g1"), 0o600)  # IN_ATTRIB: rescanned, same list: no push
        Path(node.devices, "h1").touch()  # does not match: rescanned, same list: no push
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        assert simulator.resources[RESOURCE].updates == updates + 1, "unchanged lists are not sent again"


async def test_every_source_is_watched(nursery, node, tmp_path):
    other = tmp_path / "other"
    match = [{"directory": node.devices, "pattern": "g*"}, {"directory": str(other), "pattern": "h*"}]
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, match=match)  # "other" comes later
        other.mkdir()
        (other / "h1").touch()
        (other / "g3").touch()  # not its pattern
        await simulator.wait_until(listed("g1", "g2", "h1"))
        Path(node.devices, "g1").unlink()
        await simulator.wait_until(listed("g2", "h1"))
        Path(node.devices, "h2").touch()  # not this directory's pattern
        (other / "h1").rename(other / "h3")
        await simulator.wait_until(listed("g2", "h3"))


async def test_a_device_of_several_entries_is_unhealthy_while_one_is(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, id_pattern=r"(?P<id>g[0-9]+)(-[a-z]+)?")
        updates = simulator.resources[RESOURCE].updates
        # Waiting for the stream's own decision on the new set (sent, or not): left to timing, the
        # next changes could fall in the same push interval and hide a list sent again.
        with logged("2 devices from") as grouped, logged("sent") as pushed:
            Path(node.devices, "g1-render").touch()  # joins g1: the same list, a device of two
            await grouped.wait()
            await pushed.wait()
        assert pushed.lines == [f"{RESOURCE}: the kubelet's list is unchanged: not sent again"]
        assert simulator.resources[RESOURCE].updates == updates
        answer = (await simulator.allocate(RESOURCE, ["g1"])).container_responses[0]
        assert [(m.host_path, m.read_only) for m in answer.mounts] == [
            (f"{node.devices}/g1", True),
            (f"{node.devices}/g1-render", True),
        ]
        Path(node.devices, "g1-render").unlink()
        os.symlink(".gone", Path(node.devices, "g1-render"))  # dangling (hidden names are no devices)
        await simulator.wait_until(lambda s: devices_of(s) == {"g1": gp.UNHEALTHY, "g2": gp.HEALTHY})
        with pytest.raises(gp.RPCError, match=r"g1-render is a symlink to \.gone, which does not exist"):
            await simulator.allocate(RESOURCE, ["g1"])
        Path(node.devices, ".gone").touch()
        await simulator.wait_until(listed("g1", "g2"))
        assert simulator.resources[RESOURCE].updates == updates + 2, "a member joining alone changes no list"


@pytest.mark.slow
async def test_usb_devices_come_and_go_with_their_nodes(nursery, node, tmp_path):
    sysfs = usb_tree(tmp_path)
    dev = os.path.join(node.devices, "host-dev")  # the node's /dev, with its USB buses
    usb_nodes(dev, "bus/usb/001/003", "hidraw0")  # the first key is plugged in
    os.makedirs(f"{dev}/bus/usb/002")
    top = {"dev_root": dev, "sysfs_root": sysfs}
    fields = {"usb": [{"vendor": "1050", "product": "0407"}], "allowed_host_paths": ["/dev/null"]}
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(top=top, **fields))
        await simulator.wait_until(listed("12345678"))
        # The second key: the kernel makes its USB node, then its HID interface's once bound.
        make_node(f"{dev}/bus/usb/001/004", 189, 3)
        await simulator.wait_until(listed("12345678", "87654321"))
        with logged("2 devices from USB 1050:0407") as bound:
            make_node(f"{dev}/hidraw1", 241, 1)
            await bound.wait()
        answer = (await simulator.allocate(RESOURCE, ["87654321"])).container_responses[0]
        assert [d.container_path for d in answer.devices] == [f"{dev}/bus/usb/001/004", f"{dev}/hidraw1"]
        # Unplugged: sysfs forgets it, the nodes go.
        shutil.rmtree(Path(sysfs, "bus", "usb", "devices", "1-1.1").resolve())
        os.unlink(Path(sysfs, "bus", "usb", "devices", "1-1.1"))
        os.unlink(f"{dev}/hidraw0")
        os.unlink(f"{dev}/bus/usb/001/003")
        await simulator.wait_until(listed("87654321"))
        # Buses that appear later (their controller's driver bound) are watched too: the second
        # key comes back on bus 2 (its sysfs directory standing for the new one), without hidraw1.
        shutil.rmtree(f"{dev}/bus")
        os.unlink(f"{dev}/hidraw1")
        await simulator.wait_until(listed())
        with open(Path(sysfs, "bus", "usb", "devices", "1-1.2", "uevent"), "w") as uevent:
            uevent.write("MAJOR=189\nMINOR=132\nDEVNAME=bus/usb/002/005\nDEVTYPE=usb_device\n")
        make_node(f"{dev}/bus/usb/002/005", 189, 132)
        await simulator.wait_until(listed("87654321"))
        answer = (await simulator.allocate(RESOURCE, ["87654321"])).container_responses[0]
        assert [d.container_path for d in answer.devices] == [f"{dev}/bus/usb/002/005"]


async def test_serve_warns_once_when_a_resource_has_no_device_and_says_when_it_has(
    nursery, node, tmp_path, monkeypatch
):
    """Issue: with a pattern that matches nothing, or a USB key on a machine without USB, serve only
    said that it waited for the kubelet. It warns once at start, once each time the last device
    goes, never at an update or a rescan that finds nothing again; the line when devices come says
    how many."""
    resource_dir = f"{node.devices}/k*"
    rescanned, warn_skipped_now = [trio.Event()], gp._warn_skipped_now

    def after_a_rescan(resource, *args):  # (a scan runs in a worker thread: idleness does not say it is done)
        warn_skipped_now(resource, *args)
        if resource.name == RESOURCE:
            rescanned[0].set()

    monkeypatch.setattr(gp, "_warn_skipped_now", after_a_rescan)
    with trio.fail_after(TIMEOUT), logged("no device from") as empty, logged(f"from {resource_dir}") as found:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, nothing_found(node, tmp_path))
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {} and streaming(s, YUBIKEY) == {})
        assert empty.lines[1:] == [f"{YUBIKEY}: no device from USB 1050:0407: none is offered until one appears"]
        with logged("skipping 'k::1'") as skipped:  # an update that finds no device again
            Path(node.devices, "k::1").touch()
            await skipped.wait()
            moved = node.devices + ".away"  # a rescan each time: the directory gone, then back
            rescanned[0] = trio.Event()
            os.rename(node.devices, moved)
            await rescanned[0].wait()  # its rescan, which found no directory, is done
            os.rename(moved, node.devices)
            await skipped.wait(2)
        assert len(skipped.lines) == 2, "warned again after the rescan that did not find it"
        Path(node.devices, "k1").touch()
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"k1": gp.HEALTHY})
        os.unlink(Path(node.devices, "k1"))
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {})
        Path(node.devices, "k2").touch()
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"k2": gp.HEALTHY})
    warning = f"{RESOURCE}: no device from {resource_dir}: none is offered until one appears"
    came = f"{RESOURCE}: 1 device from {resource_dir}"  # hot-plugged: which one came
    assert found.lines == [warning, f"{came}: k1 came", warning, f"{came}: k2 came"]


def test_the_hot_plug_line_names_what_came_and_went():
    assert gp._came_and_went({"g1": 1}, {"g1": 1, "g3": 1}) == ": g3 came"
    assert gp._came_and_went({"g1": 1, "g2": 1}, {"g2": 2, "g3": 1}) == ": g3 came; g1 went"
    many = {f"g{n}": 1 for n in range(12)}
    assert gp._came_and_went({}, many) == ": g0, g1, g2, g3, g4 and 7 more came"
    assert gp._came_and_went(many, many) == ""


async def test_kubelet_restart_reregisters_with_a_fresh_list(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        first = simulator.registrations[0].endpoint
        simulator.restart()
        await simulator.wait_until(lambda s: s.starts == 2)
        Path(node.devices, "g3").touch()
        await simulator.wait_until(lambda s: len(s.registrations) == 2)
        await simulator.wait_until(listed("g1", "g2", "g3"))
        assert simulator.registrations[1].endpoint != first
        assert node.our_sockets() == [simulator.registrations[1].endpoint], "the old socket is gone"


async def test_our_socket_deleted_brings_us_back(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        [old] = node.our_sockets()
        os.unlink(os.path.join(node.plugin_dir, old))
        await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s) == listed_ids("g1", "g2"))
        [new] = node.our_sockets()
        assert new != old and simulator.registrations[1].endpoint == new


async def test_the_old_registration_is_gone_before_the_next_register(nursery, node):
    # The kubelet disconnects whichever plugin is registered under the resource's name when a
    # stream ends (the simulator does too): a Register sent before the old stream's end was
    # handled would have the new registration dropped. So the order must be exactly this.
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        for round_ in range(3):
            [old] = node.our_sockets()
            os.unlink(os.path.join(node.plugin_dir, old))
            await simulator.wait_until(lambda s, n=round_ + 2: len(s.registrations) == n and devices_of(s))
        await simulator.wait_until(listed("g1", "g2"))
    endpoints = [f"gopherplug-example.com_gopher-{n}.sock" for n in (1, 2, 3, 4)]
    expected = [("registered", RESOURCE, endpoints[0])]
    for old, new in itertools.pairwise(endpoints):
        expected += [("stream ended", RESOURCE, old), ("disconnected", RESOURCE, old), ("registered", RESOURCE, new)]
    assert simulator.events == expected
    assert simulator.resources[RESOURCE].streaming


async def test_a_kubelet_sock_not_yet_reported_by_inotify_is_registered_with_once(nursery, node, monkeypatch):
    # A restarting kubelet wipes our socket and, a moment later, listens on a new
    # kubelet.sock. We serve socket 2 in that moment and wait for kubelet.sock. It appears while
    # KubeletWatch is slow to read (here: held from reading after the kubelet's checkpoint file),
    # and something else wakes register() (a device added). It used to find kubelet.sock there and
    # register under the generation before it; once inotify's report of kubelet.sock came, that
    # registration looked outdated and was made again (socket 3): two for one kubelet, the first
    # one's stream dropped without waiting for the kubelet to let it go.
    held = HeldBatches(monkeypatch, node.plugin_dir)
    with trio.fail_after(TIMEOUT), logged("serving and registering again") as again:
        simulator = await start(nursery, node, top={"metrics_address": "127.0.0.1:0"})
        listening = trio.Event()
        with logged("waiting for the kubelet: no") as waiting:
            simulator.restart(hold=listening)
            await waiting.wait()  # socket 2 served, the kubelet's sockets wiped, no kubelet.sock yet
        held.close()
        Path(node.plugin_dir, "kubelet_internal_checkpoint").touch()  # read, and then nothing more
        await held.wait_held()
        listening.set()
        await simulator.wait_until(lambda s: s.starts == 2)  # kubelet.sock made: not read by KubeletWatch
        Path(node.devices, "g3").touch()
        await simulator.wait_until(lambda s: s.registered_in == [1, 2] and listed("g1", "g2", "g3")(s))
        held.open()
        Path(node.plugin_dir, "fence").touch()
        await held.wait_handed("fence")  # and everything inotify said before it: kubelet.sock's creation
        await trio.testing.wait_all_tasks_blocked()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        registry = gp._metrics.registry
        restarts = registry.get_sample_value("gopherplug_kubelet_restarts_total")
        registrations = registry.get_sample_value("gopherplug_registrations_total", {"resource": RESOURCE})
    assert (restarts, registrations) == (1, 2), "the metrics count one registration per kubelet too"
    assert again.lines == [f"{RESOURCE}: our socket was deleted: serving and registering again"]
    assert simulator.registered_in == [1, 2], "one registration for each kubelet"
    endpoints = [f"gopherplug-example.com_gopher-{n}.sock" for n in (1, 2)]
    assert simulator.events == [
        ("registered", RESOURCE, endpoints[0]),
        ("stream ended", RESOURCE, endpoints[0]),
        ("disconnected", RESOURCE, endpoints[0]),
        ("registered", RESOURCE, endpoints[1]),
    ]
    assert node.our_sockets() == [endpoints[1]]


async def test_a_kubelet_sock_made_as_the_watch_starts_is_one_generation(nursery, node, monkeypatch):
    # KubeletWatch places its watch, then looks at kubelet.sock: a kubelet that starts in between
    # is there when it looks, and inotify reports its socket's creation too. One kubelet: counted once.
    arm, made = gp.DirectoryWatch.arm, []

    def kubelet_starts_meanwhile(watch):
        arm(watch)
        if watch.path == node.plugin_dir and not made:
            made.append(socket.socket(socket.AF_UNIX))
            made[0].bind(node.kubelet_socket)

    monkeypatch.setattr(gp.DirectoryWatch, "arm", kubelet_starts_meanwhile)
    held = HeldBatches(monkeypatch, node.plugin_dir)
    kubelet = gp.KubeletWatch(node.plugin_dir)
    try:
        with trio.fail_after(TIMEOUT):
            await nursery.start(kubelet.run)
            Path(node.plugin_dir, "fence").touch()
            await held.wait_handed("fence")
    finally:
        made[0].close()
    assert kubelet.generation == 0


async def test_a_new_kubelet_sock_with_the_old_kubelet_alive_lets_it_drop_the_old_stream_first(
    nursery, node, monkeypatch
):
    # kubelet.sock made anew (moved away and back) while the kubelet that has our registration
    # still runs, our socket untouched: a new generation as KubeletWatch sees it, the same kubelet
    # in fact. It must let our old stream go before the next Register, as after our socket's
    # deletion: the kubelet disconnects by name when a stream ends, the new registration otherwise.
    # The kubelet here is slow to let it go: it closes the stream's connection only on `release`.
    opened, release, armed = gp.open_stream, trio.Event(), []

    @contextlib.asynccontextmanager
    async def slow_to_let_go(*args, **kwargs):
        async with opened(*args, **kwargs) as responses:
            try:
                yield responses
            finally:
                if armed:
                    await release.wait()

    monkeypatch.setattr(gp, "open_stream", slow_to_let_go)
    with trio.fail_after(TIMEOUT), logged("serving and registering again") as again:
        simulator = await start(nursery, node)
        armed.append(True)
        with logged("waiting for the kubelet to let") as waiting:
            os.rename(node.kubelet_socket, node.kubelet_socket + ".away")
            os.rename(node.kubelet_socket + ".away", node.kubelet_socket)
            async with trio.open_nursery() as first:  # the plugin waits, or registers again at once

                async def then_stop(what):
                    await what()
                    first.cancel_scope.cancel()

                first.start_soon(then_stop, waiting.wait)
                first.start_soon(then_stop, functools.partial(simulator.wait_until, lambda s: len(s.registrations) > 1))
        armed.clear()
        release.set()
        endpoints = [f"gopherplug-example.com_gopher-{n}.sock" for n in (1, 2)]
        ended = ("stream ended", RESOURCE, endpoints[0])
        await simulator.wait_until(lambda s: len(s.registrations) == 2 and ended in s.events)
        assert simulator.events == [
            ("registered", RESOURCE, endpoints[0]),
            ended,
            ("disconnected", RESOURCE, endpoints[0]),
            ("registered", RESOURCE, endpoints[1]),
        ]
        await simulator.wait_until(listed("g1", "g2"))
        await simulator.allocate(RESOURCE, ["g1"])
    assert again.lines == [f"{RESOURCE}: the kubelet restarted: serving and registering again"]
    assert simulator.rejections == []


def held_list_service(release):
    """A DevicePlugin service whose ListAndWatch sends its first list (g1) only once ``release`` is set."""

    async def get_options(empty):
        return v1beta1.DevicePluginOptions(get_preferred_allocation_available=True)

    async def list_and_watch(empty):
        await release.wait()
        yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID="g1", health=gp.HEALTHY)])
        await trio.sleep_forever()

    async def allocate(request):
        return v1beta1.AllocateResponse(container_responses=[v1beta1.ContainerAllocateResponse(envs={"HELD": "1"})])

    service = purerpc.Service("v1beta1.DevicePlugin")
    for name, fn in [("GetDevicePluginOptions", get_options), ("ListAndWatch", list_and_watch), ("Allocate", allocate)]:
        service.add_method(name, fn, gp.METHODS[f"/v1beta1.DevicePlugin/{name}"].signature)
    return service


async def test_the_kubelet_stand_in_refuses_pods_from_a_streams_end_to_the_next_first_list(nursery, node):
    # The real kubelet marks every device unhealthy the moment a stream ends, and they stay so
    # until the next stream's first list: a pod admitted then is rejected for good, the plugin
    # never asked. The stand-in must be as strict, or a plugin that opens such a window passes.
    refused = (
        "Allocate failed due to no healthy devices present; cannot allocate unhealthy devices "
        f"{RESOURCE}, which is unexpected"
    )
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        async with trio.open_nursery() as plugin:
            await plugin.start(gp.serve_plugin, node.config())
            await simulator.wait_until(listed("g1", "g2"))
            await simulator.allocate(RESOURCE, ["g1"])
            plugin.cancel_scope.cancel()  # the plugin stops: its stream ends
        await simulator.wait_until(lambda s: not s.resources[RESOURCE].streaming)
        assert simulator.resources[RESOURCE].devices == {"g1": gp.UNHEALTHY, "g2": gp.UNHEALTHY}
        with pytest.raises(gp.UnexpectedAdmissionError) as info:
            await simulator.allocate(RESOURCE, ["g1"])
        assert str(info.value) == refused

        # Registered again, its stream open, its first list not sent yet: still refused.
        release = trio.Event()
        await nursery.start(gp.serve_grpc, os.path.join(node.plugin_dir, "held.sock"), [held_list_service(release)])
        request = v1beta1.RegisterRequest(version="v1beta1", endpoint="held.sock", resource_name=RESOURCE)
        await gp.call_unary(node.kubelet_socket, gp.METHODS[gp.REGISTER], request, timeout=5)
        await simulator.wait_until(lambda s: s.resources[RESOURCE].streaming)
        with pytest.raises(gp.UnexpectedAdmissionError, match="no healthy devices present"):
            await simulator.preferred_allocation(RESOURCE, ["g1"], [], 1)
        release.set()
        await simulator.wait_until(listed("g1"))
        answer = await simulator.allocate(RESOURCE, ["g1"])
    assert dict(answer.container_responses[0].envs) == {"HELD": "1"}
    assert simulator.rejections == [(RESOURCE, refused)] * 2


async def test_the_kubelet_stand_in_makes_its_removed_directory_anew(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        Path(node.plugin_dir, "left-behind").touch()  # a restart alone removes only sockets
        simulator.restart(remove_directory=True)
        await simulator.wait_until(lambda s: s.starts == 2)
    assert os.listdir(node.plugin_dir) == ["kubelet.sock"]


async def test_the_kubelet_stand_in_listens_when_told_and_records_which_start_each_registration_came_to(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        listening = trio.Event()
        with logged("waiting for the kubelet: no") as waiting:
            simulator.restart(hold=listening)
            await waiting.wait()  # the plugin saw its socket wiped, and serves again
        assert not os.path.exists(node.kubelet_socket)
        assert (simulator.starts, simulator.restarting) == (1, True)
        listening.set()
        await simulator.wait_until(lambda s: s.starts == 2 and len(s.registrations) == 2 and listed("g1", "g2")(s))
        assert not simulator.restarting
    assert simulator.registered_in == [1, 2]


async def test_kubelet_absent_at_start(nursery, node):
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.serve_plugin, node.config())
        assert not os.path.exists(os.path.join(node.plugin_dir, gp.KUBELET_SOCKET))
        assert len(node.our_sockets()) == 1, "serving already, waiting for kubelet.sock"
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await simulator.wait_until(listed("g1", "g2"))
        assert len(simulator.registrations) == 1


async def test_kubelet_stopped_for_a_while(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        async with trio.open_nursery() as kubelet:
            second = await kubelet.start(gp.KubeletSimulator(node.plugin_dir).run)  # restarts, then stops
            await second.wait_until(listed("g1", "g2"))
            kubelet.cancel_scope.cancel()
        await simulator.wait_until(lambda s: devices_of(s) is None)  # the first simulator lost its stream
        third = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await third.wait_until(listed("g1", "g2"))


def lock_file(node):
    return Path(node.plugin_dir, ".gopherplug-example.com_gopher.lock")


async def test_device_plugin_directory_removed_and_made_anew_by_the_kubelet(nursery, node):
    # On a host, the kubelet makes its directory anew at start when it was removed: the plugin
    # waits for it (inotify on the parent), takes its lock there, serves and registers again.
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        for registrations in range(2, 7):
            simulator.restart(remove_directory=True)
            await simulator.wait_until(
                lambda s, n=registrations: len(s.registrations) == n and devices_of(s) == listed_ids("g1", "g2")
            )
            assert lock_file(node).exists()
    assert node.our_sockets() == [simulator.registrations[-1].endpoint]


async def test_device_plugin_directory_removed_as_the_lock_is_taken_is_waited_for(nursery, node, monkeypatch):
    # The worst moment: the directory was there when the plugin looked, and is gone when it
    # opens its lock file. It must wait for the directory again, not stop.
    acquire, armed, removed = gp.ResourceLock.acquire, [], trio.Event()

    def removed_first(lock):
        if armed and not removed.is_set():
            shutil.rmtree(node.plugin_dir)
            removed.set()
        return acquire(lock)

    monkeypatch.setattr(gp.ResourceLock, "acquire", removed_first)
    with trio.fail_after(TIMEOUT), logged("waiting for the kubelet's directory") as waiting:
        simulator = await start(nursery, node)
        armed.append(True)
        lock_file(node).unlink()  # so that the plugin takes its lock again when it serves again,
        os.unlink(os.path.join(node.plugin_dir, node.our_sockets()[0]))  # which it does now
        await removed.wait()
        await waiting.wait()
        simulator.restart(remove_directory=True)  # the kubelet, started again, makes it anew
        await simulator.wait_until(lambda s: len(s.registrations) >= 2 and devices_of(s) == listed_ids("g1", "g2"))
    assert len(simulator.registrations) == 2
    assert lock_file(node).exists()


async def test_device_directory_deleted_and_recreated(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        shutil.rmtree(node.devices)
        await simulator.wait_until(listed())
        os.mkdir(node.devices)
        Path(node.devices, "g9").touch()
        await simulator.wait_until(listed("g9"))


async def test_device_directory_absent_at_start_and_parent_missing(nursery, node):
    nested = os.path.join(node.devices, "a", "b")
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, dataclasses_replace_dir(node.config(), nested))
        await simulator.wait_until(listed())
        os.makedirs(nested)
        Path(nested, "g1").touch()
        await simulator.wait_until(listed("g1"))


async def test_concurrent_streams_each_get_every_change(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        path = os.path.join(node.plugin_dir, simulator.resources[RESOURCE].endpoint)
        method = gp.METHODS["/v1beta1.DevicePlugin/ListAndWatch"]
        async with (
            gp.open_stream(path, method, v1beta1.Empty(), timeout=5) as a,
            gp.open_stream(path, method, v1beta1.Empty(), timeout=5) as b,
        ):
            for stream in (a, b):
                assert [d.ID for d in (await anext(stream)).devices] == ["g1", "g2"]
            Path(node.devices, "g3").touch()
            for stream in (a, b):
                assert [d.ID for d in (await anext(stream)).devices] == ["g1", "g2", "g3"]
        await simulator.wait_until(listed("g1", "g2", "g3"))


async def test_kubelet_refuses_an_invalid_resource_name_and_plugin_retries(nursery, node, caplog):
    config = node.config()
    bad = dataclasses.replace(config, resources=(dataclasses.replace(config.resources[0], name="gopher"),))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, bad)
        await simulator.wait_until(lambda s: len(s.refusals) >= 2)
    assert simulator.refusals[0] == 'the ResourceName "gopher" is invalid'
    assert not simulator.registrations
    assert 'registration failed, retrying in 0.01 s: UNKNOWN: the ResourceName "gopher" is invalid' in caplog.text
