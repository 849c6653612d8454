"""The runtime tier's machinery, which test_runtime.py (amd64, the whole matrix) and test_arm64.py (the
arm64 artefacts under emulation) share: the skip (or, under GOPHERPLUG_RUNTIME_REQUIRED, the failure)
when the tier cannot run here, the CRI compiled at test time, the images' archives, a private
containerd per run (Containerd, Run, RuncWithoutLimits), the shipped manifests translated into CRI
requests as the kubelet translates them (Pod, container_config), and a node of the kubelet's
stand-ins beside a pod (Node). test_runtime.py's docstring says how to run the tier and the rules
this machinery keeps. Not a test module: pytest collects nothing here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import textwrap
import time
import tomllib
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml

import gopherplug as gp

HERE = Path(__file__).resolve().parent
RUNTIME_DIR = Path(os.environ.get("GOPHERPLUG_RUNTIME", "/opt/gopherplug-runtime"))
DEBIAN_PYTHON = "/usr/bin/python3.11"
NEEDED = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "busybox", "cri-api.proto")
#: containerd's own binaries: DIR has them (1.7 or later), and DIR/containerd-2 a 2.x's, run with DIR's runc.
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
CONTAINERD_2_DIR = RUNTIME_DIR / "containerd-2"
ENABLE = (
    "run `sudo GOPHERPLUG_RUNTIME=DIR pytest test_runtime.py` with containerd >= 1.7 (its runc shim and ctr), "
    "runc, a static busybox and cri-api.proto in DIR, and (optional but under GOPHERPLUG_RUNTIME_REQUIRED) a "
    "containerd 2.x with its shim and ctr in DIR/containerd-2"
)

#: The cgroup mode of the run. runc and containerd pick theirs from the filesystem mounted at
#: /sys/fs/cgroup, as this process sees it: cgroup2 there is the unified hierarchy (v2), where a
#: container's device rules are an eBPF program attached to its cgroup, not a devices.list file.
CGROUP_V2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
#: The controllers the v2 hierarchy has (its root's cgroup.controllers); empty under v1.
V2_CONTROLLERS = frozenset(Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()) if CGROUP_V2 else frozenset()
#: A container spec's resources each v2 controller enforces. A limit whose controller the hierarchy
#: lacks makes runc fail (it writes e.g. cpu.weight, which is not there): see RuncWithoutLimits.
V2_RESOURCES = {"cpu": "cpu", "memory": "memory", "pids": "pids", "blockIO": "io"}
#: Under v2 on a machine whose hierarchy lacks them, the resources the tier drops before runc sees them.
DROPPED_RESOURCES = tuple(
    key for key, controller in V2_RESOURCES.items() if CGROUP_V2 and controller not in V2_CONTROLLERS
)
#: How to run the tier in cgroup v2 on a machine that boots v1 (or hybrid): in a private mount
#: namespace with cgroup2 mounted at /sys/fs/cgroup, where runc, containerd and pytest all see v2.
V2_HOW = (
    "unshare -m --propagation private sh -c 'mount -t cgroup2 none /sys/fs/cgroup && "
    "exec env GOPHERPLUG_TIER_CGROUP=v2 pytest test_runtime.py'"
)


def containerd_version(directory: Path) -> tuple[int, int]:
    """The version `containerd --version` of ``directory`` reports, as (major, minor)."""
    said = subprocess.run(
        [directory / "containerd", "--version"], capture_output=True, text=True, timeout=10, check=True
    ).stdout
    found = re.search(r" v?(\d+)\.(\d+)", said)
    assert found is not None, f"{directory}/containerd --version says {said.strip()!r}"
    return int(found[1]), int(found[2])


#: Whether the tier runs under a containerd 2.x too: when DIR/containerd-2 exists, and always under
#: GOPHERPLUG_RUNTIME_REQUIRED (CI's matrix has both; its absence there is a failure).
WITH_CONTAINERD_2 = CONTAINERD_2_DIR.exists() or bool(os.environ.get("GOPHERPLUG_RUNTIME_REQUIRED"))


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    # Unless it is the Dockerfile's, the plugin's image is the host's Debian python3.11 with the project
    # pip-installed for this interpreter: both must be CPython 3.11, so that the binary wheels fit.
    made_here = not os.environ.get("GOPHERPLUG_TIER_IMAGES")
    if made_here and (sys.version_info[:2] != (3, 11) or not Path(DEBIAN_PYTHON).exists() or not shutil.which("dpkg")):
        return f"the plugin's image needs Debian's {DEBIAN_PYTHON} (dpkg) and pytest running on Python 3.11"
    missing = [name for name in NEEDED if not (RUNTIME_DIR / name).exists()]
    if WITH_CONTAINERD_2:
        missing += [f"containerd-2/{name}" for name in CONTAINERD_BINARIES if not (CONTAINERD_2_DIR / name).exists()]
    if missing:
        return f"{RUNTIME_DIR} lacks {', '.join(missing)}"
    for directory, wanted in ((RUNTIME_DIR, "1.7 or later"), (CONTAINERD_2_DIR, "2.x"))[: 1 + WITH_CONTAINERD_2]:
        try:
            version = containerd_version(directory)
        except (OSError, subprocess.SubprocessError, AssertionError) as error:
            return f"{directory}/containerd does not run: {error}"
        if version < (1, 7) or (directory == CONTAINERD_2_DIR and version[0] != 2):
            return f"{directory}/containerd is {version[0]}.{version[1]}, not {wanted}"
    wanted_mode = os.environ.get("GOPHERPLUG_TIER_CGROUP")
    if wanted_mode not in (None, "", "v1", "v2"):
        return f"GOPHERPLUG_TIER_CGROUP is {wanted_mode!r}: say v1 or v2"
    if wanted_mode and wanted_mode != ("v2" if CGROUP_V2 else "v1"):
        return f"GOPHERPLUG_TIER_CGROUP={wanted_mode} but /sys/fs/cgroup is cgroup {'v2' if CGROUP_V2 else 'v1'}" + (
            f" (for v2 here: {V2_HOW})" if wanted_mode == "v2" else ""
        )
    if CGROUP_V2 and shutil.which("bpftool") is None:
        return "cgroup v2 shows each container's device program with bpftool (Debian's bpftool): not on PATH"
    return None


if (_WHY := _why_not()) is not None:
    # CI sets GOPHERPLUG_RUNTIME_REQUIRED: there, a tier that cannot run is a failure, not a skip.
    if os.environ.get("GOPHERPLUG_RUNTIME_REQUIRED"):
        pytest.fail(f"runtime tier required but cannot run ({_WHY}): {ENABLE}", pytrace=False)
    pytest.skip(f"runtime tier skipped ({_WHY}): {ENABLE}", allow_module_level=True)

import grpc  # noqa: E402  (test-only dependencies, imported once the tier is known to run)

#: The containerds every test runs under (the session fixture `tier` is parametrized by them):
#: DIR's own and the 2.x in DIR/containerd-2 (WITH_CONTAINERD_2), each by its version.
CONTAINERDS = {
    f"containerd-{major}.{minor}": directory
    for directory in (RUNTIME_DIR, CONTAINERD_2_DIR)[: 1 + WITH_CONTAINERD_2]
    for major, minor in [containerd_version(directory)]
}

#: Bound on one CRI call; creating the plugin's container (its image's snapshot) is the slowest one.
CRI_TIMEOUT = 60.0
#: Bound on one test's waits (a plugin's registration, a device's health, a container's start).
TIMEOUT = 60.0
#: The poll interval while containerd starts (nothing tells when it serves the CRI).
POLL = 0.05
NODE_NAME = "tier-node"
DRIVER = "gopherplug.example.com"
RESOURCE = "example.com/gopher"
#: A device outside the runtime's default device cgroup allowlist (null, zero, full, random, urandom,
#: tty, ptmx, pts, and the rest of containerd's defaults): fuse's 10:229. Only a container whose spec
#: lists it may open it.
DEVICE_MAJOR, DEVICE_MINOR = 10, 229
# The owner of a node that must keep it in the consumer: root:dialout, as udev makes a serial port.
# (A runtime not told the owner makes it root:root. The owner stays root: the plugin's container runs
# as root without CAP_DAC_OVERRIDE, so it can open only what root may by the node's mode.)
HOST_UID, HOST_GID = 0, 20
DP_CDI_CASE = "dp-cdi"


########################################################################################################
# The CRI API, compiled at test time (no generated code in the repository)


def compile_cri(into: Path) -> tuple[Any, Any]:
    """cri-api.proto imports gogoproto only for Go code generation options: without them it is plain proto3."""
    from grpc_tools import protoc

    text = (RUNTIME_DIR / "cri-api.proto").read_text()
    text = "\n".join(line for line in text.splitlines() if "gogoproto" not in line) + "\n"
    (into / "tier_cri.proto").write_text(text)
    include = str(Path(protoc.__file__).parent / "_proto")
    status = protoc.main(
        ["protoc", f"-I{into}", f"-I{include}", f"--python_out={into}", f"--grpc_python_out={into}", "tier_cri.proto"]
    )
    assert status == 0, "protoc could not compile cri-api.proto"
    sys.path.insert(0, str(into))
    try:
        import tier_cri_pb2
        import tier_cri_pb2_grpc
    finally:
        sys.path.remove(str(into))
    return tier_cri_pb2, tier_cri_pb2_grpc


########################################################################################################
# Images without a registry: docker-archive tarballs made by hand


def _add(
    layer: tarfile.TarFile,
    name: str,
    *,
    data: bytes | None = None,
    source: str | None = None,
    link: str | None = None,
    mode: int = 0o755,
) -> None:
    info = tarfile.TarInfo(name.lstrip("/"))
    info.mtime, info.uid, info.gid = 0, 0, 0
    if link is not None:
        info.type, info.linkname = tarfile.SYMTYPE, link
        layer.addfile(info)
    elif data is None and source is None:
        info.type, info.mode = tarfile.DIRTYPE, mode
        layer.addfile(info)
    else:
        if source is not None:
            data = Path(source).read_bytes()
            # The source's mtime too: a .pyc is valid only for the mtime its .py had when compiled,
            # and the plugin's read-only root cannot take a fresh one (it would compile in memory
            # at every start: slower, and about 3 MB more).
            mode, info.mtime = stat.S_IMODE(os.stat(source).st_mode), int(os.stat(source).st_mtime)
        assert data is not None
        info.size, info.mode = len(data), mode
        layer.addfile(info, io.BytesIO(data))


def docker_archive(path: Path, layer_files: Path, tags: list[str], config: dict[str, Any]) -> None:
    """One layer, a config whose rootfs.diff_ids is the layer's sha256, a manifest.json with RepoTags:
    what `docker save` writes, and what `ctr images import` reads."""
    layer = layer_files.read_bytes()
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    document = {
        "architecture": "amd64",
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": "test_runtime.py"}],
    }
    config_bytes = json.dumps(document).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": tags, "Layers": ["layer.tar"]}]
    with tarfile.open(path, "w") as archive:
        _add(archive, config_name, data=config_bytes, mode=0o644)
        _add(archive, "layer.tar", source=str(layer_files))
        _add(archive, "manifest.json", data=json.dumps(manifest).encode(), mode=0o644)


def busybox_layer(path: Path) -> None:
    """A static busybox and its applets' links: the consumers' userland and the sandbox's."""
    applets = subprocess.run(
        [RUNTIME_DIR / "busybox", "--list-full"], capture_output=True, text=True, timeout=10, check=True
    ).stdout.split()
    with tarfile.open(path, "w") as layer:
        for directory in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "dev", "proc", "sys", "tmp", "run"):
            _add(layer, directory)
        _add(layer, "bin/busybox", source=str((RUNTIME_DIR / "busybox").resolve()))
        for applet in applets:
            if applet != "bin/busybox":
                _add(layer, applet, link="/bin/busybox")


