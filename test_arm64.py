"""The runtime tier on arm64, under emulation: the artefacts built for linux/arm64 run on this machine
through QEMU (Debian's qemu-user-static, whose binfmt handler has the fix-binary flag: the kernel runs
an arm64 program, in a container or not, with the QEMU it opened at registration).

    sudo GOPHERPLUG_RUNTIME=DIR GOPHERPLUG_TIER_ARM64=ARM .venv/bin/python -m pytest test_arm64.py

ARM holds what .ci/run builds: the Dockerfile's two images and the distroless recipe's for arm64
(device-plugin.tar, dra.tar, distroless.tar: `.ci/images ARM arm64`), the one-file zipapp
(gopherplug.pyz: `.ci/zipapp`; it holds no extension module, so the one file serves every
architecture) and Debian's arm64 python3.11 unpacked in python/ (`.ci/arm64-python ARM/python`).
Without root, without the binfmt handler or without ARM the module is skipped with one line saying
why (a failure under GOPHERPLUG_RUNTIME_REQUIRED, as CI sets it).

Emulation is slow (under QEMU this machine runs Python's own work about 8 times slower and starts
a process about 30 times slower), so each artefact gets the few checks that prove it, not the
tier's whole matrix: one containerd (DIR's 1.7) in the cgroup mode the machine
boots. An architecture changes which binaries run (the interpreter, the wheels' extension modules,
runc's view of them), not how the kubelet, containerd or the kernel's device rules treat a
container: test_runtime.py proves those on amd64 in both cgroup modes and under containerd 2.x.
- The device-plugin image, in daemonset.yaml's pod as shipped (test_runtime.py's translation of it):
  its Python reports aarch64, it registers with the kubelet stand-in, lists a device node Healthy,
  and a consumer created with the Allocate answer opens the node.
- The DRA image: `check-config` of daemonset-dra.yaml's ConfigMap, and `demo --dra` (the driver
  against its in-process API server and kubelet stand-ins: a claim prepared, a CDI spec written).
- The distroless recipe's image: `check-config` of daemonset.yaml's ConfigMap.
- The zipapp on Debian's arm64 python3.11: `check-config` and `demo`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
import trio
import yaml

ARM64 = os.environ.get("GOPHERPLUG_TIER_ARM64") or ""
ARTEFACTS = ("device-plugin.tar", "dra.tar", "distroless.tar", "gopherplug.pyz", "python/usr/bin/python3.11")
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
ENABLE = (
    "run `sudo GOPHERPLUG_RUNTIME=DIR GOPHERPLUG_TIER_ARM64=ARM pytest test_arm64.py` with the arm64 "
    "artefacts in ARM (.ci/run builds them) and Debian's qemu-user-static and binfmt-support installed"
)
#: Bound on one wait under emulation: the plugin's start (Python importing gopherplug and its
#: dependencies) takes seconds under QEMU where it takes a tenth of one natively.
TIMEOUT = 300.0


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    if not BINFMT.exists():
        return f"no binfmt handler for arm64 ({BINFMT}: apt-get install qemu-user-static binfmt-support)"
    handler = BINFMT.read_text()
    if (
        not handler.startswith("enabled")
        or "flags: " not in handler
        or "F" not in handler.split("flags: ")[1].split()[0]
    ):
        # Without F the kernel looks for the interpreter in the container's root, where it is not.
        return f"{BINFMT} is not enabled with the fix-binary flag (F): {' '.join(handler.split()[:4])}"
    if not ARM64:
        return "GOPHERPLUG_TIER_ARM64 is not set"
    missing = [name for name in ARTEFACTS if not (Path(ARM64) / name).exists()]
    if missing:
        return f"GOPHERPLUG_TIER_ARM64={ARM64} lacks {', '.join(missing)}"
    return None


if (_WHY := _why_not()) is not None:
    if os.environ.get("GOPHERPLUG_RUNTIME_REQUIRED"):
        pytest.fail(f"arm64 tier required but cannot run ({_WHY}): {ENABLE}", pytrace=False)
    pytest.skip(f"arm64 tier skipped ({_WHY}): {ENABLE}", allow_module_level=True)

# The runtime tier's machinery (it skips or fails the same way when containerd cannot run here).
import gopherplug as gp  # noqa: E402
import runtimesupport as rs  # noqa: E402

ARM = Path(ARM64)
#: DIR's own containerd (1.7): one is enough to prove an architecture (see the docstring).
CONTAINERD = next(name for name, directory in rs.CONTAINERDS.items() if directory == rs.RUNTIME_DIR)
FIGURES: dict[str, object] = {}


def image_architecture(archive: Path) -> str:
    """What a docker archive's image configuration says it is built for."""
    with tarfile.open(archive) as opened:
        manifest = opened.extractfile("manifest.json")
        assert manifest is not None
        (image,) = json.load(manifest)
        config = opened.extractfile(image["Config"])
        assert config is not None
        return str(json.load(config)["architecture"])


