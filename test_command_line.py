"""The command line, as a real subprocess where signals and exit codes matter."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio
import trio.socket
import trio.testing
import yaml

import gopherplug as gp
import gopherplug_standins as standins
from gopherplug import v1beta1
from testsupport import (
    DRIVER,
    ERROR,
    GPU_ID_PATTERN,
    HERE,
    RESOURCE,
    TIMEOUT,
    StderrLines,
    deleted_message,
    devices_of,
    dra_config,
    fake_sysfs,
    gpu_by_path,
    gpu_tree,
    hailo_config,
    helm_template,
    listed,
    logged,
    purerpc,
    read_until,
    reaped,
    run_cli,
    run_cli_async,
    start,
    usb_nodes,
    usb_tree,
    without_dac_override,
    write_config,
)

# ------------------------------------------------------------------------------------------------
# The command line, as a real subprocess where signals and exit codes matter
# ------------------------------------------------------------------------------------------------


def narrated_demo(sockdir, *options):
    """`gopherplug demo` with its temporary directory in ``sockdir``: who spoke, in order, and what
    was said, a line each (the times left out)."""
    result = run_cli("demo", *options, env={"TMPDIR": str(sockdir)})
    assert (result.returncode, result.stderr) == (0, "")
    steps = [line.split(None, 3)[2:] for line in result.stdout.splitlines()[1:]]
    return " ".join(who for who, _ in steps), "\n".join(what for _, what in steps)


@pytest.mark.slow
def test_demo_narrates_the_protocol_and_leaves_nothing_behind(sockdir):
    who, said = narrated_demo(sockdir)
    assert who == (
        "kubelet plugin plugin kubelet plugin kubelet plugin kubelet plugin plugin plugin who who who demo "
        "plugin kubelet demo kubelet kubelet kubelet plugin kubelet plugin kubelet demo demo"
    )
    assert (
        "who example.com/gopher gopher0 gopher0: Healthy: default/demo-pod/app (device plugin)\n"
        "who example.com/gopher gopher1 gopher1: Healthy: default/demo-pod/app (device plugin)\n"
        "who example.com/gopher gopher2 gopher2: Healthy: free\n"
    ).replace("who ", "") in said
    assert "Register(resource example.com/gopher, endpoint gopherplug-example.com_gopher-1.sock" in said
    assert "ListAndWatch example.com/gopher: gopher0 Healthy, gopher1 Healthy, gopher2 Healthy\n" in said
    assert "GetPreferredAllocation(size 2 of gopher0, gopher1, gopher2): gopher0, gopher1\n" in said
    assert "Allocate(gopher0, gopher1)\ndevice /" in said and "\nenv GOPHER_DEVICES=gopher0,gopher1\n" in said
    assert re.search(r"\ndevice /\S+/gophers/gopher1 -> /dev/gopher1 \(rw\)\n", said)
    assert "gopher2 Healthy, gopher3 Healthy\nexample.com/gopher: capacity 4, allocatable 4\nthe kubelet had" in said
    assert "restarted: every socket in its directory deleted, kubelet.sock served again\nRegister(resource " in said
    assert "endpoint gopherplug-example.com_gopher-2.sock" in said and "registered again, listed: " in said
    assert os.listdir(sockdir) == []
    times = _narration_times(run_cli("demo", env={"TMPDIR": str(sockdir)}).stdout.splitlines())
    assert len(times) > 10 and times == sorted(times), times


def test_demo_in_a_tmpdir_too_long_for_its_sockets_says_to_shorten_it(tmp_path):
    """bind() refuses a unix socket path over 107 bytes: that was "a bug in gopherplug, please report it"."""
    long = tmp_path / ("x" * 120)
    long.mkdir()
    result = run_cli("demo", env={"TMPDIR": str(long)})
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert f"ERROR TMPDIR {long} is too long for the demo's unix sockets (107 bytes at most): set TMPDIR to " in line
    assert "bug" not in line
    assert os.listdir(long) == [], "nothing left behind"


def _narration_times(lines):
    """The times of a demo's narration lines ("   19.9 ms  kubelet  ..."), in order."""
    return [float(match[1]) for line in lines if (match := re.match(r"\s*([0-9.]+) ms  ", line))]


def test_the_docs_demo_samples_are_in_time_order():
    """The README and the docs show demos' output as samples: their times never go backwards, as a
    run's do."""
    pages = [HERE / "README.md", *sorted((HERE / "docs").glob("*.md"))]
    samples = [
        (page.name, sample)
        for page in pages
        for sample in re.findall(r"```\n(gopherplug demo[^\n]*\n.*?)```", page.read_text(), re.S)
    ]
    assert "README.md" in {page for page, _ in samples} and len(samples) >= 3, samples
    for page, sample in samples:
        times = _narration_times(sample.splitlines()[1:])
        assert len(times) > 10 and times == sorted(times), (page, sample)


@pytest.mark.slow
def test_demo_dra_narrates_the_dra_flow_and_leaves_nothing_behind(sockdir):
    who, said = narrated_demo(sockdir, "--dra")
    assert who == (
        "apiserver kubelet plugin kubelet kubelet kubelet plugin plugin plugin demo plugin scheduler kubelet plugin "
        "runtime runtime runtime runtime runtime runtime who who who who kubelet kubelet plugin plugin demo"
    )
    assert "gopher1 gopher1: Healthy: default/my-pod/app (claim default/my-gopher)\n" in said
    assert "gopher3 gopher3: Healthy: free\n" in said
    assert re.search(r"endpoint /\S+/kubelet/plugins/gopherplug.example.com/dra.sock\n", said)
    assert (
        "supported versions v1.DRAPlugin, v1beta1.DRAPlugin, v1.DRAResourceHealth, v1beta1.DRAResourceHealth, "
        "v1alpha1.DRAResourceHealth: "
        "chose k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin\n"
    ) in said
    assert (
        "NodeWatchResources: gopher0 HEALTHY, gopher1 HEALTHY, gopher2 HEALTHY (again at each change, and every 10 s)"
        in said
    )
    pool = "pool demo-node/example.com/gopher"
    assert f"{pool} generation 1, devices gopher0, gopher1, gopher2\n" in said
    assert "device gopher0: resource=example.com/gopher, id=gopher0, healthy=True\n" in said
    assert f"{pool} generation 2, devices gopher0, gopher1, gopher2, gopher3 (" in said
    assert (
        "gopher1: CDI device example.com/gopher=gopher1, example.com/gopher=7f3e-demo_gopher, "
        "gopherplug.example.com/metadata=7f3e-demo_gopher\n"
    ) in said
    assert (
        "example.com/gopher=7f3e-demo_gopher is request gopher's env, as Allocate gives it: GOPHER=gopher1\n"
    ) in said
    assert re.search(
        r"mount /\S+/plugins/gopherplug.example.com/dra-device-metadata/default_my-gopher_7f3e-demo/gopher/"
        r"metadata.json "
        r"-> /var/run/kubernetes.io/dra-device-attributes/resourceclaims/my-gopher/gopher/"
        r"gopherplug.example.com-metadata.json \(ro,bind\)\n",
        said,
    )
    assert "env GOPHER_GOPHER1=gopher1\n" in said
    assert re.search(r"mount /\S+/gophers/gopher1 -> /run/gophers/gopher1 \(bind,ro\)\n", said)
    assert said.endswith("devices gopher0, gopher1, gopher2, gopher3\ndone: plugin stopped, its sockets removed")
    assert os.listdir(sockdir) == []


def gpu_recipe_config(sockdir):
    """examples/gpu/config.yaml as a user's file, its /dev a node's tree in miniature under
    sockdir/node (as test_recipes.py's test_recipe_under_the_device_plugin makes it): the file's
    path, and the tree's /dev."""
    dev, sysfs = os.path.join(sockdir, "node", "dev"), os.path.join(sockdir, "node", "sys")
    os.makedirs(dev)
    gpu_tree(dev, sysfs)
    config = yaml.safe_load((HERE / "examples" / "gpu" / "config.yaml").read_text())
    for resource in config["resources"]:
        resource["directory"] = dev + resource["directory"].removeprefix("/dev")
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod was refused, nodes are links to it
    config.update(dev_root=dev, sysfs_root=sysfs)
    path = os.path.join(sockdir, "node", "gpu.yaml")
    with open(path, "w", encoding="utf-8") as file:
        yaml.safe_dump(config, file)
    return path, dev


@pytest.mark.slow
def test_demo_config_runs_your_configuration_against_the_kubelet_simulator(sockdir):
    """`gopherplug demo --config FILE`: the user's resources scanned where the file says, registered
    with the simulated kubelet, listed, and one device of each allocated, narrated as the demo is;
    the kubelet's directory is the demo's own, and nothing is left behind."""
    path, dev = gpu_recipe_config(sockdir)
    who, said = narrated_demo(sockdir, "--config", path)
    assert who == "plugin kubelet plugin kubelet plugin kubelet plugin kubelet plugin plugin plugin demo"
    card, render = (os.path.realpath(f"{dev}/dri/{name}") for name in ("card1", "renderD128"))
    assert said.split("\n", 1)[1] == "\n".join(
        [
            re.search(r"serving Registration on /\S+/device-plugins/kubelet.sock", said).group(0),
            "Register(resource example.com/gpu, endpoint gopherplug-example.com_gpu-1.sock, version v1beta1)",
            "dialed gopherplug-example.com_gpu-1.sock back before answering: get_preferred_allocation_available: True",
            "ListAndWatch example.com/gpu: 0000:00:02.0 Healthy, 0000:03:00.0 Healthy",
            "example.com/gpu: capacity 2, allocatable 2",
            "GetPreferredAllocation(size 1 of 0000:00:02.0, 0000:03:00.0): 0000:00:02.0",
            "pod default/demo-pod asks for 1 example.com/gpu: Allocate(0000:00:02.0)",
            f"device {card} -> {card} (rw)",  # {target}: where the by-path link leads, in the container too
            f"device {render} -> {render} (rw)",
            "env GPU_DEVICES=0000:00:02.0",
            "done: plugin stopped, its sockets removed",
        ]
    )
    assert said.startswith(f"example.com/gpu: 2 devices, 2 healthy, from {dev}/dri/by-path/pci-*\n")
    assert sorted(os.listdir(sockdir)) == ["node"]


@pytest.mark.slow
def test_demo_config_dra_prepares_a_claim_of_your_configuration(sockdir):
    """`gopherplug demo --config FILE --dra`: the same file served through DRA (api: dra, the demo's
    driver): the pool's ResourceSlice, a claim for its first device allocated and prepared, and the
    CDI edits the runtime would apply for it, from the spec the plugin wrote."""
    path, dev = gpu_recipe_config(sockdir)
    who, said = narrated_demo(sockdir, "--config", path, "--dra")
    runtime = " ".join(["runtime"] * 5)
    assert who == f"plugin apiserver kubelet kubelet plugin plugin scheduler kubelet {runtime} demo"
    card, render = (os.path.realpath(f"{dev}/dri/{name}") for name in ("card1", "renderD128"))
    first, second = gp.dra_device_name("0000:00:02.0"), gp.dra_device_name("0000:03:00.0")
    pool, cdi = "demo-node/example.com/gpu", "gopherplug.example.com/gpu=0000:00:02.0"
    lines = said.splitlines()
    env = "gopherplug.example.com/gpu=demo-0_device"  # the request's env, as Allocate gives it
    assert lines[4:12] == [
        f"ResourceSlice of pool {pool}: {first}, {second}",
        f"device {first}: resource=example.com/gpu, id=0000:00:02.0, healthy=True",  # what the scheduler selects by
        f"allocated a ResourceClaim: device {first} of pool {pool}",
        f"NodePrepareResources: CDI devices {cdi}, {env}, gopherplug.example.com/metadata=demo-0_device",
        f"{cdi}: device {card} -> {card}",
        f"{cdi}: device {render} -> {render}",
        f"{cdi}: env GPU_DEVICES_0000_00_02_0=0000:00:02.0",
        f"{env}: env GPU_DEVICES=0000:00:02.0",
    ]
    assert re.fullmatch(
        r"gopherplug.example.com/metadata=demo-0_device: mount /\S+/kubelet/plugins/gopherplug.example.com/"
        r"dra-device-metadata/default_demo-gpu_demo-0/device/metadata.json -> /var/run/kubernetes.io/"
        r"dra-device-attributes/resourceclaims/demo-gpu/device/gopherplug.example.com-metadata.json \(ro,bind\)",
        lines[12],
    )
    assert sorted(os.listdir(sockdir)) == ["node"]


