"""What the node's file systems do to the plugin, and that it serves on: descriptors run out while a
directory is rescanned, a configuration changes or describe starts; a file whose read never returns
(a FIFO here; on a node a hung device's sysfs file, a dead NFS or FUSE mount); a CDI spec directory
that cannot be written during a reload; the device directory's file system unmounted and mounted
again. Each fault costs a line and a retry, never the devices or the process."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio
import yaml

import gopherplug as gp
from testsupport import (
    BUG,
    HERE,
    OTHER,
    RESOURCE,
    TIMEOUT,
    _free_loopback_port,
    _healthz,
    config_text,
    config_with,
    listed,
    logged,
    program_file,
    read_until,
    reaped,
    reloading,
    replace_file,
    run_cli,
    streaming,
)

DESCRIBE = """#!{python}
import json, os
ids = (os.environ.get("GOPHERPLUG_DEVICES") or open(os.environ["GOPHERPLUG_DEVICES_FILE"]).read()).split(",")
print(json.dumps({i: {"attributes": {"model": "gopher"}} for i in ids}))
"""


@contextlib.contextmanager
def out_of_descriptors():
    """Within: the process may open no descriptor (EMFILE), as when every one it may have is taken;
    its limit lowered to none, so that no descriptor another task closes meanwhile frees one. Given
    back on the way out, whatever happens within."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
    try:
        with pytest.raises(OSError, match="Too many open files"):
            os.close(os.open("/dev/null", os.O_RDONLY))
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def retry_soon(monkeypatch):
    """What waits INOTIFY_RETRY_INTERVAL to try again waits a tenth of a second."""
    monkeypatch.setattr(gp, "INOTIFY_RETRY_INTERVAL", 0.1)


async def test_a_rescan_out_of_descriptors_keeps_the_devices_and_is_tried_again(nursery, node, retry_soon):
    devices = gp.Watched({})
    resource_config = node.config().resources[0]
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.watch_devices, resource_config, devices)
        assert set(devices.value) == {"g1", "g2"}
        with logged("can be read again") as again, logged("Too many open files") as said:
            with out_of_descriptors():
                os.chmod(node.devices, 0o750)  # an event about the directory itself: a rescan of it all
                await said.wait()
                assert set(devices.value) == {"g1", "g2"}, "out of descriptors is not an empty directory"
            await again.wait()
    assert said.lines == [
        f"{RESOURCE}: cannot read {node.devices}: EMFILE: Too many open files: keeping its 2 devices as known, "
        "trying again every 0.1 s"
    ]
    assert set(devices.value) == {"g1", "g2"}


async def test_a_configuration_change_out_of_descriptors_is_applied_once_it_can_be_read(
    nursery, node, tmp_path, retry_soon
):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    (tmp_path / "new.yaml").write_text(config_text(node, **{RESOURCE: {"env": "GOPHERS"}}))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        with logged("configuration reloaded") as reloaded, logged("cannot read") as said:
            with out_of_descriptors():
                os.rename(tmp_path / "new.yaml", path)  # (a rename needs no descriptor)
                await said.wait()
            await reloaded.wait()
        answer = await simulator.allocate(RESOURCE, ["g1"])
    assert said.lines == [
        f"cannot read {path}: EMFILE: Too many open files; keeping the running configuration, trying again"
    ]
    assert reloaded.lines == [f"{path}: configuration reloaded: updated in place {RESOURCE}"]
    assert dict(answer.container_responses[0].envs) == {"GOPHERS": "g1"}


async def test_describe_out_of_descriptors_is_the_nodes_state_not_a_bug(nursery, node, unexpected):
    script = program_file(node.plugin_dir, DESCRIBE)
    devices = gp.Watched({})
    with trio.fail_after(TIMEOUT):
        await nursery.start(gp.watch_devices, node.config(describe=[script]).resources[0], devices)
        while not devices.value["g1"].attributes:
            await devices.wait_touched()
        with logged("describe") as said, out_of_descriptors():
            os.mknod(os.path.join(node.devices, "g3"))  # (made without a descriptor): describe runs again
            await said.wait()
    assert said.lines == [
        f"{RESOURCE}: describe: cannot run {script}: EMFILE: Too many open files; the devices are offered "
        "without what it would say (2 keep what it said before)"
    ]
    assert BUG not in said.lines[0]
    assert not unexpected("describe")