def _ldd(binary: str) -> set[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=30).stdout
    return {m[1] for m in re.finditer(r"(?:=> )?(/\S+) \(0x", out)}


def python_layer(path: Path, site_packages: Path) -> None:
    """Debian's python3.11 (its packages' files and the shared libraries of the interpreter and its
    extension modules), the project installed with its dra extra, and a `gopherplug` entry point."""
    files: set[str] = set()
    packages = ["python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib"]
    listed = subprocess.run(["dpkg", "-L", *packages], capture_output=True, text=True, timeout=30, check=True)
    for name in listed.stdout.splitlines():
        if name.startswith("/usr/share/") or not os.path.isfile(name) or os.path.islink(name):
            continue
        files.add(name)
        if name.endswith(".py"):  # Debian compiles at install time: take the host's bytecode too
            cached = Path(name).parent / "__pycache__" / (Path(name).stem + ".cpython-311.pyc")
            if cached.exists():
                files.add(str(cached))
    libraries = _ldd(DEBIAN_PYTHON)
    # The extension modules' libraries: the standard library's and the wheels' (msgspec, PyYAML, protobuf).
    for name in [*files, *(str(p) for p in site_packages.rglob("*.so"))]:
        if name.endswith(".so"):
            libraries |= _ldd(name)
    with tarfile.open(path, "w") as layer:
        made: set[str] = set()

        def parents(name: str) -> None:
            for parent in reversed(Path(name).parents):
                if str(parent) != "/" and str(parent) not in made:
                    made.add(str(parent))
                    _add(layer, str(parent))

        for directory in ("/dev", "/proc", "/sys", "/tmp", "/etc", "/run"):
            parents(directory + "/x")
        for name in sorted(files | libraries):
            parents(name)
            _add(layer, name, source=os.path.realpath(name))
        for root, dirs, names in os.walk(site_packages):
            dirs.sort()
            relative = os.path.relpath(root, site_packages)
            target = os.path.normpath(os.path.join("/usr/lib/python3/dist-packages", relative))
            parents(target + "/x")
            for name in sorted(names):
                _add(layer, os.path.join(target, name), source=os.path.join(root, name))
        parents("/usr/local/bin/x")
        script = f"#!{DEBIAN_PYTHON}\nimport sys\n\nfrom gopherplug import main\n\nsys.exit(main())\n"
        _add(layer, "/usr/local/bin/gopherplug", data=script.encode(), mode=0o755)


PAUSE_IMAGE = "gopherplug.test/pause:tier"
BUSYBOX_IMAGE = "gopherplug.test/busybox:tier"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


#: The Dockerfile's images, as a builder made them: DIR/device-plugin.tar and DIR/dra.tar (its
#: targets), docker archives tagged with the manifests' image names; .ci/images builds them with
#: buildah. Unset, the tier makes the plugin's image itself (python_layer).
DOCKERFILE_IMAGES = os.environ.get("GOPHERPLUG_TIER_IMAGES") or None


def dockerfile_images() -> dict[str, Path]:
    """The archives of DOCKERFILE_IMAGES, each checked to carry its manifest's image name."""
    assert DOCKERFILE_IMAGES is not None
    archives = {}
    for target, manifest in (("device-plugin", "daemonset.yaml"), ("dra", "daemonset-dra.yaml")):
        archive = Path(DOCKERFILE_IMAGES) / f"{target}.tar"
        assert archive.is_file(), f"GOPHERPLUG_TIER_IMAGES: no {archive} (the Dockerfile's {target} target)"
        with tarfile.open(archive) as opened:
            member = opened.extractfile("manifest.json")
            assert member is not None
            tags = [tag for image in json.load(member) for tag in image["RepoTags"]]
        wanted = image_of(manifest_pod(manifest))
        assert any(tag in (wanted, f"docker.io/library/{wanted}") for tag in tags), f"{archive} is {tags}, not {wanted}"
        archives[target] = archive
    # And examples/distroless/Dockerfile's, which .ci/images builds beside them.
    archives["distroless"] = Path(DOCKERFILE_IMAGES) / "distroless.tar"
    assert archives["distroless"].is_file(), f"GOPHERPLUG_TIER_IMAGES: no {archives['distroless']}"
    return archives


