"""The device model end to end: sources, health, allocation."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path
from resource import RUSAGE_SELF, getrusage

import grpc
import pytest
import trio
import trio.socket
import trio.testing
import yaml
from google.protobuf.json_format import MessageToDict
from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

import gopherplug as gp
from gopherplug import StatusCode, v1beta1
from testsupport import (
    HERE,
    OTHER,
    RESOURCE,
    TIMEOUT,
    WIDGET,
    GrpcioClient,
    StderrLines,
    allocate_request,
    config_text,
    devices_of,
    fake_sysfs,
    health_of,
    host_mode,
    in_thread,
    listed,
    listed_ids,
    logged,
    read_spec,
    read_until,
    reloading,
    replace_file,
    start,
    streaming,
    widgets,
    without_dac_override,
    write_config,
)

# ------------------------------------------------------------------------------------------------
# The device model end to end: what the kubelet's stream and Allocate see
# ------------------------------------------------------------------------------------------------


async def test_health_follows_a_symlink_target_elsewhere(nursery, node, tmp_path):
    # g3 points into a directory that does not exist yet: watched through its nearest ancestor.
    target = tmp_path / "elsewhere" / "deeper" / "g3-target"
    os.symlink(target, os.path.join(node.devices, "g3"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config())
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
        assert simulator.resources[RESOURCE].allocatable == 2
        target.parent.mkdir(parents=True)
        target.touch()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.HEALTHY)
        assert simulator.resources[RESOURCE].allocatable == 3
        target.unlink()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
        with pytest.raises(gp.RPCError) as info:
            await simulator.allocate(RESOURCE, ["g3"])
        assert info.value.code == StatusCode.FAILED_PRECONDITION
        target.touch()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.HEALTHY)
        os.unlink(os.path.join(node.devices, "g3"))  # an entry that disappears leaves the list
        await simulator.wait_until(listed("g1", "g2"))


async def test_health_follows_a_symlink_to_an_entry_of_the_same_directory(nursery, node):
    Path(node.devices, "node0").touch()
    os.symlink("node0", os.path.join(node.devices, "gopher0"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(pattern="gopher*"))
        await simulator.wait_until(listed("gopher0"))
        os.unlink(os.path.join(node.devices, "node0"))  # an event about node0 decides on gopher0
        await simulator.wait_until(lambda s: health_of(s) == {"gopher0": gp.UNHEALTHY})
        Path(node.devices, "node0").touch()
        await simulator.wait_until(listed("gopher0"))


async def test_health_follows_every_hop_of_a_symlink_chain(nursery, node, tmp_path):
    # gopher0 -> by-id/usb-gopher -> real/node0, as udev lays out /dev/serial/by-id.
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "node0").touch()
    (tmp_path / "by-id").mkdir()
    os.symlink(tmp_path / "real" / "node0", tmp_path / "by-id" / "usb-gopher")
    os.symlink(tmp_path / "by-id" / "usb-gopher", os.path.join(node.devices, "gopher0"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(pattern="gopher*"))
        await simulator.wait_until(listed("gopher0"))
        os.unlink(tmp_path / "by-id" / "usb-gopher")  # unplugged: the link in between goes
        await simulator.wait_until(lambda s: health_of(s) == {"gopher0": gp.UNHEALTHY})
        os.symlink(tmp_path / "real" / "node0", tmp_path / "by-id" / "usb-gopher")
        await simulator.wait_until(listed("gopher0"))


@pytest.mark.slow
async def test_health_follows_permissions(nursery, node, tmp_path):
    # The plugin runs as a real process that cannot override file permissions, as in a pod.
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(
        [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "--config", str(path)],
        stderr=subprocess.PIPE,
    )
    stderr = StderrLines(process.stderr)
    g1 = os.path.join(node.devices, "g1")
    status = os.stat(g1)
    who = "root without capabilities" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            os.chmod(g1, 0o200)  # write only; plain files need reading
            await simulator.wait_until(lambda s: health_of(s) == {"g1": gp.UNHEALTHY, "g2": gp.HEALTHY})
            # The line says what refuses, and what to change (it gave neither mode, owner nor fix).
            await stderr.wait_for(
                f"WARNING {RESOURCE}: g1 is unhealthy: this process cannot open {g1} for reading: mode 0200 and owner "
                f"{status.st_uid}:{status.st_gid} refuse reading to {who}: fix the mode or owner on the host (a udev "
                "rule, for nodes that come and go)\n"
            )
            os.chmod(g1, 0o644)
            await simulator.wait_until(listed("g1", "g2"))
    finally:
        process.terminate()
        await process.wait()


async def test_replicas_are_offered_and_allocated_as_their_device(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(replicas=2))
        await simulator.wait_until(listed("g1::0", "g1::1", "g2::0", "g2::1"))
        assert simulator.resources[RESOURCE].capacity == 4
        answer = await simulator.allocate(RESOURCE, ["g2::1", "g1::0", "g2::0"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g2,g1"}
        picked = await simulator.preferred_allocation(RESOURCE, ["g1::0", "g1::1", "g2::0", "g2::1"], [], 2)
        assert picked == ["g1::0", "g1::1"]


async def test_numa_topology_is_reported_and_preferred(nursery, node, tmp_path):
    for name in ("g1", "g2"):
        os.unlink(os.path.join(node.devices, name))
    for name, target in [("null", "/dev/null"), ("zero", "/dev/zero"), ("full", "/dev/full")]:
        os.symlink(target, os.path.join(node.devices, name))
    config = node.config(allowed_host_paths=["/dev"])
    config = dataclasses.replace(config, sysfs_root=fake_sysfs(tmp_path / "sys", {(1, 3): 0, (1, 5): 1, (1, 7): 1}))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("full", "null", "zero"))
        assert simulator.resources[RESOURCE].topology == {"null": (0,), "zero": (1,), "full": (1,)}
        assert await simulator.preferred_allocation(RESOURCE, ["null", "zero", "full"], [], 2) == ["full", "zero"]
        answer = await simulator.allocate(RESOURCE, ["zero"])
        specs = answer.container_responses[0].devices
    assert [(s.host_path, s.container_path) for s in specs] == [("/dev/zero", f"{node.devices}/zero")]


async def test_cdi_spec_follows_the_devices_and_allocate_names_them(node, tmp_path):
    cdi_dir = tmp_path / "cdi"  # missing: created
    config = node.config(
        cdi={"kind": "example.com/gopher", "spec_dir": str(cdi_dir)},
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],
    )
    spec_file = cdi_dir / "example.com-gopher.json"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, config)
            await simulator.wait_until(listed("g1", "g2"))
            spec = read_spec(spec_file)
            assert (spec["cdiVersion"], spec["kind"]) == ("0.5.0", "example.com/gopher")
            assert [d["name"] for d in spec["devices"]] == ["g1", "g2"]
            assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
                {"path": "/dev/g1", "hostPath": f"{node.devices}/g1", "permissions": "rw"}
                | host_mode(f"{node.devices}/g1")
            ]
            Path(node.devices, "g3").touch()
            await simulator.wait_until(listed("g1", "g2", "g3"))
            # Written before the kubelet heard of g3: a container may be created with it at once.
            assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g1", "g2", "g3"]
            # One device a line, for a person reading the file: the head, three devices, the end.
            lines = spec_file.read_text().splitlines()
            assert [json.loads(line.rstrip(","))["name"] for line in lines[1:-1]] == ["g1", "g2", "g3"]
            answer = await simulator.allocate(RESOURCE, ["g3", "g1"])
            names = [d.name for d in answer.container_responses[0].cdi_devices]
            assert names == ["example.com/gopher=g3", "example.com/gopher=g1"]
            # No temporary left; the lock that keeps other processes from writing the same file.
            assert sorted(p.name for p in cdi_dir.iterdir()) == [
                ".example.com-gopher.json.lock",
                "example.com-gopher.json",
            ]
            for name in ("g1", "g2", "g3"):
                os.unlink(os.path.join(node.devices, name))
            await simulator.wait_until(listed())
            assert not spec_file.exists(), "CDI refuses a spec without devices: removed instead"
            Path(node.devices, "g4").touch()
            await simulator.wait_until(listed("g4"))
            assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g4"]
            nursery.cancel_scope.cancel()
    # Kept: the kubelet gives the runtime the same CDI names again when a container restarts,
    # whether the plugin runs or not.
    assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g4"]


async def test_cdi_spec_follows_a_chmod_or_chown_before_the_kubelet_hears(node, tmp_path):
    """A node's mode and owner in the spec follow the host's: a chmod or chown of the entry, or of
    where its symlink leads, rewrites the spec before the streams see the new set (inotify
    IN_ATTRIB); the kubelet's list itself is the same, and not sent again."""
    targets = tmp_path / "targets"
    targets.mkdir()
    (targets / "t2").touch()
    os.unlink(os.path.join(node.devices, "g2"))
    os.symlink(targets / "t2", os.path.join(node.devices, "g2"))
    os.chmod(os.path.join(node.devices, "g1"), 0o660)
    os.chmod(targets / "t2", 0o640)
    config = node.config(
        cdi={"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")},
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],  # files, as nodes would be
        allowed_host_paths=[str(targets)],
    )
    spec_file = tmp_path / "cdi" / "example.com-gopher.json"

    def described():
        return {
            device["name"]: {key: node[key] for key in ("fileMode", "uid", "gid") if key in node}
            for device in read_spec(spec_file)["devices"]
            for node in device["containerEdits"]["deviceNodes"]
        }

    me = {"uid": os.geteuid(), "gid": os.getegid()}
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, config)
            await simulator.wait_until(listed("g1", "g2"))
            assert described() == {"g1": {"fileMode": 0o660, **me}, "g2": {"fileMode": 0o640, **me}}

            async def changed(change):
                updates = simulator.resources[RESOURCE].updates
                with logged("sent") as pushed:
                    change()
                    # The kubelet's list is the same, so the stream sends nothing; the spec is
                    # already written when the stream sees the new set.
                    await pushed.wait()
                    spec = described()
                assert set(pushed.lines) == {f"{RESOURCE}: the kubelet's list is unchanged: not sent again"}
                assert simulator.resources[RESOURCE].updates == updates
                return spec

            after = await changed(lambda: os.chmod(os.path.join(node.devices, "g1"), 0o600))
            assert after == {"g1": {"fileMode": 0o600, **me}, "g2": {"fileMode": 0o640, **me}}
            after = await changed(lambda: os.chmod(targets / "t2", 0o660))  # the symlink's target
            assert after == {"g1": {"fileMode": 0o600, **me}, "g2": {"fileMode": 0o660, **me}}
            if os.geteuid() == 0:
                after = await changed(lambda: os.chown(targets / "t2", 1234, 5678))
                assert after["g2"] == {"fileMode": 0o660, "uid": 1234, "gid": 5678}
            assert devices_of(simulator) == listed_ids("g1", "g2")
            nursery.cancel_scope.cancel()