@contextlib.contextmanager
def fifo_at(path, watchdog=True):
    """A FIFO at ``path``: a read of it waits for a writer that never comes. On the way out (and,
    with ``watchdog``, after TIMEOUT, should a read block the test's own event loop) a writer comes
    and goes: every read still waiting ends; and the path is an empty file, which no read waits for."""
    os.mkfifo(path)

    def release():
        with contextlib.suppress(OSError):  # ENXIO: no reader waits
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        with contextlib.suppress(OSError):
            open(f"{path}.empty", "w").close()
            os.replace(f"{path}.empty", path)

    timer = threading.Timer(TIMEOUT, release)
    if watchdog:
        timer.start()
    try:
        yield path
    finally:
        timer.cancel()
        release()


async def test_a_value_file_that_never_answers_is_left_out_and_the_devices_are_served(
    nursery, node, tmp_path, monkeypatch
):
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5, raising=False)  # (raising: the test runs on older modules)
    (tmp_path / "g2.model").write_text("gopher\n")
    attributes = {"model": {"file": f"{tmp_path}/{{id}}.model"}}
    devices = gp.Watched({})
    with fifo_at(tmp_path / "g1.model"), trio.fail_after(TIMEOUT), logged("no answer") as said:
        # Started, the devices listed, while the read of g1's file still waits in its thread.
        await nursery.start(gp.watch_devices, node.config(attributes=attributes).resources[0], devices)
        assert said.lines == [
            f"{RESOURCE}: device g1: attributes.model: cannot read {tmp_path}/g1.model: no answer within 0.5 s"
            " (read again every 10 s until it is)"
        ]
        assert set(devices.value) == {"g1", "g2"}
        assert devices.value["g1"].attributes == ()
        assert devices.value["g2"].attributes == (("model", "string", "gopher"),)


def hung_numa_node(tmp_path):
    """A directory with one device node (h0, a link to /dev/null: 1:3), and a sysfs whose numa_node
    for 1:3 is a FIFO: its read waits for a writer (in fifo_at). Returns (directory, sysfs root, FIFO)."""
    directory, device = tmp_path / "hung", tmp_path / "sys" / "dev" / "char" / "1:3" / "device"
    directory.mkdir()
    device.mkdir(parents=True)
    os.symlink("/dev/null", directory / "h0")
    return directory, tmp_path / "sys", device / "numa_node"