def build_images(work: Path) -> dict[str, Path]:
    """The archives: pause (a shell waiting for SIGTERM), busybox, and the plugin's, either the
    Dockerfile's two (DOCKERFILE_IMAGES) or one made here under both of the manifests' names."""
    busybox = work / "busybox.layer.tar"
    busybox_layer(busybox)
    archives = {"pause": work / "pause.tar", "busybox": work / "busybox.tar"}
    waiting = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 2147483647 & wait"]
    docker_archive(archives["pause"], busybox, [PAUSE_IMAGE], {"Entrypoint": waiting, "Env": [PATH_ENV]})
    docker_archive(archives["busybox"], busybox, [BUSYBOX_IMAGE], {"Cmd": ["sh"], "Env": [PATH_ENV]})
    if DOCKERFILE_IMAGES is not None:
        return {**archives, **dockerfile_images()}
    archives["plugin"] = work / "plugin.tar"
    site = work / "site-packages"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-cache-dir",
            "--target",
            str(site),
            f"{HERE}[dra,metrics]",  # as the Dockerfile's images, which both hold the metrics extra
        ],
        check=True,
        timeout=600,
        cwd=work,
    )
    shutil.rmtree(site / "bin", ignore_errors=True)
    python = work / "plugin.layer.tar"
    python_layer(python, site)
    tags = [image_of(doc) for doc in (manifest_pod("daemonset.yaml"), manifest_pod("daemonset-dra.yaml"))]
    config = {"Entrypoint": ["gopherplug"], "Cmd": ["serve"], "Env": [PATH_ENV]}
    docker_archive(archives["plugin"], python, tags, config)
    return archives


########################################################################################################
# containerd, private to the run


class Containerd:
    """One containerd with its own root, state, socket and CDI directory. containerd, its runc shim and
    ctr come from ``bin_dir`` (RUNTIME_DIR, or the 2.x of CONTAINERDS), runc is RUNTIME_DIR's (or
    ``runc``: RuncWithoutLimits in front of it); nothing from PATH."""

    def __init__(
        self, root: Path, bin_dir: Path = RUNTIME_DIR, *, runc: Path = RUNTIME_DIR / "runc", enable_cdi: bool = True
    ) -> None:
        self.root = root
        self.bin_dir = bin_dir
        self.version = containerd_version(bin_dir)
        self.runc = runc
        self.socket = root / "c.sock"
        self.cdi_dir = root / "cdi"
        self.extra_cdi_dirs: list[Path] = []
        self.enable_cdi = enable_cdi
        self.recursive_read_only = False  #: the default runtime handler's, from Status once ready (start())
        self.process: subprocess.Popen[bytes] | None = None
        self.log = root / "containerd.log"
        self.channel: Any = None
        self.runtime: Any = None

    def default_config(self) -> str:
        return subprocess.run(
            [self.bin_dir / "containerd", "config", "default"], capture_output=True, text=True, timeout=10, check=True
        ).stdout

    def config(self) -> str:
        return self.config_v3() if self.version[0] >= 2 else self.config_v2()

    def config_v2(self) -> str:
        """containerd 1.7's configuration (version 2): its `config default`, edited."""
        text = self.default_config()
        cdi_dirs = json.dumps([str(d) for d in (self.cdi_dir, *self.extra_cdi_dirs)])
        edits = {
            # Some machines (CI's among them) refuse lowering oom_score_adj, which runc would try for
            # every sandbox and fail with "can't get final child's PID from pipe: EOF".
            r"restrict_oom_score_adj = false": "restrict_oom_score_adj = true",
            r"disable_apparmor = false": "disable_apparmor = true",
            r'sandbox_image = ".*"': f'sandbox_image = "{PAUSE_IMAGE}"',
            r"enable_cdi = false": f"enable_cdi = {str(self.enable_cdi).lower()}",
            r"cdi_spec_dirs = \[.*\]": f"cdi_spec_dirs = {cdi_dirs}",
            r"SystemdCgroup = \w+": "SystemdCgroup = false",
            r'(?m)^root = ".*"': f'root = "{self.root}/root"',
            r'(?m)^state = ".*"': f'state = "{self.root}/state"',
            r'address = "/run/containerd/containerd.sock"': f'address = "{self.socket}"',
            r'path = "/opt/containerd"': f'path = "{self.root}/opt"',
            r'conf_dir = "/etc/cni/net.d"': f'conf_dir = "{self.root}/cni"',
            # The shim finds runc on containerd's PATH, RUNTIME_DIR first; naming it leaves no doubt.
            r'BinaryName = ""': f'BinaryName = "{self.runc}"',
        }
        for pattern, replacement in edits.items():
            text, count = re.subn(pattern, replacement, text)
            assert count, f"containerd config default has no {pattern!r}"
        return text

    def config_v3(self) -> str:
        """containerd 2.x's configuration (version 3), written for it: the CRI plugin of 1.7
        (io.containerd.grpc.v1.cri) is split into io.containerd.cri.v1.images (the sandbox image,
        now a pinned image) and io.containerd.cri.v1.runtime (CDI, on by default, the runtimes, CNI),
        so 1.7's edits mostly find nothing to edit. Every key is checked against the binary's
        `config default`: containerd ignores a key it does not know, and the setting with it."""
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        text = f"""\
version = 3
root = {json.dumps(str(self.root / "root"))}
state = {json.dumps(str(self.root / "state"))}

[grpc]
  address = {json.dumps(str(self.socket))}

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {json.dumps(PAUSE_IMAGE)}

[{runtime}]
  # As for 1.7: machines that refuse lowering oom_score_adj, no AppArmor, a private CDI directory.
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_cdi = {str(self.enable_cdi).lower()}
  cdi_spec_dirs = {json.dumps([str(d) for d in (self.cdi_dir, *self.extra_cdi_dirs)])}

[{runtime}.containerd]
  default_runtime_name = "runc"

[{runtime}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
  sandboxer = "podsandbox"

[{runtime}.containerd.runtimes.runc.options]
  BinaryName = {json.dumps(str(self.runc))}
  SystemdCgroup = false

[{runtime}.cni]
  bin_dirs = [{json.dumps(str(self.root / "cni-bin"))}]
  conf_dir = {json.dumps(str(self.root / "cni"))}

[plugins.'io.containerd.internal.v1.opt']
  path = {json.dumps(str(self.root / "opt"))}

# NRI, on by default since 2.0, serves a socket at a path of the machine's (/var/run/nri/nri.sock):
# the tier has no NRI plugin, and two containerds of a run would want the one path.
[plugins.'io.containerd.nri.v1.nri']
  disable = true
"""
        unknown = _toml_keys(tomllib.loads(text)) - _toml_keys(tomllib.loads(self.default_config()))
        assert not unknown, f"containerd {self.version} does not know {sorted(unknown)}"
        return text

    def start(self) -> None:
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.toml"
        config.write_text(self.config())
        # bin_dir first: containerd starts the shim it finds on its PATH (2.x's own for 2.x).
        env = {"PATH": f"{self.bin_dir}:{RUNTIME_DIR}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(self.root)}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.bin_dir / "containerd",
                    "--config",
                    config,
                    "--root",
                    self.root / "root",
                    "--state",
                    self.root / "state",
                    "--address",
                    self.socket,
                ],
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
            )
        self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        self.runtime = CRI.RuntimeServiceStub(self.channel)
        deadline = time.monotonic() + 30
        # No event tells that containerd serves the CRI: poll its Status until the runtime is ready.
        while True:
            assert self.process.poll() is None, f"containerd exited: {self.log.read_text()[-2000:]}"
            try:
                status = self.runtime.Status(PB.StatusRequest(), timeout=2)
                if any(c.type == "RuntimeReady" and c.status for c in status.status.conditions):
                    # Whether the default runtime handler (a pod without a RuntimeClass) makes
                    # recursively read-only mounts, as the kubelet learns it: containerd 2.x says
                    # so where runc and the kernel (mount_setattr, 5.12+) can; 1.7 has no such field.
                    handlers = status.runtime_handlers if "runtime_handlers" in status.DESCRIPTOR.fields_by_name else []
                    self.recursive_read_only = any(
                        h.name == "" and h.features.recursive_read_only_mounts for h in handlers
                    )
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"containerd did not serve the CRI: {self.log.read_text()[-2000:]}"
            time.sleep(POLL)

    def import_image(self, archive: Path) -> None:
        subprocess.run(
            [self.bin_dir / "ctr", "-n", "k8s.io", "-a", self.socket, "images", "import", archive],
            check=True,
            timeout=300,
            capture_output=True,
        )

    def stop(self) -> None:
        """Every task's processes, the shims, then containerd itself, all by PID."""
        if self.process is None:
            return
        with contextlib.suppress(Exception):
            for sandbox in self.runtime.ListPodSandbox(PB.ListPodSandboxRequest(), timeout=10).items:
                with contextlib.suppress(grpc.RpcError):
                    self.runtime.StopPodSandbox(PB.StopPodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=30)
                    self.runtime.RemovePodSandbox(PB.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id), timeout=30)
        if self.channel is not None:
            self.channel.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)
        # The shims outlive containerd by design (a node's containers survive a runtime restart): find
        # them by the containerd address they were started with, and kill them and their children
        # (each container's processes) by PID.
        for pid in _shims_of(str(self.socket)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # The overlay snapshots and the sandboxes' /dev/shm are mounts under the private root.
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.root))), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], check=False, timeout=10)
        self.process = None