async def test_cdi_spec_has_no_gap_across_a_reload_or_a_restart(node, tmp_path):
    cdi_dir = tmp_path / "cdi"
    path = tmp_path / "gopherplug.yaml"
    cdi = {"cdi": {"kind": "example.com/gopher", "spec_dir": str(cdi_dir)}}
    path.write_text(config_text(node, **{RESOURCE: cdi}))
    spec_file = cdi_dir / "example.com-gopher.json"
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            simulator = await reloading(nursery, node, path)
            watcher = INotify()  # every change the spec's directory sees from here on
            watcher.add_watch(str(cdi_dir), inotify_flags.DELETE | inotify_flags.MOVED_FROM | inotify_flags.MOVED_TO)
            with logged("configuration reloaded: updated in place") as updated:
                replace_file(path, config_text(node, **{RESOURCE: {**cdi, "env": "GOPHERS"}}))  # its watch restarts
                await updated.wait()
            pre_start = {**cdi, "env": "GOPHERS", "pre_start": ["/bin/true"]}
            replace_file(path, config_text(node, **{RESOURCE: pre_start}))  # new options: served anew
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s))
            nursery.cancel_scope.cancel()
        async with trio.open_nursery() as nursery:  # the plugin restarted, as a DaemonSet update does
            simulator = await reloading(nursery, node, path)
            nursery.cancel_scope.cancel()
    events = [inotify_flags.from_mask(e.mask) for e in watcher.read(timeout=0) if e.name == spec_file.name]
    watcher.close()
    # Only atomic replacements (a temporary renamed over it); never a moment without the file.
    assert events and all(flags == [inotify_flags.MOVED_TO] for flags in events), events
    assert [d["name"] for d in read_spec(spec_file)["devices"]] == ["g1", "g2"]


async def test_cdi_write_failure_holds_new_devices_back_until_it_works(nursery, node, tmp_path):
    cdi_dir = tmp_path / "cdi"
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, cdi={"kind": "example.com/gopher", "spec_dir": str(cdi_dir)})
        os.rename(cdi_dir, tmp_path / "away")
        cdi_dir.write_text("a file where the directory was: every write fails")
        with logged("offering only the devices it describes until it can be written") as said:
            Path(node.devices, "g3").touch()  # (examined in a worker thread: a line, not idleness, says when)
            await said.wait()
        assert devices_of(simulator) == listed_ids("g1", "g2"), "g3 has no CDI description: not offered"
        cdi_dir.unlink()
        os.rename(tmp_path / "away", cdi_dir)
        Path(node.devices, "g4").touch()  # the next change writes again, g3 included
        await simulator.wait_until(listed("g1", "g2", "g3", "g4"))
    assert [d["name"] for d in read_spec(cdi_dir / "example.com-gopher.json")["devices"]] == ["g1", "g2", "g3", "g4"]


async def test_without_cdi_nothing_of_cdi_appears(nursery, node, tmp_path):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        answer = await simulator.allocate(RESOURCE, ["g1"])
    assert not answer.container_responses[0].cdi_devices


async def test_cdi_spec_dir_not_writable_stops_at_start(node, tmp_path):
    blocker = tmp_path / "file"
    blocker.touch()
    config = node.config(cdi={"kind": "example.com/gopher", "spec_dir": str(blocker / "cdi")})
    with pytest.raises(gp.GopherplugError) as info:
        with gp._unwrap_single_errors():
            async with trio.open_nursery() as nursery:
                await nursery.start(gp.serve_plugin, config)
    assert str(gp._innermost(info.value)).startswith(
        f"cannot write the CDI spec {blocker}/cdi/example.com-gopher.json: "
    )