@pytest.mark.slow
def test_demo_config_dra_waits_for_what_describe_says_not_for_a_new_generation(sockdir):
    """demo --config --dra with two resources whose describe answers at once: the plugin's run may
    answer before the demo looks at the slice, so the demo waits for describe's values (not for a
    pool generation that then never comes), shows them for both, says nothing untrue, and ends in
    seconds. A describe that fails is said with its own line, and the demo goes on."""
    describe = Path(sockdir) / "describe"
    describe.write_text(
        f"#!{sys.executable}\nimport json, os\nids = os.environ['GOPHERPLUG_DEVICES'].split(',')\n"
        "print(json.dumps({i: {'attributes': {'model': 'x-' + i}} for i in ids}))\n"
    )
    failing = Path(sockdir) / "failing"
    failing.write_text("#!/bin/sh\necho 'hailortcli: not found' >&2; exit 3\n")
    resources = []
    for name, device, script in (("hailo", "hailo0", describe), ("coral", "apex_0", describe), ("dead", "d0", failing)):
        script.chmod(0o755)
        os.makedirs(Path(sockdir) / name)
        (Path(sockdir) / name / device).touch()
        resources.append({"name": f"example.com/{name}", "directory": f"{sockdir}/{name}", "describe": [str(script)]})
    path = Path(sockdir) / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"resources": resources}))
    # Each wait for a generation that never came took DESCRIBE_TIMEOUT + 1 s: two made it fail.
    result = run_cli("demo", "--config", str(path), "--dra", env={"TMPDIR": sockdir}, timeout=2 * gp.DESCRIBE_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line.split(None, 3)[3] for line in result.stdout.splitlines()[1:]]
    assert [line for line in said if line.startswith("device ")] == [
        "device hailo0: resource=example.com/hailo, id=hailo0, healthy=True, model=x-hailo0",
        "device apex-0-d1cf8aa9: resource=example.com/coral, id=apex_0, healthy=True, model=x-apex_0",
        "device d0: resource=example.com/dead, id=d0, healthy=True",
    ]
    assert [line for line in said if "describe" in line] == [
        f"describe {failing} exited with 3: hailortcli: not found: the devices are published without what it says "
        "(the plugin tries again later)"
    ]


@pytest.mark.slow
def test_demo_config_refuses_what_check_config_refuses(tmp_path):
    """A file check-config refuses, demo --config refuses with the same line and exit 2; under --dra,
    what only the device-plugin API has is refused with why."""
    path = tmp_path / "gopherplug.yaml"
    path.write_text("resources:\n  - name: example.com/gopher\n    directory: gophers\n")
    demo, check_config = run_cli("demo", "--config", str(path)), run_cli("check-config", "--config", str(path))
    assert (demo.returncode, demo.stdout) == (check_config.returncode, "") == (2, "")
    assert (
        demo.stderr
        == check_config.stderr
        == f"gopherplug: {path}: resources[0].directory: 'gophers' must be an absolute path\n"
    )
    path.write_text(
        "resources:\n  - name: example.com/gopher\n    directory: /dev\n    pattern: 'null'\n    annotations: {a: b}\n"
    )
    dra = run_cli("demo", "--config", str(path), "--dra")
    assert (dra.returncode, dra.stdout) == (2, "")
    assert dra.stderr == (
        f"gopherplug: {path}: resources[0].annotations: is for the device-plugin API, and this resource has api: dra "
        "(devices reach containers only as CDI devices) (demo --dra serves it through DRA)\n"
    )


#: The demo's driver, where a selector finds the attributes and capacity of the configuration
ATTRIBUTES, CAPACITY = (f'device.{kind}["{gp.DEMO_DRIVER}"]' for kind in ("attributes", "capacity"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "selector, verdicts, allocated",
    [
        (  # a version compared as a version: 4.18.0 > 4.17.0 > 4.16.2, not as strings would be
            f'{ATTRIBUTES}.firmwareVersion.isGreaterThan(semver("4.17.0"))',
            ["not selected", "selected", "selected"],
            "hailo1",
        ),
        (  # a capacity against a quantity, binary suffixes by value: 16Gi and 8Gi, not 4Gi
            f'{CAPACITY}.memory.compareTo(quantity("8Gi")) >= 0 && {CAPACITY}.memory.isLessThan(quantity("10Gi"))',
            ["selected", "not selected", "not selected"],
            "hailo0",
        ),
        (f'{ATTRIBUTES}.model == "hailo8" && device.driver == "{gp.DEMO_DRIVER}"', ["selected"] * 3, "hailo0"),
        (  # MAJOR.MINOR.PATCH or an error, on each device: the claim fails on the node
            f'{ATTRIBUTES}.firmwareVersion.isGreaterThan(semver("4.17"))',
            [ERROR + "No Major.Minor.Patch elements found"] * 3,
            None,
        ),
        (  # an attribute the devices have not: not false, an error
            f'{ATTRIBUTES}.pcieRoot == "pci0000:00"',
            [ERROR + "no such key: pcieRoot"] * 3,
            None,
        ),
    ],
    ids=["version", "quantity", "string", "semver-error", "no-such-key"],
)
def test_demo_select_evaluates_a_selector_on_your_devices_as_the_scheduler(sockdir, selector, verdicts, allocated):
    """`demo --config FILE --dra --select CEL`: the selector is evaluated on each published device as
    the scheduler evaluates it (the Kubernetes CEL library's semver and quantity functions; a
    version attribute a version), each device's verdict said; the claim gets the first device
    selected, or stays unallocated at the first CEL error, in the scheduler's words."""
    _, said = narrated_demo(sockdir, "--config", hailo_config(sockdir), "--dra", "--select", selector)
    lines = said.splitlines()
    start = lines.index(f"selector #0 of claim default/demo-hailo: {selector}")
    assert lines[start + 1 : start + 4] == [f"hailo{i}: {verdict}" for i, verdict in enumerate(verdicts)]
    if allocated is None:
        assert lines[start + 4] == f"the claim stays unallocated, its pod Pending (FailedScheduling): {verdicts[0]}"
        assert not [line for line in lines if line.startswith(("allocated", "NodePrepareResources"))]
    else:
        pool = "demo-node/example.com/hailo"
        assert f"allocated a ResourceClaim: device {allocated} of pool {pool}" in lines
        assert f"gopherplug.example.com/hailo={allocated}: env HAILO_DEVICES_{allocated.upper()}={allocated}" in lines


@pytest.mark.slow
def test_demo_select_refuses_a_selector_that_cannot_compile_and_names_what_it_needs(sockdir):
    """A selector the API server would refuse is refused before the demo starts, in one line, exit 2;
    so is --select without the devices of --config and --dra."""
    path = hailo_config(sockdir)
    result = run_cli("demo", "--config", path, "--dra", "--select", f"{ATTRIBUTES}.model ==")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "gopherplug: --select: compilation failed: ERROR: <input>:1:51: Syntax error "
        "(the API server would refuse a claim with it)\n"
    )
    result = run_cli("demo", "--config", path, "--select", "true")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "gopherplug: --select: give --config FILE and --dra: it selects among your devices\n"
    script = "import sys, gopherplug\nsys.modules['celpy'] = None\nsys.exit(gopherplug.main(sys.argv[1:]))\n"
    argv = [sys.executable, "-c", script, "demo", "--config", path, "--dra", "--select", "true"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.startswith("gopherplug: --select: CEL needs the cel extra (")
    assert result.stderr.endswith("): pip install '.[dra,cel]' in a checkout\n")


@pytest.mark.slow
async def test_kubelet_command_narrates_a_serve_of_your_own_and_allocates_on_request(node, tmp_path):
    """`gopherplug kubelet --device-plugin-dir DIR` and `gopherplug serve` as two processes on one
    directory, as a user tries a configuration without a cluster: the kubelet says the
    registration, each list with its health changes (a symlink to nothing, then to a device), an
    Allocate asked on its standard input (with the plugin's preferred allocation) and by SIGUSR1 (a
    device no pod holds), a request it does not know; SIGTERM stops it, exit 0, kubelet.sock gone."""
    config = str(write_config(node, tmp_path))
    kubelet = await trio.lowlevel.open_process(
        [sys.executable, str(HERE / "gopherplug.py"), "kubelet", "--device-plugin-dir", node.plugin_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    plugin = None
    said = bytearray()
    try:
        with trio.fail_after(6 * TIMEOUT):
            await read_until(kubelet.stdout, f"serving Registration on {node.kubelet_socket}", said)
            second = await run_cli_async("kubelet", "--device-plugin-dir", node.plugin_dir)  # would wipe its sockets
            assert (second.returncode, second.stdout) == (2, b"")
            assert second.stderr.decode() == (
                f"gopherplug: kubelet: {node.kubelet_socket} answers: a kubelet serves this directory already\n"
            )
            plugin = await trio.lowlevel.open_process(
                [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", config], stderr=subprocess.DEVNULL
            )
            await read_until(kubelet.stdout, f"{RESOURCE}: capacity 2, allocatable 2\n", said)
            await kubelet.stdin.send_all(f"allocate {RESOURCE} 1\nallocate {RESOURCE} x\nborrow\n".encode())
            await read_until(kubelet.stdout, "ask for one of", said)
            target = os.path.join(node.devices, "..", "g3-target")
            os.symlink(target, os.path.join(node.devices, "g3"))  # a symlink to nothing: unhealthy
            await read_until(kubelet.stdout, f"{RESOURCE}: capacity 3, allocatable 2", said)
            Path(target).touch()
            await read_until(kubelet.stdout, "(g3 Unhealthy -> Healthy)", said)
            kubelet.send_signal(signal.SIGUSR1)
            await read_until(kubelet.stdout, "GOPHER_DEVICES=g2", said)
            kubelet.send_signal(signal.SIGTERM)
            assert await kubelet.wait() == 0
            said += await kubelet.stdout.receive_some()
    finally:
        for process in (kubelet, plugin):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
    lines = [line.split(None, 3)[2:] for line in said.decode().splitlines()]
    assert lines[1:] == [
        ["plugin", f"Register(resource {RESOURCE}, endpoint gopherplug-example.com_gopher-1.sock, version v1beta1)"],
        [
            "kubelet",
            "dialed gopherplug-example.com_gopher-1.sock back before answering: "
            "get_preferred_allocation_available: True",
        ],
        ["plugin", f"ListAndWatch {RESOURCE}: g1 Healthy, g2 Healthy"],
        ["kubelet", f"{RESOURCE}: capacity 2, allocatable 2"],
        ["plugin", "GetPreferredAllocation(size 1 of g1, g2): g1"],
        ["kubelet", f"pod default/pod-1 asks for 1 {RESOURCE}: Allocate(g1)"],
        ["plugin", "env GOPHER_DEVICES=g1"],
        ["kubelet", "allocate: 'x' is not a number of devices"],
        ["kubelet", f"'borrow': ask for one of: {gp.KUBELET_REQUESTS}"],
        ["plugin", f"ListAndWatch {RESOURCE}: g1 Healthy, g2 Healthy, g3 Unhealthy"],
        ["kubelet", f"{RESOURCE}: capacity 3, allocatable 2"],
        ["plugin", f"ListAndWatch {RESOURCE}: g1 Healthy, g2 Healthy, g3 Healthy"],
        ["kubelet", f"{RESOURCE}: capacity 3, allocatable 3 (g3 Unhealthy -> Healthy)"],
        ["plugin", "GetPreferredAllocation(size 1 of g2, g3): g2"],
        ["kubelet", f"pod default/pod-2 asks for 1 {RESOURCE}: Allocate(g2)"],
        ["plugin", "env GOPHER_DEVICES=g2"],
        ["kubelet", "stopped: kubelet.sock removed"],
    ]
    assert not os.path.exists(node.kubelet_socket)
    assert (await kubelet.stderr.receive_some()) == b""


@pytest.mark.slow
async def test_probe_shows_what_the_kubelet_sees(nursery, node, tmp_path):
    os.symlink("/dev/null", os.path.join(node.devices, "g3"))
    config = node.config(allowed_host_paths=["/dev"])
    config = dataclasses.replace(config, sysfs_root=fake_sysfs(tmp_path / "sys", {(1, 3): 1}))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, config)
        await simulator.wait_until(listed("g1", "g2", "g3"))
        result = await run_cli_async("probe", "--device-plugin-dir", node.plugin_dir)
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout.decode() == (
        "example.com/gopher: gopherplug-example.com_gopher-1.sock: 3 devices, 3 healthy; "
        "preferred allocation yes, pre-start no, registered yes, kubelet stream open\n"
        "  ID  HEALTH     NUMA\n"
        "  g1  Healthy    -\n"
        "  g2  Healthy    -\n"
        "  g3  Healthy    1\n"
    )


@pytest.mark.slow
async def test_probe_says_one_device_in_the_singular(nursery, node):
    os.unlink(os.path.join(node.devices, "g2"))
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config())
        await simulator.wait_until(listed("g1"))
        result = await run_cli_async("probe", "--device-plugin-dir", node.plugin_dir)
    assert (result.returncode, result.stderr) == (0, b"")
    assert result.stdout.decode().splitlines()[0] == (
        "example.com/gopher: gopherplug-example.com_gopher-1.sock: 1 device, 1 healthy; "
        "preferred allocation yes, pre-start no, registered yes, kubelet stream open"
    )


@pytest.mark.slow
async def test_probe_fails_for_a_configured_resource_that_does_not_answer(nursery, node, tmp_path):
    text = yaml.safe_dump(
        {
            "device_plugin_dir": node.plugin_dir,
            "resources": [
                {"name": RESOURCE, "directory": node.devices},
                {"name": "example.com/absent", "directory": node.devices},
            ],
        }
    )
    (tmp_path / "two.yaml").write_text(text)
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
    assert simulator.resources[RESOURCE].streaming
    # Two processes, each importing the module: seconds apiece on a loaded machine. The plugin is
    # serving (above): the probes end as they end, under a bound that only stops a hang.
    with trio.fail_after(10 * TIMEOUT):
        result = await run_cli_async("probe", "--config", str(tmp_path / "two.yaml"))
        only = await run_cli_async("probe", "--config", str(tmp_path / "two.yaml"), "--resource", RESOURCE)
    assert result.returncode == 1
    lines = result.stdout.decode().splitlines()
    assert lines[0].startswith("example.com/gopher: gopherplug-example.com_gopher-1.sock: 2 devices, 2 healthy")
    assert lines[-1] == f"example.com/absent: FAILED: no gopherplug socket in {node.plugin_dir}"
    assert only.returncode == 0


def stale_socket(path):
    """A socket file nothing listens on, as a process killed before its cleanup leaves it."""
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(path)


async def test_probe_finds_the_live_socket_among_dead_ones(nursery, node):
    with trio.fail_after(TIMEOUT):
        await start(nursery, node)
        # Newer and higher-numbered than the live one: what a plugin SIGKILLed at -7 leaves.
        stale_socket(os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-7.sock"))
        [result] = await gp.probe(node.plugin_dir, [RESOURCE])
    assert (result.endpoint, result.error, len(result.devices)) == ("gopherplug-example.com_gopher-1.sock", "", 2)


@pytest.mark.slow
async def test_a_killed_plugins_sockets_are_removed_by_the_next_one(nursery, node, tmp_path):
    config = str(write_config(node, tmp_path))
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    first = await trio.lowlevel.open_process([sys.executable, str(HERE / "gopherplug.py"), "--config", config])
    second = None
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            simulator.restart()
            await simulator.wait_until(lambda s: len(s.registrations) == 2 and devices_of(s))
            first.kill()  # SIGKILL, as the OOM killer does: no cleanup
            await first.wait()
            await simulator.wait_until(lambda s: devices_of(s) is None)
            assert node.our_sockets() == ["gopherplug-example.com_gopher-2.sock"]
            with open(tmp_path / "second.log", "w") as log:  # the process keeps its own copy
                argv = [sys.executable, str(HERE / "gopherplug.py"), "--config", config]
                second = await trio.lowlevel.open_process(argv, stderr=log)
            await simulator.wait_until(lambda s: len(s.registrations) == 3 and devices_of(s))
            assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]  # numbers start again
            probed = await run_cli_async("probe", "--config", config)
    finally:
        for process in (first, second):
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
    assert probed.returncode == 0, probed.stdout
    # Said of the resource, as every line about it, not of the socket's file-name stem.
    assert f" INFO {RESOURCE}: removed gopherplug-example.com_gopher-2.sock, left by a gopherplug that did " in (
        (tmp_path / "second.log").read_text()
    )


def can_unshare_mounts():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and unshare --mount")
async def test_device_plugin_directory_removed_on_the_host_exits_a_pod_with_one_line(nursery, node, tmp_path):
    # A pod's hostPath volume is a bind mount in the pod's mount namespace: made here for real.
    # Removed on the host and made anew by the kubelet, the directory the plugin sees is the
    # deleted one, where nothing can be created and nothing new shows: only a restart helps.
    in_pod = os.path.join(os.path.dirname(node.plugin_dir), "pod-dp")
    os.mkdir(in_pod)
    config = tmp_path / "gopherplug.yaml"
    config.write_text(
        yaml.safe_dump({"device_plugin_dir": in_pod, "resources": [{"name": RESOURCE, "directory": node.devices}]})
    )
    script = 'mount --bind "$0" "$1" && exec "$2" "$3" --config "$4"'
    argv = [sys.executable, str(HERE / "gopherplug.py"), str(config)]
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    pod = await trio.lowlevel.open_process(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, node.plugin_dir, in_pod, *argv],
        stderr=subprocess.PIPE,
    )
    stderr = b""
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))  # registered through the mount
            simulator.restart(remove_directory=True)
            async for chunk in pod.stderr:
                stderr += chunk
            await pod.wait()
    finally:
        if pod.returncode is None:
            pod.kill()
            await pod.wait()
    lines = stderr.decode().splitlines()
    assert pod.returncode == 1, lines
    assert [line for line in lines if " ERROR " in line] == [lines[-1]]
    assert lines[-1].endswith(f" ERROR {deleted_message(in_pod)}")
    assert len(simulator.registrations) == 1


