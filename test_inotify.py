"""inotify's limits, and directories created while their watch is placed."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
from inotify_simple import INotify

import gopherplug as gp
from testsupport import (
    HERE,
    OTHER,
    RESOURCE,
    TIMEOUT,
    StderrLines,
    config_text,
    dataclasses_replace_dir,
    health_of,
    listed,
    listed_ids,
    logged,
    reloading,
    replace_file,
    streaming,
    write_config,
)

# ------------------------------------------------------------------------------------------------
# inotify's limits, and directories created while their watch is being placed
# ------------------------------------------------------------------------------------------------


def can_limit_inotify():
    """Whether a new user namespace can be given its own inotify limits (Linux 5.11 and later)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = "echo 1 > /proc/sys/user/max_inotify_watches && echo 1 > /proc/sys/user/max_inotify_instances"
    tried = subprocess.run(
        ["unshare", "--user", "--map-root-user", "sh", "-c", probe], capture_output=True, check=False
    )
    return tried.returncode == 0


# Runs the plugin from this checkout with its inotify retry interval shortened.
LIMITED_PLUGIN = (
    "import sys, gopherplug; gopherplug.INOTIFY_RETRY_INTERVAL = 0.2; sys.exit(gopherplug.main(sys.argv[1:]))"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("watches", "instances", "limit"),
    [
        # The kubelet's directory watch takes both watches (the directory, its parent): the
        # resource's directory is the first that cannot be watched (then the config file's).
        (2, 100, "the node's limit of inotify watches is reached (raise the sysctl fs.inotify.max_user_watches)"),
        # The kubelet's directory watch takes the one instance: the resource's INotify() fails.
        (100, 1, "the node's limit of inotify instances is reached (raise the sysctl fs.inotify.max_user_instances)"),
    ],
    ids=["max_user_watches", "max_user_instances"],
)
async def test_inotify_limits_reached_fall_back_to_rescans_until_raised(
    nursery, node, tmp_path, watches, instances, limit
):
    # Since Linux 5.11 inotify's limits are per user namespace: the plugin runs in its own, with
    # limits that this node (and this test) can reach, and they are raised from outside.
    if not can_limit_inotify():
        pytest.skip("cannot give a user namespace its own inotify limits here (unshare, Linux >= 5.11)")
    (tmp_path / "target").touch()
    os.symlink(tmp_path / "target", os.path.join(node.devices, "g3"))  # a followed path too
    path = write_config(node, tmp_path)
    limits = (
        f"echo {watches} > /proc/sys/user/max_inotify_watches && "
        f'echo {instances} > /proc/sys/user/max_inotify_instances && exec "$@"'
    )
    argv = ["unshare", "--user", "--map-root-user", "sh", "-c", limits, "sh"]
    argv += [sys.executable, "-c", LIMITED_PLUGIN, "serve", "--config", str(path)]
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(argv, cwd=HERE, stderr=subprocess.PIPE)
    stderr = StderrLines(process.stderr)
    degraded = (
        f"{RESOURCE}: cannot watch {node.devices} with inotify: {limit}; "
        "rescanning it every 0.2 s until it can be watched\n"
    )
    try:
        with trio.fail_after(TIMEOUT):
            await stderr.wait_for(degraded)
            await simulator.wait_until(listed("g1", "g2", "g3"))
            os.unlink(os.path.join(node.devices, "g1"))  # no inotify event for it: found by a rescan
            await simulator.wait_until(listed("g2", "g3"))
            raised = "echo 100000 > /proc/sys/user/max_inotify_watches; echo 100 > /proc/sys/user/max_inotify_instances"
            await trio.run_process(["nsenter", "--user", "--target", str(process.pid), "sh", "-c", raised])
            await stderr.wait_for(f"{RESOURCE}: watching {node.devices} with inotify again")
            Path(node.devices, "g4").touch()
            await simulator.wait_until(listed("g2", "g3", "g4"))
            os.unlink(tmp_path / "target")  # the followed path is watched again too
            await simulator.wait_until(lambda s: health_of(s) == {**listed_ids("g2", "g4"), "g3": gp.UNHEALTHY})
    finally:
        process.terminate()
        await process.wait()
        await process.stderr.aclose()
    assert stderr.text.count(f"cannot watch {node.devices} with inotify") == 1, "said once, not at every rescan"
    assert "Traceback" not in stderr.text