async def test_host_paths_are_resolved_and_dev_is_not_allowed_from_elsewhere(nursery, node, caplog):
    # g0 -> /dev/null stands for g0 -> /dev/vda: a link into /dev from a directory anyone may write.
    os.symlink("/dev/null", os.path.join(node.devices, "g0"))
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
    assert f"skipping 'g0': host path /dev/null is outside {node.devices}: add its directory" in caplog.text

    os.unlink(os.path.join(node.devices, "g0"))
    os.symlink("../elsewhere/tty0", os.path.join(node.devices, "g0"))  # a by-id style relative link
    os.mkdir(os.path.join(os.path.dirname(node.devices), "elsewhere"))
    Path(os.path.dirname(node.devices), "elsewhere", "tty0").touch()
    with trio.fail_after(TIMEOUT):
        await nursery.start(
            gp.serve_plugin,
            gp.parse_config(
                yaml.safe_dump(
                    {
                        "device_plugin_dir": node.plugin_dir,
                        "resources": [
                            {
                                "name": OTHER,
                                "directory": node.devices,
                                "pattern": "g0",
                                "allowed_host_paths": [os.path.join(os.path.dirname(node.devices), "elsewhere")],
                                "device_specs": [{"host_path": "{path}", "container_path": "{path}"}],
                                "mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}],
                            }
                        ],
                    }
                ),
                "test.yaml",
            ),
        )
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"g0": gp.HEALTHY})
        answer = (await simulator.allocate(OTHER, ["g0"])).container_responses[0]
    target = os.path.join(os.path.dirname(node.devices), "elsewhere", "tty0")
    # The runtime opens the file that was checked, now and at every restart of the container; the
    # container sees it under the link's stable name.
    assert [(d.host_path, d.container_path) for d in answer.devices] == [(target, f"{node.devices}/g0")]
    assert [(m.host_path, m.container_path) for m in answer.mounts] == [(target, "/run/g0")]


async def test_allocate_checks_a_relinked_device_again(nursery, node, tmp_path):
    # The link is re-pointed outside the allowed roots, and Allocate comes before the plugin has
    # handled the event: the answer must come from the file system as it is, not the last list.
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a").touch()
    os.symlink(allowed / "a", os.path.join(node.devices, "g0"))
    resource = node.config(
        pattern="g0", allowed_host_paths=[str(allowed)], mounts=[{"host_path": "{path}", "container_path": "/run/{id}"}]
    ).resources[0]
    devices = gp.Watched({d.id: d for d in gp.scan_directory(resource).devices})
    roots = gp.host_path_roots(resource)
    service = gp.device_plugin_service(
        resource, devices, examine=lambda device: gp.examine_again(resource, device, roots, "/sys")
    )
    server = await nursery.start(gp.serve_grpc, os.path.join(node.plugin_dir, "p.sock"), [service])
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=["g0"])])
    method = gp.METHODS["/v1beta1.DevicePlugin/Allocate"]
    with trio.fail_after(TIMEOUT):
        answer = await gp.call_unary(server.socket_path, method, request, timeout=5)
        assert [m.host_path for m in answer.container_responses[0].mounts] == [str(allowed / "a")]
        os.unlink(os.path.join(node.devices, "g0"))
        os.symlink("/etc/hostname", os.path.join(node.devices, "g0"))
        with pytest.raises(gp.RPCError) as refused:
            await gp.call_unary(server.socket_path, method, request, timeout=5)
    assert (refused.value.code, refused.value.message) == (
        StatusCode.FAILED_PRECONDITION,
        f"example.com/gopher device g0: host path /etc/hostname is outside {node.devices}, {allowed}: add its "
        "directory to allowed_host_paths",
    )


async def test_serve_plugin_resolves_the_allowed_roots_at_each_allocate(nursery, node, tmp_path):
    # serve_plugin resolves a resource's roots once per Allocate (not per device): still at each
    # call, so an allowed directory that is a symlink re-pointed since the last one counts as it
    # is now. Its target's file stays where it was; only the root moved away from it.
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "a").touch()
    allowed = tmp_path / "allowed"
    os.symlink(first, allowed)
    os.symlink(first / "a", os.path.join(node.devices, "g0"))
    config = node.config(
        pattern="g0", allowed_host_paths=[str(allowed)], mounts=[{"host_path": "{path}", "container_path": "/run/{id}"}]
    )
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(lambda s: streaming(s, RESOURCE) == {"g0": gp.HEALTHY})
        answer = await simulator.allocate(RESOURCE, ["g0"])
        assert [m.host_path for m in answer.container_responses[0].mounts] == [str(first / "a")]
        os.unlink(allowed)
        os.symlink(second, allowed)
        with pytest.raises(gp.RPCError) as refused:
            await simulator.allocate(RESOURCE, ["g0"])
    assert refused.value.code == StatusCode.FAILED_PRECONDITION
    assert f"host path {first / 'a'} is outside {node.devices}, {second}" in refused.value.message


async def test_allocate_gives_mounts_annotations_and_cdi_together(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(
            nursery,
            node,
            device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher-{id}"}],
            mounts=[{"host_path": node.devices, "container_path": "/gophers"}],
            annotations={"example.com/gophers": "{id}"},
            cdi={"kind": "example.com/gopher", "spec_dir": os.path.join(node.devices, ".cdi")},
        )
        answer = await simulator.allocate(RESOURCE, ["g2", "g1"])
    assert MessageToDict(answer.container_responses[0]) == {
        "envs": {"GOPHER_DEVICES": "g2,g1"},
        "mounts": [{"containerPath": "/gophers", "hostPath": node.devices, "readOnly": True}],
        "devices": [
            {"containerPath": "/dev/gopher-g2", "hostPath": f"{node.devices}/g2", "permissions": "rw"},
            {"containerPath": "/dev/gopher-g1", "hostPath": f"{node.devices}/g1", "permissions": "rw"},
        ],
        "annotations": {"example.com/gophers": "g2,g1"},
        "cdiDevices": [{"name": "example.com/gopher=g2"}, {"name": "example.com/gopher=g1"}],
    }


HOOK = """
import os, sys
with open(sys.argv[1], "w") as out:
    out.write(os.environ["GOPHERPLUG_RESOURCE"] + " " + os.environ["GOPHER_DEVICES"])
if os.environ["GOPHER_DEVICES"] == "g2":
    print("checking g2", file=sys.stderr)
    print("g2 is not ready: firmware missing", file=sys.stderr)
    sys.exit(3)
if os.environ["GOPHER_DEVICES"] == "g1,g2":
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn command: killed all the same
    time.sleep(30)
"""


@pytest.mark.slow
async def test_pre_start_hook_runs_before_each_container(nursery, node, tmp_path):
    (tmp_path / "hook.py").write_text(HOOK)
    said = tmp_path / "said"
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        config = node.config(
            replicas=2, pre_start=[sys.executable, str(tmp_path / "hook.py"), str(said)], pre_start_timeout=0.5
        )
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("g1::0", "g1::1", "g2::0", "g2::1"))
        assert simulator.resources[RESOURCE].options.pre_start_required
        assert await simulator.pre_start_container(RESOURCE, ["g1::1", "g1::0"]) == v1beta1.PreStartContainerResponse()
        assert said.read_text() == "example.com/gopher g1"
        with pytest.raises(gp.RPCError) as failed:
            await simulator.pre_start_container(RESOURCE, ["g2::0"])
        asked = trio.current_time()
        with pytest.raises(gp.RPCError) as slow:
            await simulator.pre_start_container(RESOURCE, ["g1::0", "g2::1"])
        assert trio.current_time() - asked < 3, "generous: trio's default would wait 5 s after SIGTERM"
    assert (failed.value.code, failed.value.message) == (
        StatusCode.UNKNOWN,
        f"pre_start {sys.executable} exited with 3: g2 is not ready: firmware missing (first: checking g2)",
    )
    assert (slow.value.code, slow.value.message) == (
        StatusCode.DEADLINE_EXCEEDED,
        f"pre_start {sys.executable} did not finish within 0.5 s (killed)",
    )