def answer_fifo(path, text):
    """The FIFO a reader waits on answers ``text`` (its open() returns, it reads ``text``, then the
    end of the file), and is a file of that text from then on (a look at it again reads that)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # (ENXIO if no reader waited)
    try:
        path.with_name("answer").write_text(text)
        path.with_name("answer").replace(path)
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


class Released:
    """A thread limiter for the directories' scans (``gp._SCANNERS``) that says when a scan's thread
    has returned, abandoned or not (trio releases its token then)."""

    def __init__(self):
        self.limiter, self.released = trio.CapacityLimiter(4), trio.Event()

    async def acquire_on_behalf_of(self, borrower):
        await self.limiter.acquire_on_behalf_of(borrower)

    def release_on_behalf_of(self, borrower):
        self.limiter.release_on_behalf_of(borrower)
        self.released.set()


async def test_a_scan_whose_sysfs_read_never_returns_leaves_every_rpc_answering(nursery, node, tmp_path, monkeypatch):
    """A hung numa_node read in the scan of one resource (a hung GPU's sysfs, a dead mount): the other
    resource starts, registers, lists and allocates meanwhile; one line says which scan is late; once
    the read returns, the device comes with its NUMA node."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    directory, sysfs, fifo = hung_numa_node(tmp_path)
    hung = {"name": OTHER, "directory": str(directory), "allowed_host_paths": ["/dev"]}
    mine = {"name": RESOURCE, "directory": node.devices}
    config = {"device_plugin_dir": node.plugin_dir, "sysfs_root": str(sysfs), "resources": [hung, mine]}
    with fifo_at(fifo), trio.fail_after(TIMEOUT):
        with logged("has not returned") as late, logged("has returned") as returned:
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(
                gp.serve_plugin, gp.parse_config(yaml.safe_dump(config), "c")
            )  # (the one after it started)
            await simulator.wait_until(listed("g1", "g2"))
            assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
            await late.wait()
            assert late.lines == [
                f"{OTHER}: the scan of {directory} has not returned in 0.5 s (a hung sysfs file or mount "
                "under it?): offering its 0 devices as known until it does"
            ]
            assert streaming(simulator, OTHER) == {}, "registered with none known yet"
            answer_fifo(fifo, "1\n")
            await returned.wait()
            await simulator.wait_until(lambda s: streaming(s, OTHER) == {"h0": gp.HEALTHY})
    assert simulator.resources[OTHER].topology == {"h0": (1,)}
    assert returned.lines == [f"{OTHER}: the scan of {directory} has returned"]


async def test_a_watch_stopped_while_its_scan_hangs_ends_at_once_and_the_late_scan_changes_nothing(
    node, tmp_path, monkeypatch
):
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    directory, sysfs, fifo = hung_numa_node(tmp_path)
    resource_config = node.config(directory=str(directory), allowed_host_paths=["/dev"]).resources[0]
    devices, scans = gp.Watched({}), Released()
    with fifo_at(fifo), trio.fail_after(TIMEOUT), logged("the scan of") as said:
        if hasattr(gp, "_SCANNERS"):  # (a module that scans on the event loop fails below, frozen)
            gp._SCANNERS.set(scans)
        async with trio.open_nursery() as watching:
            await watching.start(gp.watch_devices, resource_config, devices, str(sysfs))  # started: the scan is late
            await said.wait()
            assert "has not returned" in said.lines[0]
            watching.cancel_scope.cancel()  # the resource stopped (a reload, the plugin's end)
        answer_fifo(fifo, "1\n")
        await scans.released.wait()  # the abandoned scan has returned
    assert len(said.lines) == 1, "no line from a scan whose watch has stopped"
    assert devices.value == {}, "no device from it"


async def test_a_directory_under_a_hung_mount_leaves_every_rpc_answering_and_goes_on_once_it_fails(
    nursery, node, tmp_path, hung_mount, monkeypatch
):
    """A resource whose directory lies under a mount that never answers (a dead NFS server, a hung FUSE
    daemon): placing its watch looks the path up, which waits as long. The resource after it starts,
    registers and allocates, /healthz answers, one line says which scan is late; once the mount fails
    (ENOTCONN), a line says so, and the plugin serves on."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    hung = hung_mount(tmp_path / "hung")
    directory, port = f"{hung.path}/devices", _free_loopback_port()
    resources = [{"name": OTHER, "directory": directory}, {"name": RESOURCE, "directory": node.devices}]
    config = {"device_plugin_dir": node.plugin_dir, "health_address": f"127.0.0.1:{port}", "resources": resources}
    with trio.fail_after(TIMEOUT), logged("has not returned") as late, logged("has returned") as returned:
        with logged("not connected") as failed:
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(config), "c"))
            await simulator.wait_until(listed("g1", "g2"))
            assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
            assert await _healthz(port) == (200, "ok\n")
            assert late.lines == [
                f"{OTHER}: the scan of {directory} has not returned in 0.5 s (a hung sysfs file or mount "
                "under it?): offering its 0 devices as known until it does"
            ]
            assert streaming(simulator, OTHER) == {}, "registered with none known yet"
            hung.release()
            await returned.wait()
            await failed.wait()
            assert (await simulator.allocate(RESOURCE, ["g2"])).container_responses
            assert await _healthz(port) == (200, "ok\n")
    assert returned.lines == [f"{OTHER}: the scan of {directory} has returned"]
    assert failed.lines == [
        f"{OTHER}: cannot read {directory}: Transport endpoint is not connected: no devices until it can"
    ]
    assert streaming(simulator, OTHER) == {}


def inotify_descriptors():
    """This process's inotify descriptors, by number."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (the listing's own, closed by now)
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:inotify":
                found.add(int(name))
    return found