def _shims_of(address: str) -> list[int]:
    """The PIDs of the runc shims serving the containerd at ``address``, and of their descendants."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if Path(argv[0]).name == "containerd-shim-runc-v2" and argv[argv.index("-address") + 1] == address:
                found.append(int(entry.name))
                found.extend(_children(int(entry.name)))
    return found


def _children(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        return children + [g for c in children for g in _children(c)]
    return []


def _toml_keys(table: dict[str, Any], prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every key of a parsed TOML document, as the path of tables that leads to it."""
    found = set()
    for key, value in table.items():
        if isinstance(value, dict) and value:
            found |= _toml_keys(value, (*prefix, key))
        else:
            found.add((*prefix, key))
    return found


class RuncWithoutLimits:
    """What runc gets under cgroup v2 on a machine whose v2 hierarchy lacks the cpu, memory, pids or
    io controller (the tier's CI machine, whose v2 hierarchy has only hugetlb): a script named as the
    runtime's binary (the runc runtime's BinaryName) that removes the resources of DROPPED_RESOURCES
    from the bundle's config.json before it runs runc, and records what it removed.

    runc would fail on any of them (`openat2 .../cpu.weight: no such file or directory`), and they
    cannot be left out upstream: containerd's CRI gives every sandbox cpu shares (2), and the kubelet
    sends shares with every container (milliCPUToShares). Only runc's create and run take a bundle;
    every other call (start, exec, state, kill, delete) passes through untouched. The device rules
    (`linux.resources.devices`) stay: they are what the tier is about."""

    def __init__(self, root: Path) -> None:
        self.path = root / "runc-without-limits"
        self.log = root / "runc-without-limits.log"
        script = f"""#!{sys.executable} -S
import json, os, sys
args = sys.argv[1:]
if "--bundle" in args:
    spec_path = os.path.join(args[args.index("--bundle") + 1], "config.json")
    with open(spec_path) as file:
        spec = json.load(file)
    resources = spec.get("linux", {{}}).get("resources", {{}})
    dropped = {{key: resources.pop(key) for key in {list(DROPPED_RESOURCES)!r} if key in resources}}
    with open(spec_path, "w") as file:
        json.dump(spec, file)
    with open({str(self.log)!r}, "a") as log:
        log.write(json.dumps({{"id": args[-1], "dropped": dropped}}) + "\\n")
os.execv({str(RUNTIME_DIR / "runc")!r}, [{str(RUNTIME_DIR / "runc")!r}, *args])
"""
        self.path.write_text(script)
        self.path.chmod(0o755)

    def dropped(self, container_id: str) -> dict[str, Any]:
        """What the script removed from the container's spec."""
        for line in self.log.read_text().splitlines():
            if (record := json.loads(line))["id"] == container_id:
                return record["dropped"]
        raise AssertionError(f"runc never created {container_id} through {self.path}")


########################################################################################################
# The run: the images, and one containerd with its private directories per containerd of CONTAINERDS


PB: Any = None
CRI: Any = None
#: What the runs measured and saw, by containerd, with the images' figures and the cgroup mode: printed
#: at the end of each (and written to GOPHERPLUG_TIER_RESULTS as JSON).
RESULTS: dict[str, Any] = {
    "containerds": sorted(CONTAINERDS) + ([] if WITH_CONTAINERD_2 else [f"(no containerd 2.x: {CONTAINERD_2_DIR})"]),
    "cgroup": "v2" if CGROUP_V2 else "v1",
    "v2 controllers": sorted(V2_CONTROLLERS),
    "resources dropped before runc": list(DROPPED_RESOURCES),
}


class Run:
    """Everything one run of the tier owns: under one containerd of CONTAINERDS."""

    def __init__(self, root: Path, name: str, archives: dict[str, Path]) -> None:
        self.root = root
        self.name = name  # containerd-<major>.<minor>, the key of CONTAINERDS
        self.id = root.name.rsplit("-", 1)[-1]
        self.dev = Path(f"/dev/gp-{self.id}")  # device nodes live in the host's /dev, as on a node
        self.cgroup_parent = f"/gopherplug-tier-{self.id}"
        self.containerd: Containerd | None = None
        self.second: Containerd | None = None  # the enable_cdi = false one, once a test started it
        self.runc: RuncWithoutLimits | None = None  # under cgroup v2 without the controllers
        self.archives = archives
        self.figures: dict[str, Any] = {}
        self.outputs: dict[str, Any] = {}
        self.started = time.monotonic()
        #: short symlinks to the nodes' kubelet directories (see dra_cluster), removed at the end
        self.links: list[Path] = []

    def containerd_for(self, root: Path, *, enable_cdi: bool = True) -> Containerd:
        """A containerd of the run's kind: its binaries, and runc or the run's RuncWithoutLimits."""
        runc = self.runc.path if self.runc is not None else RUNTIME_DIR / "runc"
        return Containerd(root, CONTAINERDS[self.name], runc=runc, enable_cdi=enable_cdi)


def remove_cgroups(parent: str) -> None:
    """The run's pod cgroups, left by runc once their containers are gone: in every v1 hierarchy, or
    in the unified one."""
    hierarchies = [Path("/sys/fs/cgroup"), *(d for d in Path("/sys/fs/cgroup").iterdir() if d.is_dir())]
    for controller in hierarchies:
        top = controller / parent.lstrip("/")
        if top.is_dir():
            for directory in sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(str(p)), reverse=True):
                with contextlib.suppress(OSError):
                    directory.rmdir()


def report(pytestconfig: pytest.Config, title: str, results: Any) -> None:
    """Print ``results`` (shown whatever the outcome: pytest keeps a fixture's output for failures
    only), and write everything so far to GOPHERPLUG_TIER_RESULTS."""
    if (where := os.environ.get("GOPHERPLUG_TIER_RESULTS")) is not None:
        Path(where).write_text(json.dumps(RESULTS, indent=2) + "\n")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n{title}:\n" + json.dumps(results, indent=2), flush=True)


########################################################################################################
# The manifests, translated into CRI requests as the kubelet does


def manifest_docs(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((HERE / name).read_text()) if doc]


def manifest_pod(name: str) -> dict[str, Any]:
    """The DaemonSet's pod template, as shipped."""
    (daemonset,) = [doc for doc in manifest_docs(name) if doc["kind"] == "DaemonSet"]
    return daemonset["spec"]["template"]


def manifest_config(name: str) -> dict[str, Any]:
    """The ConfigMap's config.yaml, parsed, as shipped."""
    (config_map,) = [doc for doc in manifest_docs(name) if doc["kind"] == "ConfigMap"]
    return yaml.safe_load(config_map["data"]["config.yaml"])


def free_loopback_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return int(free.getsockname()[1])


#: The request the kubelet's HTTP prober sends (kubernetes/kubernetes pkg/probe/http/request.go: its
#: User-Agent, Accept "*/*"; the transport has keep-alive off, so Go adds Connection: close).
KUBE_PROBE_REQUEST = (
    "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.34\r\nAccept: */*\r\n"
    "Connection: close\r\n\r\n"
)