# A pre_start command the test holds back: it registers itself (a file named by its pid), tells
# the test how many commands are registered (a line on a FIFO), then waits for a shared flock on a
# file the test holds exclusively, and unregisters before it exits.
HELD_HOOK = """
import fcntl, os, sys
running, fifo, lock = sys.argv[1:]
mine = os.path.join(running, str(os.getpid()))
open(mine, "x").close()
with open(fifo, "w") as out:
    out.write(f"{len(os.listdir(running))}\\n")
with open(lock) as held:
    fcntl.flock(held, fcntl.LOCK_SH)
os.remove(mine)
"""


class Lines:
    """The lines written to a FIFO, as they come: the read end, and a write end kept open so that
    the FIFO never reaches end of file between two writers."""

    def __init__(self, path):
        self.stream = trio.lowlevel.FdStream(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        self.keep_open = os.open(path, os.O_WRONLY)
        self.buffer = b""

    async def next(self):
        while b"\n" not in self.buffer:
            self.buffer += await self.stream.receive_some()
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    async def aclose(self):
        os.close(self.keep_open)
        await self.stream.aclose()


@pytest.mark.slow
async def test_slow_pre_starts_neither_starve_allocate_nor_all_run_at_once(pb2, nursery, node, tmp_path):
    """40 containers starting at once, their pre_start commands all slow: the kubelet's one
    connection must still carry an Allocate, and only a few commands may run at a time."""
    hook, running, fifo, lock = tmp_path / "hook.py", tmp_path / "running", tmp_path / "fifo", tmp_path / "lock"
    hook.write_text(HELD_HOOK)
    running.mkdir()
    os.mkfifo(fifo)
    lock.touch()
    calls, limit = 40, gp.PRE_START_CONCURRENCY
    command = [sys.executable, str(hook), str(running), str(fifo), str(lock)]
    held = open(lock)  # closed in the finally below
    fcntl.flock(held, fcntl.LOCK_EX)
    lines = Lines(fifo)
    client = None
    try:
        with trio.fail_after(TIMEOUT):
            simulator = await start(nursery, node, pre_start=command)
            # One grpcio channel is one connection, like the kubelet's grpc-go one to each plugin:
            # calls beyond the streams the server allows wait in the client for a free stream.
            client = GrpcioClient(pb2, os.path.join(node.plugin_dir, simulator.registrations[0].endpoint))
            pre_start = client.channel.unary_unary(
                "/v1beta1.DevicePlugin/PreStartContainer",
                request_serializer=pb2.PreStartContainerRequest.SerializeToString,
                response_deserializer=pb2.PreStartContainerResponse.FromString,
            )
            request = pb2.PreStartContainerRequest(devices_ids=["g1"])
            pending = await in_thread(lambda: [pre_start.future(request, timeout=TIMEOUT) for _ in range(calls)])
            counts = [int(await lines.next()) for _ in range(limit)]  # that many commands are held
            answer = await in_thread(client.allocate, allocate_request(pb2, "g2"), timeout=5)
            assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g2"}
            fcntl.flock(held, fcntl.LOCK_UN)
            answers = await in_thread(lambda: [call.result() for call in pending])
            assert answers == [pb2.PreStartContainerResponse()] * calls
            counts += [int(await lines.next()) for _ in range(calls - limit)]  # every command reported
    finally:
        held.close()
        if client is not None:
            client.close()
        await lines.aclose()
    assert max(counts) == limit, counts
    assert os.listdir(running) == []


async def test_pre_start_that_waits_past_its_timeout_for_a_slot_says_so(node):
    resource = node.config(pre_start=["true"], pre_start_timeout=0.2).resources[0]
    slots = trio.CapacityLimiter(2)
    with trio.fail_after(TIMEOUT):
        for holder in ("one", "two"):  # two commands running: every slot taken
            await slots.acquire_on_behalf_of(holder)
        with pytest.raises(gp.RPCError) as info:
            await gp.run_pre_start(resource, [gp.DeviceEntry("g1", f"{node.devices}/g1")], slots)
    assert (info.value.code, info.value.message) == (
        StatusCode.DEADLINE_EXCEEDED,
        "pre_start true did not start within 0.2 s: it waited all that time for one of the 2 pre_start commands "
        "already running for example.com/gopher to finish",
    )


# Writes 300 MiB to stdout and as much to stderr, then says what went wrong and fails.
LOUD_HOOK = """
import sys
chunk = b"x" * 2**20 + b"\\n"
for _ in range(300):
    sys.stdout.buffer.write(chunk)
    sys.stderr.buffer.write(chunk)
sys.stderr.buffer.write(b"the disk is full\\n\\n")
sys.exit(1)
"""


@pytest.mark.slow
async def test_pre_start_output_does_not_fill_the_plugins_memory(nursery, node):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node, pre_start=[sys.executable, "-c", LOUD_HOOK])
        peak = getrusage(RUSAGE_SELF).ru_maxrss  # KiB
        with pytest.raises(gp.RPCError) as failed:
            await simulator.pre_start_container(RESOURCE, ["g1"])
        grown = getrusage(RUSAGE_SELF).ru_maxrss - peak
    assert (failed.value.code, failed.value.message) == (
        StatusCode.UNKNOWN,
        f"pre_start {sys.executable} exited with 1: the disk is full (first: {'x' * 120})",
    )
    assert grown < 50 * 1024, f"the plugin's peak memory grew by {grown // 1024} MiB for 600 MiB of output"


def readme_example_text():
    """The embedding example as written in docs/embedding.md (its first Python code block)."""
    text = (HERE / "docs" / "embedding.md").read_text()
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def readme_example():
    """The embedding example of docs/embedding.md, as a module namespace."""
    namespace = {"__name__": "readme_example"}
    exec(compile(readme_example_text(), "docs/embedding.md", "exec"), namespace)
    return namespace


async def test_readme_embedding_example_serves_devices_from_code(nursery, node):
    example = readme_example()
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        nursery.start_soon(example["main"], node.plugin_dir)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
        answer = (await simulator.allocate("example.com/widget", ["w1"])).container_responses[0]
        assert dict(answer.envs) == {"WIDGETS": "w1", "WIDGET_FIRMWARE": "2.1"}
        assert [(d.host_path, d.container_path) for d in answer.devices] == [("/dev/w1", "/dev/w1")]
        example["devices"].set({"w2": gp.DeviceEntry("w2", "/dev/w2", health=gp.UNHEALTHY)})
        await simulator.wait_until(lambda s: widgets(s) == {"w2": gp.UNHEALTHY})


EMBEDDING_EXAMPLES = HERE / "examples" / "embedding"