async def test_a_watch_stopped_while_its_placement_hangs_leaves_its_descriptor_to_the_thread(
    node, tmp_path, hung_mount, monkeypatch
):
    """The thread that places a watch under a hung mount is abandoned by the stop (a reload, the end),
    and places it once the mount fails: through the watch's descriptor, closed by then would its number
    be another file's (here the next inotify instance's), which would get that watch. It stays open
    until the thread returns, then the thread closes it."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    hung = hung_mount(tmp_path / "hung")
    resource_config = node.config(directory=f"{hung.path}/devices").resources[0]
    before, scans = inotify_descriptors(), Released()
    with trio.fail_after(TIMEOUT), logged("the scan of") as said:
        if hasattr(gp, "_SCANNERS"):
            gp._SCANNERS.set(scans)
        async with trio.open_nursery() as watching:
            await watching.start(gp.watch_devices, resource_config, gp.Watched({}))  # started: the scan is late
            await said.wait()
            watching.cancel_scope.cancel()
        assert len(inotify_descriptors() - before) == 1, "left open for the thread that may still place through it"
        with gp.INotify() as other:
            hung.release()
            await scans.released.wait()  # the abandoned thread has returned, its watch placed
            watches = [line for line in Path(f"/proc/self/fdinfo/{other.fileno()}").read_text().splitlines()]
            assert not [line for line in watches if line.startswith("inotify wd:")], "none in another's instance"
    assert inotify_descriptors() == before, "closed by the thread"
    assert len(said.lines) == 1, "no line from a scan whose watch has stopped"


def linked_into(tmp_path):
    """A directory whose one device, h0, is a symlink to a file two levels into another directory (on
    which a test may mount a HungMount after the scan). Returns (that directory, the device directory)."""
    target, directory = tmp_path / "target", tmp_path / "linked"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "h0").touch()
    directory.mkdir()
    os.symlink(target / "sub" / "h0", directory / "h0")
    return target, directory


async def test_a_rescan_whose_followed_path_lies_under_a_hung_mount_places_its_watch_off_the_loop(
    nursery, node, tmp_path, hung_mount, monkeypatch
):
    """A device's symlink leads into a directory on which a mount that never answers comes later: the
    rescan (the device directory's mode changed) places the watch on the symlink's target again, which
    looks its path up, off the event loop; its devices are offered as known meanwhile."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    target, directory = linked_into(tmp_path)
    resource_config = node.config(directory=str(directory), allowed_host_paths=[str(target)]).resources[0]
    devices = gp.Watched({})
    with trio.fail_after(TIMEOUT), logged("has not returned") as late, logged("has returned") as returned:
        await nursery.start(gp.watch_devices, resource_config, devices)
        assert set(devices.value) == {"h0"}
        hung = hung_mount(target)  # over the target's directory: no event says so
        os.chmod(directory, 0o750)  # an event about the directory itself: a rescan, its watches placed anew
        await late.wait()
        assert set(devices.value) == {"h0"}, "offered as known"
        hung.release()
        await returned.wait()
        while devices.value["h0"].health == gp.HEALTHY:
            await devices.wait_touched()
    assert devices.value["h0"].problem == f"cannot stat {directory}/h0: Transport endpoint is not connected"
    assert late.lines == [
        f"{RESOURCE}: the scan of {directory} has not returned in 0.5 s (a hung sysfs file or mount under it?): "
        "offering its 1 device as known until it does"
    ]


async def test_allocate_of_a_device_that_leads_under_a_hung_mount_is_refused_in_time_and_the_plugin_serves_on(
    nursery, node, tmp_path, hung_mount, monkeypatch
):
    """A device's symlink leads into a directory on which a mount that never answers comes after the
    scan: Allocate looks the device up again (in a worker thread) and is refused after FILE_READ_TIMEOUT
    with one line; the other resource's Allocate and /healthz answer meanwhile, and after the mount
    fails too."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    target, directory, port = *linked_into(tmp_path), _free_loopback_port()
    linked = {"name": OTHER, "directory": str(directory), "allowed_host_paths": [str(target)]}
    resources = [linked, {"name": RESOURCE, "directory": node.devices}]
    config = {"device_plugin_dir": node.plugin_dir, "health_address": f"127.0.0.1:{port}", "resources": resources}
    refused = []

    async def allocate_h0():
        with pytest.raises(gp.RPCError) as info:
            await simulator.allocate(OTHER, ["h0"])
        refused.append((info.value.code, info.value.message))

    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(config), "c"))
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"h0": gp.HEALTHY} and listed("g1", "g2")(s))
        hung = hung_mount(target)  # over the target's directory: no event says so
        with logged("refused Allocate") as said:
            async with trio.open_nursery() as calls:
                calls.start_soon(allocate_h0)
                assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
                assert await _healthz(port) == (200, "ok\n")
        hung.release()
        assert (await simulator.allocate(RESOURCE, ["g2"])).container_responses
        assert await _healthz(port) == (200, "ok\n")
    why = f"{OTHER} device h0: its files have not answered in 0.5 s (a hung mount under {directory}?)"
    assert refused == [(gp.StatusCode.FAILED_PRECONDITION, why)]
    assert said.lines == [f"{OTHER}: refused Allocate of h0: {why}"]


async def test_allocate_follows_a_reload_that_moves_the_directory_out_of_dev_root_onto_a_hung_mount(
    nursery, node, tmp_path, hung_mount, monkeypatch
):
    # In dev_root (devtmpfs, which never hangs) Allocate looks on the event loop; reloaded in place to
    # a directory elsewhere, its look goes to a worker thread: a device there under a hung mount is refused.
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    target, directory = linked_into(tmp_path)
    path = tmp_path / "gopherplug.yaml"

    def text(**resource):
        top = {"device_plugin_dir": node.plugin_dir, "dev_root": os.path.dirname(node.devices)}
        return yaml.safe_dump({**top, "resources": [{"name": RESOURCE, "directory": node.devices, **resource}]})

    path.write_text(text())
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
        replace_file(path, text(directory=str(directory), allowed_host_paths=[str(target)]))
        await simulator.wait_until(listed("h0"))
        hung_mount(target)  # over the target's directory: no event says so
        with pytest.raises(gp.RPCError) as info:
            await simulator.allocate(RESOURCE, ["h0"])
    assert info.value.message == (
        f"{RESOURCE} device h0: its files have not answered in 0.5 s (a hung mount under {directory}?)"
    )


async def test_pre_start_of_a_device_that_leads_under_a_hung_mount_is_refused_in_time(
    nursery, node, tmp_path, hung_mount, monkeypatch
):
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    target, directory = linked_into(tmp_path)
    config = node.config(directory=str(directory), allowed_host_paths=[str(target)], pre_start=["true"])
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("h0"))
        hung_mount(target)  # over the target's directory: no event says so
        with pytest.raises(gp.RPCError) as info:
            await simulator.pre_start_container(RESOURCE, ["h0"])
    assert (info.value.code, info.value.message) == (
        gp.StatusCode.FAILED_PRECONDITION,
        f"{RESOURCE} device h0: its files have not answered in 0.5 s (a hung mount under {directory}?)",
    )


@pytest.mark.slow
async def test_serve_with_a_directory_under_a_hung_mount_stops_at_sigterm(nursery, node, tmp_path, hung_mount):
    """`gopherplug serve`, the first resource's directory under a mount that never answers: its scan is
    said to be late, the resource after it registers and lists its devices, and SIGTERM ends the
    process, exit 0, the thread that waits in the kernel for the mount left to the process's end."""
    hung = hung_mount(tmp_path / "hung")
    resources = [{"name": OTHER, "directory": f"{hung.path}/devices"}, {"name": RESOURCE, "directory": node.devices}]
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": resources}))
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    async with reaped(argv, stderr=subprocess.PIPE) as process:
        said = bytearray()
        with trio.fail_after(gp.FILE_READ_TIMEOUT + TIMEOUT):
            await read_until(process.stderr, f"the scan of {hung.path}/devices has not returned", said)
            await simulator.wait_until(listed("g1", "g2"))
            process.send_signal(signal.SIGTERM)
            await read_until(process.stderr, "SIGTERM received: stopping", said)
        with trio.fail_after(TIMEOUT):
            assert await process.wait() == 0


async def test_allocate_never_reads_sysfs_a_hung_numa_node_after_the_scan_leaves_it_answering(nursery, node, tmp_path):
    # Allocate runs on the event loop: a read there of a hung GPU's sysfs file would freeze every RPC.
    directory, sysfs, numa_node = hung_numa_node(tmp_path)
    numa_node.write_text("1\n")
    hung = {"name": OTHER, "directory": str(directory), "allowed_host_paths": ["/dev"]}
    config = {"device_plugin_dir": node.plugin_dir, "sysfs_root": str(sysfs), "resources": [hung]}
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(config), "c"))
    with trio.fail_after(TIMEOUT):
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"h0": gp.HEALTHY})
    assert simulator.resources[OTHER].topology == {"h0": (1,)}
    numa_node.unlink()
    with fifo_at(numa_node), trio.fail_after(TIMEOUT / 2):  # (the FIFO's watchdog frees a frozen loop at TIMEOUT)
        answer = await simulator.allocate(OTHER, ["h0"])
        assert [spec.host_path for spec in answer.container_responses[0].devices] == ["/dev/null"]
        assert (await simulator.allocate(OTHER, ["h0"])).container_responses, "and again"