@pytest.mark.slow
async def test_a_second_plugin_for_the_same_resource_refuses_and_leaves_the_first_alone(nursery, node, tmp_path):
    with trio.fail_after(TIMEOUT):
        simulator = await start(nursery, node)
        result = await run_cli_async("--config", str(write_config(node, tmp_path)))
    assert result.returncode == 1
    lock = os.path.join(node.plugin_dir, ".gopherplug-example.com_gopher.lock")
    assert (
        result.stderr.decode()
        .splitlines()[-1]
        .endswith(
            f"ERROR example.com/gopher is already served on this node by another gopherplug (pid {os.getpid()} "
            f"on host {os.uname().nodename}, lock file {lock}): stop that one, or remove the resource from one "
            "configuration"
        )
    )
    assert node.our_sockets() == ["gopherplug-example.com_gopher-1.sock"]
    assert len(simulator.registrations) == 1 and simulator.resources[RESOURCE].streaming


@pytest.mark.slow
def test_a_kubelet_directory_root_may_not_write_says_what_to_do(node, tmp_path):
    """As the DaemonSet runs it, root without CAP_DAC_OVERRIDE, in a directory of another owner:
    one line that says permission denied and what to fix, not Python's PermissionError and errno."""
    os.chown(node.plugin_dir, 1000, 1000)
    os.unlink(os.path.join(node.devices, "g2"))
    path = write_config(node, tmp_path)
    argv = [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    lock = os.path.join(node.plugin_dir, ".gopherplug-example.com_gopher.lock")
    assert result.returncode == 1
    assert [line.split(" ", 1)[1] for line in result.stderr.splitlines()] == [
        f"INFO {RESOURCE}: 1 device from {node.devices}/*",  # one device, said so
        f"ERROR cannot take the lock {lock}: permission denied: run gopherplug as root, "
        f"and {node.plugin_dir} must belong to root",
    ]


# The holder of a lock, in a PID namespace and a UTS namespace of its own, as in a pod.
LOCK_HOLDER = """
import socket, sys
socket.sethostname("gopherplug-abcde")
sys.path.insert(0, sys.argv[1])
import gopherplug
gopherplug.FileLock(sys.argv[2], "taken", "fix").acquire()
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


@pytest.mark.slow
async def test_a_lock_held_in_a_container_names_it_so_it_can_be_found(tmp_path):
    """Its pid is 1 in its own namespace, which finds nothing from here: the message says so, gives
    its hostname (a pod's name) and its pid as this process sees it."""
    tried = subprocess.run(["unshare", "--pid", "--uts", "--fork", "true"], capture_output=True, check=False)
    if tried.returncode != 0:
        pytest.skip(f"cannot make PID and UTS namespaces here: {tried.stderr.decode().strip()}")
    path = str(tmp_path / ".lock")
    argv = ["unshare", "--pid", "--uts", "--fork", "--kill-child", sys.executable, "-c", LOCK_HOLDER, str(HERE), path]
    holder = await trio.lowlevel.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        said = b""
        with trio.fail_after(TIMEOUT):
            while not said.endswith(b"\n") and (chunk := await holder.stdout.receive_some()):
                said += chunk
        assert said == b"held\n"
        with pytest.raises(gp.GopherplugError) as info:
            gp.FileLock(path, "taken", "fix").acquire()
        (child,) = Path(f"/proc/{holder.pid}/task/{holder.pid}/children").read_text().split()  # python, pid 1 there
    finally:
        await holder.stdin.aclose()
        with trio.fail_after(TIMEOUT):
            await holder.wait()
    assert str(info.value) == (
        f"taken by another gopherplug (pid 1 in another PID namespace (a container; pid {child} in this one), "
        f"hostname gopherplug-abcde, lock file {path}): fix"
    )


@pytest.mark.slow
async def test_a_long_resource_name_gets_a_short_socket_name(nursery, node, tmp_path):
    # The readable name would fit at socket number 1 and pass the 107-byte limit at 10.
    name = "example.com/" + "n" * 57
    assert len(os.path.join(node.plugin_dir, f"gopherplug-example.com_{'n' * 57}-10.sock")) > gp.MAX_SOCKET_PATH
    path = tmp_path / "long.yaml"
    path.write_text(
        yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": [{"name": name, "directory": node.devices}]})
    )
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.load_config(str(path)))
        for restarts in range(10):
            await simulator.wait_until(
                lambda s, n=restarts: len(s.registrations) == n + 1 and s.resources[name].streaming
            )
            simulator.restart()
        await simulator.wait_until(lambda s: len(s.registrations) == 11 and s.resources[name].streaming)
        probed = await run_cli_async("probe", "--config", str(path))
    endpoint = simulator.registrations[-1].endpoint
    assert re.fullmatch(r"gopherplug-[0-9a-f]{16}-11\.sock", endpoint), endpoint
    assert probed.returncode == 0
    assert probed.stdout.decode().startswith(f"{name}: {endpoint}: 2 devices, 2 healthy")


#: What a device plugin's serve never needs, imported where first needed: the DRA driver's API client
#: (lightkube, httpx2 and theirs), the metrics server's prometheus_client, the "did you mean" of a
#: mistaken configuration (difflib), and what only tests and the demos use.
ONLY_WHEN_NEEDED = ("lightkube", "httpx2", "httpcore2", "h11", "prometheus_client", "difflib", "gopherplug_standins")


@pytest.mark.slow
async def test_a_device_plugin_serves_without_importing_what_only_dra_metrics_or_mistakes_need(nursery, node, tmp_path):
    """Every module a process imports costs its start-up time and keeps its code in memory for the
    process's life: a device plugin's serve, to its first list and an Allocate, imports none of
    ONLY_WHEN_NEEDED. An audit hook started before gopherplug logs each import of those, and of
    yaml (imported at every start: the hook is seen to work)."""
    config = str(write_config(node, tmp_path))
    imports = tmp_path / "imports"
    watched = (*ONLY_WHEN_NEEDED, "yaml")
    hooked = (
        "import sys\n"
        f"def hook(event, args, log=open({str(imports)!r}, 'a', buffering=1)):\n"
        f"    if event == 'import' and args[0] in {watched!r}:\n"
        "        log.write(args[0] + '\\n')\n"
        "sys.addaudithook(hook)\n"
        "import gopherplug\n"
        "sys.exit(gopherplug.main())\n"
    )
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    plugin = await trio.lowlevel.open_process(
        [sys.executable, "-c", hooked, "serve", "--config", config], cwd=HERE, stderr=subprocess.DEVNULL
    )
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            answer = await simulator.allocate(RESOURCE, ["g1"])
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}
    finally:
        plugin.kill()
        await plugin.wait()
    assert imports.read_text().split() == ["yaml"]


@pytest.mark.slow
async def test_out_of_file_descriptors_the_plugin_waits_and_serves_on(nursery, node, tmp_path):
    config = str(write_config(node, tmp_path))
    limited = "import resource, sys, runpy; resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48)); "
    limited += "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    plugin = await trio.lowlevel.open_process(
        [sys.executable, "-c", limited, str(HERE / "gopherplug.py"), "--config", config], stderr=subprocess.PIPE
    )
    hogs, seen = [], bytearray()
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            endpoint = os.path.join(node.plugin_dir, simulator.registrations[-1].endpoint)
            for _ in range(60):  # more connections than it has descriptors left; they wait in the backlog
                hog = trio.socket.socket(socket.AF_UNIX)
                await hog.connect(endpoint)
                hogs.append(hog)
            await read_until(plugin.stderr, "Too many open files (raise the open-files limit", seen)
            for hog in hogs:
                hog.close()
            await read_until(plugin.stderr, "accepting connections on", seen)
            answer = await simulator.allocate(RESOURCE, ["g1"])
        assert plugin.returncode is None
        assert dict(answer.container_responses[0].envs) == {"GOPHER_DEVICES": "g1"}
        assert seen.count(b"cannot accept connections") == 1
    finally:
        for hog in hogs:
            hog.close()
        plugin.kill()
        await plugin.wait()


# `gopherplug who`: the kubelet's PodResources answer, read against the configuration