WIDGET_SOCKET = "gopherplug-example.com_widget-1.sock"


def test_readme_embedding_example_is_the_example_file():
    """docs/embedding.md's example is examples/embedding/device_plugin.py, which mypy --strict checks
    (pyproject.toml's [tool.mypy] files) against the typed public API: the shape hook's answer is a
    ContainerAllocateResponse."""
    assert readme_example_text() == (EMBEDDING_EXAMPLES / "device_plugin.py").read_text()
    assert "examples/embedding" in tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert "response: gopherplug.ContainerAllocateResponse" in readme_example_text()


LESSONS = HERE / "examples" / "lesson"


#: The lessons in reading order (docs/protocol.md's table), and those with a --demo.
LESSON_FILES = ["gopher_devices.py", "gopher_plugin.py", "gopher_allocation.py", "gopher_dra.py", "gopher_claims.py"]


LESSON_DEMOS = LESSON_FILES[1:]


#: What the demos' narrations must name between them: every v1beta1 RPC the kubelet calls, Register,
#: TopologyInfo and CDI on the device-plugin side; DRA's objects, its RPCs and a CEL selector on an
#: attribute and a capacity on the other.
LESSON_NAMES = [
    "GetDevicePluginOptions",
    "ListAndWatch",
    "GetPreferredAllocation",
    "Allocate(",
    "PreStartContainer",
    "Register(",
    "TopologyInfo",
    "cdi_devices",
    "DeviceClass",
    "ResourceClaim",
    'device.attributes["gopher.example.com"]',
    'device.capacity["gopher.example.com"]',
    "ResourceSlice",
    "NodePrepareResources",
    "NodeUnprepareResources",
    "CDI spec",
]


def _narration(stdout):
    """A demo's lines without their times, its temporary directory as <root>."""
    return [re.sub(r"/\S*/lesson-[^/ )]+", "<root>", line.split(" ms  ", 1)[1]) for line in stdout.splitlines()]


def test_every_lesson_is_read_in_one_sitting_and_type_checked():
    """The lessons of examples/lesson, each at most 250 lines (a sitting), are the five docs/protocol.md
    lists in order, each named there with its exercises; mypy --strict checks them and the solutions."""
    assert sorted(path.name for path in LESSONS.glob("gopher_*.py")) == sorted(LESSON_FILES)
    for name in LESSON_FILES:
        assert len((LESSONS / name).read_text().splitlines()) <= 250, name
    table = (HERE / "docs" / "protocol.md").read_text()
    assert [table.index(f"`{name}`") for name in LESSON_FILES] == sorted(
        table.index(f"`{name}`") for name in LESSON_FILES
    )
    assert "examples/lesson" in tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["mypy"]["files"]


@pytest.mark.slow
def test_the_lesson_demos_exit_0_and_name_every_rpc_and_dra_object(sockdir):
    """Each lesson's --demo, run as a learner runs it (its own process, against gopherplug's kubelet
    simulator, or the DRA kubelet, API server and scheduler stand-ins), exits 0 with nothing on
    stderr; each step of a demo fails it (exit 1) unless the stand-in sees it within 10 s. Together
    the narrations name every RPC and DRA object the lessons teach, by the names the code uses, and
    the demos leave nothing behind."""
    env = {**os.environ, "PYTHONPATH": str(HERE), "TMPDIR": sockdir}  # socket paths under 108 bytes
    said = {}
    for name in LESSON_DEMOS:
        result = subprocess.run(
            [sys.executable, str(LESSONS / name), "--demo"], env=env, capture_output=True, text=True, timeout=60
        )
        assert (result.returncode, result.stderr) == (0, ""), name + ": " + result.stdout + result.stderr
        said[name] = _narration(result.stdout)
    everything = "\n".join(line for lines in said.values() for line in lines)
    assert [name for name in LESSON_NAMES if name not in everything] == []
    assert "first list" not in everything
    assert os.listdir(sockdir) == []

    # Lesson 2: the kubelet's view, in order (the plugin's own lines may come a moment before or after).
    listed = "gopher0 Healthy, gopher1 Healthy, gopher2 Healthy, gopher3 Healthy"
    assert [line for line in said["gopher_plugin.py"] if not line.startswith("plugin")] == [
        "kubelet  listening on <root>/device-plugins/kubelet.sock",
        "kubelet  GetDevicePluginOptions, during Register: all False",
        "kubelet  ListAndWatch: no devices",
        "demo     plugged in: gophers/ appears with gopher0, gopher1, gopher2",
        "kubelet  ListAndWatch: gopher0 Healthy, gopher1 Healthy, gopher2 Healthy",
        "kubelet  Allocate(gopher0, gopher1) -> env {'GOPHER_DEVICES': 'gopher0,gopher1'}",
        "kubelet    device <root>/gophers/gopher0 -> /dev/gopher0 (rw)",
        "kubelet    device <root>/gophers/gopher1 -> /dev/gopher1 (rw)",
        "demo     created gophers/gopher3",
        f"kubelet  ListAndWatch (inotify told the plugin): {listed}",
        "demo     gophers/gopher4: a symlink to nothing",
        f"kubelet  ListAndWatch: {listed}, gopher4 Unhealthy",
        "demo     its target appeared",
        f"kubelet  ListAndWatch: {listed}, gopher4 Healthy",
        "demo     unplugged: gophers/ deleted, as udev deletes /dev/serial/by-id",
        "kubelet  ListAndWatch: no devices",
        "demo     plugged in again: a new gophers/ with gopher0",
        "kubelet  ListAndWatch (the new directory watched): gopher0 Healthy",
        "demo     the kubelet restarts: it deletes every socket, makes a new kubelet.sock",
        "kubelet  ListAndWatch, after Register: gopher0 Healthy",
        "demo     done: the plugin stopped, its socket removed",
    ]
    # kubelet.sock is created at bind(), a moment before listen(): a Register may be refused, and retried.
    plugin = [line for line in said["gopher_plugin.py"] if line.startswith("plugin") and "no answer yet" not in line]
    assert plugin == [
        "plugin   <root>/gophers is missing: no devices until it comes (inotify on <root>)",
        "plugin   Register(example.com/gopher, endpoint gopher-1.sock, version v1beta1)",
        "plugin   <root>/gophers appeared: watching it",
        "plugin   <root>/gophers is missing: no devices until it comes (inotify on <root>)",
        "plugin   <root>/gophers appeared: watching it",
        "plugin   the kubelet restarted: a new socket, a new Register",
        "plugin   Register(example.com/gopher, endpoint gopher-2.sock, version v1beta1)",
    ]
    # Lesson 3: the shipped GetPreferredAllocation takes no heed of NUMA (exercise 1 makes it).
    assert [line for line in said["gopher_allocation.py"] if not line.startswith("plugin")] == [
        "kubelet  GetDevicePluginOptions, during Register: pre_start_required True, "
        "get_preferred_allocation_available True",
        "kubelet  ListAndWatch, with TopologyInfo: gopher0 NUMA 0, gopher1 NUMA 1, gopher2 NUMA 0, gopher3 NUMA 1",
        "pod      resources.limits: {example.com/gopher: 2}; the scheduler counted 4 allocatable",
        "kubelet  GetPreferredAllocation(2 of gopher0, gopher1, gopher2, gopher3) -> gopher0, gopher1 (NUMA 0 and 1)",
        "kubelet  Allocate(gopher0, gopher1) -> cdi_devices "
        "['example.com/gopher=gopher0', 'example.com/gopher=gopher1']",
        "runtime  CDI spec example.com/gopher=gopher0: env GOPHER_GOPHER0=gopher0, /run/gophers/gopher0",
        "kubelet  PreStartContainer(gopher0, gopher1): ready, the container starts",
        "demo     unplugged gopher1; the container exits, and the kubelet restarts it",
        "kubelet  PreStartContainer(gopher0, gopher1) -> unknown device gopher1: not started, retried later",
        "demo     done",
    ]
    # Lesson 4: the slice before and after registration, updated, prepared, and written again after
    # the kubelet's restart wiped it (a create after the restart, or the demo fails).
    dra = said["gopher_dra.py"]
    slices = [line for line in dra if line.startswith("plugin   ResourceSlice node-1-gopher.example.com generation")]
    assert slices[0].endswith("generation 1: gopher0, gopher1, gopher2"), slices
    assert slices[-1].endswith(": gopher0, gopher1, gopher2, gopher3"), slices
    all_four = "gopher0, gopher1, gopher2, gopher3"
    assert [line for line in dra if line not in slices] == [
        "plugin   GetInfo: the kubelet found gopher.example.com-reg.sock",
        "plugin   NotifyRegistrationStatus: registered",
        "apiserver this node's ResourceSlice: gopher0, gopher1, gopher2",
        "apiserver   gopher1: attributes {'model': {'string': 'pocket'}}, capacity {'memory': {'value': '2Gi'}}",
        "demo     created gophers/gopher3",
        f"apiserver the ResourceSlice, updated: {all_four}",
        "scheduler ResourceClaim default/my-gopher, allocated: gopher1 of pool node-1 (lesson 5: how)",
        "kubelet  NodePrepareResources(default/my-gopher) -> CDI example.com/gopher=gopher1",
        "runtime  CDI spec example.com/gopher=gopher1: env GOPHER_GOPHER1=gopher1, mount /run/gophers/gopher1",
        "kubelet  NodeUnprepareResources(default/my-gopher): the pod is gone",
        "demo     the kubelet restarts: it deletes this node's slices, walks plugins_registry again",
        "plugin   GetInfo: the kubelet found gopher.example.com-reg.sock",
        "plugin   NotifyRegistrationStatus: registered",
        f"apiserver the ResourceSlice, written again: {all_four}",
        "demo     done",
    ]
    # Lesson 5: the scheduler stand-in evaluates the claim's CEL for real: the giant of 4Gi, and none of 8Gi.
    claims = [line for line in said["gopher_claims.py"] if not line.startswith("plugin")]
    assert (
        claims[-9:]
        == [
            "scheduler ResourceClaim default/big-gopher, status.allocation: gopher3 of pool node-1",
            "kubelet  NodePrepareResources(default/big-gopher) -> CDI example.com/gopher=gopher3",
            "runtime  the CDI spec gives the container: GOPHER_GOPHER3=gopher3",
            "kubelet  NodeUnprepareResources(default/big-gopher): the pod is gone",
            "user     ResourceClaim default/huge-gopher: the same, with 8Gi",
            "scheduler ResourceClaim default/huge-gopher: cannot allocate all claims: its pod stays Pending",
            "demo     done",
        ][-9:]
        or claims
    )