@pytest.fixture(scope="module")
def arm64_tier(pytestconfig):
    """One containerd with the arm64 images imported for linux/arm64 (and the tier's amd64 pause and
    busybox images for the sandboxes and the consumer); at the end everything of the run removed,
    as test_runtime.py's tier fixture does, and the figures printed."""
    root = Path(tempfile.mkdtemp(prefix=f"gparm-{secrets.token_hex(3)}-", dir="/tmp"))
    rs.PB, rs.CRI = rs.compile_cri(root)
    busybox = root / "busybox.layer.tar"
    rs.busybox_layer(busybox)
    archives = {"pause": root / "pause.tar", "busybox": root / "busybox.tar"}
    rs.docker_archive(archives["pause"], busybox, [rs.PAUSE_IMAGE], {"Entrypoint": rs.SLEEPER, "Env": [rs.PATH_ENV]})
    rs.docker_archive(archives["busybox"], busybox, [rs.BUSYBOX_IMAGE], {"Cmd": ["sh"], "Env": [rs.PATH_ENV]})
    tier = rs.Run(root, CONTAINERD, archives)
    try:
        tier.dev.mkdir(mode=0o755)
        if rs.DROPPED_RESOURCES:
            tier.runc = rs.RuncWithoutLimits(root)
        tier.containerd = tier.containerd_for(root / "ctrd")
        tier.containerd.start()
        for archive in archives.values():
            tier.containerd.import_image(archive)
        imported = time.monotonic()
        for name in ("device-plugin", "dra", "distroless"):
            archive = ARM / f"{name}.tar"
            assert image_architecture(archive) == "arm64", f"{archive} is not an arm64 image"
            # ctr imports (and unpacks) only this machine's platform unless told another.
            ctr(tier, "images", "import", "--platform", "linux/arm64", str(archive), timeout=600)
        FIGURES["arm64 image import (s)"] = round(time.monotonic() - imported, 1)
        FIGURES["arm64 image sizes (MB, archive)"] = {
            name: round((ARM / f"{name}.tar").stat().st_size / 1e6, 1)
            for name in ("device-plugin", "dra", "distroless")
        }
        yield tier
    finally:
        if tier.containerd is not None:
            try:
                tier.containerd.stop()
            except Exception as error:  # the rest of the cleanup must still happen
                print(f"stopping the containerd in {tier.containerd.root}: {error!r}")
        rs.remove_cgroups(tier.cgroup_parent)
        shutil.rmtree(tier.dev, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        rs.report(
            pytestconfig, f"arm64 tier ({CONTAINERD}, cgroup {rs.RESULTS['cgroup']})", {**FIGURES, **tier.figures}
        )


def ctr(tier: rs.Run, *args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    assert tier.containerd is not None
    command = [str(tier.containerd.bin_dir / "ctr"), "-n", "k8s.io", "-a", str(tier.containerd.socket), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def run_image(tier: rs.Run, manifest: str, image: str, *args: str) -> tuple[int, str, float]:
    """``image``'s entrypoint with ``args`` in a container of its own (`ctr run`: the host's network,
    a cgroup under the run's parent), with the manifest's ConfigMap mounted where its DaemonSet mounts
    it and the container's plain environment (GOPHERPLUG_CONFIG): its exit code, its output, and the
    seconds it took."""
    if "/" not in image.split(":")[0]:
        image = f"docker.io/library/{image}"  # as ctr import named it: ctr normalises no reference
    name = f"arm64-{secrets.token_hex(3)}"
    where = tier.root / name
    where.mkdir()
    (where / "config.yaml").write_text(yaml.safe_dump(rs.manifest_config(manifest)))
    (container,) = rs.manifest_pod(manifest)["spec"]["containers"]
    env = [f"--env={item['name']}={item['value']}" for item in container.get("env", []) if "value" in item]
    started = time.monotonic()
    done = ctr(
        tier,
        "run",
        "--rm",
        "--platform",
        "linux/arm64",
        "--net-host",
        "--cgroup",
        f"{tier.cgroup_parent}/{name}",
        "--mount",
        f"type=bind,src={where},dst=/etc/gopherplug,options=rbind:ro",
        *env,
        image,
        name,
        *args,
    )
    return done.returncode, done.stdout + done.stderr, round(time.monotonic() - started, 1)


async def test_the_arm64_device_plugin_image_registers_and_a_consumer_gets_its_device(arm64_tier, nursery):
    """daemonset.yaml's pod on the arm64 image: Python in it is aarch64, it registers with the kubelet
    stand-in and lists the node Healthy, and the consumer created with Allocate's answer opens it."""
    tier = arm64_tier
    node = rs.Node(tier, "daemonset.yaml")
    path = node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        started = time.monotonic()
        async with node.running() as plugin:
            await kubelet.wait_until(lambda k: rs.kubelet_lists(k, "gopher0"))
            FIGURES["device plugin: container created -> registered, first list (s)"] = round(
                time.monotonic() - started, 1
            )
            assert kubelet.resources[rs.RESOURCE].devices == {"gopher0": gp.HEALTHY}
            code, machine = await rs.exec_sync(
                tier.containerd, plugin, "python3.11", "-c", "import platform; print(platform.machine())", timeout=120
            )
            assert (code, machine.strip()) == (0, "aarch64"), machine
            pod = rs.Pod(tier, "consumer")
            holder = (pod.namespace, pod.name, "consumer")
            answer = (await kubelet.allocate(rs.RESOURCE, ["gopher0"], container=holder)).container_responses[0]
            fields = rs.allocated_fields(answer)
            assert [d.host_path for d in fields["devices"]] == [str(path)]
            config = rs.consumer_config(pod, **fields)
            config.mounts.extend(rs.allocated_mounts(answer))
            async with rs.running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await rs.consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
    tier.outputs["arm64 device plugin: consumer"] = seen
    assert "GOPHER_DEVICES=gopher0" in seen["env"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw"), seen
    assert rs.not_granted_refused(seen), seen


def test_the_arm64_dra_image_checks_its_config_and_runs_the_demo(arm64_tier):
    """The DRA image's gopherplug, as the DaemonSet's container would run it: `check-config` of the
    shipped ConfigMap, and `demo --dra` (its dependencies' arm64 wheels: msgspec, PyYAML's and
    protobuf's extension modules, all imported)."""
    image = rs.image_of(rs.manifest_pod("daemonset-dra.yaml"))
    code, said, took = run_image(arm64_tier, "daemonset-dra.yaml", image, "gopherplug", "check-config")
    FIGURES["dra image: check-config (s)"] = took
    assert code == 0, said
    assert said.startswith("/etc/gopherplug/config.yaml: OK: 1 resource(s)"), said
    code, said, took = run_image(arm64_tier, "daemonset-dra.yaml", image, "gopherplug", "demo", "--dra")
    FIGURES["dra image: demo --dra (s)"] = took
    assert code == 0, said
    assert "NodePrepareResources(" in said and "done: plugin stopped" in said, said


def test_the_arm64_distroless_image_checks_its_config(arm64_tier):
    """examples/distroless/Dockerfile's image for arm64: distroless's Python (Debian's arm64
    python3.11) runs gopherplug from its --target directory."""
    image = rs.image_of(rs.manifest_pod("daemonset.yaml")) + "-distroless"
    code, said, took = run_image(
        arm64_tier, "daemonset.yaml", image, "/usr/bin/python3.11", "-m", "gopherplug", "check-config"
    )
    FIGURES["distroless image: check-config (s)"] = took
    assert code == 0, said
    assert said.startswith("/etc/gopherplug/config.yaml: OK: 1 resource(s)"), said


@pytest.mark.parametrize("command", [["check-config", "--config", "CONFIG"], ["demo"]])
def test_the_zipapp_runs_on_debians_arm64_python(tmp_path, command):
    """The one file on Debian's arm64 python3.11 (QEMU_LD_PREFIX: QEMU finds the arm64 dynamic
    loader and libraries in the unpacked tree), as a user runs it: `python3.11 gopherplug.pyz ...`."""
    root = ARM / "python"
    # The interpreter is an arm64 program (ELF e_machine 183, EM_AARCH64): on this machine it runs
    # through QEMU's binfmt handler only.
    assert int.from_bytes((root / "usr/bin/python3.11").read_bytes()[18:20], "little") == 183
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(rs.manifest_config("daemonset.yaml")))
    args = [str(config) if arg == "CONFIG" else arg for arg in command]
    started = time.monotonic()
    done = subprocess.run(
        [str(root / "usr/bin/python3.11"), str(ARM / "gopherplug.pyz"), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "QEMU_LD_PREFIX": str(root)},
        check=False,
    )
    FIGURES[f"zipapp on arm64 python3.11: {command[0]} (s)"] = round(time.monotonic() - started, 1)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    if command[0] == "demo":
        assert "done: plugin stopped" in said, said
    else:
        assert said.startswith(f"{config}: OK: 1 resource(s)"), said