@pytest.mark.slow
async def test_reload_adding_a_resource_beyond_the_inotify_instance_limit_serves_it_by_rescanning(
    nursery, node, tmp_path, monkeypatch, caplog
):
    # This process's own limits cannot be lowered: the one INotify() the added resource's watch
    # makes fails as the kernel fails it when fs.inotify.max_user_instances is reached.
    monkeypatch.setattr(gp, "INOTIFY_RETRY_INTERVAL", 0.05)
    limit = {"reached": False}
    real_inotify = gp.INotify

    def inotify(*args, **kwargs):
        if limit["reached"]:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_inotify(*args, **kwargs)

    monkeypatch.setattr(gp, "INotify", inotify)
    path = tmp_path / "gopherplug.yaml"
    path.write_text(config_text(node, **{RESOURCE: {}}))
    both = {RESOURCE: listed_ids("g1", "g2", "g3"), OTHER: listed_ids("g1", "g2", "g3")}
    with (
        trio.fail_after(TIMEOUT),
        logged(f"cannot watch {node.devices} with inotify") as degraded,
        logged(f"watching {node.devices} with inotify again") as recovered,
    ):
        simulator = await reloading(nursery, node, path)
        limit["reached"] = True
        replace_file(path, config_text(node, **{RESOURCE: {}, OTHER: {}}))
        await simulator.wait_until(lambda s: streaming(s, OTHER) == listed_ids("g1", "g2"))
        await degraded.wait()
        Path(node.devices, "g3").touch()  # RESOURCE hears of it from inotify, OTHER from a rescan
        await simulator.wait_until(lambda s: {name: streaming(s, name) for name in both} == both)
        limit["reached"] = False
        await recovered.wait()
        Path(node.devices, "g4").touch()
        both = {name: {**devices, "g4": gp.HEALTHY} for name, devices in both.items()}
        await simulator.wait_until(lambda s: {name: streaming(s, name) for name in both} == both)
    assert degraded.lines == [
        f"{OTHER}: cannot watch {node.devices} with inotify: the node's limit of inotify instances is reached "
        "(raise the sysctl fs.inotify.max_user_instances); rescanning it every 0.05 s until it can be watched"
    ]
    [record] = [r for r in caplog.records if r.getMessage() == degraded.lines[0]]
    assert record.resource == OTHER


def add_watch_creating(monkeypatch, missing, create):
    """Make INotify.add_watch create ``create`` right after an add_watch on ``missing`` failed for
    want of it: inside the window between that watch and the one on its parent."""
    real_add_watch = INotify.add_watch

    def add_watch(self, path, mask):
        try:
            return real_add_watch(self, path, mask)
        except FileNotFoundError:
            if os.fsdecode(path) == missing and not os.path.exists(create):
                os.makedirs(create)
            raise

    monkeypatch.setattr(INotify, "add_watch", add_watch)


@pytest.mark.parametrize("missing", ["dir", "parent"], ids=["the directory", "its parent"])
async def test_device_directory_created_while_its_watch_is_placed_is_watched(nursery, node, monkeypatch, missing):
    directory = os.path.join(node.devices, "a", "b")
    add_watch_creating(monkeypatch, directory if missing == "dir" else os.path.dirname(directory), directory)
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, dataclasses_replace_dir(node.config(), directory))
        await simulator.wait_until(listed())
        assert os.path.isdir(directory), "created in the window"
        Path(directory, "g7").touch()
        await simulator.wait_until(listed("g7"))


async def test_symlink_targets_directory_created_while_its_watch_is_placed_is_watched(
    nursery, node, tmp_path, monkeypatch
):
    target = tmp_path / "elsewhere" / "deeper" / "g3-target"
    os.symlink(target, os.path.join(node.devices, "g3"))
    add_watch_creating(monkeypatch, str(target.parent), str(target.parent))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config())
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
        assert target.parent.is_dir(), "created in the window"
        target.touch()
        await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.HEALTHY)