async def liveness_probe(node: Node, pod: Pod | None = None) -> tuple[int, str]:
    """The manifest's liveness probe as the kubelet makes it: an HTTP GET of its httpGet path on the
    pod's IP and the port it names, the name resolved through the container's ports (findPortByName,
    pkg/kubelet/prober/prober.go), within its timeoutSeconds; 200-399 is success. The sandboxes are on
    the host's network here: the pod's IP is the host's, loopback, and the port the pod's own (see
    Node.health_ports). Returns (status code, body)."""
    pod = pod or node.pod
    (container,) = node.template["spec"]["containers"]
    probe = container["livenessProbe"]
    get = probe["httpGet"]
    named = {port["name"]: port["containerPort"] for port in container.get("ports", ())}
    port = named[get["port"]] if isinstance(get["port"], str) else get["port"]
    # The manifest's own consistency: the port the probe asks is the one its ConfigMap serves on.
    assert port == int(manifest_config(node.manifest)["health_address"].rpartition(":")[2]), (port, named)
    host, port = "127.0.0.1", node.health_ports[pod.name]
    with trio.fail_after(probe["timeoutSeconds"]):
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            await stream.send_all(KUBE_PROBE_REQUEST.format(path=get["path"], host=host, port=port).encode())
            answer = b""
            while chunk := await stream.receive_some():
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


def image_of(template: dict[str, Any]) -> str:
    return template["spec"]["containers"][0]["image"]