@pytest.mark.slow
async def test_who_names_the_pod_and_container_holding_each_device(nursery, node, tmp_path):
    """A device plugin's devices: the kubelet books an Allocate to the container it was for, and
    PodResources List tells; `who` (a subprocess, as an operator runs it) reads it against the
    configuration: each device with its health, path and holder, or free; --json the same."""
    config = write_config(node, tmp_path, replicas=2)
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, gp.load_config(str(config)))
        await simulator.wait_until(lambda s: len(devices_of(s) or ()) == 4)
        await simulator.allocate(RESOURCE, ["g1::0"], container=("default", "web", "app"))
        await simulator.allocate(RESOURCE, ["g1::1"], container=("jobs", "batch-1", "main"))
        socket_path = os.path.join(node.plugin_dir, "..", "pod-resources", "kubelet.sock")
        pod_resources = await nursery.start(standins.PodResourcesSimulator(socket_path, simulator).run)
        text = await run_cli_async("who", "--config", str(config), "--pod-resources-socket", socket_path)
        as_json = await run_cli_async("who", "--config", str(config), "--json", "--pod-resources-socket", socket_path)
    assert (text.returncode, text.stderr) == (0, b"")
    g1, g2 = os.path.join(node.devices, "g1"), os.path.join(node.devices, "g2")
    assert text.stdout.decode().splitlines() == [
        f"{RESOURCE} g1 {g1}: Healthy: default/web/app (device plugin, share 0), jobs/batch-1/main (device plugin, "
        "share 1)",
        f"{RESOURCE} g2 {g2}: Healthy: free",
    ]
    documents = json.loads(as_json.stdout)
    assert [(d["device_id"], d["health"], [h["pod"] for h in d["holders"]]) for d in documents] == [
        ("g1", "Healthy", ["web", "batch-1"]),
        ("g2", "Healthy", []),
    ]
    assert documents[0]["holders"][0] == {
        "namespace": "default",
        "pod": "web",
        "container": "app",
        "via": "device plugin",
        "share": "0",
    }
    assert pod_resources.calls == ["List", "List"]
    # The pod ends: its devices are free again, as the kubelet says.
    simulator.remove_pod("default", "web")
    [held, free] = gp.device_holders(
        [(node.config(replicas=2).resources[0], gp.scan_directory(node.config(replicas=2).resources[0]).devices)],
        pod_resources.pods(),
    )
    assert [h.pod for h in held.holders] == ["batch-1"] and free.holders == ()


