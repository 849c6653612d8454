"""Node Feature Discovery: the feature file the plugin writes."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
import yaml
from inotify_simple import INotify
from inotify_simple import flags as inotify_flags

import gopherplug as gp
from testsupport import (
    HERE,
    OTHER,
    RESOURCE,
    TIMEOUT,
    health_of,
    listed,
    logged,
    reaped,
    reloading,
    replace_file,
    run_cli,
)

# ------------------------------------------------------------------------------------------------
# Node Feature Discovery: nfd_features_file
# ------------------------------------------------------------------------------------------------


#: A label's name after its prefix, and a label's value (k8s.io/apimachinery's validation: qualifiedNameFmt,
#: labelValueFmt), each of at most 63 characters; a DNS subdomain as the prefix.
K8S_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


K8S_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def nfd_file_labels(path):
    """The node labels NFD makes of the feature file at ``path``, read as its local source reads it
    (kubernetes-sigs/node-feature-discovery source/local/local.go: a file of at most 64 KiB whose name
    does not begin with "."; each line trimmed, "#" lines skipped, a "# +" line a directive it must
    know, "<name>[=<value>]", a value "true" when missing) and checked as nfd-master checks a label
    before it writes it (pkg/apis/nfd/validate's Label: a qualified name, in NFD's own namespace for
    a kubernetes.io one; a valid label value; a value beginning with "@" is looked up as a feature,
    not taken as it is). Fails the test at the first line NFD would skip or nfd-master refuse."""
    path = Path(path)
    assert not path.name.startswith(".") and path.stat().st_size <= 65536, path
    labels = {}
    for line in path.read_text().split("\n"):
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            assert not line.startswith("# +"), f"a directive: {line}"
            continue
        name, _, value = line.partition("=") if "=" in line else (line, "=", "true")
        prefix, _, part = name.rpartition("/")
        assert prefix == "feature.node.kubernetes.io", line  # NFD's: no other kubernetes.io, none missing
        assert len(part) <= 63 and K8S_NAME.fullmatch(part), line
        assert len(value) <= 63 and K8S_VALUE.fullmatch(value) and not value.startswith("@"), line
        assert name not in labels, f"{name} twice"
        labels[name] = value
    return labels


def test_nfd_features_file_is_an_absolute_path_to_a_file_nfd_reads():
    def refused(value):
        with pytest.raises(gp.ConfigError) as caught:
            gp.parse_config(
                yaml.safe_dump({"nfd_features_file": value, "resources": [{"name": RESOURCE, "directory": "/g"}]}),
                "cfg.yaml",
            )
        return str(caught.value)

    assert (
        refused("features.d/gopherplug")
        == "cfg.yaml: nfd_features_file: 'features.d/gopherplug' must be an absolute path"
    )
    assert refused("/etc/kubernetes/node-feature-discovery/features.d/.gopherplug") == (
        "cfg.yaml: nfd_features_file: '/etc/kubernetes/node-feature-discovery/features.d/.gopherplug': NFD skips "
        "a file whose name begins with '.': name the file, e.g. "
        "/etc/kubernetes/node-feature-discovery/features.d/gopherplug"
    )
    config = gp.parse_config(yaml.safe_dump({"resources": [{"name": RESOURCE, "directory": "/g"}]}), "cfg.yaml")
    assert config.nfd_features_file is None  # off unless given


@pytest.mark.slow
def test_check_config_shows_the_nfd_labels_of_the_attributes_every_device_shares(sockdir):
    """Per resource the count of healthy devices and each attribute all of its
    devices share, as NFD takes them: a literal, a file that reads the same for each device, the
    standard ones sysfs gives without their domain; not one that differs between devices (a file
    per device), not gopherplug's bookkeeping (id, resource, healthy), not a negative integer (no
    label value stands for it). A value that is no label value as it is made one (spaces, "+",
    longer than 63), a name too long for a label shortened with its hash: every line valid for NFD."""
    tmp_path = Path(sockdir)
    devices, values = tmp_path / "g", tmp_path / "values"
    devices.mkdir()
    values.mkdir()
    for name, serial in (("gpu0", "S-0"), ("gpu1", "S-1"), ("gpu2", "S-2")):
        (devices / name).touch()
        (values / f"{name}.serial").write_text(serial)
        (values / f"{name}.board").write_text("p4401\n")
    (devices / "gpu2").unlink()
    (devices / "gpu2").symlink_to("gone")  # dangling: unhealthy, in the attributes, not in the count
    long_name = "a" * 32  # the longest an attribute's name may be
    attributes = {
        "productName": "NVIDIA H200 NVL",
        "cores": 132,
        "offset": -1,
        "fast": True,
        "driverVersion": {"version": "580.159.4+build.7"},
        "serial": {"file": f"{values}/{{id}}.serial", "type": "string"},
        "board": {"file": f"{values}/{{id}}.board", "type": "string"},
        "notes": "x" * 64,
    }
    features = tmp_path / "features.d" / "gopherplug"
    path = tmp_path / "cfg.yaml"
    document = {
        "nfd_features_file": str(features),
        "resources": [
            {"name": "example.com/gpu", "directory": str(devices), "attributes": attributes},
            {"name": "example.com/none", "directory": str(tmp_path / "missing")},
            {
                "name": "long-resource-name.example.com/accelerator",
                "directory": str(devices),
                "attributes": {long_name: "long"},
            },
        ],
    }
    path.write_text(yaml.safe_dump(document))
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    shown = result.stdout.split(f"NFD feature file {features} (nfd_features_file), as serve would write it:\n")[1]
    assert not features.exists()  # check-config writes nothing
    features.parent.mkdir()
    features.write_text("".join(line.strip() + "\n" for line in shown.splitlines()))
    labels = nfd_file_labels(features)
    part = f"long-resource-name.example.com-accelerator.{long_name}"
    shortened = f"{part[:54]}-{hashlib.sha256(part.encode()).hexdigest()[:8]}"
    assert labels == {
        "feature.node.kubernetes.io/example.com-gpu.count": "2",
        "feature.node.kubernetes.io/example.com-gpu.board": "p4401",  # the same file text for each: shared
        "feature.node.kubernetes.io/example.com-gpu.cores": "132",
        "feature.node.kubernetes.io/example.com-gpu.driverVersion": "580.159.4-build.7",
        "feature.node.kubernetes.io/example.com-gpu.fast": "true",
        "feature.node.kubernetes.io/example.com-gpu.notes": "x" * 63,
        "feature.node.kubernetes.io/example.com-gpu.productName": "NVIDIA-H200-NVL",
        "feature.node.kubernetes.io/example.com-none.count": "0",
        "feature.node.kubernetes.io/long-resource-name.example.com-accelerator.count": "2",
        f"feature.node.kubernetes.io/{shortened}": "long",
    }
    assert len(shortened) == 63


async def nfd_written(watcher, features):
    """Until the feature file is replaced (renamed over, as gopherplug writes it) or removed: the
    inotify events of its directory, read as they come."""
    while True:
        await trio.lowlevel.wait_readable(watcher.fileno())
        events = watcher.read(timeout=0)
        if any(e.name == features.name for e in events):
            return [inotify_flags.from_mask(e.mask) for e in events if e.name == features.name]


async def test_the_nfd_feature_file_follows_hot_plugs_health_and_reloads(nursery, node, tmp_path):
    """serve keeps the feature file: written at start, atomically (only renames over it: NFD never
    reads half a file, and skips the hidden temporary), again when a device is plugged in (inotify
    sees it, the count goes up) or loses its health, not when nothing it says changed; a resource
    removed by a reload takes its lines along; a cancel (a clean stop) removes the file."""
    features_dir = tmp_path / "features.d"
    features = features_dir / "gopherplug"
    path = tmp_path / "gopherplug.yaml"

    def write(**resources):
        entries = [{"name": name, "directory": node.devices, **keys} for name, keys in resources.items()]
        document = {"device_plugin_dir": node.plugin_dir, "nfd_features_file": str(features), "resources": entries}
        replace_file(path, yaml.safe_dump(document))

    write(**{RESOURCE: {"attributes": {"model": "Gopher 9000"}}, OTHER: {"pattern": "g1"}})
    features_dir.mkdir()
    target = tmp_path / "targets" / "g3-target"  # g3 is a link to it: healthy while it is there
    target.parent.mkdir()
    watcher = INotify()
    watcher.add_watch(str(features_dir), inotify_flags.MOVED_TO | inotify_flags.DELETE | inotify_flags.CLOSE_WRITE)
    count, model = (
        f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.count",
        f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.model",
    )
    other = f"{gp.NFD_LABEL_NAMESPACE}/example.com-other.count"
    try:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as serving:
                simulator = await reloading(serving, node, path)
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features) == {count: "2", model: "Gopher-9000", other: "1"}
                target.touch()
                Path(node.devices, "g3").symlink_to(target)  # hot-plugged
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features) == {count: "3", model: "Gopher-9000", other: "1"}
                target.unlink()  # the link dangles: unhealthy
                await simulator.wait_until(lambda s: health_of(s).get("g3") == gp.UNHEALTHY)
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features)[count] == "2"
                with logged("configuration reloaded: removed example.com/other") as reloaded:
                    write(**{RESOURCE: {"attributes": {"model": "Gopher 9000"}}})
                    await reloaded.wait()
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features) == {count: "2", model: "Gopher-9000"}
                with logged("configuration reloaded: updated in place example.com/gopher") as reloaded:
                    write(**{RESOURCE: {"attributes": {"model": "Gopher 9000"}, "env": "GOPHERS"}})  # no label changes
                    await reloaded.wait()
                target.touch()  # healthy again: one write, for this change alone
                assert await nfd_written(watcher, features) == [[inotify_flags.MOVED_TO]]
                assert nfd_file_labels(features)[count] == "3"
                # A rolling update's newer pod writes its own file before this one stops: that one stays.
                newer = features_dir / "newer"
                newer.write_text(f"{count}=3\n")
                os.replace(newer, features)
                serving.cancel_scope.cancel()
    finally:
        watcher.close()
    assert os.listdir(features_dir) == ["gopherplug"] and features.read_text() == f"{count}=3\n"


async def test_an_nfd_feature_file_that_cannot_be_written_is_one_line_and_the_plugin_serves_on(nursery, node, tmp_path):
    """Its directory is a file: one error line naming the file and why, the devices served all the
    same; fixed, the next change writes it, and says so."""
    blocked = tmp_path / "features.d"
    blocked.write_text("not a directory")
    features = blocked / "gopherplug"
    config = node.config(top={"nfd_features_file": str(features)})
    with trio.fail_after(TIMEOUT), logged("the NFD feature file") as said:
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("g1", "g2"))
        await said.wait()
        blocked.unlink()
        blocked.mkdir()
        Path(node.devices, "g3").touch()
        await simulator.wait_until(listed("g1", "g2", "g3"))
        await said.wait(2)
    assert said.lines == [
        f"cannot write the NFD feature file {features} (nfd_features_file): {blocked} is not a directory: its "
        "labels stay as they were; trying again at the next change or in 30 s",
        f"wrote the NFD feature file {features} again",
    ]
    assert nfd_file_labels(features) == {f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.count": "3"}


@pytest.mark.slow
async def test_serve_removes_its_nfd_feature_file_at_sigterm(nursery, node, tmp_path):
    """`gopherplug serve` in its own process writes the feature file, and SIGTERM (the kubelet
    stopping the pod) removes it: NFD drops the labels of devices no plugin serves any more."""
    features = tmp_path / "features.d" / "gopherplug"  # its directory made by serve
    path = tmp_path / "gopherplug.yaml"
    resource = {"name": RESOURCE, "directory": node.devices}
    document = {"device_plugin_dir": node.plugin_dir, "nfd_features_file": str(features), "resources": [resource]}
    path.write_text(yaml.safe_dump(document))
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    watcher = INotify()
    watcher.add_watch(str(tmp_path), inotify_flags.CREATE)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    try:
        async with reaped(argv, stderr=subprocess.DEVNULL) as process:
            with trio.fail_after(TIMEOUT):
                await simulator.wait_until(listed("g1", "g2"))
                while not features.exists():  # woken by its directory's creation, then by the file's
                    await trio.lowlevel.wait_readable(watcher.fileno())
                    for event in watcher.read(timeout=0):
                        if event.name == "features.d":
                            watcher.add_watch(str(features.parent), inotify_flags.MOVED_TO)
                assert nfd_file_labels(features) == {f"{gp.NFD_LABEL_NAMESPACE}/example.com-gopher.count": "2"}
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
    finally:
        watcher.close()
    assert os.listdir(features.parent) == []