async def test_a_reload_whose_emptying_check_meets_a_hung_scan_is_held_back_and_the_loop_runs(
    nursery, node, tmp_path, monkeypatch
):
    # A warned-about pattern is checked against the directory (would it empty a served resource?):
    # that scan reads the device's numa_node, which hangs, off the event loop; late, the file waits.
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    directory, sysfs, numa_node = hung_numa_node(tmp_path)
    numa_node.write_text("0\n")
    path = tmp_path / "gopherplug.yaml"

    def text(pattern):
        hung = {"name": OTHER, "directory": str(directory), "allowed_host_paths": ["/dev"], "pattern": pattern}
        mine = {"name": RESOURCE, "directory": node.devices}
        return yaml.safe_dump(
            {"device_plugin_dir": node.plugin_dir, "sysfs_root": str(sysfs), "resources": [mine, hung]}
        )

    path.write_text(text("h*"))
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        await simulator.wait_until(lambda s: streaming(s, OTHER) == {"h0": gp.HEALTHY})
    numa_node.unlink()
    with fifo_at(numa_node), trio.fail_after(TIMEOUT / 2), logged("held back") as held:  # (watchdog: TIMEOUT)
        replace_file(path, text(r"h\d+"))
        await held.wait()
        assert (await simulator.allocate(RESOURCE, ["g1"])).container_responses
    assert held.lines[0].startswith(
        f"{path}: held back, keeping the running configuration: {OTHER}'s scan has not returned in 0.5 s, and "
        r"resources[1].pattern: 'h\d+' looks like a regular expression"
    )
    assert streaming(simulator, OTHER) == {"h0": gp.HEALTHY}