@pytest.mark.slow
async def test_the_lesson_plugin_waits_for_a_missing_directory_in_one_line(tmp_path):
    """The lesson plugin started before its directory exists (udev makes /dev/serial/by-id at the
    first plug) says so in one line, no traceback, and watches the directory once it appears, its
    parent made too: inotify on the nearest ancestor that exists. Without the kubelet's directory
    it stops with one line."""
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    (tmp_path / "dp").mkdir()
    gophers = tmp_path / "usb" / "gophers"
    argv = [sys.executable, str(LESSONS / "gopher_plugin.py"), "--device-plugin-dir", str(tmp_path / "dp")]
    process = await trio.lowlevel.open_process(
        [*argv, "--directory", str(gophers)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    said = bytearray()
    try:
        with trio.fail_after(TIMEOUT):
            await read_until(process.stdout, "\n", said)
            assert _narration(said.decode()) == [
                f"plugin   {gophers} is missing: no devices until it comes (inotify on {tmp_path})"
            ]
            gophers.mkdir(parents=True)
            await read_until(process.stdout, "watching it", said)
        assert _narration(said.decode())[1:] == [f"plugin   {gophers} appeared: watching it"]
    finally:
        process.kill()
        await process.wait()
    assert await process.stderr.receive_some() == b""
    result = subprocess.run(
        [*argv[:2], "--device-plugin-dir", str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stdout) == (1, "")
    assert (
        result.stderr
        == f"{tmp_path / 'none'}: No such file or directory: is the kubelet's device-plugin directory here?\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("lesson", ["gopher_dra.py", "gopher_claims.py"])
def test_the_dra_lessons_demo_says_one_line_without_the_dra_extra(sockdir, lesson):
    """Without the dra extra (h11 for the API server stand-in), a DRA lesson's --demo says in one
    line what to install, as `gopherplug demo --dra` does: no traceback."""
    script = (
        "import sys, runpy\n"
        "sys.modules['h11'] = None\n"
        f"sys.argv = [{lesson!r}, '--demo']\n"
        f"runpy.run_path({str(LESSONS / lesson)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{LESSONS}:{HERE}", "TMPDIR": sockdir}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (
        f"{lesson} --demo needs the dra extra (import of h11 halted; None in sys.modules): "
        "pip install '.[dra]' in a checkout of gopherplug\n"
    )


@pytest.mark.slow
def test_the_exercises_reference_solutions_pass_and_the_shipped_lesson_gets_a_hint(sockdir):
    """examples/lesson/check.py: every exercise's reference solution (solutions/, applied to a copy
    of the lessons) passes its check against the kubelet simulator, or the API server and
    scheduler stand-ins with cel-python's CEL; the lessons as shipped do not, and a check says what
    the kubelet saw and a hint, never a traceback. EXERCISES.md has a section for each exercise."""
    check = [sys.executable, str(LESSONS / "check.py")]
    env = {**os.environ, "PYTHONPATH": str(HERE), "TMPDIR": sockdir}
    result = subprocess.run([*check, "--solution", "all"], env=env, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        "exercise 1: passed\nexercise 2: passed\nexercise 3: passed\n",
        "",
    )
    exercises = (LESSONS / "EXERCISES.md").read_text()
    assert re.findall(r"^## (\d)\.", exercises, re.MULTILINE) == ["1", "2", "3"]
    for number, hint in [
        (1, "hint: in prefer(), group available by self.devices.value[id].numa"),
        (2, "hint: in PreStartContainer, read lock_dir/LCK..<id>"),
        (3, 'hint: in Driver.describe(), give each device the attribute "numaNode"'),
    ]:
        result = subprocess.run([*check, str(number)], env=env, capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stderr) == (1, ""), result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == f"exercise {number}: not yet.", result.stdout
        assert re.match(r"  the (kubelet|scheduler) saw: ", lines[1]), result.stdout
        assert lines[2].startswith(f"  {hint}"), result.stdout
        assert "Traceback" not in result.stdout
    assert os.listdir(sockdir) == []


async def open_example(script, plugin_dir, stderr, **kwargs):
    """An embedding example as its own process, pointed at ``plugin_dir`` as a user would point it,
    importing gopherplug from this checkout."""
    env = {**os.environ, "GOPHERPLUG_DEVICE_PLUGIN_DIR": plugin_dir, "PYTHONPATH": str(HERE)}
    return await trio.lowlevel.open_process([sys.executable, str(script)], env=env, stderr=stderr, **kwargs)


async def stop_example(process, stop):
    """``stop`` it (a signal, or a coroutine function of the example's own way), then its exit code
    and how long it took; killed if it outlives the test."""
    try:
        asked = trio.current_time()
        if isinstance(stop, signal.Signals):
            process.send_signal(stop)
        else:
            await stop()
        code = await process.wait()
        return code, trio.current_time() - asked
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["docs/embedding.md", "examples/embedding/device_plugin.py"])
async def test_embedding_example_serves_then_stops_cleanly_on_sigterm(nursery, node, tmp_path, source):
    """docs/embedding.md's program, run verbatim as its own process: it serves, and SIGTERM (the kubelet
    deleting its pod) stops it with exit code 0, leaving nothing of its own in the kubelet's
    directory, its log lines naming the resource under the program's own logging.basicConfig."""
    script = tmp_path / "example.py"
    script.write_text(readme_example_text() if source == "docs/embedding.md" else (HERE / source).read_text())
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await open_example(script, node.plugin_dir, subprocess.PIPE)
    said = StderrLines(process.stderr)
    with trio.fail_after(TIMEOUT):
        try:
            await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
            # Logged once Register has returned, after the kubelet's first list: waited for.
            await said.wait_for(f"\nINFO:gopherplug:{WIDGET}: registered with the kubelet as {WIDGET_SOCKET}\n")
            assert sorted(os.listdir(node.plugin_dir)) == [
                ".gopherplug-example.com_widget.lock",
                WIDGET_SOCKET,
                "kubelet.sock",
            ]
        finally:
            code, took = await stop_example(process, signal.SIGTERM)
        await said.wait_for("\nINFO:gopherplug:SIGTERM received: stopping\n")
    assert code == 0, said.text
    assert took < 5, "generous: the stop takes milliseconds"
    assert os.listdir(node.plugin_dir) == ["kubelet.sock"]


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGTERM", "end of input"])
async def test_asyncio_host_example_serves_what_asyncio_says_then_stops_cleanly(nursery, node, tmp_path, stop):
    """examples/embedding/asyncio_host.py: gopherplug in trio's guest mode inside asyncio, the devices
    from the asyncio side (a line of standard input each), stopped by SIGTERM through
    serve_until_signalled or by the asyncio side itself at the end of its input."""
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await open_example(
            EMBEDDING_EXAMPLES / "asyncio_host.py", node.plugin_dir, stderr, stdin=subprocess.PIPE
        )
    with trio.fail_after(TIMEOUT):
        try:
            await process.stdin.send_all(b"w0 w1\n")
            await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
            await process.stdin.send_all(b"w1 w2!\n")
            await simulator.wait_until(lambda s: widgets(s) == {"w1": gp.HEALTHY, "w2": gp.UNHEALTHY})
            assert len(simulator.registrations) == 1, "one registration: the changes go down its stream"
        finally:
            code, _ = await stop_example(process, signal.SIGTERM if stop == "SIGTERM" else process.stdin.aclose)
    said = (tmp_path / "stderr").read_text()
    assert code == 0, said
    assert os.listdir(node.plugin_dir) == ["kubelet.sock"]
    assert "WARNING:gopherplug:example.com/widget: w2 is unhealthy: said so" in said.splitlines()


async def test_serve_until_signalled_passes_sighup_on_and_returns_with_its_function():
    """SIGHUP goes to ``on_sighup`` and stops nothing; a function that returns on its own ends it.
    (SIGTERM and SIGINT: the tests of the examples and of `gopherplug serve`, in their own processes.)"""
    hangups, done = Calls(), trio.Event()

    async def serve(started):
        started.set()
        await done.wait()

    started = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as inner:
            inner.start_soon(functools.partial(gp.serve_until_signalled, serve, started, on_sighup=hangups.add))
            await started.wait()  # the signals are received from before serve() starts
            for count in (1, 2):
                os.kill(os.getpid(), signal.SIGHUP)
                await hangups.wait_for(count)
            done.set()  # serve() returns: so does serve_until_signalled, no signal needed
    assert hangups.value == 2


class Calls:
    """A callback that counts its calls, and a way to wait for them."""

    def __init__(self):
        self.value = 0
        self.changed = trio.Event()

    def add(self):
        self.value += 1
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, count):
        while self.value < count:
            await self.changed.wait()


async def serve_widgets(nursery, node, given):
    """serve_devices for WIDGET with ``given`` (a Watched), against a KubeletSimulator streaming."""
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    await nursery.start(gp.serve_devices, gp.resource_config(WIDGET), given, node.plugin_dir)
    return simulator


def skipped_warnings(caplog):
    return sorted(message for r in caplog.records if " skipping " in (message := r.getMessage()))


async def test_serve_devices_skips_what_a_directory_would_skip_warning_once_each(nursery, node, caplog):
    """An embedding program's devices are checked as a directory's entries are: an ID the kubelet
    would refuse or misread ("x::1" reads as replica 1 of x), and a key that is not its entry's ID,
    are skipped, each with one warning however often the program sets them again."""
    bad = {name: gp.DeviceEntry(name, f"/dev/w{n}") for n, name in enumerate(("bad id", "x::1", ""))}
    bad["alias"] = gp.DeviceEntry("w9", "/dev/w9")  # the kubelet would ask for "alias" and get w9
    given = gp.Watched({"w0": gp.DeviceEntry("w0", "/dev/w0"), **bad})
    with trio.fail_after(TIMEOUT):
        simulator = await serve_widgets(nursery, node, given)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY})
        given.set({**given.value, "w1": gp.DeviceEntry("w1", "/dev/w1")})  # the same bad ones, set again
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
        rule = "a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'"
        assert skipped_warnings(caplog) == [
            f"{WIDGET}: skipping '': {rule}",
            f"{WIDGET}: skipping 'alias': the key must be its DeviceEntry's id, 'w9'",
            f"{WIDGET}: skipping 'bad id': {rule}",
            f"{WIDGET}: skipping 'x::1': {rule}",
        ]
        given.set({"w1": given.value["w1"]})  # gone: one that comes back is warned about again
        await simulator.wait_until(lambda s: widgets(s) == {"w1": gp.HEALTHY})
        with logged("skipping 'x::1'") as again:
            given.set({"w1": given.value["w1"], "x::1": bad["x::1"]})
            await again.wait()
    assert skipped_warnings(caplog).count(f"{WIDGET}: skipping 'x::1': {rule}") == 2
    assert widgets(simulator) == {"w1": gp.HEALTHY}