def quantity(text: str | int) -> int:
    """A Kubernetes quantity in bytes (the manifests use Mi and plain numbers)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}
    found = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    assert found is not None, text
    return int(found[1]) * units.get(found[2], 1)


def _milli_cpu(text: str) -> int:
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def atomic_dir(target: Path, files: dict[str, str | bytes]) -> Path:
    """A volume as the kubelet's atomic writer lays it out (kubernetes/kubernetes
    pkg/volume/util/atomic_writer.go): the files in a `..<timestamp>` directory, a `..data` symlink to
    it, and a symlink per file through `..data`, so that an update swaps them all at once."""
    target.mkdir(parents=True)
    stamp = target / time.strftime("..%Y_%m_%d_%H_%M_%S.000000001", time.gmtime())
    stamp.mkdir()
    for name, content in files.items():
        (stamp / name).write_bytes(content.encode() if isinstance(content, str) else content)
        (target / name).symlink_to(f"..data/{name}")
    (target / "..data").symlink_to(stamp.name)
    return target


#: What the kubelet masks and makes read-only in every unprivileged container's /proc and /sys
#: (kubernetes/kubernetes pkg/securitycontext/util.go, ConvertToRuntimeMaskedPaths and
#: ConvertToRuntimeReadonlyPaths with the Default proc mount).
MASKED_PATHS = [
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
]
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


class Pod:
    """One pod as the kubelet runs it: its directory (kubernetes/kubernetes pkg/kubelet/kubelet_pods.go
    keeps etc-hosts, volumes and each container's termination-log file under the pod's directory), the
    sandbox's config, and its containers' configs."""

    def __init__(self, tier: Run, name: str, namespace: str = "default") -> None:
        self.tier, self.name, self.namespace = tier, name, namespace
        self.uid = str(uuid.uuid4())
        self.dir = tier.root / "pods" / self.uid
        self.dir.mkdir(parents=True)
        self.sandbox_id = ""
        self.container_ids: dict[str, str] = {}

    def sandbox_config(self, labels: dict[str, str] | None = None) -> Any:
        # generatePodSandboxConfig (pkg/kubelet/kuberuntime/kuberuntime_sandbox.go): metadata, the
        # pod's log directory, labels, and the pod's cgroup parent; the namespaces follow the pod
        # spec. Host network: the tier has no CNI; hostname is left out for host-network pods. The
        # sandbox's seccomp profile is the pod-level one, Unconfined when unset (the manifests set it
        # per container) and the kubelet's seccompDefault is off, its default.
        log_dir = self.dir / "logs"
        log_dir.mkdir(exist_ok=True)
        return PB.PodSandboxConfig(
            metadata=PB.PodSandboxMetadata(name=self.name, uid=self.uid, namespace=self.namespace, attempt=0),
            log_directory=str(log_dir),
            labels={
                **(labels or {}),
                "io.kubernetes.pod.name": self.name,
                "io.kubernetes.pod.namespace": self.namespace,
                "io.kubernetes.pod.uid": self.uid,
            },
            linux=PB.LinuxPodSandboxConfig(
                cgroup_parent=f"{self.tier.cgroup_parent}/pod{self.uid}",
                security_context=PB.LinuxSandboxSecurityContext(
                    namespace_options=PB.NamespaceOption(
                        network=PB.NamespaceMode.NODE, pid=PB.NamespaceMode.CONTAINER, ipc=PB.NamespaceMode.POD
                    ),
                    seccomp=PB.SecurityProfile(profile_type=PB.SecurityProfile.ProfileType.Unconfined),
                ),
            ),
        )

    def hosts_mount(self) -> Any:
        # makeMounts: every container gets a kubelet-managed /etc/hosts; for a host-network pod it is
        # a copy of the node's (ensureHostsFile in pkg/kubelet/kubelet_pods.go), writable.
        hosts = self.dir / "etc-hosts"
        if not hosts.exists():
            shutil.copyfile("/etc/hosts", hosts)
        return PB.Mount(container_path="/etc/hosts", host_path=str(hosts), readonly=False)

    def termination_mount(self, container: dict[str, Any]) -> Any:
        # makeMounts of pkg/kubelet/kuberuntime/kuberuntime_container.go: a fresh file in the pod's
        # containers/<name>/ directory, bind-mounted read-write at the container's
        # terminationMessagePath (the API server defaults it to /dev/termination-log).
        directory = self.dir / "containers" / container["name"]
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / secrets.token_hex(4)
        log.touch()
        log.chmod(0o666)  # writable whatever user the container runs as, as the kubelet makes it
        path = container.get("terminationMessagePath", "/dev/termination-log")
        return PB.Mount(container_path=path, host_path=str(log), readonly=False)


def container_config(
    pod: Pod,
    spec: dict[str, Any],
    container: dict[str, Any],
    *,
    volumes: dict[str, str],
    service_env: dict[str, str],
    extra_mounts: Iterable[Any] = (),
    recursive_read_only: bool = False,
) -> Any:
    """generateContainerConfig (kubernetes/kubernetes pkg/kubelet/kuberuntime/kuberuntime_container.go) for
    one container of the pod spec: image, command and args, env (fieldRefs resolved, the service
    variables), mounts (each volumeMount of a volume whose host side is ``volumes[name]``, /etc/hosts,
    the termination log), resources and the security context (security_context.go)."""
    env = dict(service_env)
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            env[item["name"]] = NODE_NAME
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.uid":
            env[item["name"]] = pod.uid  # podFieldSelectorRuntimeValue, pkg/kubelet/kubelet_pods.go
        else:
            raise AssertionError(f"the tier does not resolve {item}")
    mounts = []
    for mount in container.get("volumeMounts", []):
        # A mount without mountPropagation is private (pkg/kubelet/kubelet_pods.go, translateMountPropagation).
        assert mount.get("mountPropagation", "None") == "None", f"the tier does not translate {mount}"
        # recursiveReadOnly (makeMounts, pkg/kubelet/kubelet_pods.go): IfPossible asks the runtime
        # for a recursively read-only mount where the runtime handler reports that it can (the CRI
        # Status's runtime_handlers features), and is plain read-only elsewhere.
        rro = mount.get("recursiveReadOnly", "Disabled")
        assert rro in ("Disabled", "IfPossible"), f"the tier does not translate recursiveReadOnly {rro}"
        recursive = {"recursive_read_only": True} if rro == "IfPossible" and recursive_read_only else {}
        mounts.append(
            PB.Mount(
                container_path=mount["mountPath"],
                host_path=volumes[mount["name"]],
                readonly=bool(mount.get("readOnly", False)),
                propagation=PB.MountPropagation.PROPAGATION_PRIVATE,
                **recursive,
            )
        )
    mounts.extend(extra_mounts)
    mounts.append(pod.hosts_mount())
    mounts.append(pod.termination_mount(container))
    resources = container.get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    # milliCPUToShares (pkg/kubelet/cm/helpers_linux.go): shares = milli * 1024 / 1000, at least 2.
    shares = max(2, _milli_cpu(requests.get("cpu", "0")) * 1024 // 1000)
    linux_resources = PB.LinuxContainerResources(cpu_shares=shares)
    if "memory" in limits:
        linux_resources.memory_limit_in_bytes = quantity(limits["memory"])
    sc = container.get("securityContext", {})
    security = PB.LinuxContainerSecurityContext(
        privileged=bool(sc.get("privileged", False)),
        readonly_rootfs=bool(sc.get("readOnlyRootFilesystem", False)),
        # allowPrivilegeEscalation false is no_new_privs (security_context.go, AddNoNewPrivileges).
        no_new_privs=sc.get("allowPrivilegeEscalation") is False,
        namespace_options=PB.NamespaceOption(
            network=PB.NamespaceMode.NODE, pid=PB.NamespaceMode.CONTAINER, ipc=PB.NamespaceMode.POD
        ),
        capabilities=PB.Capability(
            add_capabilities=sc.get("capabilities", {}).get("add", []),
            drop_capabilities=sc.get("capabilities", {}).get("drop", []),
        ),
    )
    if not security.privileged:
        security.masked_paths.extend(MASKED_PATHS)
        security.readonly_paths.extend(READONLY_PATHS)
    if "runAsUser" in sc:
        security.run_as_user.value = sc["runAsUser"]
    seccomp = sc.get("seccompProfile", spec.get("securityContext", {}).get("seccompProfile", {}))
    if seccomp.get("type") == "RuntimeDefault":
        security.seccomp.profile_type = PB.SecurityProfile.ProfileType.RuntimeDefault
    else:
        security.seccomp.profile_type = PB.SecurityProfile.ProfileType.Unconfined
    name = container["name"]
    return PB.ContainerConfig(
        metadata=PB.ContainerMetadata(name=name, attempt=0),
        image=PB.ImageSpec(image=container["image"]),
        command=container.get("command", []),
        args=container.get("args", []),
        working_dir=container.get("workingDir", ""),
        envs=[PB.KeyValue(key=k, value=v) for k, v in env.items()],
        mounts=mounts,
        log_path=f"{name}/0.log",
        labels={
            "io.kubernetes.container.name": name,
            "io.kubernetes.pod.name": pod.name,
            "io.kubernetes.pod.namespace": pod.namespace,
            "io.kubernetes.pod.uid": pod.uid,
        },
        annotations={"io.kubernetes.container.terminationMessagePath": mounts[-1].container_path},
        linux=PB.LinuxContainerConfig(resources=linux_resources, security_context=security),
    )


########################################################################################################
# Talking CRI from trio: grpcio is blocking, so every call runs in a worker thread with a deadline


async def cri(containerd: Containerd, method: str, request: Any, timeout: float = CRI_TIMEOUT) -> Any:
    call = getattr(containerd.runtime, method)
    return await trio.to_thread.run_sync(functools.partial(call, request, timeout=timeout))


@contextlib.asynccontextmanager
async def running_pod(containerd: Containerd, pod: Pod, sandbox: Any, containers: list[Any]):
    """RunPodSandbox, then CreateContainer and StartContainer for each container; on the way out,
    StopPodSandbox and RemovePodSandbox (which stop and remove its containers), also on failure."""
    try:
        answer = await cri(containerd, "RunPodSandbox", PB.RunPodSandboxRequest(config=sandbox))
        pod.sandbox_id = answer.pod_sandbox_id
        for config in containers:
            created = await cri(
                containerd,
                "CreateContainer",
                PB.CreateContainerRequest(pod_sandbox_id=pod.sandbox_id, config=config, sandbox_config=sandbox),
            )
            pod.container_ids[config.metadata.name] = created.container_id
            await cri(containerd, "StartContainer", PB.StartContainerRequest(container_id=created.container_id))
        yield pod
    finally:
        if pod.sandbox_id:
            with trio.CancelScope(shield=True), contextlib.suppress(grpc.RpcError):
                await cri(containerd, "StopPodSandbox", PB.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id))
                await cri(containerd, "RemovePodSandbox", PB.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox_id))


async def exec_sync(containerd: Containerd, container_id: str, *cmd: str, timeout: int = 20) -> tuple[int, str]:
    """ExecSync: what the container itself says, exit code and stdout+stderr."""
    answer = await cri(
        containerd, "ExecSync", PB.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout)
    )
    return answer.exit_code, (answer.stdout + answer.stderr).decode(errors="replace")


async def container_status(containerd: Containerd, container_id: str, verbose: bool = False) -> Any:
    return await cri(
        containerd, "ContainerStatus", PB.ContainerStatusRequest(container_id=container_id, verbose=verbose)
    )


#: How often the plugin's container state is looked at, to fail a test at once if it exits.
EXIT_POLL = 0.2


async def fail_if_exited(containerd: Containerd, container_id: str) -> None:
    """Raise once the container has exited. No CRI event tells it here (GetContainerEvents needs
    the kubelet's evented PLEG, off by default): a bounded-interval poll of ContainerStatus."""
    while True:
        status = (await container_status(containerd, container_id)).status
        if status.state == PB.ContainerState.CONTAINER_EXITED:
            raise AssertionError(f"the container exited with {status.exit_code} ({status.reason})")
        await trio.sleep(EXIT_POLL)


SLEEPER = ["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 2147483647 & wait"]


def consumer_config(pod: Pod, name: str = "consumer", **fields: Any) -> Any:
    """A busybox container that waits, as the kubelet would create it for a pod with default security
    (masked and read-only /proc paths); ``fields`` add what the device manager or DRA gave it."""
    config = PB.ContainerConfig(
        metadata=PB.ContainerMetadata(name=name, attempt=0),
        image=PB.ImageSpec(image=BUSYBOX_IMAGE),
        command=SLEEPER,
        log_path=f"{name}/0.log",
        linux=PB.LinuxContainerConfig(
            security_context=PB.LinuxContainerSecurityContext(
                masked_paths=MASKED_PATHS,
                readonly_paths=READONLY_PATHS,
                namespace_options=PB.NamespaceOption(network=PB.NamespaceMode.NODE, pid=PB.NamespaceMode.CONTAINER),
            )
        ),
        **fields,
    )
    config.mounts.append(pod.hosts_mount())
    config.mounts.append(pod.termination_mount({"name": name}))
    return config


#: A node no consumer is granted: the tier's device's neighbour, made by the consumer itself with
#: mknod (runc allows every container to make nodes, `c *:* m`; opening one is the device rules' call).
NOT_GRANTED_PATH, NOT_GRANTED = "/tmp/not-granted", (DEVICE_MAJOR, DEVICE_MINOR + 1)


async def consumer_report(containerd: Containerd, container_id: str, device: str) -> dict[str, Any]:
    """What a consumer sees: its environment, its device node, whether it opens it for reading and
    writing, and whether it opens a node it was not granted (NOT_GRANTED); and the device rules of its
    cgroup (the major 10 ones: the tier's device's), from the host."""
    _, env = await exec_sync(containerd, container_id, "env")
    ls_code, ls = await exec_sync(containerd, container_id, "ls", "-l", device)
    open_code, opened = await exec_sync(containerd, container_id, "sh", "-c", f"exec 3<>{device} && echo opened rw")
    major, minor = NOT_GRANTED
    _, refused = await exec_sync(
        containerd,
        container_id,
        "sh",
        "-c",
        f"mknod {NOT_GRANTED_PATH} c {major} {minor} && exec 3<>{NOT_GRANTED_PATH} && echo opened rw",
    )
    rules = await device_rules(containerd, container_id)
    return {
        "device rules (host side)": [rule for rule in rules["rules"] if rule.startswith(f"c {DEVICE_MAJOR}:")],
        **({"device program (host side)": rules["program"]} if "program" in rules else {}),
        "env": sorted(line for line in env.splitlines() if not line.startswith(("PATH=", "HOSTNAME=", "HOME="))),
        "ls -l": ls.strip(),
        "ls exit": ls_code,
        "open rw": opened.strip(),
        "open exit": open_code,
        f"not granted (c {major}:{minor}, made inside): mknod, open rw": refused.strip(),
    }


def not_granted_refused(seen: dict[str, Any]) -> bool:
    """Whether the consumer of ``seen`` (consumer_report) made the node it was not granted and was
    refused opening it by its device rules: EPERM, as busybox's sh says it."""
    (said,) = [value for key, value in seen.items() if key.startswith("not granted")]
    return bool(said == f"sh: can't create {NOT_GRANTED_PATH}: Operation not permitted")


async def container_cgroup(containerd: Containerd, container_id: str) -> str:
    """The container's cgroup, as the runtime spec containerd reports names it (with the cgroupfs
    driver, cgroupsPath is a path under each hierarchy)."""
    status = await container_status(containerd, container_id, verbose=True)
    return json.loads(status.info["info"])["runtimeSpec"]["linux"]["cgroupsPath"].lstrip("/")


async def device_rules(containerd: Containerd, container_id: str) -> dict[str, Any]:
    """The device rules the kernel applies to the container, in devices.list's form ("c 10:229 rw").

    cgroup v1: its devices cgroup's devices.list. cgroup v2 has no such file: runc attaches an eBPF
    program of type cgroup_device to the container's cgroup, which the kernel runs at every open(),
    access() and mknod() of a device node (security/device_cgroup.c, devcgroup_check_permission).
    bpftool (Debian's) names the programs attached to the cgroup and dumps each one's instructions
    as the kernel verified them; the rules are read back from them (see program_rules)."""
    cgroup = await container_cgroup(containerd, container_id)
    if not CGROUP_V2:
        listed = (Path("/sys/fs/cgroup/devices") / cgroup / "devices.list").read_text()
        return {"rules": listed.split("\n")[:-1]}
    attached = json.loads(_bpftool("-j", "cgroup", "show", f"/sys/fs/cgroup/{cgroup}"))
    programs = [p for p in attached if p["attach_type"] == "cgroup_device"]
    assert len(programs) == 1, f"cgroup {cgroup}: device programs {attached}"
    (program,) = programs
    dumped = _bpftool("prog", "dump", "xlated", "id", str(program["id"]))
    return {
        "program": f"bpftool cgroup show: {program['id']} {program['attach_type']} {program['attach_flags']}",
        "rules": program_rules(dumped),
    }


def _bpftool(*args: str) -> str:
    return subprocess.run(["bpftool", *args], capture_output=True, text=True, timeout=30, check=True).stdout


#: The instructions of runc's device program (opencontainers/runc libcontainer/cgroups/devices/
#: devicefilter.go, DeviceFilter), as `bpftool prog dump xlated` prints them. The prologue loads the
#: device's type (r2: 1 block, 2 char), the access asked (r3: 1 mknod, 2 read, 4 write), major (r4)
#: and minor (r5); then one block per rule, most specific last, each falling through to the next
#: when a check fails, and ending in `w0 = <1 allow, 0 deny>; exit`; the last block is the default.
_PROLOGUE = re.compile(r"r[2-5] = \*\(u32 \*\)\(r1 \+\d+\)|w2 &= 65535|w3 >>= 16|w1 = w3|if r1 != r3 goto pc\+\d+")
_TYPE, _ACCESS = re.compile(r"if r2 != 0x(\d) goto pc\+\d+"), re.compile(r"w1 &= (\d+)")
_MAJOR = re.compile(r"if r4 != 0x([0-9a-f]+) goto pc\+\d+")
_MINOR = re.compile(r"if r5 != 0x([0-9a-f]+) goto pc\+\d+")
_VERDICT = re.compile(r"w0 = ([01])")


def program_rules(dumped: str) -> list[str]:
    """The allow rules of a runc device program dumped by bpftool, as devices.list lines ("c 10:229
    rw", "c *:* m"), in the program's order. An instruction runc does not emit fails the test: the
    reading would no longer be sure."""
    rules, denied = [], False
    kind, access, major, minor = "a", "rwm", "*", "*"
    for line in dumped.splitlines():
        found = re.match(r"\s*\d+: \([0-9a-f]{2}\) (.*)$", line)
        if found is None:
            continue
        instruction = found[1]
        if (match := _TYPE.fullmatch(instruction)) is not None:
            kind = {"1": "b", "2": "c"}[match[1]]
        elif (match := _ACCESS.fullmatch(instruction)) is not None:
            access = "".join(letter for bit, letter in ((2, "r"), (4, "w"), (1, "m")) if int(match[1]) & bit)
        elif (match := _MAJOR.fullmatch(instruction)) is not None:
            major = str(int(match[1], 16))
        elif (match := _MINOR.fullmatch(instruction)) is not None:
            minor = str(int(match[1], 16))
        elif (match := _VERDICT.fullmatch(instruction)) is not None:
            # runc emits a deny block before an allow one only for a default-allow list (which no
            # container of the CRI gets): the allow rules are then no longer the whole story.
            assert not (denied and match[1] == "1"), f"a deny rule before an allow rule: {dumped}"
            denied |= match[1] == "0"
            if match[1] == "1":
                rules.append(f"{kind} {major}:{minor} {access}")
        elif instruction == "exit":
            kind, access, major, minor = "a", "rwm", "*", "*"
        else:
            assert _PROLOGUE.fullmatch(instruction), f"an instruction runc's device program has not: {line!r}"
    return rules


########################################################################################################
# The plugin's pod on a node of the run


class Node:
    """One test's node: private host directories standing in for the kubelet's, device nodes in the
    run's directory of /dev, and the DaemonSet's pod translated for them."""

    def __init__(self, tier: Run, manifest: str, case: str = "") -> None:
        self.tier, self.manifest = tier, manifest
        self.case = tier.root / "host" / (case or secrets.token_hex(3))
        self.devices = tier.dev / self.case.name
        self.devices.mkdir(exist_ok=True)
        # The host side of the manifests' device directory (/etc/gophers), made as an operator would:
        # its hostPath is of type Directory, so the kubelet creates nothing (configs() checks it is
        # there). The ConfigMap's directory is replaced below: it stays empty.
        (self.case / "etc-gophers").mkdir(parents=True, exist_ok=True)
        self.kubelet_dir = self.case / "kubelet"
        self.device_plugin_dir = self.kubelet_dir / "device-plugins"
        self.device_plugin_dir.mkdir(parents=True, exist_ok=True)
        (self.kubelet_dir / "pod-resources").mkdir(exist_ok=True)  # the kubelet makes it at its start
        self.template = manifest_pod(manifest)
        self.config = manifest_config(manifest)
        # The ConfigMap's one edit: the devices are the run's nodes in /dev.
        self.config["resources"][0]["directory"] = str(self.devices)
        if manifest == "daemonset-dra.yaml" and "metrics_address" in self.config:
            # And for the DRA pod a second one: its metrics on a port of the kernel's choosing. A
            # real pod has a network namespace of its own; the tier's share the host's (no CNI), so
            # two DRA pods at once (a rolling update's, or another run's on this machine) would both
            # want the manifest's port.
            self.config["metrics_address"] = "127.0.0.1:0"
        # The host side of each hostPath volume; /dev and /sys are the host's own.
        self.host_paths = {
            "/var/lib/kubelet/device-plugins": str(self.device_plugin_dir),
            "/var/lib/kubelet/plugins_registry": str(self.kubelet_dir / "plugins_registry"),
            "/var/lib/kubelet/plugins": str(self.kubelet_dir / "plugins"),
            "/var/lib/kubelet/pod-resources": str(self.kubelet_dir / "pod-resources"),
            "/var/run/cdi": str(tier.containerd.cdi_dir),
            "/etc/gophers": str(self.case / "etc-gophers"),
            "/dev": "/dev",
            "/sys": "/sys",
        }
        self.service_env: dict[str, str] = {}
        self.service_account: dict[str, str] | None = None
        #: pod name -> its liveness port. A real pod has a network namespace of its own, where the
        #: manifest's port is free; the tier's share the host's, where two pods of a rolling update
        #: (or another run on this machine) would both want it: each gets a free one, in its
        #: ConfigMap's health_address, and liveness_probe() asks that one.
        self.health_ports: dict[str, int] = {}
        self.watchers: dict[str, trio.CancelScope] = {}  # container ID -> its fail_if_exited watch
        self.stopped: set[str] = set()  # containers the test stopped itself (stop_now)
        self.pod = Pod(
            tier, f"{self.template['metadata']['labels']['app.kubernetes.io/name']}-{self.case.name}", "kube-system"
        )

    def host_side(self, path: str) -> str:
        """Where a hostPath volume's path is on this run's host: host_paths, or a directory under
        one of them (the DRA pod mounts only its own plugins/<driver>, not all of plugins)."""
        if path in self.host_paths:
            return self.host_paths[path]
        parent = next(p for p in self.host_paths if p not in ("/", "/dev", "/sys") and path.startswith(p + "/"))
        return self.host_paths[parent] + path[len(parent) :]

    def add_readme_cdi_mount(self) -> None:
        """What docs/deployment.md's step 4 says to add to daemonset.yaml for a resource with
        `cdi:` at the default spec_dir: its YAML block's volumeMounts and volumes, as written there."""
        step = (HERE / "docs" / "deployment.md").read_text().split("4. With `cdi`, mount", 1)[1].split("\n5. ", 1)[0]
        block = textwrap.dedent(step.split("```yaml\n", 1)[1].split("```", 1)[0])
        addition = yaml.safe_load(block)
        spec = self.template["spec"]
        spec["containers"][0]["volumeMounts"].extend(addition["volumeMounts"])
        spec["volumes"].extend(addition["volumes"])

    def mknod(self, name: str) -> Path:
        path = self.devices / name
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(DEVICE_MAJOR, DEVICE_MINOR))
        return path

    def surge(self) -> Pod:
        """Another pod of the same DaemonSet on this node, with a UID of its own: the one a rolling
        update with maxSurge: 1 creates beside the running one (the DaemonSet controller's
        surging pod, pkg/controller/daemon/update.go)."""
        return Pod(self.tier, f"{self.pod.name}-surge", self.pod.namespace)

    def configs(self, pod: Pod | None = None) -> tuple[Any, Any]:
        pod = pod or self.pod
        spec = self.template["spec"]
        volumes: dict[str, str] = {}
        for volume in spec["volumes"]:
            name = volume["name"]
            if "hostPath" in volume:
                # The kubelet's hostPath type checks (pkg/volume/hostpath/host_path.go): Directory
                # must exist, DirectoryOrCreate is created.
                host = Path(self.host_side(volume["hostPath"]["path"]))
                if volume["hostPath"].get("type") == "DirectoryOrCreate":
                    host.mkdir(parents=True, exist_ok=True)
                assert host.is_dir(), f"hostPath {host} (type Directory) does not exist"
                volumes[name] = str(host)
            elif "configMap" in volume:
                where = pod.dir / "volumes" / "kubernetes.io~configmap" / name
                config = dict(self.config)
                if "health_address" in config:
                    port = self.health_ports.setdefault(pod.name, free_loopback_port())
                    config["health_address"] = f"127.0.0.1:{port}"
                volumes[name] = str(atomic_dir(where, {"config.yaml": yaml.safe_dump(config)}))
            else:
                raise AssertionError(f"the tier does not translate volume {volume}")
        extra = []
        if self.service_account is not None and spec.get("automountServiceAccountToken", True):
            # The service account admission plugin adds a projected volume (token, ca.crt,
            # namespace) mounted read-only at this path in every container; the kubelet writes it
            # with the atomic writer.
            where = pod.dir / "volumes" / "kubernetes.io~projected" / "kube-api-access"
            extra.append(
                PB.Mount(
                    container_path=gp.SERVICE_ACCOUNT_DIR,
                    host_path=str(atomic_dir(where, self.service_account)),
                    readonly=True,
                    propagation=PB.MountPropagation.PROPAGATION_PRIVATE,
                )
            )
        (container,) = spec["containers"]
        config = container_config(
            pod,
            spec,
            container,
            volumes=volumes,
            service_env=self.service_env,
            extra_mounts=extra,
            recursive_read_only=self.tier.containerd.recursive_read_only,
        )
        return pod.sandbox_config(self.template["metadata"]["labels"]), config

    @contextlib.asynccontextmanager
    async def running(self, pod: Pod | None = None):
        """The pod (``pod``: another of the DaemonSet's, see surge()), running; fails the test at
        once, with the plugin's log, if the plugin's container exits."""
        sandbox, config = self.configs(pod)
        pod = pod or self.pod
        try:
            async with running_pod(self.tier.containerd, pod, sandbox, [config]) as pod:
                container_id = pod.container_ids[config.metadata.name]
                watch = self.watchers[container_id] = trio.CancelScope()  # its own: the test's body runs in the nursery

                async def watched() -> None:
                    with watch:
                        await fail_if_exited(self.tier.containerd, container_id)

                async with trio.open_nursery() as watching:
                    watching.start_soon(watched)
                    yield container_id
                    watching.cancel_scope.cancel()
                if container_id not in self.stopped:
                    await self.stop(container_id)
        except BaseException:
            # The plugin's own log, as `kubectl logs` would show it, beside the failure.
            with contextlib.suppress(OSError):
                print(
                    f"--- {pod.name} {config.metadata.name} log ---\n"
                    + (pod.dir / "logs" / config.log_path).read_text()
                )
            raise

    async def stop_now(self, container_id: str) -> None:
        """Stop a pod's plugin while the test goes on (the old pod of a rolling update): its exit is
        expected, not a failure."""
        self.watchers[container_id].cancel()
        self.stopped.add(container_id)
        await self.stop(container_id)

    async def stop(self, container_id: str) -> None:
        """StopContainer, as the kubelet stops a pod it deletes (and a rolling update each old pod):
        SIGTERM, then SIGKILL after the grace period. The plugin must exit at once and cleanly: every
        second it takes is a second of every rollout without the plugin on that node."""
        stopping = time.monotonic()
        await cri(
            self.tier.containerd,
            "StopContainer",
            PB.StopContainerRequest(container_id=container_id, timeout=STOP_GRACE),
            timeout=STOP_GRACE + 10,
        )
        self.tier.figures[f"{self.manifest}: SIGTERM -> exited (ms)"] = ms_since(stopping)
        status = (await container_status(self.tier.containerd, container_id)).status
        assert (status.state, status.exit_code) == (PB.CONTAINER_EXITED, 0), status