def test_allocate_s_look_at_a_device_has_the_scans_topology_for_the_same_node_only(tmp_path):
    directory, sysfs, numa_node = hung_numa_node(tmp_path)
    numa_node.write_text("1\n")
    resource = config_with(directory=str(directory), allowed_host_paths=["/dev"]).resources[0]
    [device] = gp.scan_directory(resource, str(sysfs)).devices
    roots = gp.host_path_roots(resource)
    numa_node.unlink()
    with fifo_at(numa_node):  # a read would wait for its watchdog, then find no number
        assert gp.examine_again(resource, device, roots, str(sysfs)).numa_node == device.numa_node == 1
        os.unlink(directory / "h0")
        os.symlink("/dev/zero", directory / "h0")  # another node (1:5) at the path: its scan will say
        assert gp.examine_again(resource, device, roots, str(sysfs)).numa_node is None


@pytest.mark.slow
def test_check_config_says_a_value_file_or_a_configuration_that_never_answers_in_one_line(node, tmp_path):
    path = tmp_path / "gopherplug.yaml"
    resource = {"name": RESOURCE, "directory": node.devices, "attributes": {"model": {"file": f"{tmp_path}/{{id}}"}}}
    path.write_text(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": [resource]}))
    (tmp_path / "g2").write_text("gopher")
    with fifo_at(tmp_path / "g1", watchdog=False):  # (another process reads it)
        result = run_cli("check-config", "--config", str(path), timeout=TIMEOUT * 3)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "g1" in line and "attributes.model" in line]
    assert lines == [
        f"  warning: device g1: attributes.model: cannot read {tmp_path}/g1: no answer within "
        f"{gp.FILE_READ_TIMEOUT:g} s"
    ], result.stderr
    with fifo_at(tmp_path / "config.yaml", watchdog=False):
        result = run_cli("check-config", "--config", str(tmp_path / "config.yaml"), timeout=TIMEOUT * 3)
    assert result.returncode == gp.EXIT_USAGE
    assert result.stderr.splitlines() == [
        f"gopherplug: {tmp_path}/config.yaml: cannot read: no answer within {gp.FILE_READ_TIMEOUT:g} s"
    ]