async def test_serve_devices_refuses_a_plain_dict_and_a_relative_directory_in_one_line(node):
    """What the CLI refuses through its configuration, the API refuses before anything starts: a
    dict where a Watched is wanted (it would fail deep inside, or never hear of a change) and a
    relative device_plugin_dir (never the kubelet's: it would wait for kubelet.sock forever)."""
    resource = gp.resource_config(WIDGET)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(TypeError) as caught:
            await gp.serve_devices(resource, {"w0": gp.DeviceEntry("w0", "/dev/w0")}, node.plugin_dir)
        assert str(caught.value) == (
            "serve_devices: devices must be a gopherplug.Watched holding a dict of device ID -> DeviceEntry, not a "
            "dict: pass Watched({...}) and call its .set() when the devices change"
        )
        with pytest.raises(ValueError, match=r"^serve_devices: device_plugin_dir 'device-plugins' must be an absolute"):
            await gp.serve_devices(resource, gp.Watched({}), "device-plugins")
        with pytest.raises(TypeError, match=r"^serve_dra_devices: devices must be a gopherplug.Watched"):
            await gp.serve_dra_devices(resource, {}, driver="gopherplug.example.com")


def test_serve_devices_from_asyncio_points_to_trios_guest_mode():
    """Awaited from an asyncio program, serve_devices says to run it in trio's guest mode, as the
    asyncio example does, instead of failing inside trio ('RunContext' has no attribute 'runner')."""
    import asyncio

    async def host():
        await gp.serve_devices(gp.resource_config(WIDGET), gp.Watched({}), "/var/lib/kubelet/device-plugins")

    with pytest.raises(RuntimeError) as caught:
        asyncio.run(host())
    assert str(caught.value) == (
        "serve_devices runs under trio, not this event loop: from asyncio, run it in trio's guest mode "
        "(trio.lowlevel.start_guest_run), as examples/embedding/asyncio_host.py does"
    )
    assert (HERE / "examples" / "embedding" / "asyncio_host.py").is_file()


