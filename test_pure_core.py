"""The pure core: configuration, names, directories, the answers."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import random
import re
import shutil
import socket
import stat
import sys
import time
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
import yaml
from hypothesis import given
from hypothesis import strategies as st

import gopherplug as gp
from gopherplug import StatusCode, v1beta1
from testsupport import (
    CDI_ADDED,
    GPU_ID_PATTERN,
    HERE,
    MINIMAL,
    PROPERTIES,
    RESOURCE,
    TIMEOUT,
    allocate,
    cdi_problem,
    config_with,
    deleted_message,
    fake_sysfs,
    gpu_by_path,
    host_mode,
    listed,
    logged,
    preferred,
    read_spec,
    resource_in,
    run_cli,
    start,
    usb,
    usb_nodes,
    usb_tree,
)

# ------------------------------------------------------------------------------------------------
# Pure core: configuration, names, directories, responses
# ------------------------------------------------------------------------------------------------


def test_minimal_config_gets_the_documented_defaults():
    config = gp.parse_config(MINIMAL, "cfg.yaml")
    assert config.device_plugin_dir is None  # found at start: find_device_plugin_dir()
    assert config.sysfs_root == "/sys"
    assert config.resources == (gp.ResourceConfig("example.com/gopher", "/etc/gophers", "*", "GOPHER_DEVICES", None),)


def test_find_device_plugin_dir_picks_the_one_with_a_kubelet_socket(tmp_path, caplog):
    candidates = [str(tmp_path / name) for name in ("default", "microk8s", "k0s")]
    for directory in candidates:
        os.mkdir(directory)
    Path(candidates[0], "kubelet.sock").touch()  # a regular file is not a kubelet
    with socket.socket(socket.AF_UNIX) as kubelet:
        kubelet.bind(os.path.join(candidates[2], "kubelet.sock"))
        with caplog.at_level("INFO", logger="gopherplug"):
            assert gp.find_device_plugin_dir(candidates) == candidates[2]
    assert f"kubelet.sock found in {candidates[2]}: using it" in caplog.text
    os.unlink(os.path.join(candidates[2], "kubelet.sock"))
    assert gp.find_device_plugin_dir(candidates) == candidates[0]
    assert (
        f"no kubelet.sock in {', '.join(candidates)}: waiting for the kubelet in {candidates[0]}; if this node's "
        "kubelet uses another directory, set device_plugin_dir in the configuration, --device-plugin-dir or "
        "GOPHERPLUG_DEVICE_PLUGIN_DIR"
    ) in caplog.text


# /proc/self/mountinfo of a container as containerd starts it: its own root (overlay) and /dev
# (tmpfs), the kubelet's directory from the host, and in the second case the host's /dev too.
CONTAINER_MOUNTS = """\
1500 1400 0:120 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/var/lib/containerd/l1:/l2,upperdir=/u
1501 1500 0:121 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1502 1500 0:122 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1503 1502 0:123 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666
1510 1500 253:1 /var/lib/kubelet/device-plugins /var/lib/kubelet/device-plugins rw,relatime - ext4 /dev/vda1 rw
1511 1500 253:1 /etc/my\\040gophers /etc/my\\040gophers rw,relatime - ext4 /dev/vda1 rw
"""


HOST_DEV = "1520 1502 0:6 / /dev rw,nosuid,relatime - devtmpfs devtmpfs rw,size=8135516k,mode=755\n"


@pytest.mark.parametrize(
    ("directory", "mountinfo", "on"),
    [
        ("/etc/gophers", CONTAINER_MOUNTS, "/ (overlay)"),  # the image's own /etc
        ("/dev/serial/by-id", CONTAINER_MOUNTS, "/dev (tmpfs)"),  # the runtime's /dev, not the host's
        ("/dev/serial/by-id", CONTAINER_MOUNTS + HOST_DEV, None),  # hostPath /dev at /dev, on top
        ("/var/lib/kubelet/device-plugins", CONTAINER_MOUNTS, None),
        ("/etc/my gophers/sub", CONTAINER_MOUNTS, None),  # a mount point with a space, escaped
        ("/dev/serial/by-id", Path("/proc/self/mountinfo").read_text(), None),  # this machine, no container
    ],
)
def test_container_only_paths_are_recognised(directory, mountinfo, on):
    problem = gp.container_only_problem(directory, mountinfo)
    if on is None:
        assert problem is None
    else:
        assert problem == (
            f"{directory} is on {on}, which looks like this container's own filesystem, not the host's: the "
            "container runtime opens device paths on the host, so mount the host's directory at the same path "
            "(a hostPath volume)"
        )


def test_a_deleted_directory_seen_through_a_mount_is_recognised(tmp_path):
    gone = tmp_path / "device-plugins"
    gone.mkdir()
    fd = os.open(gone, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.rmdir(gone)
        # Like a hostPath mount of a directory removed on the host, this path still leads to it.
        through = f"/proc/self/fd/{fd}"
        links = os.stat(through).st_nlink
        assert links == 0
        assert gp.deleted_directory_problem(through, links, "") == deleted_message(through)
    finally:
        os.close(fd)
    # mountinfo says so too, whatever link count a file system gives its directories.
    kubelet_dir = "/var/lib/kubelet/device-plugins"
    deleted = CONTAINER_MOUNTS.replace(f"{kubelet_dir} {kubelet_dir}", f"{kubelet_dir}//deleted {kubelet_dir}")
    assert gp.deleted_directory_problem(kubelet_dir, 1, deleted) == deleted_message(kubelet_dir)
    assert gp.deleted_directory_problem(kubelet_dir, 2, CONTAINER_MOUNTS) is None
    assert gp.deleted_directory_problem(kubelet_dir, None, CONTAINER_MOUNTS) is None, "missing: to be waited for"
    assert gp.deleted_directory_problem("/etc/gophers", 2, deleted) is None, "another mount's"


def test_find_device_plugin_dir_prefers_a_live_kubelet(tmp_path):
    candidates = [str(tmp_path / name) for name in ("default", "microk8s")]
    for directory in candidates:
        os.mkdir(directory)
    with socket.socket(socket.AF_UNIX) as dead:  # what a kubelet that is gone leaves
        dead.bind(os.path.join(candidates[0], "kubelet.sock"))
    with socket.socket(socket.AF_UNIX) as kubelet:
        kubelet.bind(os.path.join(candidates[1], "kubelet.sock"))
        kubelet.listen()
        assert gp.find_device_plugin_dir(candidates) == candidates[1]


def test_the_example_configuration_lists_every_key():
    """config.example.yaml says every key is listed there: each key parse_config knows (the names its
    "unknown key" lines give, and _RESOURCE_KEYS) is written in it, as a key or a commented one,
    and uncommented they parse."""

    def known(text):
        with pytest.raises(gp.ConfigError) as info:
            gp.parse_config(text)
        return set(info.value.problem.partition("expected one of ")[2].split(", "))

    resource = "resources: [{name: example.com/a, directory: /x, "
    keys = known("nope: 1\nresources: []") | known("dra: {driver: x.example.com, nope: 1}\nresources: []")
    keys |= gp._RESOURCE_KEYS
    for nested in ("cdi: {kind: a.b/cc, nope: 1}", "usb: [{nope: 1}]", "mounts: [{nope: 1}]"):
        keys |= known(resource + nested + "}]")
    keys |= known("resources: [{name: example.com/a, match: [{nope: 1}]}]")
    keys |= known(resource + "device_specs: [{nope: 1}]}]") | known(resource + "attributes: {a: {file: /x, nope: 1}}}]")
    text = (HERE / "config.example.yaml").read_text()
    written = set(re.findall(r"^[ ]*(?:#[ ]*)?(?:-[ ]+)?\{?([a-z_]+):", text, re.MULTILINE))
    written |= set(re.findall(r"[{,] ?([a-z_]+):", text))  # in flow mappings: {vendor: "1050", product: "0407"}
    assert sorted(keys - written) == []
    # The keys this test added to the file, uncommented, parse (the others: test_example_config_is_valid).
    for key in ("health_address", "nfd_features_file"):
        text = text.replace(f"# {key}:", f"{key}:")
    for key in ("shared_with:", "attributes:", "  productName:", "  firmwareVersion:", "capacity:", "  memory:"):
        text = text.replace(f"    # {key}", f"    {key}")
    text = text.replace("shared_with: [example.com/serial]", "")
    text = text.replace("# describe: [/usr/local/bin/describe-gophers]", f"describe: [{sys.executable}]")
    parsed = gp.parse_config(text)
    assert (parsed.health_address, parsed.nfd_features_file) == (
        "0.0.0.0:9402",
        "/etc/kubernetes/node-feature-discovery/features.d/gopherplug",
    )
    assert parsed.resources[0].describe == (sys.executable,)
    assert [value.name for value in parsed.resources[0].attributes + parsed.resources[0].capacity] == [
        "productName",
        "firmwareVersion",
        "memory",
    ]


def test_example_config_is_valid():
    config = gp.load_config(str(HERE / "config.example.yaml"))
    assert [r.name for r in config.resources] == ["example.com/gopher"]
    assert config.resources[0].device_specs == (gp.DeviceSpecTemplate("/dev/{id}", "/dev/gopher{index}", "rw"),)
    assert config.resources[0].mounts == (gp.MountTemplate("/etc/gophers", "/run/gophers", True),)
    assert config.resources[0].annotations == (("example.com/gophers", "{id}"),)
    assert (config.resources[0].replicas, config.resources[0].preferred) == (1, "packed")
    # The commented-out keys are valid too, once uncommented (with their own container paths).
    text = (HERE / "config.example.yaml").read_text()
    for key in ("cdi:", "  kind:", "  spec_dir:", "pre_start:", "pre_start_timeout:"):
        text = text.replace(f"    # {key}", f"    {key}")
    text = text.replace("/usr/local/bin/reset-gopher", sys.executable).replace("/dev/gopher{index}", "/dev/{id}")
    uncommented = gp.parse_config(text).resources[0]
    assert uncommented.cdi == gp.CDIConfig("example.com/gopher", "/var/run/cdi")
    # The dra block, uncommented, with a resource of its own.
    block = text[text.index("# dra:\n") :].split("\n\n")[0]
    dra = "\n".join(line.removeprefix("# ") for line in block.splitlines())
    dra += "\nresources: [{name: example.com/gopher, directory: /etc/gophers, api: dra}]\n"
    assert gp.parse_config(dra).dra == gp.DraConfig("gopherplug.example.com", "/var/lib/kubelet", "NoSchedule")
    assert "  device_metadata: true\n" in dra  # the default, written out; false turns it off
    assert gp.parse_config(dra.replace("device_metadata: true", "device_metadata: false")).dra.device_metadata is False
    metrics = text.replace('# metrics_address: "0.0.0.0:9400"', 'metrics_address: "0.0.0.0:9400"')
    assert gp.parse_config(metrics).metrics_address == "0.0.0.0:9400"
    assert (uncommented.pre_start, uncommented.pre_start_timeout) == ((sys.executable, "--quick"), 25.0)
    # match, id_pattern and usb, each in place of directory and pattern.
    sources = text.replace("    directory: /etc/gophers\n", "").replace('    pattern: "*"\n', "")
    sources = sources.replace("allowed_host_paths: [/dev]", "allowed_host_paths: [/dev, /etc/gophers]")
    usb = sources
    for key in ("match:", "  - {directory: /dev, pattern:", "id_pattern:"):
        sources = sources.replace(f"    # {key}", f"    {key}")
    uncommented = gp.parse_config(sources).resources[0]
    assert uncommented.sources == (gp.Source("/dev", "ttyUSB*"), gp.Source("/dev", "ttyACM*"))
    assert uncommented.id_pattern.fullmatch("pci-0000:00:02.0-card")["id"] == "0000:00:02.0"
    for key in ("usb:", "  - {vendor:"):  # a resource of USB devices: beside directory or match, refused
        usb = usb.replace(f"    # {key}", f"    {key}")
    assert gp.parse_config(usb).resources[0].usb == (
        gp.UsbSelector("1050", "0407"),
        gp.UsbSelector("0403", "6001", "A10KZP45"),
    )
    # dra and api (without what DRA refuses).
    dra = (
        text.replace("# dra:", "dra:").replace("#   driver:", "  driver:").replace("#   kubelet_dir:", "  kubelet_dir:")
    )
    dra = dra.replace("    # api: device-plugin", "    api: dra")
    dra = re.sub(r"    annotations:\n(      .*\n)+", "", dra)
    for key in ("pre_start", "pre_start_timeout", "replicas", "preferred"):
        dra = re.sub(rf"    {key}:.*\n", "", dra)
    parsed = gp.parse_config(dra)
    assert parsed.dra == gp.DraConfig("gopherplug.example.com", "/var/lib/kubelet")
    assert parsed.resources[0].api == "dra"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("example.com/gopher", None),
        ("a.b-c.example/x_y.z", None),
        ("example.com/" + "x" * 63, None),
        ("gopher", "must be an extended resource name, domain/name (e.g. example.com/gopher)"),
        ("example.com/a/b", "must be an extended resource name, domain/name (e.g. example.com/gopher)"),
        ("kubernetes.io/gopher", "the kubernetes.io domain is reserved for Kubernetes' own resources"),
        ("gpu.kubernetes.io/gopher", "the kubernetes.io domain is reserved for Kubernetes' own resources"),
        ("requests.example.com/gopher", 'must not start with "requests."'),
        ("Example.com/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        ("example..com/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        ("/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        ("x" * 245 + "/gopher", "the domain before '/' must be a lower-case DNS subdomain (e.g. example.com)"),
        *(
            (
                name,
                "the name after '/' must be 1 to 63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit",
            )
            for name in (
                "example.com/",
                "example.com/-gopher",
                "example.com/gopher.",
                "example.com/" + "x" * 64,
                "example.com/go pher",
            )
        ),
    ],
)
def test_resource_names_are_validated_as_the_kubelet_does(name, problem):
    assert gp.resource_name_problem(name) == problem


@pytest.mark.parametrize(
    ("name", "env"),
    [
        ("example.com/gopher", "GOPHER_DEVICES"),
        ("example.com/fpga.v2-x", "FPGA_V2_X_DEVICES"),
        ("e.com/3d", "_3D_DEVICES"),
    ],
)
def test_default_env_name(name, env):
    assert gp.default_env_name(name) == env


def test_scan_directory(tmp_path):
    for name in ["g10", "g2", "g1", ".hidden", "other.txt", "has space", "x" * 64, "y" * 63]:
        (tmp_path / name).touch()
    os.symlink("/dev/null", tmp_path / "gnull")
    os.symlink(tmp_path / "missing", tmp_path / "gdangling")
    # Outside /dev, a link into /dev is a device only where allowed (here: that one node).
    assert ("gnull", f"host path /dev/null is outside {tmp_path}: add its directory to allowed_host_paths") in (
        gp.scan_directory(resource_in(tmp_path)).skipped
    )
    scan = gp.scan_directory(resource_in(tmp_path, allowed_host_paths=["/dev/null"]))
    devices = scan.devices
    assert [d.id for d in devices] == ["g1", "g2", "g10", "gdangling", "gnull", "other.txt", "y" * 63]
    assert [name for name, _ in scan.skipped] == ["has space", "x" * 64]
    assert {d.id: d.is_device_node for d in devices}["gnull"] is True
    assert {d.id: d.is_device_node for d in devices}["g1"] is False
    assert devices[0].path == str(tmp_path / "g1")
    assert scan.followed == {"/dev/null", str(tmp_path / "missing")}
    assert [d.id for d in gp.scan_directory(resource_in(tmp_path, pattern="g?")).devices] == ["g1", "g2"]


def test_scan_directory_missing_or_a_file(tmp_path):
    assert gp.scan_directory(resource_in(tmp_path / "nope")) == gp.Scan((), ())
    (tmp_path / "file").touch()
    assert gp.scan_directory(resource_in(tmp_path / "file")) == gp.Scan((), ())


def test_scan_health_of_symlinks(tmp_path):
    os.symlink(tmp_path / "elsewhere" / "target", tmp_path / "g0")
    (g0,) = gp.scan_directory(resource_in(tmp_path, pattern="g*")).devices
    assert (g0.health, g0.problem) == (
        gp.UNHEALTHY,
        f"{tmp_path}/g0 is a symlink to {tmp_path}/elsewhere/target, which does not exist",
    )
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "target").touch()
    (g0,) = gp.scan_directory(resource_in(tmp_path, pattern="g*")).devices
    assert (g0.health, g0.problem) == (gp.HEALTHY, "")


def test_scan_numa_node_of_device_nodes_from_sysfs(tmp_path):
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("null", "/dev/null"), ("zero", "/dev/zero"), ("full", "/dev/full"), ("rand", "/dev/random")]:
        os.symlink(target, devices / name)
    (devices / "plain").touch()
    # /dev/null is 1:3, /dev/zero 1:5, /dev/full 1:7 on every Linux; /dev/random (1:8) gets no file.
    sysfs = fake_sysfs(tmp_path / "sys", {(1, 3): 0, (1, 5): 1, (1, 7): -1})
    resource = resource_in(devices, allowed_host_paths=["/dev"])
    numa = {d.id: d.numa_node for d in gp.scan_directory(resource, sysfs).devices}
    assert numa == {"null": 0, "zero": 1, "full": None, "rand": None, "plain": None}


def test_scan_skips_a_sub_directory_and_a_symlink_to_one(tmp_path):
    # /dev/dri without a pattern: by-path was offered as a Healthy device, DRI_DEVICES=by-path, no GPU.
    dri = tmp_path / "dri"
    (dri / "by-path").mkdir(parents=True)
    (dri / "card1").touch()
    os.symlink(dri / "by-path", dri / "by-id")
    scan = gp.scan_directory(resource_in(dri))
    assert [d.id for d in scan.devices] == ["card1"]
    assert scan.skipped == tuple(
        (
            name,
            f"a directory, not a device: for the devices in it, write directory: {dri}/{name} (or a match entry "
            "for it); a pattern that leaves it out silences this line",
        )
        for name in ("by-id", "by-path")
    )
    assert gp.scan_directory(resource_in(dri, pattern="card*")).skipped == ()


@pytest.mark.slow
def test_check_config_says_a_sub_directory_is_skipped_and_how_to_offer_what_is_in_it(tmp_path):
    dri = tmp_path / "dri"
    (dri / "by-path").mkdir(parents=True)
    (dri / "card1").touch()
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"resources": [{"name": "example.com/gpu", "directory": str(dri)}]}))
    result = run_cli("check-config", "--strict", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:5] == [
        f"example.com/gpu: 1 device, 1 healthy, from {dri}/*",
        "  ID     HEALTH     PATH",
        f"  card1  Healthy    {dri}/card1",
        f"  skipped 'by-path': a directory, not a device: for the devices in it, write directory: {dri}/by-path "
        "(or a match entry for it); a pattern that leaves it out silences this line",
    ]


async def test_serve_offers_no_sub_directory_and_warns_once(nursery, node, caplog):
    os.mkdir(os.path.join(node.devices, "by-path"))
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)  # g1 and g2 alone
        Path(node.devices, "g3").touch()  # a rescan of the directory finds by-path again
        await simulator.wait_until(listed("g1", "g2", "g3"))
    warned = [m for m in caplog.messages if m.startswith(f"{RESOURCE}: skipping 'by-path': a directory, not a device")]
    assert len(warned) == 1


def serial_and_ch340(tmp_path, **ch340):
    """/dev/ttyUSB0 as a migrated generic-device-plugin set-up finds it twice: by a ttyUSB* glob, and
    through the udev link of the adapter (the same node a usb: 1a86:7523 resource finds)."""
    dev = tmp_path / "dev"
    if not dev.exists():
        (dev / "serial" / "by-id").mkdir(parents=True)
        for name in ("ttyUSB0", "ttyUSB1"):
            (dev / name).touch()
        os.symlink(dev / "ttyUSB0", dev / "serial" / "by-id" / "usb-1a86_USB_Serial-if00")
    return [
        {"name": "example.com/serial", "directory": str(dev), "pattern": "ttyUSB*"},
        {"name": "example.com/ch340", "directory": str(dev / "serial" / "by-id"), **ch340},
    ]


def test_two_resources_share_an_env_only_when_they_share_devices():
    """One env on two resources is refused (BAD_CONFIGS), unless one lists the other in shared_with:
    two names for the same devices (a ttyUSB* glob and the adapter's by-id link), a pod asking for
    one of them, whose program reads the same variable either way."""
    ch340 = "{name: example.com/ch340, directory: /dev/serial/by-id, env: SERIAL, shared_with: [example.com/serial]}"
    text = f"resources: [{{name: example.com/serial, directory: /dev, pattern: 'ttyUSB*', env: SERIAL}}, {ch340}]"
    assert [resource.env for resource in gp.parse_config(text).resources] == ["SERIAL", "SERIAL"]


SHARED_TTYUSB0 = (
    "{dev}/ttyUSB0 is offered by both example.com/serial (device ttyUSB0) and example.com/ch340 (device "
    "usb-1a86_USB_Serial-if00): two pods could be given it at once; leave it out of one, or, if they are meant to "
    "share it, list example.com/ch340 in shared_with of example.com/serial"
)


@pytest.mark.parametrize(
    ("serial", "ch340", "lines"),
    [
        ({}, {}, [SHARED_TTYUSB0]),
        ({"shared_with": ["example.com/ch340"]}, {}, []),  # either one saying so is enough
        ({}, {"shared_with": ["example.com/serial"]}, []),
        ({"pattern": "ttyUSB1"}, {}, []),
    ],
)
def test_shared_nodes_names_the_node_and_both_resources_unless_one_allows_it(tmp_path, serial, ch340, lines):
    document = serial_and_ch340(tmp_path, **ch340)
    document[0].update(serial)
    config = gp.parse_config(yaml.safe_dump({"resources": document}), "c")
    offered = [(r, gp.scan_directory(r).devices) for r in config.resources]
    assert gp.shared_nodes(offered) == [line.format(dev=tmp_path / "dev") for line in lines]


@pytest.mark.slow
def test_check_config_says_once_that_two_resources_offer_one_node_and_strict_fails(tmp_path):
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"resources": serial_and_ch340(tmp_path)}))
    result = run_cli("check-config", "--config", str(path))
    warning = f"gopherplug: warning: {SHARED_TTYUSB0}\n".format(dev=tmp_path / "dev")
    assert (result.returncode, result.stderr) == (0, warning)
    strict = run_cli("check-config", "--strict", "--config", str(path))
    assert (strict.returncode, strict.stderr.splitlines()[1:]) == (
        1,
        [f"gopherplug: --strict: {tmp_path}/dev/ttyUSB0: offered twice"],
    )
    path.write_text(yaml.safe_dump({"resources": serial_and_ch340(tmp_path, shared_with=["example.com/serial"])}))
    allowed = run_cli("check-config", "--strict", "--config", str(path))
    assert (allowed.returncode, allowed.stderr) == (0, "")


async def test_serve_says_once_that_two_resources_offer_one_node(nursery, tmp_path, sockdir, caplog):
    plugin_dir = os.path.join(sockdir, "dp")
    os.mkdir(plugin_dir)
    document = {"device_plugin_dir": plugin_dir, "resources": serial_and_ch340(tmp_path)}
    os.unlink(tmp_path / "dev" / "ttyUSB0")  # not plugged in yet: nothing is shared
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(document), "c"))
        await simulator.wait_until(lambda s: "example.com/serial" in s.resources)
        shared = SHARED_TTYUSB0.format(dev=tmp_path / "dev")
        assert shared not in caplog.messages
        with logged(shared) as said:
            (tmp_path / "dev" / "ttyUSB0").touch()  # plugged in: both resources find it
            await said.wait()
        (tmp_path / "dev" / "ttyUSB2").touch()  # another change of both: nothing new to say
        await simulator.wait_until(lambda s: "ttyUSB2" in s.resources["example.com/serial"].devices)
    assert caplog.messages.count(shared) == 1


def test_scan_skips_devices_whose_host_paths_escape(tmp_path):
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "ok").touch()
    os.symlink("/etc/hostname", devices / "escape")
    resource = resource_in(devices, device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}])
    scan = gp.scan_directory(resource)
    assert [d.id for d in scan.devices] == ["ok"]
    assert scan.skipped == (
        ("escape", f"host path /etc/hostname is outside {devices}: add its directory to allowed_host_paths"),
    )
    allowed = resource_in(
        devices,
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{id}"}],
        allowed_host_paths=["/etc"],
    )
    assert [d.id for d in gp.scan_directory(allowed).devices] == ["escape", "ok"]


def test_ids_may_hold_colons_as_pci_addresses_do(tmp_path):
    # /dev/dri/by-path names: the PCI address has ":" in it. "::" would be ambiguous with replicas.
    for name in ["pci-0000:00:02.0-card", "pci-0000:00:02.0-render", "a::b", ":edge"]:
        (tmp_path / name).touch()
    resource = resource_in(tmp_path, replicas=2, cdi={"kind": "example.com/gpu"})
    scan = gp.scan_directory(resource)
    assert [d.id for d in scan.devices] == ["pci-0000:00:02.0-card", "pci-0000:00:02.0-render"]
    assert scan.skipped == (
        (":edge", "a CDI device name must begin and end with a letter or digit"),
        ("a::b", "a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'"),
    )
    answer = allocate(resource, scan.devices, "pci-0000:00:02.0-card::1", "pci-0000:00:02.0-card::0")
    [container] = answer.container_responses
    assert dict(container.envs) == {"GOPHER_DEVICES": "pci-0000:00:02.0-card"}
    assert [d.name for d in container.cdi_devices] == ["example.com/gpu=pci-0000:00:02.0-card"]
    spec = gp.cdi_spec(resource, scan.devices)
    assert [d["name"] for d in spec["devices"]] == ["pci-0000:00:02.0-card", "pci-0000:00:02.0-render"]
    assert cdi_problem(spec["cdiVersion"], spec) is None


def test_scan_skips_names_cdi_refuses(tmp_path):
    for name in ["g0", "g1-", "_g2"]:
        (tmp_path / name).touch()
    scan = gp.scan_directory(resource_in(tmp_path, cdi={"kind": "example.com/gopher"}))
    assert [d.id for d in scan.devices] == ["g0"]
    assert [name for name, _ in scan.skipped] == ["_g2", "g1-"]


def test_find_usb_devices_by_serial(tmp_path):
    sysfs = usb_tree(tmp_path)
    yubikey = gp.UsbSelector("1050", "0407")
    assert gp.find_usb_devices([yubikey], sysfs, "/host/dev") == (
        usb("12345678", "1-1.1", "1050", "0407", "12345678", "bus/usb/001/003", "hidraw0", dev="/host/dev"),
        usb("87654321", "1-1.2", "1050", "0407", "87654321", "bus/usb/001/004", "hidraw1", dev="/host/dev"),
    )
    chosen = dataclasses.replace(yubikey, serial="87654321")
    assert gp.find_usb_devices([chosen], sysfs) == (
        usb("87654321", "1-1.2", "1050", "0407", "87654321", "bus/usb/001/004", "hidraw1"),
    )
    assert gp.find_usb_devices([dataclasses.replace(yubikey, serial="8765432")], sysfs) == ()


@pytest.mark.slow
@pytest.mark.parametrize("serials", [("0001", "0001"), (None, None)])
def test_find_usb_devices_by_port_without_unique_serials(tmp_path, serials):
    sysfs = usb_tree(tmp_path, cp2102_serials=serials)
    # The hubs match too: each has its own node only, not its children's (1-1.3 holds 1-1.3.2).
    selectors = [gp.UsbSelector("10c4", "ea60"), gp.UsbSelector("05e3", "0610")]
    assert gp.find_usb_devices(selectors, sysfs) == (
        usb("1-1", "1-1", "05e3", "0610", None, "bus/usb/001/002"),
        usb("1-1.3", "1-1.3", "05e3", "0610", None, "bus/usb/001/005"),
        usb("1-1.3.2", "1-1.3.2", "10c4", "ea60", serials[1], "bus/usb/001/006", "ttyUSB1"),
        usb("1-1.4", "1-1.4", "10c4", "ea60", serials[0], "bus/usb/001/007", "ttyUSB0"),
    )


@pytest.mark.slow
def test_find_usb_devices_camera_with_several_nodes(tmp_path):
    assert gp.find_usb_devices([gp.UsbSelector("046d", "0825")], usb_tree(tmp_path)) == (
        usb("2-3", "2-3", "046d", "0825", None, "bus/usb/002/002", "input/event3", "video0"),
    )


def test_find_usb_devices_root_hubs_only_when_named(tmp_path):
    sysfs = usb_tree(tmp_path)
    everything_else = [gp.UsbSelector(*ids) for ids in [("05e3", "0610"), ("1050", "0407"), ("10c4", "ea60")]]
    assert not {d.port for d in gp.find_usb_devices(everything_else, sysfs)} & {"usb1", "usb2"}
    assert gp.find_usb_devices([gp.UsbSelector("1d6b", "0002")], sysfs) == (
        usb("0000:00:14.0", "usb1", "1d6b", "0002", "0000:00:14.0", "bus/usb/001/001"),
    )
    both = [gp.UsbSelector("1d6b", "0002"), gp.UsbSelector("1d6b", "0003")]  # one controller's serial, twice
    assert [d.id for d in gp.find_usb_devices(both, sysfs)] == ["usb1", "usb2"]


@pytest.mark.slow
@pytest.mark.parametrize("serial", ["has space", "a::b", "x" * 64, "", "1-1.1"])
def test_find_usb_devices_serial_invalid_as_id(tmp_path, serial):
    sysfs = usb_tree(tmp_path, yubikey_serial=serial)
    assert [(d.id, d.serial) for d in gp.find_usb_devices([gp.UsbSelector("1050", "0407")], sysfs)] == [
        ("1-1.2", serial),
        ("12345678", "12345678"),
    ]


@pytest.mark.slow
def test_find_usb_devices_skips_what_vanished(tmp_path):
    sysfs = usb_tree(tmp_path)
    root = Path(sysfs, "bus", "usb", "devices")
    (root / "1-1.2").resolve().joinpath("uevent").unlink()  # being unplugged
    shutil.rmtree((root / "1-1.4").resolve())  # gone, its link dangling
    (root / "1-1.3.2:1.0").resolve().joinpath("ttyUSB1", "tty", "ttyUSB1", "uevent").unlink()  # one node gone
    selectors = [gp.UsbSelector("1050", "0407"), gp.UsbSelector("10c4", "ea60")]
    # The serial that 1-1.3.2 shared with 1-1.4 is its own again: its ID.
    assert gp.find_usb_devices(selectors, sysfs) == (
        usb("0001", "1-1.3.2", "10c4", "ea60", "0001", "bus/usb/001/006"),
        usb("12345678", "1-1.1", "1050", "0407", "12345678", "bus/usb/001/003", "hidraw0"),
    )
    assert gp.find_usb_devices(selectors, str(tmp_path / "nothing")) == ()


def test_sources_usb_and_dev_root_parsed():
    shorthand = config_with(directory="/dev/serial/by-id", pattern="usb-*")
    assert shorthand.dev_root == "/dev"
    assert shorthand.resources[0].sources == (gp.Source("/dev/serial/by-id", "usb-*"),)
    several = config_with(
        match=[{"directory": "/dev", "pattern": "ttyUSB*"}, {"directory": "/dev/", "pattern": "ttyACM*"}]
    )
    assert several.resources[0].sources == (gp.Source("/dev", "ttyUSB*"), gp.Source("/dev", "ttyACM*"))
    assert several.resources[0].origin() == "/dev/ttyUSB*, /dev/ttyACM*"
    keys = config_with(top={"dev_root": "/host/dev"}, usb=[{"vendor": "1050", "product": "040A", "serial": "0042"}])
    assert keys.dev_root == "/host/dev"
    assert keys.resources[0].usb == (gp.UsbSelector("1050", "040a", "0042"),)
    assert keys.resources[0].sources == ()
    assert keys.resources[0].origin() == "USB 1050:040a '0042'"
    grouped = config_with(directory="/dev/dri/by-path", id_pattern=r"pci-(?P<id>.+)-(card|render)")
    assert grouped.resources[0].id_pattern.fullmatch("pci-0000:00:02.0-card")["id"] == "0000:00:02.0"


def test_several_sources_make_one_list(tmp_path):
    for name in ["ttyUSB0", "ttyUSB1", "ttyACM0", "ttyS0"]:
        (tmp_path / name).touch()
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "ttyUSB9").touch()
    match = [{"directory": str(tmp_path), "pattern": p} for p in ("ttyUSB*", "ttyACM*")]
    match.append({"directory": str(tmp_path / "more")})
    scan = gp.scan_directory(config_with(match=match).resources[0])
    assert [(d.id, d.path) for d in scan.devices] == [
        ("ttyACM0", f"{tmp_path}/ttyACM0"),
        ("ttyUSB0", f"{tmp_path}/ttyUSB0"),
        ("ttyUSB1", f"{tmp_path}/ttyUSB1"),
        ("ttyUSB9", f"{tmp_path}/more/ttyUSB9"),
    ]
    # The same name in two directories is one ID: one device of both (id_pattern or not).
    (tmp_path / "more" / "ttyUSB0").touch()
    [usb0] = [d for d in gp.scan_directory(config_with(match=match).resources[0]).devices if d.id == "ttyUSB0"]
    assert [m.path for m in usb0.members] == [f"{tmp_path}/more/ttyUSB0", f"{tmp_path}/ttyUSB0"]


def test_id_pattern_makes_one_device_of_its_entries(tmp_path):
    dev = str(tmp_path / "dev")
    by_path = gpu_by_path(dev)
    config = config_with(
        top={"dev_root": dev}, directory=by_path, id_pattern=GPU_ID_PATTERN, allowed_host_paths=["/dev/null"]
    )
    resource = config.resources[0]
    scan = gp.scan_directory(resource, dev_root=dev)
    assert scan.skipped == (
        ("platform-simple-framebuffer.0-card", f"id_pattern '{GPU_ID_PATTERN}' finds no ID in the name"),
    )
    [gpu] = scan.devices
    assert (gpu.id, gpu.health, gpu.path) == ("0000:00:02.0", gp.HEALTHY, f"{by_path}/pci-0000:00:02.0-card")
    names = ["pci-0000:00:02.0-card", "pci-0000:00:02.0-firmware", "pci-0000:00:02.0-render"]
    assert [m.path for m in gpu.members] == [f"{by_path}/{name}" for name in names]
    # Each node its DeviceSpec, at its stable name; the file that is no node its (read-only) mount.
    answer = allocate(resource, scan.devices, "0000:00:02.0").container_responses[0]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "0000:00:02.0"}
    assert [(d.host_path, d.container_path, d.permissions) for d in answer.devices] == [
        (os.path.realpath(f"{dev}/dri/card1"), f"{by_path}/pci-0000:00:02.0-card", "rw"),
        (os.path.realpath(f"{dev}/dri/renderD128"), f"{by_path}/pci-0000:00:02.0-render", "rw"),
    ]
    assert [(m.host_path, m.container_path, m.read_only) for m in answer.mounts] == [
        (f"{by_path}/pci-0000:00:02.0-firmware", f"{by_path}/pci-0000:00:02.0-firmware", True)
    ]
    # {name} and {target} are each member's; {id} the device's.
    templated = dataclasses.replace(
        resource,
        device_specs=(gp.DeviceSpecTemplate("{path}", "/gpu/{id}/{name}{index}"),),
        mounts=(gp.MountTemplate("{target}", "/firmware/{name}"),),
    )
    answer = allocate(templated, gp.scan_directory(templated, dev_root=dev).devices, "0000:00:02.0")
    assert sorted(d.container_path for d in answer.container_responses[0].devices) == [
        f"/gpu/0000:00:02.0/{name}0" for name in names
    ]
    assert sorted(m.container_path for m in answer.container_responses[0].mounts) == [f"/firmware/{n}" for n in names]
    # The device is unhealthy while one member is, and says which.
    os.unlink(f"{dev}/dri/renderD128")
    [gpu] = gp.scan_directory(resource, dev_root=dev).devices
    problem = f"{by_path}/pci-0000:00:02.0-render is a symlink to ../renderD128, which does not exist"
    assert (gpu.health, gpu.problem) == (gp.UNHEALTHY, problem)
    with pytest.raises(gp.RPCError, match="renderD128, which does not exist"):
        allocate(resource, [gpu], "0000:00:02.0")


def test_cdi_spec_lists_every_member(tmp_path):
    dev = str(tmp_path / "dev")
    by_path = gpu_by_path(dev)
    config = config_with(
        top={"dev_root": dev},
        directory=by_path,
        id_pattern=GPU_ID_PATTERN,
        allowed_host_paths=["/dev/null"],
        cdi={"kind": "example.com/gpu", "spec_dir": str(tmp_path / "cdi")},
    )
    resource = config.resources[0]
    devices = gp.scan_directory(resource, dev_root=dev).devices
    spec = gp.cdi_spec(resource, devices)
    [described] = spec["devices"]
    assert described["name"] == "0000:00:02.0"
    real = os.path.realpath
    assert described["containerEdits"]["deviceNodes"] == [
        {"path": f"{by_path}/pci-0000:00:02.0-card", "hostPath": real(f"{dev}/dri/card1"), "permissions": "rw"}
        | host_mode(f"{dev}/dri/card1"),
        {"path": f"{by_path}/pci-0000:00:02.0-render", "hostPath": real(f"{dev}/dri/renderD128"), "permissions": "rw"}
        | host_mode(f"{dev}/dri/renderD128"),
    ]
    firmware = f"{by_path}/pci-0000:00:02.0-firmware"
    assert described["containerEdits"]["mounts"] == [
        {"hostPath": firmware, "containerPath": firmware, "options": ["bind", "ro"]}
    ]
    assert cdi_problem(spec["cdiVersion"], spec) is None
    answer = allocate(resource, devices, "0000:00:02.0").container_responses[0]
    assert [d.name for d in answer.cdi_devices] == ["example.com/gpu=0000:00:02.0"]


def test_a_device_is_examined_again_member_by_member(tmp_path):
    dev = str(tmp_path / "dev")
    by_path = gpu_by_path(dev)
    resource = config_with(
        top={"dev_root": dev}, directory=by_path, id_pattern=GPU_ID_PATTERN, allowed_host_paths=["/dev/null"]
    ).resources[0]
    [gpu] = gp.scan_directory(resource, dev_root=dev).devices
    roots = gp.host_path_roots(resource, dev)
    assert gp.examine_again(resource, gpu, roots, "/sys") == gpu
    os.unlink(f"{by_path}/pci-0000:00:02.0-firmware")  # a member gone: the device is what is left
    assert [m.path for m in gp.examine_again(resource, gpu, roots, "/sys").members] == [
        f"{by_path}/pci-0000:00:02.0-card",
        f"{by_path}/pci-0000:00:02.0-render",
    ]
    os.unlink(f"{by_path}/pci-0000:00:02.0-card")
    os.symlink("/etc/hostname", f"{by_path}/pci-0000:00:02.0-card")  # re-pointed out of bounds
    assert "host path /etc/hostname is outside" in gp.examine_again(resource, gpu, roots, "/sys")
    for name in os.listdir(by_path):
        os.unlink(f"{by_path}/{name}")
    assert gp.examine_again(resource, gpu, roots, "/sys") is None


def test_examining_with_directories_resolved_once_finds_what_realpath_finds(tmp_path):
    # Allocate resolves each directory once and an entry that is no symlink as that and its name:
    # the same host paths as a realpath() of each entry, through a symlinked directory, a symlinked
    # entry and a plain one, and a directory re-pointed between two calls is met at the second.
    for place in ("a", "b", "elsewhere"):
        (tmp_path / place).mkdir()
    for name in ("g0", "g1"):
        (tmp_path / "a" / name).write_text("")
        (tmp_path / "b" / name).write_text("")
    (tmp_path / "elsewhere" / "g9").write_text("")
    os.symlink(tmp_path / "a", tmp_path / "devices")
    os.symlink(tmp_path / "elsewhere" / "g9", tmp_path / "a" / "g2")
    resource = config_with(
        directory=str(tmp_path / "devices"),
        device_specs=[{"host_path": "{path}", "container_path": "/dev/{name}"}],
        allowed_host_paths=[str(tmp_path / "elsewhere")],
    ).resources[0]
    devices = {device.id: device for device in gp.scan_directory(resource).devices}
    assert sorted(devices) == ["g0", "g1", "g2"]

    def both_ways():
        directories: dict[str, str] = {}
        roots = gp.host_path_roots(resource, directories=directories)
        once = {i: gp.examine_again(resource, device, roots, "/sys", directories) for i, device in devices.items()}
        assert directories == {str(tmp_path / "devices"): os.path.realpath(tmp_path / "devices")}
        each = {
            i: gp.examine_again(resource, device, gp.host_path_roots(resource), "/sys") for i, device in devices.items()
        }
        assert once == each
        return {i: found and [spec.host_path for spec in found.device_specs] for i, found in once.items()}

    assert both_ways() == {
        "g0": [str(tmp_path / "a" / "g0")],
        "g1": [str(tmp_path / "a" / "g1")],
        "g2": [str(tmp_path / "elsewhere" / "g9")],
    }
    os.unlink(tmp_path / "devices")
    os.symlink(tmp_path / "b", tmp_path / "devices")  # re-pointed: b has g0 and g1, no g2
    assert both_ways() == {"g0": [str(tmp_path / "b" / "g0")], "g1": [str(tmp_path / "b" / "g1")], "g2": None}


def test_usb_devices_are_devices_of_their_nodes(tmp_path):
    sysfs = usb_tree(tmp_path)
    dev = str(tmp_path / "dev")
    usb_nodes(dev, "bus/usb/001/003", "hidraw0", "bus/usb/001/004")  # the second key's hidraw1: not yet
    config = config_with(
        top={"dev_root": dev, "sysfs_root": sysfs},
        usb=[{"vendor": "1050", "product": "0407"}],
        allowed_host_paths=["/dev/null"],
    )
    resource = config.resources[0]
    scan = gp.scan_directory(resource, sysfs, dev)
    assert [(d.id, [m.path for m in d.members] or [d.path]) for d in scan.devices] == [
        ("12345678", [f"{dev}/bus/usb/001/003", f"{dev}/hidraw0"]),
        ("87654321", [f"{dev}/bus/usb/001/004"]),
    ]
    answer = allocate(resource, scan.devices, "12345678").container_responses[0]
    assert [d.container_path for d in answer.devices] == [f"{dev}/bus/usb/001/003", f"{dev}/hidraw0"]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "12345678"}


def test_allocate_env_in_request_order_and_templated_device_specs(gophers):
    resource = resource_in(
        gophers,
        env="G",
        device_specs=[{"host_path": "/dev/{id}", "container_path": "/dev/gopher{index}"}],
        allowed_host_paths=["/dev"],
    )
    answer = allocate(resource, gp.scan_directory(resource).devices, "g3", "g1").container_responses[0]
    assert dict(answer.envs) == {"G": "g3,g1"}
    assert [(s.host_path, s.container_path, s.permissions) for s in answer.devices] == [
        ("/dev/g3", "/dev/gopher0", "rw"),
        ("/dev/g1", "/dev/gopher1", "rw"),
    ]
    assert not answer.mounts and not answer.annotations and not answer.cdi_devices


def test_allocate_passes_device_nodes_through_when_no_templates(tmp_path):
    os.symlink("/dev/null", tmp_path / "null")
    (tmp_path / "plain").touch()
    resource = resource_in(tmp_path, allowed_host_paths=["/dev"])
    answer = allocate(resource, gp.scan_directory(resource).devices, "plain", "null").container_responses[0]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "plain,null"}
    # The runtime gets the node itself; the container finds it under the entry's stable name.
    assert [(s.host_path, s.container_path, s.permissions) for s in answer.devices] == [
        ("/dev/null", f"{tmp_path}/null", "rw")
    ]


def test_allocate_refuses_unknown_ids_naming_them(gophers):
    resource = resource_in(gophers)
    devices = gp.scan_directory(resource).devices
    with pytest.raises(gp.RPCError) as info:
        allocate(resource, devices, "g1", "g12", "zz", "g12")
    assert info.value.code == StatusCode.INVALID_ARGUMENT
    assert info.value.message == "unknown example.com/gopher device IDs: g12, zz"
    with pytest.raises(gp.RPCError, match="AllocateRequest has no container requests"):
        gp.allocate_response(resource, {}, v1beta1.AllocateRequest())


def test_allocate_refuses_an_unhealthy_device(tmp_path):
    os.symlink(tmp_path / "gone", tmp_path / "g0")
    resource = resource_in(tmp_path)
    with pytest.raises(gp.RPCError) as info:
        allocate(resource, gp.scan_directory(resource).devices, "g0")
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    assert info.value.message == (
        f"example.com/gopher device g0: {tmp_path}/g0 is a symlink to {tmp_path}/gone, which does not exist"
    )


def test_allocate_maps_replicas_to_their_device_once(gophers):
    resource = resource_in(
        gophers,
        replicas=3,
        device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher{index}"}],
        mounts=[
            {"host_path": str(gophers), "container_path": "/gophers"},  # the same for every device: once
            {"host_path": "{path}", "container_path": "/run/{id}", "read_only": False},
        ],
        annotations={"example.com/gophers": "{id}", "example.com/gopher-{index}": "{path}", "example.com/t": "x"},
    )
    answer = allocate(resource, gp.scan_directory(resource).devices, "g2::1", "g0::0", "g2::2").container_responses[0]
    assert dict(answer.envs) == {"GOPHER_DEVICES": "g2,g0"}
    assert [(s.host_path, s.container_path) for s in answer.devices] == [
        (f"{gophers}/g2", "/dev/gopher0"),
        (f"{gophers}/g0", "/dev/gopher1"),
    ]
    assert [(m.host_path, m.container_path, m.read_only) for m in answer.mounts] == [
        (str(gophers), "/gophers", True),
        (f"{gophers}/g2", "/run/g2", False),
        (f"{gophers}/g0", "/run/g0", False),
    ]
    assert dict(answer.annotations) == {
        "example.com/gophers": "g2,g0",
        "example.com/gopher-0": f"{gophers}/g2",
        "example.com/gopher-1": f"{gophers}/g0",
        "example.com/t": "x",
    }
    for bad in ["g2", "g2::3", "g2::01", "g2::", "::1", "g9::0"]:
        with pytest.raises(gp.RPCError, match=r"unknown example\.com/gopher device IDs"):
            allocate(resource, gp.scan_directory(resource).devices, bad)


def test_allocate_refuses_clashing_container_paths(gophers):
    resource = resource_in(gophers, device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher"}])
    devices = gp.scan_directory(resource).devices
    assert len(allocate(resource, devices, "g1").container_responses[0].devices) == 1
    with pytest.raises(gp.RPCError) as info:
        allocate(resource, devices, "g1", "g2")
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    assert info.value.message == (
        f"two devices for container path /dev/gopher, from {gophers}/g1 and {gophers}/g2: "
        "put {id} or {index} in the container path"
    )


def test_allocate_names_cdi_devices(gophers):
    resource = resource_in(gophers, cdi={"kind": "example.com/gopher"})
    answer = allocate(resource, gp.scan_directory(resource).devices, "g1", "g0").container_responses[0]
    assert [d.name for d in answer.cdi_devices] == ["example.com/gopher=g1", "example.com/gopher=g0"]


def test_cdi_spec(tmp_path):
    os.symlink("/dev/null", tmp_path / "null")
    (tmp_path / "plain").touch()
    resource = resource_in(
        tmp_path,
        cdi={"kind": "example.com/gopher"},
        mounts=[{"host_path": "{path}", "container_path": "/run/{id}"}],
        allowed_host_paths=["/dev"],
    )
    assert gp.cdi_spec(resource, gp.scan_directory(resource).devices) == {
        "cdiVersion": "0.5.0",
        "kind": "example.com/gopher",
        "devices": [
            {
                "name": "null",
                "containerEdits": {
                    "env": ["GOPHER_DEVICES_NULL=null"],
                    "deviceNodes": [
                        {"path": f"{tmp_path}/null", "hostPath": "/dev/null", "permissions": "rw"}
                        | host_mode("/dev/null")
                    ],
                    "mounts": [{"hostPath": "/dev/null", "containerPath": "/run/null", "options": ["bind", "ro"]}],
                },
            },
            {
                "name": "plain",
                "containerEdits": {
                    "env": ["GOPHER_DEVICES_PLAIN=plain"],
                    "mounts": [
                        {"hostPath": f"{tmp_path}/plain", "containerPath": "/run/plain", "options": ["bind", "ro"]}
                    ],
                },
            },
        ],
    }
    assert gp.cdi_spec(resource, ()) is None


def test_cdi_spec_gives_a_node_the_host_mode_and_owner(tmp_path):
    """A node udev keeps at 0660 root:dialout must not become 0666 root:root in the consumer, as it
    does when the spec says nothing: the runtime makes it from the spec alone (CDI fills in its type
    and numbers from the host, not its mode or owner), where a DeviceSpec gets the host node's."""
    if os.geteuid() != 0:
        pytest.skip("mknod and chown need root")
    devices, targets = tmp_path / "devices", tmp_path / "targets"
    devices.mkdir()
    targets.mkdir()
    os.mknod(devices / "ttyS0", stat.S_IFCHR | 0o600, os.makedev(4, 64))
    os.chmod(devices / "ttyS0", 0o660)  # (mknod's mode passes through the umask)
    os.chown(devices / "ttyS0", 1234, 5678)
    os.mknod(targets / "renderD128", stat.S_IFCHR | 0o600, os.makedev(226, 128))
    os.chmod(targets / "renderD128", 0o640)
    os.chown(targets / "renderD128", 0, 4321)
    os.symlink(targets / "renderD128", devices / "render")  # a symlink: its target's mode and owner
    cdi = gp.CDIConfig("example.com/gopher", str(tmp_path / "cdi"))
    resource = resource_in(devices, cdi={"kind": cdi.kind}, allowed_host_paths=[str(targets)])
    gp.write_cdi_spec(cdi, gp.cdi_spec(resource, gp.scan_directory(resource).devices))
    spec = read_spec(cdi.spec_file)
    nodes = {device["name"]: device["containerEdits"]["deviceNodes"] for device in spec["devices"]}
    assert nodes == {
        "render": [
            {"path": f"{devices}/render", "hostPath": f"{targets}/renderD128", "permissions": "rw"}
            | {"fileMode": 0o640, "uid": 0, "gid": 4321}
        ],
        "ttyS0": [
            {"path": f"{devices}/ttyS0", "hostPath": f"{devices}/ttyS0", "permissions": "rw"}
            | {"fileMode": 0o660, "uid": 1234, "gid": 5678}
        ],
    }
    # Fields of CDI 0.3.0, the earliest: the version stays what hostPath needs.
    assert spec["cdiVersion"] == "0.5.0" and cdi_problem("0.5.0", spec) is None
    # The DeviceSpecs of Allocate are as before: the runtime reads the host node itself.
    answer = allocate(resource, gp.scan_directory(resource).devices, "ttyS0").container_responses[0]
    assert [(d.host_path, d.container_path, d.permissions) for d in answer.devices] == [
        (f"{devices}/ttyS0", f"{devices}/ttyS0", "rw")
    ]


@pytest.mark.parametrize(
    ("names", "fields", "version"),
    [
        (["plain"], {"mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}]}, "0.3.0"),
        (["0plain"], {"mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}]}, "0.5.0"),
        (["null"], {"allowed_host_paths": ["/dev"]}, "0.5.0"),  # a device node: its hostPath
        (
            ["plain"],
            {"cdi": {"kind": "example.com/gpu.v2"}, "mounts": [{"host_path": "{path}", "container_path": "/run/{id}"}]},
            "0.6.0",
        ),
    ],
)
def test_cdi_spec_declares_the_lowest_version_its_features_need(tmp_path, names, fields, version):
    for name in names:
        if name == "null":
            os.symlink("/dev/null", tmp_path / name)
        else:
            (tmp_path / name).touch()
    resource = resource_in(tmp_path, **{"cdi": {"kind": "example.com/gopher"}, **fields})
    spec = gp.cdi_spec(resource, gp.scan_directory(resource).devices)
    assert spec["cdiVersion"] == version
    assert json.loads(json.dumps(spec)) == spec  # what the file holds
    for library in CDI_ADDED:  # a library that knows up to this version: accepts from `version` on
        assert (cdi_problem(library, spec) is None) == (library >= version), (library, cdi_problem(library, spec))


@pytest.mark.parametrize(
    ("available", "must_include", "size", "expected"),
    [
        (["g10", "g2", "g1"], [], 2, ["g1", "g2"]),
        (["g10", "g2", "g1"], ["g10"], 2, ["g10", "g1"]),
        (["g1", "g2"], ["g2", "g2"], 1, ["g2"]),
        (["g1", "g2"], [], 5, ["g1", "g2"]),
        (["g1"], ["g9"], 1, ["g1"]),  # never a device the kubelet did not offer
        (["g1", "g01", "g001"], [], 3, ["g001", "g01", "g1"]),  # equal as numbers: string order, every run
        ([], [], 0, []),
    ],
)
def test_preferred_allocation(tmp_path, available, must_include, size, expected):
    assert preferred(resource_in(tmp_path), (), available, must_include, size) == expected


@pytest.mark.parametrize(
    ("kubelet_id", "device"),
    [
        ("g0::1", "g0"),
        ("g0::2", None),  # two replicas: ::0 and ::1
        ("g0::01", None),
        ("g0::²", None),  # isdigit() accepts it, int() fails on it
        ("g0", None),
        ("g0::1::1", "g0::1"),
        ("::0", ""),
    ],
)
def test_underlying_id(kubelet_id, device):
    resource = resource_in("/g", replicas=2)
    assert resource.underlying_id(kubelet_id) == device
    assert resource.underlying_ids([kubelet_id, "g1::0"]) == [device, "g1"]


REPLICAS = ["g0::0", "g0::1", "g1::0", "g1::1", "g2::0", "g2::1"]


@pytest.mark.parametrize(
    ("policy", "available", "must_include", "size", "expected"),
    [
        ("packed", REPLICAS, [], 3, ["g0::0", "g0::1", "g1::0"]),
        ("packed", REPLICAS, ["g1::1"], 2, ["g1::1", "g1::0"]),
        ("packed", ["g0::0", "g1::0", "g1::1"], [], 2, ["g0::0", "g1::0"]),
        ("spread", REPLICAS, [], 3, ["g0::0", "g1::0", "g2::0"]),
        ("spread", REPLICAS, ["g1::1"], 3, ["g1::1", "g0::0", "g2::0"]),
        ("spread", REPLICAS, [], 4, ["g0::0", "g1::0", "g2::0", "g0::1"]),
    ],
)
def test_preferred_allocation_packs_or_spreads_replicas(gophers, policy, available, must_include, size, expected):
    resource = resource_in(gophers, replicas=2, preferred=policy)
    devices = gp.scan_directory(resource).devices
    assert preferred(resource, devices, available, must_include, size) == expected


@pytest.mark.parametrize(
    ("available", "must_include", "size", "expected"),
    [
        (["null", "zero", "full", "rand"], [], 2, ["full", "rand"]),  # node 1 offers the most: stay there
        (["null", "zero", "full", "rand"], ["zero"], 2, ["zero", "full"]),
        (["null", "zero", "full", "rand"], ["null"], 2, ["null", "full"]),  # node 0 is full: then natural order
        (["null", "zero", "full"], [], 3, ["full", "zero", "null"]),  # node 1 first, then the rest
    ],
)
def test_preferred_allocation_keeps_to_one_numa_node(tmp_path, available, must_include, size, expected):
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, target in [("null", "/dev/null"), ("zero", "/dev/zero"), ("full", "/dev/full"), ("rand", "/dev/random")]:
        os.symlink(target, devices / name)
    sysfs = fake_sysfs(tmp_path / "sys", {(1, 3): 0, (1, 5): 1, (1, 7): 1, (1, 8): 1})
    resource = resource_in(devices, allowed_host_paths=["/dev"])
    assert preferred(resource, gp.scan_directory(resource, sysfs).devices, available, must_include, size) == expected


# Properties of the pure core, over generated inputs (hypothesis)

YAML_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)


YAML_DATA = st.recursive(
    YAML_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)


RESOURCE_KEYS = sorted(gp._RESOURCE_KEYS)


CONFIG_LIKE = st.fixed_dictionaries(
    {"resources": st.lists(st.dictionaries(st.sampled_from(RESOURCE_KEYS), YAML_DATA, max_size=6), max_size=3)},
    optional={"device_plugin_dir": YAML_DATA, "sysfs_root": YAML_DATA},
)


@pytest.mark.slow
@PROPERTIES
@given(st.one_of(YAML_DATA, CONFIG_LIKE))
def test_parse_config_raises_only_config_errors(data):
    try:
        config = gp.parse_config(yaml.safe_dump(data), "cfg.yaml")
    except gp.ConfigError as error:
        assert str(error).startswith("cfg.yaml: ") and "\n" not in str(error).strip()
    else:
        assert config.resources and all(gp.resource_name_problem(r.name) is None for r in config.resources)


@pytest.mark.slow
@PROPERTIES
@given(st.text(max_size=200))
def test_parse_config_of_any_text_raises_only_config_errors(text):
    try:
        gp.parse_config(text, "cfg.yaml")
    except gp.ConfigError:
        pass


DEVICE_IDS = st.sampled_from([f"g{i}" for i in range(8)])


REPLICA_IDS = st.builds(lambda device, n: f"{device}::{n}", DEVICE_IDS, st.integers(0, 3))


KUBELET_IDS = st.one_of(DEVICE_IDS, REPLICA_IDS, st.text(max_size=8))


@pytest.mark.slow
@PROPERTIES
@given(
    present=st.sets(DEVICE_IDS),
    replicas=st.integers(1, 3),
    requested=st.lists(KUBELET_IDS, max_size=10),
)
def test_allocate_answers_only_with_requested_devices(present, replicas, requested):
    resource = resource_in("/g", replicas=replicas)
    devices = {i: gp.DeviceEntry(i, f"/g/{i}") for i in present}
    request = v1beta1.AllocateRequest(container_requests=[v1beta1.ContainerAllocateRequest(devices_ids=requested)])
    try:
        answer = gp.allocate_response(resource, devices, request).container_responses[0]
    except gp.RPCError as error:
        assert error.code == StatusCode.INVALID_ARGUMENT
        return
    given_ids = [i for i in answer.envs[resource.env].split(",") if i]
    assert given_ids == list(dict.fromkeys(resource.underlying_id(i) for i in requested))
    assert set(given_ids) <= present


@pytest.mark.slow
@PROPERTIES
@given(
    numa=st.dictionaries(DEVICE_IDS, st.integers(0, 2) | st.none()),
    replicas=st.integers(1, 3),
    policy=st.sampled_from(["packed", "spread"]),
    available=st.lists(KUBELET_IDS, max_size=12),
    must_include=st.lists(KUBELET_IDS, max_size=4),
    size=st.integers(0, 2**31 - 1),
)
def test_preferred_allocation_picks_only_offered_ids(numa, replicas, policy, available, must_include, size):
    resource = resource_in("/g", replicas=replicas, preferred=policy)
    devices = [gp.DeviceEntry(i, f"/g/{i}", numa_node=node) for i, node in numa.items()]
    picked = preferred(resource, devices, available, must_include, size)
    again = preferred(resource, devices, available, must_include, size)
    assert picked == again, "deterministic"
    assert set(picked) <= set(available) and len(picked) == len(set(picked))
    kept = [i for i in dict.fromkeys(must_include) if i in available]  # the kubelet needs them all
    assert picked[: len(kept)] == kept
    assert len(picked) == max(len(kept), min(size, len(set(available))))


def natural_key_before(device_id):
    """gopherplug's _natural_key before it became a flat list: the reference for natural order."""
    return [
        (0, int(part), "") if part[0] in "0123456789" else (1, 0, part)
        for part in re.split(r"([0-9]+)", device_id)
        if part
    ]


def pick_one_at_a_time(resource, devices, available, chosen, size):
    """gopherplug's _pick before it became one sort: the rule done literally, each pick the smallest
    of all remaining candidates. O(size x candidates); the reference for _pick. One change: IDs with
    equal natural keys ("g01", "g1") in string order, where this left them in set order, which
    varies with the hash seed from one run to the next."""
    device_of = {kubelet_id: resource.underlying_id(kubelet_id) for kubelet_id in available}
    numa_of = {
        kubelet_id: (entry.numa_node if (entry := devices.get(device or "")) is not None else None)
        for kubelet_id, device in device_of.items()
    }
    candidates = sorted(set(available) - set(chosen), key=lambda i: (natural_key_before(i), i))
    nodes = {node for kubelet_id in chosen if (node := numa_of[kubelet_id]) is not None}
    if not nodes:
        counts = collections.Counter(node for i in candidates if (node := numa_of[i]) is not None)
        nodes = set(sorted(counts, key=lambda node: (-counts[node], node))[:1])
    used = collections.Counter(device_of[kubelet_id] for kubelet_id in chosen)
    sign = -1 if resource.preferred == "packed" else 1
    while len(chosen) < size and candidates:

        def rank(kubelet_id):
            node_rank = 0 if not nodes or numa_of[kubelet_id] in nodes else 1
            return node_rank, sign * used[device_of[kubelet_id]]

        best = min(range(len(candidates)), key=lambda i: rank(candidates[i]))
        kubelet_id = candidates.pop(best)
        chosen.append(kubelet_id)
        used[device_of[kubelet_id]] += 1
        if (node := numa_of[kubelet_id]) is not None:
            nodes.add(node)
    return chosen


# Numbers as the kubelet may write them: leading zeros, and beyond 64 bits.
NUMBERS = st.integers(0, 30).map(str) | st.sampled_from(["00", "01", "007", "9" * 25])


# Lists of IDs of one shape (the fast path of _natural_sorted).
SHAPED_ID_LISTS = st.sampled_from(["g{}", "g{}::{}", "{}", "{}.{}-x"]).flatmap(
    lambda shape: st.lists(st.builds(shape.format, *[NUMBERS] * shape.count("{}")), max_size=30)
)


# Lists of IDs of a few shapes, as from a directory with two naming schemes, and of any shapes.
MIXED_ID_LISTS = st.lists(
    NUMBERS.map("gpu{}".format) | st.builds("gpu{}x{}".format, NUMBERS, NUMBERS) | NUMBERS.map("nvme{}".format),
    max_size=30,
)


ANY_ID_LISTS = st.lists(NUMBERS.map("g{}".format) | NUMBERS.map("g{}::1".format) | st.text(max_size=6), max_size=30)


@pytest.mark.slow
@PROPERTIES
@given(st.one_of(SHAPED_ID_LISTS, MIXED_ID_LISTS, ANY_ID_LISTS))
def test_natural_order_is_unchanged(ids):
    ids = list(dict.fromkeys(ids))

    def compare(key, a, b):
        return (key(a) > key(b)) - (key(a) < key(b))

    for a, b in itertools.pairwise(ids):
        assert compare(gp._natural_key, a, b) == compare(natural_key_before, a, b), (a, b)
    expected = sorted(ids, key=lambda i: (natural_key_before(i), i))
    assert gp._natural_sorted(ids) == expected
    assert gp._natural_sorted(ids[::-1]) == expected, "whatever order they come in"


DEVICE_NAMES = [f"g{i}" for i in range(8)] + ["g01", "g1::1", "x"]  # "g1::1": a device whose replicas look nested


@st.composite
def pick_inputs(draw):
    """A resource, its devices, and a request to _pick: a shuffled part of the devices' IDs, and a
    few more, of replicas out of range, of missing devices, or any text."""
    replicas = draw(st.integers(1, 4))
    resource = resource_in("/g", replicas=replicas, preferred=draw(st.sampled_from(["packed", "spread"])))
    topology = st.sampled_from([1, 0, 2, None]) if draw(st.booleans()) else st.none()
    missing = draw(st.sets(st.sampled_from(DEVICE_NAMES)))
    devices = {i: gp.DeviceEntry(i, f"/g/{i}", numa_node=draw(topology)) for i in DEVICE_NAMES if i not in missing}
    real = draw(st.permutations([kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]))
    other = st.builds("{}::{}".format, st.sampled_from(DEVICE_NAMES), NUMBERS) | st.text(max_size=6)
    available = list(dict.fromkeys(real[: draw(st.integers(0, len(real)))] + draw(st.lists(other, max_size=4))))
    must_include = draw(st.lists(st.sampled_from(available) | other if available else other, max_size=6))
    chosen = list(dict.fromkeys(i for i in must_include if i in available))
    return resource, devices, available, chosen, draw(st.integers(0, len(available) + 2))


@pytest.mark.slow
@PROPERTIES
@given(pick_inputs())
def test_preferred_allocation_picks_as_one_at_a_time(inputs):
    resource, devices, available, chosen, size = inputs
    expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
    assert gp._pick(resource, devices, available, list(chosen), size) == expected


def _container_request(available, must_include, size):
    return v1beta1.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
    )


@pytest.mark.slow
@PROPERTIES
@given(pick_inputs(), st.booleans())
def test_preferred_order_answers_as_one_at_a_time_or_not_at_all(inputs, listed_only):
    """_PreferredOrder, the service's precomputed answer: where it answers, it is the rule's pick;
    where it cannot (several NUMA nodes, spread replicas, an ID not listed), it says None."""
    resource, devices, available, chosen, size = inputs
    if listed_only:  # the usual request: only IDs the plugin lists, so that the order may answer
        listed = {i for d in devices for i in resource.replica_ids(d)}
        available, chosen = [i for i in available if i in listed], [i for i in chosen if i in listed]
        size = min(size, len(available) + 2)
    expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
    fast = gp._PreferredOrder(resource, devices).answer(_container_request(available, chosen, size))
    assert fast is None or fast == expected


@pytest.mark.slow
@PROPERTIES
@given(pick_inputs(), st.booleans())
def test_preferred_allocation_as_served_picks_as_one_at_a_time(inputs, listed_only):
    """What the service answers: the request read with bytes IDs (_PreferredAllocationWire), the
    device set's _PreferredOrder kept; from the order or from _pick, the rule's pick."""
    resource, devices, available, chosen, size = inputs
    if listed_only:
        listed = {i for d in devices for i in resource.replica_ids(d)}
        available, chosen = [i for i in available if i in listed], [i for i in chosen if i in listed]
    expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
    request = gp._PreferredAllocationWire()
    request.container_requests.add(
        available_deviceIDs=[i.encode() for i in available],
        must_include_deviceIDs=[i.encode() for i in chosen],
        allocation_size=size,
    )
    order = gp._PreferredOrder(resource, devices)
    answer = gp.preferred_allocation_response(resource, devices, request, order=order)
    assert list(answer.container_responses[0].deviceIDs) == expected


def test_preferred_order_leaves_ids_that_are_no_utf8_to_pick():
    """A sysfs name with bytes that are no UTF-8 (kept as surrogate escapes) has no wire form: no
    order then, and _pick answers (such an ID cannot reach the kubelet, but the others can)."""
    resource = resource_in("/g")
    devices = {i: gp.DeviceEntry(i, f"/g/{i}") for i in ("g1", "g2", "g\udcff")}
    order = gp._PreferredOrder(resource, devices)
    assert order.order is None and order.answer(_container_request(["g2", "g1"], [], 1)) is None
    assert preferred(resource, devices.values(), ["g2", "g1"], [], 1) == ["g1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("replicas", "policy", "nodes", "must_include", "answers"),
    [
        (1, "packed", [None], 0, True),  # plain devices, no topology: the usual large resource
        (1, "spread", [None], 3, True),
        (1, "packed", [1], 3, True),  # every device on one NUMA node
        (4, "packed", [0], 0, True),  # packed replicas, nothing to include
        (4, "packed", [0], 3, False),  # the chosen devices' replicas come first: _pick
        (4, "spread", [None], 0, False),  # round robin over the devices: _pick
        (1, "packed", [0, 1], 0, False),  # the node offering the most fills first: _pick
    ],
)
def test_preferred_allocation_from_the_order_where_it_applies(replicas, policy, nodes, must_include, answers):
    """Which requests the order answers, on 2,000 devices with the kubelet's shuffled IDs; the
    answer, from the order or not, is the rule's (_pick, itself checked against the literal rule)."""
    rng = random.Random(replicas)
    resource = resource_in("/g", replicas=replicas, preferred=policy)
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=nodes[i % len(nodes)]) for i in range(2000)}
    ids = [kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]
    available = rng.sample(ids, len(ids) * 3 // 4)  # a quarter allocated already
    must = rng.sample(available, must_include)
    order = gp._PreferredOrder(resource, devices)
    for size in (must_include + 1, must_include + 2, 500, len(available)):
        fast = order.answer(_container_request(available, must, size))
        assert (fast is not None) == answers
        expected = gp._pick(resource, devices, dict.fromkeys(available), must, size)
        assert (expected if fast is None else fast) == expected
    # An ID the plugin does not list (a device gone since the kubelet's last list): the rule ranks it.
    assert order.answer(_container_request([*available, "g99999"], must, 3)) is None
    # An ID offered twice (the kubelet never does): one candidate, as _pick counts it.
    twice = [*available, available[-1]]
    assert order.answer(_container_request(twice, must, len(available))) is None
    request = v1beta1.PreferredAllocationRequest(container_requests=[_container_request(twice, must, len(available))])
    answer = gp.preferred_allocation_response(resource, devices, request, order=order).container_responses[0]
    assert list(answer.deviceIDs) == gp._pick(resource, devices, dict.fromkeys(available), must, len(available))


@pytest.mark.parametrize("policy", ["packed", "spread"])
@pytest.mark.parametrize("seed", range(4))
def test_preferred_allocation_picks_as_one_at_a_time_at_scale(policy, seed):
    """Hundreds of IDs on three NUMA nodes, some without: nodes fill up and new ones join."""
    rng = random.Random(seed)
    resource = resource_in("/g", replicas=3, preferred=policy)
    nodes = [2, 2, 2, 1, 1, 0, None]  # node 2 offers the most, not node 0
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=rng.choice(nodes)) for i in range(150)}
    ids = [kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]
    available = [*rng.sample(ids, 300), "g999::0", "g1::7", "junk"]
    chosen = rng.sample(available, rng.choice([0, 1, 5]))
    for size in (1, 50, 200, len(available)):
        expected = pick_one_at_a_time(resource, devices, available, list(chosen), size)
        assert gp._pick(resource, devices, available, list(chosen), size) == expected


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["packed", "spread"])
def test_preferred_allocation_of_50000_ids_is_quick(policy):
    """One pick at a time over every candidate took minutes for this; one sort takes milliseconds."""
    resource = resource_in("/g", replicas=4, preferred=policy)
    devices = {f"g{i}": gp.DeviceEntry(f"g{i}", f"/g/g{i}", numa_node=i % 2) for i in range(12_500)}
    ids = [kubelet_id for device in devices for kubelet_id in resource.replica_ids(device)]
    random.Random(0).shuffle(ids)
    started = time.perf_counter()
    picked = preferred(resource, devices.values(), ids, ids[:10], len(ids))
    assert time.perf_counter() - started < 1.0  # about 0.05 s on a CI machine
    assert sorted(picked) == sorted(ids) and picked[:10] == ids[:10]