async def test_a_reload_while_the_cdi_directory_cannot_be_written_keeps_serving_and_writes_later(
    nursery, node, tmp_path, caplog, retry_soon
):
    path = tmp_path / "gopherplug.yaml"
    cdi = {"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")}
    path.write_text(config_text(node, **{RESOURCE: {"cdi": cdi}}))
    lock = tmp_path / "cdi" / ".example.com-gopher.json.lock"
    with trio.fail_after(TIMEOUT):
        simulator = await reloading(nursery, node, path)
        lock.unlink()
        lock.mkdir()  # every write fails from now on (as on a full or read-only file system)
        with logged("configuration reloaded") as reloaded:
            replace_file(path, config_text(node, **{RESOURCE: {"cdi": cdi, "env": "NEW"}}))
            await reloaded.wait()
        assert reloaded.lines == [f"{path}: configuration reloaded: kept {RESOURCE} as it was"]
        with logged("cannot write the CDI spec") as said:
            os.mknod(os.path.join(node.devices, "g3"))
            await said.wait()
        lock.rmdir()  # writable again: the spec is written with no other event, g3 offered
        await simulator.wait_until(listed("g1", "g2", "g3"))
    spec = (tmp_path / "cdi" / "example.com-gopher.json").read_text()
    assert '"g3"' in spec
    assert len(said.lines) == 1
    assert said.lines[0].endswith("; offering only the devices it describes until it can be written")


def mount_tmpfs(directory):
    subprocess.run(["mount", "-t", "tmpfs", "gopherplug-test", str(directory)], check=True)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root and mount")