@pytest.mark.slow
async def test_who_waits_while_the_kubelet_refuses_past_its_rate_limit_and_says_so(nursery, node):
    """The kubelet refuses a PodResources call past its rate limit at once (RESOURCE_EXHAUSTED,
    "rejected by rate limit"), 100 a second in bursts of 10 for every client together: who asks
    again, saying so, and gets its answer."""
    socket_path = os.path.join(node.plugin_dir, "pr", "kubelet.sock")
    with trio.fail_after(TIMEOUT):
        # The kubelet's burst, with a bucket that refills slowly (a token in 2 s, not 10 ms), so
        # that the call after the burst is refused however slow this machine is.
        strict = await nursery.start(standins.PodResourcesSimulator(socket_path, qps=0.5).run)
        method = gp.PODRESOURCES_METHODS[gp.LIST_POD_RESOURCES]
        request = gp.podresourcespb.ListPodResourcesRequest()
        for _ in range(standins.POD_RESOURCES_BURST):  # the burst, at once: each answered
            await gp.call_unary(socket_path, method, request, timeout=TIMEOUT)
        with pytest.raises(gp.RPCError) as refused:
            await gp.call_unary(socket_path, method, request, timeout=TIMEOUT)
        said = []
        pods = await gp.list_pod_resources(socket_path, said.append)
    assert (refused.value.code, refused.value.message) == (gp.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
    assert pods == [] and strict.calls == ["List"] * (standins.POD_RESOURCES_BURST + 1)
    assert said and set(said) == {
        "the kubelet refused PodResources List past its rate limit (rejected by rate limit): asking again"
    }
    assert strict.refused == 1 + len(said)


@pytest.mark.slow
async def test_who_without_the_kubelets_socket_says_what_to_mount(node, tmp_path):
    config = write_config(node, tmp_path)
    missing = os.path.join(os.path.dirname(node.plugin_dir), "pod-resources", "kubelet.sock")  # the default
    result = await run_cli_async("who", "--config", str(config))
    assert (result.returncode, result.stdout) == (1, b"")
    assert result.stderr.decode() == (
        f"gopherplug: no kubelet PodResources socket at {missing}: in a pod, mount the kubelet's "
        f"{os.path.dirname(missing)} read-only at that path (the shipped manifests do); elsewhere, give "
        "--pod-resources-socket\n"
    )


@pytest.mark.slow
@pytest.mark.parametrize("given_as", ["--pod-resources-socket", "GOPHERPLUG_POD_RESOURCES_SOCKET"])
async def test_who_with_a_socket_given_that_does_not_exist_says_so(node, tmp_path, given_as):
    # It told the user who had given --pod-resources-socket to give --pod-resources-socket.
    config = write_config(node, tmp_path)
    missing = os.path.join(node.plugin_dir, "nowhere", "kubelet.sock")
    given = ["--pod-resources-socket", missing] if given_as.startswith("--") else []
    env = {} if given else {given_as: missing}
    result = await run_cli_async("who", "--config", str(config), *given, env=env)
    assert (result.returncode, result.stdout) == (1, b"")
    assert result.stderr.decode() == (
        f"gopherplug: {given_as}: {missing} does not exist: give the kubelet's PodResources socket, "
        "pod-resources/kubelet.sock in its root directory (/var/lib/kubelet/pod-resources/kubelet.sock by default)\n"
    )


def test_who_finds_the_kubelets_socket_in_its_root_directory():
    resources = "resources: [{name: example.com/serial, directory: /dev, pattern: 'ttyS*', api: dra}]\n"
    plain = gp.parse_config(
        "device_plugin_dir: /var/snap/microk8s/common/var/lib/kubelet/device-plugins\n"
        + resources.replace(", api: dra", "")
    )
    assert gp.pod_resources_socket(plain) == "/var/snap/microk8s/common/var/lib/kubelet/pod-resources/kubelet.sock"
    dra = gp.parse_config(f"dra: {{driver: {DRIVER}, kubelet_dir: /var/lib/k0s/kubelet}}\n" + resources)
    assert gp.pod_resources_socket(dra) == "/var/lib/k0s/kubelet/pod-resources/kubelet.sock"


def generic_device_plugin_service(paths):
    """A stand-in for generic-device-plugin serving one `paths` group of ``paths`` (count 1): each
    device's ID is its sha1 of "0" and the path (squat/generic-device-plugin deviceplugin/path.go),
    Allocate gives the path as a DeviceSpec. Returns the IDs by path and the service."""
    ids = {path: hashlib.sha1(f"0{path}".encode()).hexdigest() for path in paths}

    async def get_options(empty):
        return v1beta1.DevicePluginOptions()

    async def list_and_watch(empty):
        yield v1beta1.ListAndWatchResponse(devices=[v1beta1.Device(ID=i, health=gp.HEALTHY) for i in ids.values()])
        await trio.sleep_forever()

    async def allocate(request):
        by_id = {i: path for path, i in ids.items()}
        specs = [
            v1beta1.DeviceSpec(host_path=by_id[i], container_path=by_id[i], permissions="mrw")
            for c in request.container_requests
            for i in c.devices_ids
        ]
        return v1beta1.AllocateResponse(container_responses=[v1beta1.ContainerAllocateResponse(devices=specs)])

    service = purerpc.Service("v1beta1.DevicePlugin")
    for name, fn in [("GetDevicePluginOptions", get_options), ("ListAndWatch", list_and_watch), ("Allocate", allocate)]:
        service.add_method(name, fn, gp.METHODS[f"/v1beta1.DevicePlugin/{name}"].signature)
    return ids, service


async def test_a_node_switched_from_generic_device_plugin_holds_the_pods_device_back_until_it_ends(
    nursery, sockdir, monkeypatch
):
    """docs/generic-device-plugin.md, "Switching a node from generic-device-plugin": a pod got ttyUSB0 from
    generic-device-plugin under its hashed ID; generic-device-plugin stops, gopherplug starts for
    the same resource name. As the kubelet does, the stand-in keeps the pod's allocation (its
    podDevices) and lists gopherplug's devices in place of the old ones, and chooses the next
    pod's device by ID alone: ttyUSB0 would be free to it. gopherplug, told by PodResources before
    it registers, offers ttyUSB0 Unhealthy from its first list, says so in one line, and offers it
    again once the pod has ended."""
    monkeypatch.setattr(gp, "FOREIGN_HOLDS_POLL", 0.05)  # PodResources asked again every 50 ms, not 10 s
    resource = "squat.ai/serial"
    kubelet_dir = os.path.join(sockdir, "kubelet")
    plugin_dir, devices = os.path.join(kubelet_dir, "device-plugins"), os.path.join(sockdir, "dev")
    os.makedirs(plugin_dir)
    os.mkdir(devices)
    paths = [os.path.join(devices, name) for name in ("ttyUSB0", "ttyUSB1")]
    for path in paths:
        Path(path).touch()
    gdp_ids, service = generic_device_plugin_service(paths)
    config = {
        "device_plugin_dir": plugin_dir,
        "resources": [{"name": resource, "directory": devices, "pattern": "ttyUSB*"}],
    }
    lists = []  # every device list the kubelet got from gopherplug, in order
    with trio.fail_after(TIMEOUT):
        kubelet = await nursery.start(gp.KubeletSimulator(plugin_dir).run)
        socket_path = os.path.join(kubelet_dir, gp.POD_RESOURCES_SOCKET)
        pod_resources = await nursery.start(standins.PodResourcesSimulator(socket_path, kubelet).run)
        async with trio.open_nursery() as generic_device_plugin:
            await generic_device_plugin.start(gp.serve_grpc, os.path.join(plugin_dir, "serial.sock"), [service])
            request = v1beta1.RegisterRequest(version="v1beta1", endpoint="serial.sock", resource_name=resource)
            await gp.call_unary(kubelet.socket_path, gp.METHODS[gp.REGISTER], request, timeout=TIMEOUT)
            await kubelet.wait_until(
                lambda k: k.resources[resource].devices == dict.fromkeys(gdp_ids.values(), "Healthy")
            )
            answer = await kubelet.allocate(resource, [gdp_ids[paths[0]]], container=("default", "modem", "app"))
            assert [d.host_path for d in answer.container_responses[0].devices] == [paths[0]]
            generic_device_plugin.cancel_scope.cancel()  # its DaemonSet's pod leaves the node
        await kubelet.wait_until(lambda k: not k.resources[resource].streaming)
        assert kubelet.available(resource) == []  # every old ID unhealthy: nothing to choose from

        def seen(k):
            """Records each new list of gopherplug's; true once one offers ttyUSB0 healthy."""
            current = k.resources[resource]
            if current.endpoint != "serial.sock" and current.updates and (not lists or lists[-1] != current.devices):
                lists.append(dict(current.devices))
            return bool(lists) and lists[-1].get("ttyUSB0") == "Healthy"

        recorded = trio.Event()

        async def record():
            await kubelet.wait_until(seen)
            recorded.set()

        nursery.start_soon(record)
        with logged("held by running pods") as warned, logged("offered") as offered:
            await nursery.start(gp.serve_plugin, gp.parse_config(yaml.safe_dump(config), "gopherplug.yaml"))
            await kubelet.wait_until(lambda k: k.resources[resource].devices.get("ttyUSB1") == "Healthy")
            # The pod runs on with its device, booked under generic-device-plugin's ID; gopherplug
            # reports ttyUSB0 Unhealthy, so the kubelet cannot choose it for another pod.
            assert kubelet.pod_devices == {("default", "modem"): {"app": {resource: [gdp_ids[paths[0]]]}}}
            assert kubelet.resources[resource].devices == {"ttyUSB0": "Unhealthy", "ttyUSB1": "Healthy"}
            assert kubelet.available(resource) == ["ttyUSB1"]
            # `who` tells it too: ttyUSB0 is the modem pod's, under generic-device-plugin's ID.
            configured = gp.parse_config(yaml.safe_dump(config)).resources[0]
            [usb0, usb1] = gp.device_holders(
                [(configured, gp.scan_directory(configured).devices)], pod_resources.pods()
            )
            assert [(h.pod, h.via, h.share) for h in usb0.holders] == [
                ("modem", f"device plugin, under another plugin's ID {gdp_ids[paths[0]][:12]}…", "")
            ]
            assert usb1.holders == ()
            # The pod ends: the kubelet frees its ID, and gopherplug offers ttyUSB0 again.
            kubelet.remove_pod("default", "modem")
            await recorded.wait()
            await offered.wait()
    assert kubelet.available(resource) == ["ttyUSB0", "ttyUSB1"]
    # Never offered healthy while the pod held it: from the first list the kubelet got.
    assert lists == [{"ttyUSB0": "Unhealthy", "ttyUSB1": "Healthy"}, {"ttyUSB0": "Healthy", "ttyUSB1": "Healthy"}]
    short = gdp_ids[paths[0]][:12]
    assert warned.lines == [
        f"{resource}: 1 device held by running pods under IDs this plugin does not offer (another plugin's, such as "
        f"generic-device-plugin's, or a device gone since): default/modem/app holds ttyUSB0 as {short}…: Unhealthy "
        "here until that pod ends (docs/generic-device-plugin.md: Switching a node from generic-device-plugin)"
    ]
    assert offered.lines[-1] == f"{resource}: ttyUSB0: the pod holding it under another plugin's ID has ended: offered"
    assert pod_resources.calls[0] == "List" and set(pod_resources.calls) == {"List"}


def test_foreign_holds_tell_generic_device_plugins_ids_from_unknown_ones():
    """A held ID that is generic-device-plugin's for a device (a count above 1 too; a device of
    several entries by its members' paths) is named; ours (a replica's too) is not a foreign hold;
    any other is held by "a device this plugin cannot tell"."""
    resource = gp.parse_config(
        "resources: [{name: squat.ai/fuse, directory: /dev, pattern: fuse, replicas: 2}]"
    ).resources[0]
    fuse = gp.DeviceEntry("fuse", "/dev/fuse")
    pair = gp.DeviceEntry(
        "C0",
        "/dev/snd/controlC0",
        members=(gp.DeviceEntry("C0", "/dev/snd/controlC0"), gp.DeviceEntry("C0", "/dev/snd/pcmC0D0c")),
    )
    third = hashlib.sha1(b"3/dev/fuse").hexdigest()
    both = hashlib.sha1(b"0/dev/snd/controlC0/dev/snd/pcmC0D0c").hexdigest()
    pod = gp.podresourcespb.PodResources(name="p", namespace="ns")
    pod.containers.add(
        name="c",
        devices=[
            gp.podresourcespb.ContainerDevices(resource_name=resource.name, device_ids=["fuse::1", third, both, "zz"])
        ],
    )
    other = gp.podresourcespb.PodResources(name="q", namespace="ns")
    other.containers.add(
        name="c", devices=[gp.podresourcespb.ContainerDevices(resource_name="squat.ai/x", device_ids=["y"])]
    )
    holds = gp.foreign_holds(resource, [fuse, pair], [pod, other])
    assert [(h.holder.pod, h.kubelet_id, h.device_id) for h in holds] == [
        ("p", third, "fuse"),
        ("p", both, "C0"),
        ("p", "zz", ""),
    ]
    # A shared resource holds nothing back (each pod has a share); an ID it cannot tell, neither:
    # both are named, with what the kubelet may do and what to do.
    assert gp.foreign_holds_report(holds, held_back=False) == (
        f"3 devices held by running pods under IDs this plugin does not offer (another plugin's, such as "
        f"generic-device-plugin's, or a device gone since): ns/p/c holds {third[:12]}…, fuse, a share of it; "
        f"ns/p/c holds {both[:12]}…, C0, a share of it; ns/p/c holds zz, a device this plugin cannot tell: the "
        "kubelet counts only the IDs it gave as in use and may give the same device to another pod: drain the node, "
        "or keep new pods of this resource off it, until they end (docs/generic-device-plugin.md: Switching a node "
        "from generic-device-plugin)"
    )
    kept = gp.held_back({"fuse": fuse, "C0": pair}, holds)
    assert (kept["fuse"].health, kept["fuse"].problem) == (
        gp.UNHEALTHY,
        "held by pod ns/p under another plugin's ID, until that pod ends",
    )
    assert kept["C0"].health == gp.UNHEALTHY and kept["C0"].members == pair.members
    nothing = {"fuse": fuse}
    assert gp.held_back(nothing, holds[2:]) is nothing and gp.held_back(gp.RETIRED, holds) is gp.RETIRED


async def test_probe_fails_a_plugin_the_kubelet_does_not_read(node):
    # A kubelet that accepts Register but never opens ListAndWatch (one that dropped the plugin:
    # resources stuck at 0). Every DevicePlugin call still answers; only the status tells.
    async def register(request):
        return v1beta1.Empty()

    registration = purerpc.Service("v1beta1.Registration")
    registration.add_method("Register", register, gp.METHODS[gp.REGISTER].signature)
    with trio.fail_after(TIMEOUT), logged("registered with the kubelet as") as registered:
        async with trio.open_nursery() as nursery:
            async with trio.open_nursery() as deaf:
                await deaf.start(gp.serve_grpc, node.kubelet_socket, [registration])
                await nursery.start(gp.serve_plugin, node.config())
                await registered.wait()
                [patient] = await gp.probe(node.plugin_dir, [RESOURCE], grace=3600)
                [strict] = await gp.probe(node.plugin_dir, [RESOURCE], grace=0)
                deaf.cancel_scope.cancel()
            # A real kubelet starts: it registers the plugin again, and reads its list.
            simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
            await simulator.wait_until(listed("g1", "g2"))
            [good] = await gp.probe(node.plugin_dir, [RESOURCE], grace=0)
            nursery.cancel_scope.cancel()
    assert (patient.error, patient.status.registered, patient.status.streams) == ("", True, 0)
    assert strict.error.startswith(
        "gopherplug-example.com_gopher-1.sock answers, but the kubelet has had no ListAndWatch stream from it for "
    )
    assert strict.error.endswith(" s (registered: yes): it is not using these devices")
    assert (good.error, good.status.registered, good.status.streams) == ("", True, 1)


@pytest.mark.slow
async def test_json_logs_one_object_per_event_with_the_resource(nursery, node, tmp_path):
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    process = await trio.lowlevel.open_process(
        [sys.executable, str(HERE / "gopherplug.py"), "--config", str(path)],
        stderr=subprocess.PIPE,
        env={**os.environ, "GOPHERPLUG_LOG_FORMAT": "json"},
    )
    said = bytearray()

    async def read_until(text: bytes) -> None:  # b"" reads to the end
        while not text or text not in said:
            if not (chunk := await process.stderr.receive_some()):
                return
            said.extend(chunk)

    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            await simulator.allocate(RESOURCE, ["g2"])
            # The kubelet lists the devices before its Register call returns: the plugin logs its
            # registration after the kubelet's first calls, so that line is waited for.
            await read_until(b"registered with the kubelet as ")
            process.send_signal(signal.SIGTERM)
            await read_until(b"")
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    events = [json.loads(line) for line in said.decode().splitlines()]
    by_message = {event["message"]: event for event in events}
    assert by_message["allocated g2"] == {**by_message["allocated g2"], "level": "info", "resource": RESOURCE}
    assert "resource" not in by_message["SIGTERM received: stopping"]
    registered = [e for e in events if e["message"].startswith("registered with the kubelet as ")]
    assert len(registered) == 1 and registered[0]["resource"] == RESOURCE
    assert all(event["time"].endswith("+00:00") or event["time"][-6] in "+-" for event in events)


@contextlib.contextmanager
def device_cgroup_denying(node_path):
    """A cgroup v1 device cgroup whose processes may not open the device number of ``node_path``,
    as an unprivileged container's may not open what its spec does not list: yields the argv prefix
    that runs a command inside it. Needs root and the v1 devices controller (cgroup v2 does the
    same with an eBPF program, which this test does not build)."""
    devices = "/sys/fs/cgroup/devices"
    if os.geteuid() != 0 or not os.path.isfile(os.path.join(devices, "devices.deny")):
        pytest.skip("needs root and cgroup v1's devices controller")
    rdev = os.stat(node_path).st_rdev
    group = tempfile.mkdtemp(prefix="gopherplug-test-", dir=devices)
    try:
        Path(group, "devices.deny").write_text(f"c {os.major(rdev)}:{os.minor(rdev)} rwm\n")
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
    finally:
        os.rmdir(group)  # its processes have exited: run() waited for them


@pytest.mark.slow
def test_a_node_refused_only_by_the_plugins_own_device_cgroup_is_healthy(node, tmp_path):
    # In an unprivileged pod, access() on every device node the plugin offers fails with EPERM:
    # its device cgroup lists none of them (a real node: kvm, tun, ttyUSB0 were all Unhealthy).
    # The consumer is given the node in its own cgroup, so that refusal says nothing of the device.
    gpu = os.path.join(node.devices, "gpu0")
    for name in os.listdir(node.devices):
        os.unlink(os.path.join(node.devices, name))
    os.mknod(gpu, 0o660 | stat.S_IFCHR, os.makedev(240, 0))  # no driver needed: nothing opens it
    path = write_config(node, tmp_path)
    with device_cgroup_denying(gpu) as inside:
        script = f"import os\ntry: os.open({gpu!r}, os.O_RDWR)\nexcept OSError as e: print(e.errno)"
        opened = subprocess.run([*inside, sys.executable, "-c", script], capture_output=True, text=True, check=True)
        assert opened.stdout == f"{errno.EPERM}\n"  # the premise: the cgroup refuses, whatever the mode
        result = subprocess.run(
            [*inside, sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:] == [
        f"{RESOURCE}: 1 device, 1 healthy, from {node.devices}/*",
        "  ID    HEALTH     PATH",
        f"  gpu0  Healthy    {gpu}",
        "  Allocate gpu0 gives a container:",
        f"    device {gpu} <- {gpu} rw",
        "    env GOPHER_DEVICES=gpu0",
    ]


@pytest.mark.slow
def test_check_config_as_root_shows_what_the_pod_would_refuse(node, tmp_path):
    # Root on the node keeps CAP_DAC_OVERRIDE; the shipped pod (root, capabilities dropped) does not.
    if os.geteuid() != 0:
        pytest.skip("needs root: the difference is root's CAP_DAC_OVERRIDE")
    g1 = os.path.join(node.devices, "g1")
    os.chmod(g1, 0o600)
    os.chown(g1, 1000, 1000)
    path = write_config(node, tmp_path)
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.splitlines()[1:] == [
        f"{RESOURCE}: 2 devices, 2 healthy, from {node.devices}/*",
        "  ID  HEALTH     PATH",
        f"  g1  Healthy    {g1} (Unhealthy in the shipped pod: mode 0600 and owner 1000:1000 refuse reading "
        "to root without capabilities)",
        f"  g2  Healthy    {node.devices}/g2",
        "  Allocate g1 gives a container:",
        "    env GOPHER_DEVICES=g1",
    ]
    # Without the capability, this process's own verdict is the pod's.
    dropped = subprocess.run(
        [*without_dac_override(), sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (
        f"  g1  Unhealthy  {g1} (this process cannot open {g1} for reading: mode 0600 and owner 1000:1000 refuse "
        "reading to root without capabilities: fix the mode or owner on the host (a udev rule, for nodes that come and "
        "go))"
    ) in dropped.stdout.splitlines()


@pytest.mark.slow
async def test_debug_logs_are_gopherplugs_own_not_the_http2_internals(nursery, node, tmp_path):
    # At debug, h2 and hpack logged 36 lines per Allocate call (every frame, every header table change).
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    with open(tmp_path / "stderr", "wb") as stderr:
        process = await trio.lowlevel.open_process(
            [sys.executable, str(HERE / "gopherplug.py"), "--config", str(path), "--log-level", "debug"], stderr=stderr
        )
    try:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            for _ in range(10):
                await simulator.allocate(RESOURCE, ["g2"])
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert f" DEBUG {RESOURCE}: sent 2 devices" in "\n".join(lines)  # gopherplug's own debug lines are there
    assert sum(" allocated g2" in line for line in lines) == 10
    assert len(lines) < 40, "\n".join(lines[:60])  # about 20; each Allocate is one line


@pytest.mark.slow
def test_probe_without_any_plugin_exits_1(node):
    result = run_cli("probe", "--device-plugin-dir", node.plugin_dir)
    assert (result.returncode, result.stdout) == (1, f"no gopherplug socket in {node.plugin_dir}\n")


def test_plain_probe_says_which_directories_hold_no_kubelet_not_that_it_waits(tmp_path, capsys, monkeypatch):
    # Plain `probe` said "waiting for the kubelet in ..." (serve's line), and then exited 1.
    known = (str(tmp_path / "a"), str(tmp_path / "b"))
    monkeypatch.setattr(gp, "KNOWN_DEVICE_PLUGIN_DIRS", known)
    monkeypatch.delenv("GOPHERPLUG_DEVICE_PLUGIN_DIR", raising=False)
    assert gp.main(["probe"]) == gp.EXIT_FAILURE
    assert capsys.readouterr() == (
        "",
        f"gopherplug: no kubelet.sock in {known[0]}, {known[1]}: no kubelet runs here, or it uses another "
        "directory: give --device-plugin-dir (or --config)\n",
    )
    os.mkdir(known[1])  # a kubelet's directory, and no plugin in it
    with socket.socket(socket.AF_UNIX) as kubelet:
        kubelet.bind(os.path.join(known[1], "kubelet.sock"))
        assert gp.main(["probe"]) == gp.EXIT_FAILURE
    assert capsys.readouterr() == (f"no gopherplug socket in {known[1]}\n", "")


@pytest.mark.slow
def test_check_config_summarises_a_good_file(node, tmp_path):
    os.symlink("/dev/null", os.path.join(node.devices, "null"))
    os.symlink("/dev/zero", os.path.join(node.devices, "zero"))
    os.symlink("/etc/hostname", os.path.join(node.devices, "host"))
    Path(node.devices, "has space").touch()
    path = write_config(node, tmp_path, allowed_host_paths=["/dev/null"])
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    outside = f"is outside {node.devices}, /dev/null: add its directory to allowed_host_paths"
    assert result.stdout == (
        f"{path}: OK: 1 resource(s): {RESOURCE} ({node.devices}/*); kubelet at {node.plugin_dir}\n"
        f"{RESOURCE}: 4 devices, 4 healthy, from {node.devices}/*\n"
        "  ID    HEALTH     PATH\n"
        f"  g1    Healthy    {node.devices}/g1\n"
        f"  g2    Healthy    {node.devices}/g2\n"
        f"  host  Healthy    {node.devices}/host -> /etc/hostname\n"  # a file, not a node: no DeviceSpec
        f"  null  Healthy    {node.devices}/null -> /dev/null\n"
        "  skipped 'has space': a device ID must be 1 to 63 of A-Z a-z 0-9 . _ - :, without '::'\n"
        f"  skipped 'zero': host path /dev/zero {outside}\n"
        "  Allocate g1 gives a container:\n"  # a file, not a node: no DeviceSpec
        "    env GOPHER_DEVICES=g1\n"
    )
    via_env = run_cli("check-config", env={"GOPHERPLUG_CONFIG": str(path)})
    assert via_env.stdout == result.stdout


@pytest.mark.slow
def test_check_config_shows_each_devices_members(tmp_path):
    dev, plugin_dir = str(tmp_path / "dev"), str(tmp_path / "dp")
    os.mkdir(plugin_dir)  # a kubelet's directory (a missing one is warned about)
    by_path = gpu_by_path(dev)
    sysfs = usb_tree(tmp_path)
    usb_nodes(dev, "bus/usb/001/003", "hidraw0")
    path = tmp_path / "gopherplug.yaml"
    resources = [
        {"name": "example.com/gpu", "directory": by_path, "id_pattern": GPU_ID_PATTERN},
        {"name": "example.com/yubikey", "usb": [{"vendor": "1050", "product": "0407"}]},
    ]
    for resource in resources:
        resource["allowed_host_paths"] = ["/dev/null"]  # where mknod is refused, nodes are links to it
    top = {"device_plugin_dir": plugin_dir, "dev_root": dev, "sysfs_root": sysfs}
    path.write_text(yaml.safe_dump({**top, "resources": resources}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    real = os.path.realpath
    assert result.stdout == (
        f"{path}: OK: 2 resource(s): example.com/gpu ({by_path}/*), example.com/yubikey (USB 1050:0407); "
        f"kubelet at {plugin_dir}\n"
        f"example.com/gpu: 1 device, 1 healthy, from {by_path}/*\n"
        "  ID            HEALTH     PATH\n"
        f"  0000:00:02.0  Healthy    {by_path}/pci-0000:00:02.0-card -> {real(dev + '/dri/card1')}\n"
        f"                           {by_path}/pci-0000:00:02.0-firmware\n"
        f"                           {by_path}/pci-0000:00:02.0-render -> {real(dev + '/dri/renderD128')}\n"
        # the pattern as written in the file, its backslashes not doubled
        f"  skipped 'platform-simple-framebuffer.0-card': id_pattern '{GPU_ID_PATTERN}' finds no ID in the name\n"
        "  Allocate 0000:00:02.0 gives a container:\n"
        f"    device {by_path}/pci-0000:00:02.0-card <- {real(dev + '/dri/card1')} rw\n"
        f"    device {by_path}/pci-0000:00:02.0-render <- {real(dev + '/dri/renderD128')} rw\n"
        f"    mount {by_path}/pci-0000:00:02.0-firmware <- {by_path}/pci-0000:00:02.0-firmware ro\n"
        "    env GPU_DEVICES=0000:00:02.0\n"
        "example.com/yubikey: 1 device, 1 healthy, from USB 1050:0407\n"
        "  ID        HEALTH     PATH\n"
        f"  12345678  Healthy    {dev}/bus/usb/001/003"
        + (" -> /dev/null" if os.path.islink(f"{dev}/hidraw0") else "")
        + "\n"
        f"            {' ' * 9}  {dev}/hidraw0" + (" -> /dev/null" if os.path.islink(f"{dev}/hidraw0") else "") + "\n"
        "  Allocate 12345678 gives a container:\n"
        f"    device {dev}/bus/usb/001/003 <- {real(dev + '/bus/usb/001/003')} rw\n"
        f"    device {dev}/hidraw0 <- {real(dev + '/hidraw0')} rw\n"
        "    env YUBIKEY_DEVICES=12345678\n"
    )


@pytest.mark.slow
def test_check_config_says_what_is_missing_and_strict_exits_1_for_it(tmp_path):
    # A directory not there (yet) or a machine without USB used to print "0 devices, 0 healthy", like a typo.
    missing, plugin_dir, sysfs = str(tmp_path / "gophers"), str(tmp_path / "dp"), str(tmp_path / "sys")
    os.mkdir(plugin_dir)  # a kubelet's directory (a missing one is warned about)
    path = tmp_path / "gopherplug.yaml"
    resources = [
        {"name": RESOURCE, "directory": missing},
        {"name": "example.com/yubikey", "usb": [{"vendor": "1050", "product": "0407"}]},
    ]
    top = {"device_plugin_dir": plugin_dir, "sysfs_root": sysfs, "dev_root": str(tmp_path)}
    path.write_text(yaml.safe_dump({**top, "resources": resources}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")  # valid: serve would run, and wait
    assert result.stdout == (
        f"{path}: OK: 2 resource(s): {RESOURCE} ({missing}/*), example.com/yubikey (USB 1050:0407); "
        f"kubelet at {plugin_dir}\n"
        f"{RESOURCE}: 0 devices, 0 healthy, from {missing}/*\n"
        f"  warning: {missing} does not exist (yet): serve waits for it\n"
        "  a container: none, no healthy device to give\n"
        "example.com/yubikey: 0 devices, 0 healthy, from USB 1050:0407\n"
        f"  warning: {sysfs}/bus/usb/devices does not exist: this machine has no USB bus (yet)\n"
        "  a container: none, no healthy device to give\n"
    )
    strict = run_cli("check-config", "--strict", "--config", str(path))
    assert (strict.returncode, strict.stdout) == (1, result.stdout)
    assert strict.stderr == (
        f"gopherplug: --strict: {RESOURCE}: a warning and no healthy device\n"
        "gopherplug: --strict: example.com/yubikey: a warning and no healthy device\n"
    )
    os.mkdir(missing)
    Path(missing, "g0").touch()
    path.write_text(yaml.safe_dump({**top, "resources": resources[:1]}))
    assert run_cli("check-config", "--strict", "--config", str(path)).returncode == 0


@pytest.mark.slow
def test_check_config_says_what_to_write_for_a_directory_that_is_a_device_or_a_glob(tmp_path):
    # generic-device-plugin's `path: /dev/fuse` and `path: /dev/ttyUSB*`, carried over as directories:
    # serve would never find a device, and check-config only said "is not a directory".
    glob, plain = str(tmp_path / "ttyUSB*"), str(tmp_path / "gophers")
    path = tmp_path / "gopherplug.yaml"
    resources = [
        {"name": "example.com/null", "directory": "/dev/null"},
        {"name": "example.com/serial", "match": [{"directory": glob}, {"directory": plain}]},
    ]
    os.mkdir(tmp_path / "dp")  # a kubelet's directory (a missing one is warned about)
    path.write_text(yaml.safe_dump({"device_plugin_dir": str(tmp_path / "dp"), "resources": resources}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")  # valid: serve would run, and wait
    warnings = [line for line in result.stdout.splitlines() if line.startswith("  warning: ")]
    assert warnings == [
        "  warning: /dev/null is a character device, not a directory of devices: to offer it, write directory: /dev "
        "and pattern: 'null'",
        f"  warning: {glob} does not exist, and a directory is not a glob: for the entries it matches, write "
        f"directory: {tmp_path} and pattern: 'ttyUSB*'",
        f"  warning: {plain} does not exist (yet): serve waits for it",  # maybe not plugged in yet: no advice
    ]
    Path(plain).write_text("")
    result = run_cli("check-config", "--config", str(path))
    assert (
        f"  warning: {plain} is a file, not a directory of devices: to offer it, write directory: {tmp_path} and "
        "pattern: 'gophers'"
    ) in result.stdout.splitlines()


async def test_serve_says_what_to_write_for_a_directory_that_is_a_device(nursery, node, caplog):
    with trio.fail_after(TIMEOUT):
        simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
        await nursery.start(gp.serve_plugin, node.config(directory="/dev/null"))
        await simulator.wait_until(listed())
    assert (
        f"{RESOURCE}: /dev/null is a character device, not a directory of devices: to offer it, write directory: "
        "/dev and pattern: 'null'"
    ) in caplog.messages


@pytest.mark.slow
def test_check_config_shows_what_a_container_gets_for_one_device(node, tmp_path):
    # Allocate's own answer for the first healthy device: the user had to script the simulator to see it.
    path = write_config(
        node,
        tmp_path,
        env="GOPHERS",
        replicas=2,
        device_specs=[{"host_path": "{path}", "container_path": "/dev/gopher-{id}", "permissions": "r"}],
        mounts=[{"host_path": "/etc/gophers", "container_path": "/run/{id}", "read_only": True}],
        allowed_host_paths=["/etc/gophers"],
        annotations={"example.com/gophers": "{id}"},
        cdi={"kind": "example.com/gopher", "spec_dir": str(tmp_path / "cdi")},
    )
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout.split("\n", 1)[1] == (
        f"{RESOURCE}: 2 devices, 2 healthy (each offered 2 times), from {node.devices}/*\n"
        "  ID  HEALTH     PATH\n"
        f"  g1  Healthy    {node.devices}/g1\n"
        f"  g2  Healthy    {node.devices}/g2\n"
        "  Allocate g1::0 gives a container:\n"
        f"    device /dev/gopher-g1 <- {node.devices}/g1 r\n"
        "    mount /run/g1 <- /etc/gophers ro\n"
        "    env GOPHERS=g1\n"
        "    annotation example.com/gophers=g1\n"
        "    cdi example.com/gopher=g1\n"
    )


@pytest.mark.slow
def test_check_config_warns_when_allocate_would_refuse_every_pod(node, tmp_path):
    # Two members of one device share {index}: the file is valid, and every Allocate of g1 fails.
    for name in ("g1", "g2"):
        os.unlink(os.path.join(node.devices, name))
    for name in ("g1-a", "g1-b"):
        Path(node.devices, name).touch()
    specs = [{"host_path": "{path}", "container_path": "/dev/gopher{index}"}]
    path = write_config(node, tmp_path, id_pattern="(?P<id>g[0-9]+)-[a-z]", device_specs=specs)
    result = run_cli("check-config", "--strict", "--config", str(path))
    assert result.stdout.splitlines()[-1] == (
        f"  warning: Allocate g1 fails, and so would every pod given it: two devices for container path "
        f"/dev/gopher0, from {node.devices}/g1-a and {node.devices}/g1-b: put {{id}} or {{index}} in the container path"
    )
    assert (result.returncode, result.stderr) == (1, f"gopherplug: --strict: {RESOURCE}: a warning\n")


@pytest.mark.slow
def test_cli_takes_no_abbreviation_and_sends_generic_device_plugins_device_to_the_readme(node, tmp_path):
    # argparse took generic-device-plugin's --device for an abbreviation of --device-plugin-dir:
    # "--device-plugin-dir: '{"name":"serial",…}' must be an absolute path".
    document = '{"name": "serial", "groups": [{"paths": [{"path": "/dev/ttyUSB*"}]}]}'
    for args in (["--device", document], ["serve", f"--device={document}"], ["check-config", "--device", document]):
        result = run_cli(*args)
        assert (result.returncode, result.stdout) == (2, "")
        assert result.stderr == (
            "gopherplug: --device: is generic-device-plugin's option, not gopherplug's: write each --device as a "
            "resource of the configuration file given by --config (docs/generic-device-plugin.md translates it)\n"
        )
    assert (HERE / "docs" / "generic-device-plugin.md").read_text().startswith("# Coming from generic-device-plugin\n")
    # No other prefix of an option is taken for it either, on any command.
    path = write_config(node, tmp_path)
    for args, meant in (
        (["check-config", "--conf", str(path)], "--config"),
        (["probe", "--device-plugin", node.plugin_dir], "--device-plugin-dir"),
    ):
        result = run_cli(*args)
        assert (result.returncode, result.stderr) == (
            2,
            f"gopherplug {args[0]}: {args[1]} is not an option: did you mean {meant}?\n",
        )


@pytest.mark.slow
def test_check_config_says_serve_would_stop_for_an_extra_that_is_not_installed(node, sockdir, tmp_path):
    # check-config --strict exited 0 for metrics_address or dra without their extra, and serve exited 1.
    blocked = tmp_path / "blocked"  # modules that fail to import, as an absent extra does
    blocked.mkdir()
    for module in ("prometheus_client", "lightkube"):
        (blocked / f"{module}.py").write_text(f'raise ImportError("No module named {module!r}")\n')
    env = {"PYTHONPATH": str(blocked), "NODE_NAME": "node-1"}
    metrics = "metrics_address needs prometheus_client (No module named 'prometheus_client')"
    path = write_config(node, tmp_path)
    (g := Path(sockdir, "g")).mkdir()
    (g / "gopher0").touch()
    dra = tmp_path / "dra.yaml"
    dra.write_text(dra_config(g, Path(sockdir, "k"), cdi={"kind": "example.com/gopher"}))
    for config, args, problem, extra in (
        (path, ["--metrics-address", "127.0.0.1:0"], metrics, "metrics"),
        (dra, [], "DRA needs the Kubernetes client lightkube (No module named 'lightkube')", "dra"),
    ):
        warning = (
            f"gopherplug: warning: {problem}: install gopherplug with its {extra} extra, pip install '.[{extra}]' "
            "in a checkout: serve would stop at start"
        )
        result = run_cli("check-config", "--config", str(config), *args, env=env)
        assert (result.returncode, result.stderr.splitlines()) == (0, [warning])
        strict = run_cli("check-config", "--strict", "--config", str(config), *args, env=env)
        assert (strict.returncode, strict.stderr.splitlines()) == (
            1,
            [warning, f"gopherplug: --strict: {problem.split(' (')[0]}"],
        )
    served = run_cli("serve", "--config", str(path), "--metrics-address", "127.0.0.1:0", env=env)
    assert served.returncode == 1
    assert served.stderr.splitlines()[-1].endswith(
        f"ERROR {metrics}: install gopherplug with its metrics extra, pip install '.[metrics]' in a checkout"
    )


@pytest.mark.parametrize(
    ("given", "kubelet_in", "problem"),
    [
        ("{0}", None, None),  # there, no kubelet on this machine yet: nothing to say
        ("{0}", 0, None),
        ("{0}-typo", None, "{0}-typo does not exist: serve would wait there for the kubelet; did you mean {0}?"),
        ("/nowhere-like-it", None, "/nowhere-like-it does not exist: serve would wait there for the kubelet"),
        (
            "{0}-typo",
            1,
            "{0}-typo does not exist: serve would wait there for the kubelet; this machine's kubelet is in {1}",
        ),
        (
            "{0}",
            1,
            "{0} holds no kubelet.sock: serve would wait there for the kubelet; this machine's kubelet is in {1}",
        ),
    ],
)
def test_device_plugin_dir_mistake_proposes_the_kubelets_directory(sockdir, given, kubelet_in, problem):
    known = [os.path.join(sockdir, "k", "device-plugins"), os.path.join(sockdir, "mk", "device-plugins")]
    for directory in known:
        os.makedirs(directory)
    with socket.socket(socket.AF_UNIX) as kubelet:
        if kubelet_in is not None:
            kubelet.bind(os.path.join(known[kubelet_in], "kubelet.sock"))
            kubelet.listen()
        expected = problem.format(*known) if problem else None
        assert gp.device_plugin_dir_mistake(given.format(*known), known) == expected


def test_device_plugin_dir_mistake_proposes_no_directory_that_is_missing_too(sockdir):
    """A known directory given, missing on this machine: no "did you mean" itself (another known
    one may be proposed)."""
    known = [os.path.join(sockdir, "k", "device-plugins"), os.path.join(sockdir, "k2", "device-plugins")]
    for directory, other in (known, known[::-1]):
        said = f"{directory} does not exist: serve would wait there for the kubelet"
        assert gp.device_plugin_dir_mistake(directory, known) == f"{said}; did you mean {other}?"
        assert gp.device_plugin_dir_mistake(directory, [directory]) == said


@pytest.mark.slow
def test_check_config_takes_the_charts_configmap_and_helm_templates_output(helm, tmp_path):
    """What the chart's README promises: check-config --config on the chart's ConfigMap, or on
    `helm template`'s whole output, checks the configuration in it (and refuses what it refuses)."""
    render = helm_template(helm, "chart/gopherplug/ci/device-plugin-values.yaml")
    assert render.returncode == 0, render.stderr
    (configmap,) = [doc for doc in yaml.safe_load_all(render.stdout) if doc and doc["kind"] == "ConfigMap"]
    whole, alone = tmp_path / "render.yaml", tmp_path / "configmap.yaml"
    whole.write_text(render.stdout)
    alone.write_text(yaml.safe_dump(configmap))
    for path in (whole, alone):
        result = run_cli("check-config", "--config", str(path))
        first = result.stdout.splitlines()[0] if result.stdout else result.stderr
        assert first.startswith(f"{path} (ConfigMap kube-system/gopherplug, config.yaml): OK: 1 resource(s): "), first
    configmap["data"]["config.yaml"] = configmap["data"]["config.yaml"].replace("resources:", "resourcs:")
    alone.write_text(yaml.safe_dump(configmap))
    result = run_cli("check-config", "--config", str(alone))
    assert result.returncode == 2
    assert result.stderr.startswith(f"gopherplug: {alone} (ConfigMap kube-system/gopherplug, config.yaml): resourcs: ")
    alone.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}}))
    assert run_cli("check-config", "--config", str(alone)).stderr == (
        f"gopherplug: {alone}: holds Kubernetes objects, Secret, and no ConfigMap with a config.yaml key: give the "
        "chart's ConfigMap, helm template's output, or the configuration file\n"
    )


@pytest.mark.slow
def test_check_config_warns_of_a_device_plugin_dir_that_is_not_there(node, tmp_path):
    # A typo in device_plugin_dir: serve waits for the kubelet for ever, and check-config said nothing.
    if gp._kubelets_directory(gp.KNOWN_DEVICE_PLUGIN_DIRS) is not None:
        pytest.skip("a kubelet runs on this machine: the line names its directory instead")
    path = write_config(node, tmp_path)
    typo = "/var/lib/kubelet/device-plugin"
    for args, named in (([], "device_plugin_dir"), (["--device-plugin-dir", typo], "--device-plugin-dir")):
        if not args:
            path.write_text(path.read_text().replace(node.plugin_dir, typo))
        result = run_cli("check-config", "--config", str(path), *args)
        warning = (
            f"gopherplug: warning: {named}: {typo} does not exist: serve would wait there for the kubelet; did you "
            "mean /var/lib/kubelet/device-plugins?"
        )
        assert (result.returncode, result.stderr.splitlines()) == (0, [warning])
        strict = run_cli("check-config", "--strict", "--config", str(path), *args)
        assert (strict.returncode, strict.stderr.splitlines()) == (
            1,
            [warning, f"gopherplug: --strict: {named}: no kubelet.sock"],
        )


@pytest.mark.slow
def test_check_config_rejects_a_bad_file_with_exit_2(node, tmp_path):
    path = write_config(node, tmp_path, directory="relative")
    result = run_cli("check-config", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr == f"gopherplug: {path}: resources[0].directory: 'relative' must be an absolute path\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fields", "stderr"),
    [
        (
            {"directory": "{dev}"},
            "resources[0].pattern: '*' (the default) in {dev} offers every entry there read-write, disks, kmsg and "
            "mem among them: name the devices (e.g. 'ttyUSB*'), or set whole_dev: true",
        ),
        (
            {"match": [{"directory": "{devices}"}, {"directory": "{dev}/", "pattern": "**"}]},
            "resources[0].match[1].pattern: '**' in {dev} offers every entry there read-write, disks, kmsg and mem "
            "among them: name the devices (e.g. 'ttyUSB*'), or set whole_dev: true",
        ),
        (
            {"whole_dev": True},
            "resources[0].whole_dev: is for a pattern that matches every entry of {dev}, and this resource has "
            "none: remove it",
        ),
        ({"directory": "{dev}", "whole_dev": True}, None),  # asked for: offered
    ],
)
def test_a_pattern_that_offers_the_whole_dev_root_needs_whole_dev(node, tmp_path, fields, stderr):
    dev = str(tmp_path / "dev")  # dev_root: the same rule as for /dev itself
    os.mkdir(dev)
    fill = {"dev": dev, "devices": node.devices}
    resource = json.loads(
        json.dumps({"name": RESOURCE, **fields}).replace("{dev}", dev).replace("{devices}", node.devices)
    )
    if "match" not in resource and "directory" not in resource:
        resource["directory"] = node.devices
    path = tmp_path / "gopherplug.yaml"
    path.write_text(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "dev_root": dev, "resources": [resource]}))
    result = run_cli("check-config", "--config", str(path))
    if stderr is None:
        assert (result.returncode, result.stderr) == (0, "")
    else:
        assert (result.returncode, result.stderr) == (2, f"gopherplug: {path}: {stderr.format(**fill)}\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pattern", "glob"),
    [
        (r"tty\d+", "'tty[0-9]*'"),
        ("^ttyUSB.*$", "'ttyUSB*'"),
        ("(a|b)", "it as a glob (alternatives: a match entry each)"),
    ],
)
def test_a_glob_that_looks_like_a_regex_is_warned_about(node, tmp_path, pattern, glob):
    # Valid, so not refused; but as a glob it matches only names with a backslash or a plus in them.
    path = write_config(node, tmp_path, pattern=pattern)
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (
        0,
        f"gopherplug: warning: {path}: resources[0].pattern: '{pattern}' looks like a regular expression, but "
        f"pattern is a glob (fnmatch): write {glob}\n",
    )


@pytest.mark.slow
def test_serve_logs_the_warning_about_a_regex_like_glob(node, tmp_path):
    # A directory where the socket would be ends serve at once (exit 1): the warning came first.
    os.mkdir(os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-1.sock"))
    path = write_config(node, tmp_path, pattern=r"g\d+")
    result = run_cli("serve", "--config", str(path), timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0].split(" ", 1)[1] == (
        rf"WARNING {path}: resources[0].pattern: 'g\d+' looks like a regular expression, but pattern is a glob "
        "(fnmatch): write 'g[0-9]*'"
    )


@pytest.mark.slow
def test_check_config_without_roots_rights_says_what_serve_will_need(sockdir):
    """check-config said OK to a user without root's rights, and serve then failed: it says, a line
    each, where serve must create sockets or files (a missing directory's parent, where it would be
    made) and the kubelet's socket it must connect to. Run without CAP_DAC_OVERRIDE (setpriv drops
    root's capabilities; a user other than root has none), so that the mode bits decide."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to run check-config without root's capabilities")
    kubelet = Path(sockdir) / "kubelet"
    (kubelet / "device-plugins").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(kubelet / "device-plugins" / "kubelet.sock"))
        for path in (kubelet / "device-plugins" / "kubelet.sock", kubelet / "device-plugins", kubelet):
            path.chmod(0o555)
        config = {
            "device_plugin_dir": str(kubelet / "device-plugins"),
            "dra": {"driver": "gopherplug.example.com", "kubelet_dir": str(kubelet)},
            "resources": [
                {"name": "example.com/null", "directory": "/dev", "pattern": "null", "cdi": {"kind": "a.b/nul"}},
                {"name": "example.com/zero", "directory": "/dev", "pattern": "zero", "api": "dra"},
            ],
        }
        config["resources"][0]["cdi"]["spec_dir"] = str(kubelet / "cdi")
        path = Path(sockdir) / "gopherplug.yaml"
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o444)
        drop = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"] if os.geteuid() == 0 else []
        result = subprocess.run(
            [*drop, sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "NODE_NAME": "node-1"},
            check=False,
        )
        for path in (kubelet, kubelet / "device-plugins"):
            path.chmod(0o755)  # for the fixture's clean-up
    cannot = f"which this process (uid {os.geteuid()}) cannot: run it as root"
    assert (result.returncode, result.stderr.splitlines()) == (
        0,
        [
            f"gopherplug: warning: serve will need to {does} {where}, {cannot}"
            for does, where in [
                ("write CDI specs in", kubelet / "cdi"),
                ("create its sockets in", kubelet / "device-plugins"),
                ("connect to", kubelet / "device-plugins" / "kubelet.sock"),
                ("create its registration socket in", kubelet / "plugins_registry"),
                ("create its DRA socket and checkpoint in", kubelet / "plugins" / "gopherplug.example.com"),
            ]
        ],
    )


@pytest.mark.slow
def test_an_attribute_named_like_a_standard_one_in_the_drivers_domain_is_warned_about(node, tmp_path):
    """attributes: {pcieRoot: ...} is published as <driver>/pcieRoot, which a claim's matchAttribute:
    resource.kubernetes.io/pcieRoot never sees: check-config (and serve, which logs the same
    warnings) names the standard attribute. One in a domain of the user's own, or the standard one
    itself, is what was meant."""
    attributes = {
        "pcieRoot": "pci0000:00",
        "gopherplug.example.com/pciBusID": "0000:01:00.0",
        "localNUMANodes": 0,
        "example.com/pcieRoot": "x",
        "resource.kubernetes.io/pcieRoot": "pci0000:00",
    }
    path = write_config(node, tmp_path, api="dra", attributes=attributes)
    document = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**document, "dra": {"driver": "gopherplug.example.com"}}))
    result = run_cli("check-config", "--config", str(path), env={"NODE_NAME": "node-1"})
    said = [line for line in result.stderr.splitlines() if "attributes" in line]
    assert (result.returncode, said) == (
        0,
        [
            f"gopherplug: warning: {path}: resources[0].attributes.{name}: is gopherplug.example.com/{short}, in the "
            f"driver's domain, where matchAttribute: resource.kubernetes.io/{short} never looks: name it "
            f"resource.kubernetes.io/{short}, the standard attribute"
            for name, short in [
                ("gopherplug.example.com/pciBusID", "pciBusID"),
                ("localNUMANodes", "localNUMANodes"),
                ("pcieRoot", "pcieRoot"),
            ]
        ],
    )
    assert [w.partition("attributes.")[2] for w in gp.load_config(str(path)).warnings] == [
        line.partition("attributes.")[2] for line in said
    ]  # what serve logs at start and at each reload


def test_a_relative_command_is_the_configuration_files_not_the_working_directorys(tmp_path, monkeypatch, capsys):
    """describe: [./describe-accel] beside the configuration file: resolved against the file's
    directory (check-config shows the path it runs), so that it works from any working directory, as
    serve in its pod runs; a configuration that is no file (parse_config's text) refuses it."""
    conf, devices = tmp_path / "conf", tmp_path / "accel"
    conf.mkdir()
    devices.mkdir()
    (devices / "hailo0").touch()
    script = conf / "describe-accel"
    script.write_text(f'#!{sys.executable}\nprint(\'{{"hailo0": {{"attributes": {{"model": "hailo-8"}}}}}}\')\n')
    script.chmod(0o755)
    path = conf / "gopherplug.yaml"
    resource = {"name": "example.com/hailo", "directory": str(devices), "describe": ["./describe-accel", "--quick"]}
    path.write_text(yaml.safe_dump({"resources": [resource]}))
    monkeypatch.chdir(tmp_path)  # where ./describe-accel is not
    assert gp.main(["check-config", "--config", "conf/gopherplug.yaml"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[2:6] == [
        f"  describe: {script} --quick",
        "  ID      HEALTH     PATH",
        f"  hailo0  Healthy    {devices}/hailo0",
        '          attributes: model="hailo-8"',
    ]
    with pytest.raises(gp.ConfigError) as info:
        gp.parse_config(path.read_text())
    assert str(info.value) == (
        "<config>: resources[0].describe[0]: './describe-accel' is relative, and this configuration has no file here "
        "to resolve it against: make it absolute"
    )


def a_mounted_block_device():
    """The device number of a filesystem mounted here that is on a block device (major not 0)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        number, mount_point = line.split()[2], line.split()[4]
        if not number.startswith("0:"):
            return tuple(map(int, number.split(":"))), mount_point
    pytest.skip("no filesystem here is mounted from a block device")


@pytest.mark.slow
@pytest.mark.parametrize("allowed", [False, True])
def test_a_block_device_that_holds_a_mounted_filesystem_is_skipped_unless_allowed(node, tmp_path, allowed):
    (major, minor), mount_point = a_mounted_block_device()
    try:
        os.mknod(os.path.join(node.devices, "disk"), 0o600 | stat.S_IFBLK, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("mknod is refused here")
    path = write_config(node, tmp_path, **({"allow_mounted": True} if allowed else {}))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (0, "")
    skipped = (
        f"  skipped 'disk': block device {major}:{minor} holds the filesystem mounted at {mount_point}: "
        "set allow_mounted: true to offer it\n"
    )
    assert (skipped in result.stdout) is not allowed
    assert (f"  disk  Healthy    {node.devices}/disk\n" in result.stdout) is allowed


@pytest.mark.slow
def test_check_config_refuses_octal_looking_numbers_with_what_they_became(node, tmp_path):
    path = write_config(node, tmp_path, replicas=10)
    path.write_text(path.read_text().replace("replicas: 10", "replicas: 010"))
    result = run_cli("check-config", "--config", str(path))
    assert (result.returncode, result.stderr) == (
        2,
        f"gopherplug: {path}: resources[0].replicas: 010 is read by YAML as an octal number, 8: write 8 if you "
        "meant that, or 10 without the leading zero\n",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        ((), "gopherplug: no configuration: give --config FILE or set GOPHERPLUG_CONFIG\n"),
        (
            ("serve", "--config", "/nonexistent.yaml"),
            "gopherplug: /nonexistent.yaml: cannot read: No such file or directory\n",
        ),
    ],
)
def test_serve_without_usable_config_exits_2(args, stderr):
    result = run_cli(*args, env={"GOPHERPLUG_CONFIG": ""})
    assert (result.returncode, result.stderr) == (2, stderr)


@pytest.mark.slow
def test_bad_usage_exits_2():
    result = run_cli("serve", "--log-level", "loud", env={"GOPHERPLUG_CONFIG": ""})
    assert result.returncode == 2
    assert "invalid choice: 'loud'" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("word", "said"),
    [
        ("server", "did you mean serve?"),
        ("chek-config", "did you mean check-config?"),
        ("xyzzy", "the commands are serve, check-config, probe, who, demo, kubelet"),
    ],
)
def test_a_word_that_is_not_a_command_is_one_line(word, said):
    """`gopherplug server` was `serve` with an unrecognized argument 'server' and the usage."""
    result = run_cli(word, env={"GOPHERPLUG_CONFIG": ""})
    assert (result.returncode, result.stdout, result.stderr) == (
        2,
        "",
        f"gopherplug: {word!r} is not a command: {said}\n",
    )


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        ("serve --conf F", "gopherplug serve: --conf is not an option: did you mean --config?"),
        ("--conf=F", "gopherplug serve: --conf is not an option: did you mean --config?"),
        ("check-config --stric", "gopherplug check-config: --stric is not an option: did you mean --strict?"),
        ("who --frobnicate", "gopherplug who: --frobnicate is not an option: gopherplug who --help lists them"),
        ("check-config F", "gopherplug check-config: 'F': use --config F"),
        ("demo F", "gopherplug demo: 'F': use --config F"),
        ("probe --config F G", "gopherplug probe: 'G': it takes no word"),
    ],
)
def test_an_option_misspelt_or_a_file_without_config_is_one_line(argv, said, capsys):
    """argparse said "unrecognized arguments: --conf F" after the usage; a near option is named, and
    a file given as a word is told how to be given."""
    assert gp.main(argv.split()) == 2
    assert capsys.readouterr() == ("", said + "\n")


@pytest.mark.slow
def test_check_config_into_a_pipe_closed_early_ends_without_a_traceback(node, tmp_path):
    """`check-config | head -1`: the reader has what it wanted; no BrokenPipeError traceback, and
    the status a shell gives a command SIGPIPE ended. The pipe's reading end is closed before
    check-config starts, so its first write meets a closed pipe whatever the machine's load (with
    `| head -c 1`, a short output can fit the pipe before head exits, and nothing breaks)."""
    path = write_config(node, tmp_path)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, str(HERE / "gopherplug.py"), "check-config", "--config", str(path)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")


@pytest.mark.slow
def test_the_script_without_its_dependencies_says_what_to_install_in_one_line(tmp_path):
    """`python gopherplug.py` from a checkout, in an environment without its dependencies (a bare
    venv): one line naming what is missing and what to install, not an import traceback."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    result = subprocess.run(
        [str(tmp_path / "bare" / "bin" / "python"), str(HERE / "gopherplug.py"), "check-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1 and result.stdout == "", result.stderr
    (line,) = result.stderr.splitlines()
    assert re.fullmatch(
        r"gopherplug: No module named '\w+': install its dependencies \(pip install \. in a checkout, or pip "
        r"install --require-hashes -r requirements/device-plugin\.lock\), or run it where they are",
        line,
    ), line
    assert (HERE / "requirements" / "device-plugin.lock").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "value", "stderr"),
    [
        ("GOPHERPLUG_LOG_LEVEL", "verbose", "GOPHERPLUG_LOG_LEVEL: 'verbose': use one of debug, info, warning, error"),
        ("GOPHERPLUG_LOG_FORMAT", "yaml", "GOPHERPLUG_LOG_FORMAT: 'yaml': use one of text, json"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "demo", "check-config"])  # check-config: what serve would refuse
def test_a_bad_log_setting_from_the_environment_is_one_line_and_exit_2(
    node, tmp_path, command, variable, value, stderr
):
    # argparse checks choices only on the command line: the variable's value was used unchecked.
    path = write_config(node, tmp_path)
    result = run_cli(command, env={"GOPHERPLUG_CONFIG": str(path), variable: value})
    assert (result.returncode, result.stderr) == (2, f"gopherplug: {stderr}\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (("--device-plugin-dir", "relative"), {}, "--device-plugin-dir"),
        ((), {"GOPHERPLUG_DEVICE_PLUGIN_DIR": "relative"}, "GOPHERPLUG_DEVICE_PLUGIN_DIR"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "probe", "check-config"])
def test_a_relative_device_plugin_dir_is_named_where_it_was_given(node, tmp_path, command, args, env, named):
    path = write_config(node, tmp_path)
    result = run_cli(command, "--config", str(path), *args, env=env)
    assert (result.returncode, result.stderr) == (2, f"gopherplug: {named}: 'relative' must be an absolute path\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "env"),
    [(("--device-plugin-dir", "{dir}"), {}), ((), {"GOPHERPLUG_DEVICE_PLUGIN_DIR": "{dir}"})],
)
def test_check_config_says_where_serve_would_find_the_kubelet_given_the_option_or_the_variable(
    node, tmp_path, args, env
):
    # serve takes the directory from either; check-config named the file's (or none) all the same.
    other = node.plugin_dir + "-other"  # short: a socket path must fit in it
    os.mkdir(other)  # a kubelet's directory (a missing one is warned about)
    path = write_config(node, tmp_path)
    args = [arg.format(dir=other) for arg in args]
    result = run_cli("check-config", "--config", str(path), *args, env={k: v.format(dir=other) for k, v in env.items()})
    assert (result.returncode, result.stderr) == (0, "")
    assert (
        result.stdout.splitlines()[0] == f"{path}: OK: 1 resource(s): {RESOURCE} ({node.devices}/*); kubelet at {other}"
    )


@pytest.mark.slow
def test_runtime_failure_exits_1_with_one_line(node, tmp_path):
    # Something that is not a socket occupies our socket's path: nothing gopherplug can fix.
    os.mkdir(os.path.join(node.plugin_dir, "gopherplug-example.com_gopher-1.sock"))
    result = run_cli("--config", str(write_config(node, tmp_path)), timeout=30)
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1].endswith(
        f"ERROR example.com/gopher: cannot serve on {node.plugin_dir}: Address already in use"
    )
    assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_signal_stops_cleanly_and_removes_sockets(nursery, node, tmp_path, signum):
    path = write_config(node, tmp_path)
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    async with reaped(argv, stderr=subprocess.DEVNULL) as process:
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            assert len(node.our_sockets()) == 1
            sent = trio.current_time()
            process.send_signal(signum)
            assert await process.wait() == 0
            elapsed = trio.current_time() - sent
            await simulator.wait_until(lambda s: devices_of(s) is None)  # the kubelet saw the stream end
    assert node.our_sockets() == []
    assert elapsed < 5, "generous bound; docs/performance.md gives the measured figure"


@pytest.mark.slow
async def test_sighup_reads_the_configuration_again_and_keeps_serving(nursery, node, tmp_path):
    path = write_config(node, tmp_path)
    # Written through a hard link in another directory, the file changes without an event for the
    # watch on its own directory (inotify reports to the parent of the name written through): only
    # SIGHUP can make the plugin see this change.
    os.mkdir(tmp_path / "elsewhere")
    os.link(path, tmp_path / "elsewhere" / "same.yaml")
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path)]
    async with reaped(argv, stderr=subprocess.PIPE) as process:
        stderr = StderrLines(process.stderr)
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            with open(tmp_path / "elsewhere" / "same.yaml", "r+") as same:  # in place: the same inode
                resource = {"name": RESOURCE, "directory": node.devices, "pattern": "g1"}
                same.write(yaml.safe_dump({"device_plugin_dir": node.plugin_dir, "resources": [resource]}))
                same.truncate()
            process.send_signal(signal.SIGHUP)
            await simulator.wait_until(listed("g1"))
            await stderr.wait_for(f"configuration reloaded: updated in place {RESOURCE}")
            assert process.returncode is None  # not killed (129), still serving
            said = stderr.text
            assert said.index(f"INFO SIGHUP received: reading {path} again") < said.index("configuration reloaded")
            process.send_signal(signal.SIGHUP)  # nothing changed since: said so
            await stderr.wait_for(f"INFO {path} unchanged")
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    assert node.our_sockets() == []


@pytest.mark.slow
@pytest.mark.parametrize("given", [["--metrics-address", "127.0.0.1:0"], []])
async def test_serve_with_a_metrics_address_reloads_nothing_at_start(nursery, node, tmp_path, given):
    # The option made the running configuration differ from the file's first reading: "configuration
    # reloaded: no resource changed" 100 ms after every start.
    path = write_config(node, tmp_path)
    env = {**os.environ, "GOPHERPLUG_METRICS_ADDRESS": "127.0.0.1:0"} if not given else None
    simulator = await nursery.start(gp.KubeletSimulator(node.plugin_dir).run)
    argv = [sys.executable, str(HERE / "gopherplug.py"), "serve", "--config", str(path), *given]
    async with reaped(argv, stderr=subprocess.PIPE, env=env) as process:
        stderr = StderrLines(process.stderr)
        with trio.fail_after(TIMEOUT):
            await simulator.wait_until(listed("g1", "g2"))
            await stderr.wait_for("serving Prometheus metrics on http://127.0.0.1:")
            process.send_signal(signal.SIGHUP)  # read after the first reading, and said after anything it did
            await stderr.wait_for(f"INFO {path} unchanged")
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    assert "configuration reloaded" not in stderr.text