@pytest.mark.parametrize("health", ["Broken", "healthy", None])
def test_device_entry_refuses_a_health_the_kubelet_does_not_know(health):
    """The kubelet takes any string and allocates only "Healthy": any other would reach it as an
    unhealthy device with no one told why."""
    with pytest.raises(ValueError) as caught:
        gp.DeviceEntry("w0", "/dev/w0", health=health)
    assert str(caught.value) == (
        f"DeviceEntry 'w0': health={health!r}: use gopherplug.HEALTHY or gopherplug.UNHEALTHY ('Healthy' or "
        "'Unhealthy', as the kubelet spells them)"
    )
    assert gp.DeviceEntry("w0", "/dev/w0", health=gp.UNHEALTHY).health == "Unhealthy"


async def test_serve_devices_logs_the_health_changes_the_program_publishes(nursery, node, caplog):
    """One line per device whose health changed, naming the resource in the message itself: what a
    plain handler (caplog here, logging.basicConfig in a program) shows."""
    healthy = {name: gp.DeviceEntry(name, f"/dev/{name}") for name in ("w0", "w1")}
    given = gp.Watched(healthy)
    caplog.set_level(logging.INFO, "gopherplug")
    with trio.fail_after(TIMEOUT):
        simulator = await serve_widgets(nursery, node, given)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
        caplog.clear()
        broken = dataclasses.replace(healthy["w0"], health=gp.UNHEALTHY, problem="firmware crashed")
        given.set({**healthy, "w0": broken})
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.UNHEALTHY, "w1": gp.HEALTHY})
        with logged("no reason given") as said:  # unhealthy still, for another reason: said again
            given.set({**healthy, "w0": dataclasses.replace(broken, problem="")})
            await said.wait()
        given.set(healthy)
        await simulator.wait_until(lambda s: widgets(s) == {"w0": gp.HEALTHY, "w1": gp.HEALTHY})
    assert [(r.levelname, r.getMessage()) for r in caplog.records if " w0 " in r.getMessage()] == [
        ("WARNING", f"{WIDGET}: w0 is unhealthy: firmware crashed"),
        ("WARNING", f"{WIDGET}: w0 is unhealthy (no reason given)"),
        ("INFO", f"{WIDGET}: w0 is healthy again"),
    ]
    assert all(r.resource == WIDGET for r in caplog.records if r.getMessage().startswith(f"{WIDGET}: "))


def test_find_device_plugin_dir_takes_the_environment_variable_as_the_command_line_does(monkeypatch, tmp_path):
    monkeypatch.setenv("GOPHERPLUG_DEVICE_PLUGIN_DIR", f"{tmp_path}/dp/")
    assert gp.find_device_plugin_dir([]) == f"{tmp_path}/dp"
    monkeypatch.setenv("GOPHERPLUG_DEVICE_PLUGIN_DIR", "dp")
    with pytest.raises(gp.ConfigError) as info:
        gp.find_device_plugin_dir([])
    assert str(info.value) == "GOPHERPLUG_DEVICE_PLUGIN_DIR: 'dp' must be an absolute path"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"env": "bad-name"},
            "resource_config('example.com/widget'): env: 'bad-name' is not a valid environment variable name",
        ),
        (
            {"env": "PATH"},
            "resource_config('example.com/widget'): env: 'PATH' is given meaning by the shell or the dynamic loader: "
            "choose another name",
        ),
        (
            {"directory": "/x"},
            "resource_config('example.com/widget'): directory: is about a directory's entries: "
            "give each DeviceEntry what it needs",
        ),
    ],
)
def test_resource_config_validates_like_a_file(options, message):
    with pytest.raises(gp.ConfigError) as info:
        gp.resource_config("example.com/widget", **options)
    assert str(info.value) == message


async def test_grpcio_kubelet_end_to_end(pb2, nursery, node):
    """grpcio plays the kubelet: Register dials back with grpcio, then ListAndWatch and Allocate."""
    kubelet_socket = os.path.join(node.plugin_dir, gp.KUBELET_SOCKET)
    seen = {}
    registered = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def register(request, context):
        channel = grpc.insecure_channel(f"unix:{os.path.join(node.plugin_dir, request.endpoint)}")
        options = channel.unary_unary(
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            request_serializer=pb2.Empty.SerializeToString,
            response_deserializer=pb2.DevicePluginOptions.FromString,
        )(pb2.Empty(), timeout=10)
        seen.update(request=request, options=options, channel=channel)
        trio.from_thread.run_sync(registered.set, trio_token=token)
        return pb2.Empty()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "v1beta1.Registration",
                {
                    "Register": grpc.unary_unary_rpc_method_handler(
                        register,
                        request_deserializer=pb2.RegisterRequest.FromString,
                        response_serializer=pb2.Empty.SerializeToString,
                    )
                },
            )
        ]
    )
    server.add_insecure_port(f"unix:{kubelet_socket}")
    server.start()
    try:
        with trio.fail_after(TIMEOUT):
            await nursery.start(gp.serve_plugin, node.config())
            await registered.wait()  # set from grpcio's thread once Register's dial-back succeeded
            assert seen["options"].get_preferred_allocation_available
            client = GrpcioClient(pb2, os.path.join(node.plugin_dir, seen["request"].endpoint))
            stream = client.list_and_watch(pb2.Empty())
            first = await in_thread(next, stream)
            assert [(d.ID, d.health) for d in first.devices] == [("g1", "Healthy"), ("g2", "Healthy")]
            Path(node.devices, "g3").touch()
            second = await in_thread(next, stream)
            assert [d.ID for d in second.devices] == ["g1", "g2", "g3"]
            answer = await in_thread(client.allocate, allocate_request(pb2, "g3"), timeout=5)
            assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g3"}
            stream.cancel()
            client.close()
            seen["channel"].close()
    finally:
        server.stop(None).wait()