async def test_the_device_directory_mounted_again_is_watched_again(nursery, node, tmp_path, retry_soon):
    directory = tmp_path / "mounted"
    directory.mkdir()
    mount_tmpfs(directory)
    try:
        (directory / "g1").touch()
        devices = gp.Watched({})
        resource_config = node.config(directory=str(directory)).resources[0]
        with trio.fail_after(TIMEOUT):
            await nursery.start(gp.watch_devices, resource_config, devices)
            assert set(devices.value) == {"g1"}
            with logged("mounted there again") as remounted:
                subprocess.run(["umount", str(directory)], check=True)
                while devices.value:  # the covered mount point: empty
                    await devices.wait_touched()
                mount_tmpfs(directory)  # no inotify event says so
                (directory / "g5").touch()
                await remounted.wait()
                while set(devices.value) != {"g5"}:
                    await devices.wait_touched()
                (directory / "g6").touch()  # and it is watched
                while set(devices.value) != {"g5", "g6"}:
                    await devices.wait_touched()
    finally:
        while subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode == 0:
            pass


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root and mount")
async def test_a_look_at_the_bare_mount_point_goes_on_until_a_file_system_is_mounted_there(
    nursery, node, tmp_path, retry_soon, monkeypatch
):
    """The order of the unmounts, the mounts and the plugin's looks is nobody's to choose: here a tmpfs
    is unmounted and another mounted before the plugin reads the unmount, the second is unmounted right
    after a look, the plugin looks at the bare mount point, and only then is a third mounted. The
    devices are the third's all the same."""
    directory = tmp_path / "mounted"
    directory.mkdir()
    identity, looked, unmount_after_look = gp._identity, [trio.Event()], []
    loop = trio.lowlevel.current_trio_token()

    def look(path):  # the plugin looking at what is at the path (in a worker thread): no inotify event tells of a mount
        seen = identity(path)
        if path == str(directory):
            loop.run_sync_soon(looked[0].set)
            while unmount_after_look:
                subprocess.run(["umount", unmount_after_look.pop()], check=True)
        return seen

    monkeypatch.setattr(gp, "_identity", look)
    mount_tmpfs(directory)
    try:
        (directory / "g1").touch()
        devices = gp.Watched({})
        resource_config = node.config(directory=str(directory)).resources[0]
        with trio.fail_after(TIMEOUT), logged("mounted there again") as remounted:
            await nursery.start(gp.watch_devices, resource_config, devices)
            subprocess.run(["umount", str(directory)], check=True)
            mount_tmpfs(directory)  # before the plugin hears of the unmount: it runs in this task's trio run
            (directory / "g5").touch()
            while set(devices.value) != {"g5"}:
                await devices.wait_touched()
            unmount_after_look.append(str(directory))
            while devices.value:  # unmounted right after a look: the bare mount point rescanned
                await devices.wait_touched()
            looked[0] = trio.Event()
            await looked[0].wait()  # a look at the bare mount point
            mount_tmpfs(directory)  # no inotify event says so
            (directory / "g9").touch()
            while set(devices.value) != {"g9"}:
                await devices.wait_touched()
            # The scan that found g9 may have read the third tmpfs (it runs off the event loop, which
            # may mount it meanwhile), before the next look says that it is mounted.
            await remounted.wait(2)
        assert len(remounted.lines) == 2  # one line for each tmpfs mounted again, none for the bare mount point
    finally:
        while subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode == 0:
            pass


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root and mount")
async def test_a_look_at_an_unmounted_directory_whose_stat_hangs_leaves_the_loop_running(
    nursery, node, tmp_path, retry_soon, monkeypatch
):
    """After an unmount the plugin looks at what is at the path every few seconds (a stat): on a dead
    NFS or FUSE mount that stat never returns. It is given up after FILE_READ_TIMEOUT, the event loop
    running meanwhile, and a later look finds the file system mounted there again."""
    monkeypatch.setattr(gp, "FILE_READ_TIMEOUT", 0.5)
    directory = tmp_path / "mounted"
    directory.mkdir()
    identity, hanging, released = gp._identity, threading.Event(), threading.Event()

    def look(path):  # the first look at the path hangs until released (at the latest after TIMEOUT)
        if path == str(directory) and not hanging.is_set():
            hanging.set()
            released.wait(TIMEOUT)
            released.set()
        return identity(path)

    monkeypatch.setattr(gp, "_identity", look)
    mount_tmpfs(directory)
    try:
        (directory / "g1").touch()
        devices = gp.Watched({})
        with logged("mounted there again") as remounted:
            with trio.fail_after(TIMEOUT):
                await nursery.start(gp.watch_devices, node.config(directory=str(directory)).resources[0], devices)
                subprocess.run(["umount", str(directory)], check=True)
                await trio.to_thread.run_sync(hanging.wait)
            assert not released.is_set(), "the loop runs while the look hangs"
            released.set()
            mount_tmpfs(directory)
            (directory / "g5").touch()
            with trio.fail_after(TIMEOUT):
                while set(devices.value) != {"g5"}:
                    await devices.wait_touched()
                await remounted.wait()
    finally:
        released.set()
        while subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode == 0:
            pass