#: The grace period StopContainer gives (the pod's default terminationGracePeriodSeconds is 30).
STOP_GRACE = 30


def allocated_fields(answer: Any) -> dict[str, Any]:
    """What the kubelet puts into the consumer's CreateContainer from one ContainerAllocateResponse
    (pkg/kubelet/cm/devicemanager/manager.go GetDeviceRunContainerOptions, then
    kuberuntime_container.go): devices, env, mounts, annotations and CDI devices."""
    return {
        "devices": [
            PB.Device(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
            for d in answer.devices
        ],
        "envs": [PB.KeyValue(key=k, value=v) for k, v in sorted(answer.envs.items())],
        "annotations": dict(answer.annotations),
        "CDI_devices": [PB.CDIDevice(name=d.name) for d in answer.cdi_devices],
    }


def allocated_mounts(answer: Any) -> list[Any]:
    return [
        PB.Mount(container_path=m.container_path, host_path=m.host_path, readonly=m.read_only) for m in answer.mounts
    ]


def ms_since(since: float) -> float:
    """Milliseconds from ``since`` (time.monotonic()) to now, to the tenth: a figure of the run."""
    return round((time.monotonic() - since) * 1e3, 1)


def kubelet_lists(kubelet: gp.KubeletSimulator, *ids: str) -> bool:
    resource = kubelet.resources.get(RESOURCE)
    return resource is not None and resource.streaming and all(i in resource.devices for i in ids)
