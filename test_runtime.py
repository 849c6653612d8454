"""The runtime tier: gopherplug's shipped DaemonSets run in a real containerd, driven through the CRI as
the kubelet drives it.

    sudo GOPHERPLUG_RUNTIME=DIR .venv/bin/python -m pytest test_runtime.py

DIR holds containerd >= 1.7 (CDI-capable) with containerd-shim-runc-v2 and ctr, runc, a static busybox and
the CRI API (cri-api.proto), and DIR/containerd-2 a containerd 2.x with its shim and ctr (CI's matrix
has both; by hand it may be left out); every test runs under each containerd. Without root or without
DIR (default /opt/gopherplug-runtime) the whole module is skipped with one line saying so (a failure
instead when GOPHERPLUG_RUNTIME_REQUIRED is set, as CI does). Every binary comes from DIR, never from
PATH. GOPHERPLUG_TIER_RESULTS=FILE also writes the figures and the consumers' outputs, printed at the
end of the run, to FILE as JSON.

The cgroup mode is the one this process sees at /sys/fs/cgroup (cgroup2 there: v2), as runc's and
containerd's is; GOPHERPLUG_TIER_CGROUP=v1 or v2 says which one the run is meant for (V2_HOW: v2 on a
machine that boots v1).

Rules of this file:
- Nothing of the machine is touched but what the run creates: containerd has a private root, state,
  socket and CDI directory; the device nodes the tests make live in a directory of /dev unique to the run;
  the pod cgroups under a parent unique to the run. Everything is removed at the end, also on failure,
  containerd and every container by PID.
- The pods are the manifests' own (daemonset.yaml, daemonset-dra.yaml, read as shipped: the Helm
  chart's renders, which test_chart.py keeps equal to `helm template`). The translation to CRI
  requests copies what the kubelet does (sources cited beside each piece); the only substitutions
  are the image, the host side of hostPath volumes (private directories; /dev and /sys stay the host's),
  the ConfigMap's contents, the API server's address and the service account's token, and the host's
  network namespace for the sandboxes (no CNI here), which makes each pod's liveness port one of its
  own (the ConfigMap's health_address and the port the probe names, together).
- Assertions rest on what containerd or the container itself reports (ExecSync, ContainerStatus), and on
  what the kubelet stand-ins received, never on gopherplug's word.
- Every I/O has a bound; nothing sleeps to synchronise. Where no event exists (containerd's socket
  answering, a container's state), a short bounded poll of the real thing stands in.
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
import ssl
import stat
import subprocess
import sys
import tarfile
import tempfile
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
import gopherplug_standins as standins

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


def _remove_cgroups(parent: str) -> None:
    """The run's pod cgroups, left by runc once their containers are gone: in every v1 hierarchy, or
    in the unified one."""
    hierarchies = [Path("/sys/fs/cgroup"), *(d for d in Path("/sys/fs/cgroup").iterdir() if d.is_dir())]
    for controller in hierarchies:
        top = controller / parent.lstrip("/")
        if top.is_dir():
            for directory in sorted((Path(d) for d, _, _ in os.walk(top)), key=lambda p: len(str(p)), reverse=True):
                with contextlib.suppress(OSError):
                    directory.rmdir()


def _report(pytestconfig: pytest.Config, title: str, results: Any) -> None:
    """Print ``results`` (shown whatever the outcome: pytest keeps a fixture's output for failures
    only), and write everything so far to GOPHERPLUG_TIER_RESULTS."""
    if (where := os.environ.get("GOPHERPLUG_TIER_RESULTS")) is not None:
        Path(where).write_text(json.dumps(RESULTS, indent=2) + "\n")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print(f"\n{title}:\n" + json.dumps(results, indent=2), flush=True)


@pytest.fixture(scope="session")
def images(pytestconfig):
    """The CRI compiled and the images' archives built, once for every containerd of the run."""
    global PB, CRI
    root = Path(tempfile.mkdtemp(prefix=f"gpimg-{secrets.token_hex(3)}-", dir="/tmp"))
    try:
        PB, CRI = compile_cri(root)
        built = time.monotonic()
        archives = build_images(root)
        RESULTS["image build (s)"] = round(time.monotonic() - built, 1)
        RESULTS["plugin images"] = (
            f"the Dockerfile's (GOPHERPLUG_TIER_IMAGES={DOCKERFILE_IMAGES})"
            if DOCKERFILE_IMAGES is not None
            else "made by the tier (the host's python3.11 and the project)"
        )
        # A docker archive holds its layers uncompressed: about the image's size on a node.
        RESULTS["image sizes (MB, archive)"] = {k: round(v.stat().st_size / 1e6, 1) for k, v in archives.items()}
        yield archives
    finally:
        shutil.rmtree(root, ignore_errors=True)
        _report(pytestconfig, "runtime tier", {k: v for k, v in RESULTS.items() if k not in CONTAINERDS})


@pytest.fixture(scope="session", params=sorted(CONTAINERDS))
def tier(request, images, pytestconfig):
    """The run under one containerd of CONTAINERDS (every test runs under each): containerd started
    and the images imported; at the end, whatever happened, containerd and its containers stopped by
    PID, mounts, cgroups, the run's /dev directory and files removed, and the figures and consumers'
    outputs printed."""
    root = Path(tempfile.mkdtemp(prefix=f"gprt-{secrets.token_hex(3)}-", dir="/tmp"))
    tier = Run(root, request.param, images)
    try:
        tier.dev.mkdir(mode=0o755)
        if DROPPED_RESOURCES:
            tier.runc = RuncWithoutLimits(root)
        tier.containerd = tier.containerd_for(root / "ctrd")
        # The device-plugin resource with `cdi:` writes its spec where its pod can write (see
        # test_a_device_plugin_cdi_device_reaches_a_consumer); the runtime reads that directory too.
        tier.containerd.extra_cdi_dirs.append(root / "host" / DP_CDI_CASE / "kubelet" / "device-plugins" / "cdi")
        tier.containerd.extra_cdi_dirs[-1].mkdir(parents=True)
        tier.containerd.start()
        imported = time.monotonic()
        for archive in tier.archives.values():
            tier.containerd.import_image(archive)
        tier.figures["image import (s)"] = round(time.monotonic() - imported, 1)
        yield tier
    finally:
        for containerd in (tier.containerd, tier.second):
            if containerd is not None:
                try:
                    containerd.stop()
                except Exception as error:  # the rest of the cleanup must still happen
                    print(f"stopping the containerd in {containerd.root}: {error!r}")
        _remove_cgroups(tier.cgroup_parent)
        shutil.rmtree(tier.dev, ignore_errors=True)
        for link in tier.links:
            link.unlink(missing_ok=True)
        shutil.rmtree(root, ignore_errors=True)
        tier.figures["tier duration (s)"] = round(time.monotonic() - tier.started, 1)
        version = containerd_version(CONTAINERDS[tier.name])
        RESULTS[tier.name] = {
            "containerd": f"{version[0]}.{version[1]}",
            "cgroup": RESULTS["cgroup"],
            "figures": tier.figures,
            "consumer outputs": tier.outputs,
        }
        _report(pytestconfig, f"runtime tier results ({tier.name}, cgroup {RESULTS['cgroup']})", RESULTS[tier.name])


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


def _quantity(text: str | int) -> int:
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
        linux_resources.memory_limit_in_bytes = _quantity(limits["memory"])
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
        self.tier.figures[f"{self.manifest}: SIGTERM -> exited (ms)"] = _ms(stopping)
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


########################################################################################################
# The device plugin, as daemonset.yaml ships it


def _listed(kubelet: gp.KubeletSimulator, *ids: str) -> bool:
    resource = kubelet.resources.get(RESOURCE)
    return resource is not None and resource.streaming and all(i in resource.devices for i in ids)


async def test_device_plugin_pod_registers_and_offers_a_mknod_node_healthy(tier, nursery):
    """The shipped pod starts under the shipped security context (read-only root, no capability,
    seccomp, no_new_privs, the memory limit: the container shows each), registers, and offers device
    nodes its own device cgroup forbids it to open (10:229 is not in the runtime's default allowlist)
    as Healthy; a node its mode refuses to it as Unhealthy."""
    node = Node(tier, "daemonset.yaml")
    node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            started = time.monotonic()
            await kubelet.wait_until(lambda k: _listed(k, "gopher0"))
            tier.figures["device plugin: container started -> registered, first list (ms)"] = _ms(started)
            code, said = await exec_sync(
                tier.containerd, plugin, "python3.11", "-c", SHOW_CONFINEMENT, str(node.devices / "gopher0")
            )
            assert code == 0, said
            confinement = json.loads(said)
            tier.outputs["device plugin: the plugin's confinement, from inside"] = confinement
            assert confinement["CapEff"] == "0000000000000000" and confinement["NoNewPrivs"] == "1"
            assert confinement["Seccomp"] == "2"  # filter mode: RuntimeDefault
            assert confinement["write /"].startswith("OSError: [Errno 30] Read-only file system")
            # The cgroup, read on the host: in the pod, /sys is the host's own (the manifest's mount).
            limit = _quantity(manifest_pod("daemonset.yaml")["spec"]["containers"][0]["resources"]["limits"]["memory"])
            if "memory" in DROPPED_RESOURCES:
                # Cannot hold here: this machine's cgroup v2 hierarchy has no memory controller, so
                # RuncWithoutLimits took the limit out of the spec before runc (which would fail on
                # it) and nothing enforces it. What holds: the spec containerd handed runc had it.
                assert tier.runc is not None and tier.runc.dropped(plugin)["memory"]["limit"] == limit
                enforced = "not enforced: this cgroup v2 hierarchy has no memory controller (dropped before runc)"
            else:
                assert await memory_limit(tier.containerd, plugin) == limit
                enforced = "memory.max" if CGROUP_V2 else "memory.limit_in_bytes"
            tier.outputs["device plugin: memory limit"] = f"{limit} in the spec given to runc; {enforced}"
            # The plugin's own cgroup refuses the node: what makes the health question real.
            assert confinement["open gopher0"] == "PermissionError: [Errno 1] Operation not permitted", confinement
            listed = []
            for number in range(1, 21):
                # Not synchronisation: spacing the samples beyond gopherplug's push interval, so each
                # one measures a lone change, not the interval left from the previous one.
                await trio.sleep(2 * gp.LIST_PUSH_INTERVAL)
                created = time.monotonic()
                node.mknod(f"gopher{number}")
                await kubelet.wait_until(lambda k, n=number: _listed(k, f"gopher{n}"))
                listed.append(_ms(created))
            tier.figures["device plugin: mknod -> kubelet stand-in lists it (ms, n=20)"] = _spread(listed)
            # A node whose mode refuses root without capabilities (EACCES, before the device cgroup is
            # asked) is one the plugin, and any consumer running as it does, cannot use: Unhealthy.
            locked = node.mknod("locked")
            locked.chmod(0)
            await kubelet.wait_until(lambda k: _listed(k, "locked"))
            devices = kubelet.resources[RESOURCE].devices
            assert devices == {**{f"gopher{n}": gp.HEALTHY for n in range(21)}, "locked": gp.UNHEALTHY}
            # gopherplug's health check is access(): what the kernel says to it in the plugin's
            # container, in either cgroup mode (v1: devices.list; v2: the eBPF program), beside the
            # verdicts the kubelet got and the plugin's own device rules (no 10:229 among them).
            code, said = await exec_sync(
                tier.containerd, plugin, "python3.11", "-c", SHOW_ACCESS, str(node.devices / "gopher0"), str(locked)
            )
            assert code == 0, said
            errnos = json.loads(said)
            own_rules = await device_rules(tier.containerd, plugin)
            tier.outputs["device plugin: access() in the plugin's container -> the kubelet's verdict"] = {
                name: f"{errnos[str(node.devices / name)]} -> {devices[name]}" for name in ("gopher0", "locked")
            }
            tier.outputs["device plugin: the plugin's own device rules (host side)"] = {
                **{k: v for k, v in own_rules.items() if k == "program"},
                "rules": [rule for rule in own_rules["rules"] if rule.startswith(f"c {DEVICE_MAJOR}:")],
            }
            assert errnos == {str(node.devices / "gopher0"): "EPERM", str(locked): "EACCES"}, errnos
            assert f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw" not in own_rules["rules"]
            tier.figures["device plugin: idle RSS, 21 devices (MiB)"] = await _rss(tier.containerd, plugin)


#: The plugin's metrics page, fetched over loopback from inside its container.
SCRAPE = """
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10) as answer:
    sys.stdout.write(answer.read().decode())
"""

#: Run by the plugin's own Python in its container: access(R_OK | W_OK) of each path, as gopherplug's
#: health check asks it (0, or the errno's name).
SHOW_ACCESS = """
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
said = {}
for path in sys.argv[1:]:
    said[path] = "0" if libc.access(path.encode(), os.R_OK | os.W_OK) == 0 else errno.errorcode[ctypes.get_errno()]
print(json.dumps(said))
"""

#: Run by the plugin's own Python in its container: what confines it, as the kernel reports it.
SHOW_CONFINEMENT = """
import json, os, sys
seen = {}
for line in open("/proc/self/status"):
    key, _, value = line.partition(":")
    if key in ("CapEff", "CapBnd", "NoNewPrivs", "Seccomp", "Uid"):
        seen[key] = value.strip()
for what, action in (("write /", lambda: open("/tier-probe", "w")),
                     ("open gopher0", lambda: open(sys.argv[1], "rb"))):
    try:
        action()
        seen[what] = "ok"
    except OSError as error:
        seen[what] = f"{type(error).__name__}: {error}".split(": '")[0]
print(json.dumps(seen))
"""


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1e3, 1)


def _spread(samples: list[float]) -> str:
    ordered = sorted(samples)
    return f"p50 {ordered[len(ordered) // 2]}, max {ordered[-1]}"


async def cgroup_file(containerd: Containerd, container_id: str, controller: str, name: str) -> str:
    """A file of the container's cgroup, found through the runtime spec containerd reports (with the
    cgroupfs driver, cgroupsPath is a path under each hierarchy)."""
    path = await container_cgroup(containerd, container_id)
    hierarchy = Path("/sys/fs/cgroup") if CGROUP_V2 else Path("/sys/fs/cgroup") / controller
    return (hierarchy / path / name).read_text().strip()


async def memory_limit(containerd: Containerd, container_id: str) -> int:
    if CGROUP_V2:
        return int(await cgroup_file(containerd, container_id, "memory", "memory.max"))
    return int(await cgroup_file(containerd, container_id, "memory", "memory.limit_in_bytes"))


async def _rss(containerd: Containerd, container_id: str) -> dict[str, float]:
    """The plugin's resident memory: its process's VmRSS (the container's init, whose PID the verbose
    ContainerStatus gives) and its cgroup's anonymous memory (memory.stat: v1 total_rss, v2 anon)."""
    status = await container_status(containerd, container_id, verbose=True)
    info = json.loads(status.info["info"])
    found = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{info['pid']}/status").read_text())
    assert found is not None
    figures = {"VmRSS": round(int(found[1]) / 1024, 1)}
    with contextlib.suppress(OSError, KeyError):
        stats = dict(
            line.split() for line in (await cgroup_file(containerd, container_id, "memory", "memory.stat")).splitlines()
        )
        figures["cgroup rss"] = round(int(stats["anon" if CGROUP_V2 else "total_rss"]) / 2**20, 1)
    return figures


async def test_the_distroless_recipe_serves_under_the_shipped_pod(tier, nursery):
    """examples/distroless/Dockerfile's image (docs/deployment.md, "A distroless image of your own")
    in daemonset.yaml's pod, its image swapped and nothing else: it starts under the shipped security
    context (read-only root, no capability), registers, and lists a device node Healthy."""
    if "distroless" not in tier.archives:
        pytest.skip("the distroless recipe's image is built by .ci/images: GOPHERPLUG_TIER_IMAGES")
    node = Node(tier, "daemonset.yaml")
    node.template["spec"]["containers"][0]["image"] = image_of(node.template) + "-distroless"
    node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            started = time.monotonic()
            await kubelet.wait_until(lambda k: _listed(k, "gopher0"))
            tier.figures["distroless recipe: container started -> registered, first list (ms)"] = _ms(started)
            assert kubelet.resources[RESOURCE].devices == {"gopher0": gp.HEALTHY}
            code, said = await exec_sync(
                tier.containerd, plugin, "python3.11", "-c", SHOW_CONFINEMENT, str(node.devices / "gopher0")
            )
            assert code == 0, said
            confinement = json.loads(said)
            assert confinement["CapEff"] == "0000000000000000", confinement
            assert confinement["write /"].startswith("OSError: [Errno 30] Read-only file system"), confinement
            tier.figures["distroless recipe: idle RSS, 1 device (MiB)"] = await _rss(tier.containerd, plugin)


async def test_a_consumer_given_the_allocate_answer_opens_the_node_and_one_without_cannot(tier, nursery):
    """The consumer is created with what the kubelet stand-in's Allocate got (DeviceSpecs, env, mounts,
    annotations, CDI devices): the runtime puts the node in its /dev and its device cgroup, and it opens
    it read-write. A control container that sees the same node through a bind mount but got no
    DeviceSpec is refused by its device cgroup."""
    node = Node(tier, "daemonset.yaml")
    path = node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            await kubelet.wait_until(lambda k: _listed(k, "gopher0"))
            # The manifest's liveness probe, as the kubelet makes it: an HTTP GET from the host.
            code, said = await liveness_probe(node)
            assert code == 200, said
            tier.outputs["device plugin: liveness probe"] = f"{code} {said.strip()}"
            # And the operator's full check, `gopherplug probe`, in the plugin's container.
            code, said = await exec_sync(tier.containerd, plugin, "gopherplug", "probe", timeout=10)
            assert code == 0, said
            tier.outputs["device plugin: gopherplug probe"] = said.strip().splitlines()
            pod = Pod(tier, "consumer")
            holder = (pod.namespace, pod.name, "consumer")
            answer = (await kubelet.allocate(RESOURCE, ["gopher0"], container=holder)).container_responses[0]
            # The metrics the manifest turns on, scraped from inside the plugin's container as a
            # Prometheus in the pod network would (here the sandbox has the host's network).
            port = manifest_config("daemonset.yaml")["metrics_address"].rpartition(":")[2]
            code, page = await exec_sync(tier.containerd, plugin, "python3.11", "-c", SCRAPE, port)
            assert code == 0, page
            metrics = [line for line in page.splitlines() if line.startswith("gopherplug_")]
            tier.outputs["device plugin: metrics"] = metrics[:15]
            assert f'gopherplug_devices{{health="Healthy",resource="{RESOURCE}"}} 1.0' in metrics, page
            assert f'gopherplug_allocate_seconds_count{{resource="{RESOURCE}"}} 1.0' in metrics, page
            fields = allocated_fields(answer)
            assert [d.host_path for d in fields["devices"]] == [str(path)]
            config = consumer_config(pod, **fields)
            config.mounts.extend(allocated_mounts(answer))
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
                # Who holds it, as an operator asks: `gopherplug who` in the plugin's container,
                # through the manifest's read-only mount of the kubelet's PodResources socket.
                socket_path = str(node.kubelet_dir / gp.POD_RESOURCES_SOCKET)
                await nursery.start(standins.PodResourcesSimulator(socket_path, kubelet).run)
                code, who = await exec_sync(tier.containerd, plugin, "gopherplug", "who")
                assert code == 0, who
            control = Pod(tier, "control")
            config = consumer_config(control)
            config.mounts.append(PB.Mount(container_path="/mnt/devices", host_path=str(node.devices), readonly=False))
            async with running_pod(tier.containerd, control, control.sandbox_config(), [config]):
                refused = await consumer_report(
                    tier.containerd, control.container_ids["consumer"], "/mnt/devices/gopher0"
                )
    tier.outputs["device plugin: consumer"] = seen
    tier.outputs["device plugin: gopherplug who, while the consumer runs"] = who.strip().splitlines()
    assert who.strip() == f"{RESOURCE} gopher0 {path}: Healthy: {pod.namespace}/{pod.name}/consumer (device plugin)"
    tier.outputs["device plugin: control without the DeviceSpec"] = refused
    assert "GOPHER_DEVICES=gopher0" in seen["env"]
    assert seen["ls exit"] == 0 and seen["ls -l"].startswith("crw") and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")
    assert refused["ls exit"] == 0 and refused["ls -l"].startswith("crw")
    assert refused["open exit"] != 0 and "Operation not permitted" in refused["open rw"]
    assert not_granted_refused(seen) and not_granted_refused(refused)
    # The DeviceSpec's rule, in the consumer's device rules only (v1: devices.list; v2: its eBPF program).
    rule = f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw"
    assert rule in seen["device rules (host side)"] and rule not in refused["device rules (host side)"]


def _without_termination_message_path(template: dict[str, Any]) -> dict[str, Any]:
    template = json.loads(json.dumps(template))
    del template["spec"]["containers"][0]["terminationMessagePath"]
    return template


@pytest.mark.parametrize("manifest", ["daemonset.yaml", "daemonset-dra.yaml"])
async def test_the_default_termination_message_path_cannot_start_under_the_read_only_dev(tier, manifest):
    """Why the manifests set terminationMessagePath: with the default /dev/termination-log, runc must
    create the kubelet's bind-mount target in the host's /dev, mounted read-only, and the container
    never starts. The same pod with the shipped path is shown starting by the tests above and below."""
    node = Node(tier, manifest)
    node.template = _without_termination_message_path(node.template)
    with trio.fail_after(TIMEOUT), pytest.raises(grpc.RpcError) as failed:
        async with node.running():
            pass
    message = failed.value.details()
    tier.outputs[f"{manifest} with /dev/termination-log"] = message
    assert '"/dev/termination-log"' in message and "read-only file system" in message


@contextlib.contextmanager
def _removed_afterwards(cdi_dir: Path):
    """gopherplug keeps its CDI spec on exit (a restart must not take devices from running pods): the
    test removes it, since the DRA driver's spec names the same devices (same kind, same IDs) and the
    runtime would take the one of the later directory."""
    try:
        yield
    finally:
        for spec in cdi_dir.iterdir():
            spec.unlink()


@pytest.mark.parametrize(
    "spec_dir",
    [
        pytest.param(gp.CDIConfig.spec_dir, id="default-spec-dir"),
        pytest.param("/var/lib/kubelet/device-plugins/cdi", id="spec-dir-in-the-device-plugin-dir"),
    ],
)
async def test_a_device_plugin_cdi_device_reaches_a_consumer(tier, nursery, spec_dir):
    """The CDI spec gopherplug writes for a device-plugin resource loads in containerd: a consumer
    created with nothing but the CDI device name of the Allocate answer gets the node and the env
    through containerd's CDI handling.

    Both at the default spec_dir, mounted from the host with the lines docs/deployment.md's
    step 4 gives (daemonset.yaml's example has no `cdi:` and leaves it out, so nothing is created
    on nodes without CDI; without them the pod exits with "cannot write the CDI spec
    /var/run/cdi/...: Read-only file system"), and at a spec_dir in the device-plugin directory,
    which this containerd reads too."""
    default = spec_dir == gp.CDIConfig.spec_dir
    node = Node(tier, "daemonset.yaml", "" if default else DP_CDI_CASE)
    node.config["resources"][0]["cdi"] = {"kind": RESOURCE, "spec_dir": spec_dir}
    if default:
        node.add_readme_cdi_mount()
    path = node.mknod("gopher0")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    host_cdi_dir = tier.containerd.cdi_dir if default else tier.containerd.extra_cdi_dirs[-1]
    with trio.fail_after(TIMEOUT), _removed_afterwards(host_cdi_dir):
        async with node.running():
            await kubelet.wait_until(lambda k: _listed(k, "gopher0"))
            answer = (await kubelet.allocate(RESOURCE, ["gopher0"])).container_responses[0]
            fields = allocated_fields(answer)
            tier.outputs[f"device plugin with cdi ({spec_dir}): Allocate answer"] = {
                "devices": len(fields["devices"]),
                "envs": dict(answer.envs),
                "cdi_devices": [d.name for d in answer.cdi_devices],
            }
            assert [d.name for d in fields["CDI_devices"]] == [f"{RESOURCE}=gopher0"]
            # Only the CDI device: what reaches the consumer then comes from the spec gopherplug wrote.
            pod = Pod(tier, "cdi-consumer")
            config = consumer_config(pod, CDI_devices=fields["CDI_devices"])
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
    tier.outputs[f"device plugin with cdi ({spec_dir}): consumer"] = seen
    assert any(line.startswith("GOPHER_DEVICES") and line.endswith("=gopher0") for line in seen["env"])
    assert seen["ls exit"] == 0 and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")


@pytest.mark.parametrize("through", ["device-spec", "cdi"])
async def test_a_consumer_sees_the_node_with_the_host_mode(tier, nursery, through):
    """A node the host keeps at 0660 (as udev does for serial ports and render nodes) must not become
    writable by every user of the consumer. Given as a DeviceSpec, the runtime copies the host
    node's mode and owner; given as a CDI device, the spec's fileMode, uid and gid decide (without
    them: 0666 root:root, runc's default)."""
    node = Node(tier, "daemonset.yaml", DP_CDI_CASE)
    node.config["resources"][0]["cdi"] = {"kind": RESOURCE, "spec_dir": "/var/lib/kubelet/device-plugins/cdi"}
    name = f"serial-{through}"
    path = node.mknod(name)
    path.chmod(0o660)
    os.chown(path, HOST_UID, HOST_GID)
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)
    with trio.fail_after(TIMEOUT), _removed_afterwards(tier.containerd.extra_cdi_dirs[-1]):
        async with node.running():
            await kubelet.wait_until(lambda k: _listed(k, name))
            fields = allocated_fields((await kubelet.allocate(RESOURCE, [name])).container_responses[0])
            if through == "cdi":
                fields["devices"] = []
            else:
                fields["CDI_devices"] = []
            pod = Pod(tier, "mode-consumer")
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [consumer_config(pod, **fields)]):
                _, listed = await exec_sync(tier.containerd, pod.container_ids["consumer"], "ls", "-ln", str(path))
    tier.outputs[f"a 0660 node given through {through}"] = listed.strip()
    assert listed.startswith("crw-rw---- "), listed
    assert listed.split()[2:4] == [str(HOST_UID), str(HOST_GID)], listed  # the host node's owner and group


########################################################################################################
# The DRA driver, as daemonset-dra.yaml ships it


def metadata_spec_host_view(cdi_dir: Path, in_pod: str, host_side: Path) -> None:
    """The DRA pod's device metadata CDI specs (kind <driver>/metadata) in ``cdi_dir``, with each
    mount's hostPath under the pod's kubelet root read through ``host_side`` (_api_server_for).
    Replaced by rename, as gopherplug writes them: containerd's CDI cache sees whole files only."""
    for path in cdi_dir.glob(f"{DRIVER.replace('/', '-')}-metadata_*.json"):
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            for mount in device["containerEdits"].get("mounts", []):
                if mount["hostPath"].startswith(in_pod + "/"):
                    mount["hostPath"] = str(host_side) + mount["hostPath"][len(in_pod) :]
        temporary = path.with_name(f".{path.name}.host-view")
        temporary.write_text(json.dumps(spec))
        temporary.replace(path)


async def _api_server_for(node: Node, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    """An API server stand-in over TLS, with what the kubelet gives the DRA pod to reach it: the
    service's address in env (pkg/kubelet/kubelet_pods.go getServiceEnvVarMap, the `kubernetes`
    service), and the service account's projected token and ca.crt. And where a kubelet stand-in
    finds the node's kubelet directory (below)."""
    import trustme

    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    token = secrets.token_urlsafe(24)
    api = await nursery.start(standins.ApiServerSimulator(ssl_context=context, tokens={token}).run)
    node.service_env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
    node.service_account = {"token": token, "ca.crt": ca.cert_pem.bytes().decode(), "namespace": "kube-system"}
    # On a node the kubelet sees the plugin's sockets at the paths the pod made them, as hostPath
    # and mountPath are equal; here the host side is a private directory, so the kubelet stand-in
    # works on the host side: the translation's one concession. Through a symlink no longer than
    # the pod's kubelet root: the pod names its sockets to fit a unix socket's 108 bytes from there
    # (with POD_UID, "<driver>-<pod UID>-reg.sock" leaves little room), and the run's directory is
    # longer. The endpoint GetInfo names is read on the same side.
    # The second concession, for the same reason: a claim's device metadata CDI spec names the
    # metadata file's hostPath as the pod sees it (/var/lib/kubelet/plugins/...), which on a node is
    # the host's path too; here it is read through the same symlink. The spec is rewritten in the
    # CDI directory once the claim is prepared, before any consumer is created, only that prefix.
    in_pod = node.config["dra"]["kubelet_dir"]
    host_side = Path("/tmp") / f"gk{secrets.token_hex(4)}"
    host_side.symlink_to(node.kubelet_dir)
    node.tier.links.append(host_side)
    assert len(str(host_side)) <= len(in_pod)
    call_unary = gp.call_unary

    async def host_view(socket_path: str, method: Any, request: Any, *, timeout: float) -> Any:
        answer = await call_unary(socket_path, method, request, timeout=timeout)
        if method is gp.DRA_METHODS[gp.GET_INFO]:
            answer.endpoint = answer.endpoint.replace(in_pod, str(host_side), 1)
        if method.name == "NodePrepareResources":
            metadata_spec_host_view(node.tier.containerd.cdi_dir, in_pod, host_side)
        return answer

    monkeypatch.setattr(gp, "call_unary", host_view)
    return api, host_side


async def dra_cluster(
    node: Node, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> tuple[standins.ApiServerSimulator, standins.DraKubeletSimulator]:
    """Around the shipped DRA pod on ``node``: the API server stand-in of _api_server_for with the
    node's Node, and the DRA kubelet stand-in on the node's kubelet directory, running."""
    api, host_side = await _api_server_for(node, nursery, monkeypatch)
    api.put_node(NODE_NAME, str(uuid.uuid4()))  # registered by the kubelet: the slices' owner
    kubelet = standins.DraKubeletSimulator(str(host_side), wipe=lambda d: api.delete_node_slices(NODE_NAME, d))
    await nursery.start(kubelet.run)
    return api, kubelet


async def stored_devices(api: Any, pool: str, wanted: Any) -> dict[str, dict[str, Any]]:
    """The devices of ``pool`` as the API server stand-in stores them (by name, across the pool's
    slices), once ``wanted(devices)`` holds; woken by each write."""
    while True:
        devices = {
            device["name"]: device
            for item in api.slices.values()
            if item["spec"]["pool"]["name"] == pool
            for device in item["spec"]["devices"]
        }
        if wanted(devices):
            return devices
        await api.changed.wait_touched()


def dra_claim(name: str, requests: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """A ResourceClaim in namespace default as the scheduler leaves it: its requests, and the
    allocation's results (each a request's name, the driver, pool and device, and what the scheduler
    copies from the request: adminAccess, tolerations)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": str(uuid.uuid4())},
        "spec": {"devices": {"requests": requests}},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def _shipped_device_class() -> dict[str, Any]:
    """The shipped DeviceClass that ordinary claims name (the manifest's first; the second,
    "<name>-admin", is for admin-access claims)."""
    classes = [doc for doc in manifest_docs("daemonset-dra.yaml") if doc["kind"] == "DeviceClass"]
    assert [c["metadata"]["name"] for c in classes] == ["gopher.example.com", "gopher.example.com-admin"]
    return classes[0]


def _device_class() -> str:
    return str(_shipped_device_class()["metadata"]["name"])


async def test_dra_pod_registers_publishes_prepares_and_a_consumer_gets_its_cdi_device(tier, nursery, monkeypatch):
    """The shipped DRA pod registers through plugins_registry, writes its ResourceSlice to the API
    server stand-in over TLS with the projected token and ca.crt, prepares an allocated claim; a
    consumer created with the claim's CDI device IDs (CRI CDI_devices, as the kubelet passes them)
    gets the node through containerd's own CDI handling. A containerd with enable_cdi = false runs
    the same consumer without device and without env, and says nothing."""
    node = Node(tier, "daemonset-dra.yaml")
    path = node.mknod("gopher0")
    path.chmod(0o660)  # the host's mode reaches the consumer through the CDI spec, as a DeviceSpec's would
    os.chown(path, HOST_UID, HOST_GID)
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    device = gp.dra_device_name("gopher0")

    def published() -> bool:
        return any(s["spec"]["pool"]["name"] == pool and s["spec"]["devices"] for s in api.slices.values())

    with trio.fail_after(TIMEOUT):
        async with node.running() as plugin:
            started = time.monotonic()

            async def registered() -> None:
                await kubelet.wait_until(lambda k: DRIVER in k.drivers)

                tier.figures["DRA: container started -> registered (ms)"] = _ms(started)

            async def slice_published() -> None:
                while not published():
                    await api.changed.wait_touched()
                tier.figures["DRA: container started -> slice published (ms)"] = _ms(started)

            async with trio.open_nursery() as both:
                both.start_soon(registered)
                both.start_soon(slice_published)
            tier.figures["DRA: idle RSS, 1 device (MiB)"] = await _rss(tier.containerd, plugin)
            (written,) = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
            assert written["spec"]["nodeName"] == NODE_NAME
            assert [d["name"] for d in written["spec"]["devices"]] == [device]
            code, said = await liveness_probe(node)
            assert code == 200, said
            tier.outputs["DRA: liveness probe"] = f"{code} {said.strip()}"
            code, said = await exec_sync(tier.containerd, plugin, "gopherplug", "probe", timeout=10)
            assert code == 0, said
            tier.outputs["DRA: gopherplug probe"] = said.strip().splitlines()
            uid = str(uuid.uuid4())
            api.put_claim(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"namespace": "default", "name": "gopher", "uid": uid},
                    # A prioritized list (firstAvailable, GA in 1.36): the scheduler names the
                    # subrequest it satisfied in the result, "gopher/any"; the pod's container asks
                    # for the claim's request "gopher" only.
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gopher",
                                    "firstAvailable": [
                                        {"name": "fast", "deviceClassName": "fast-gopher"},
                                        {"name": "any", "deviceClassName": "gopher"},
                                    ],
                                }
                            ]
                        }
                    },
                    "status": {
                        "allocation": {
                            "devices": {
                                "results": [{"request": "gopher/any", "driver": DRIVER, "pool": pool, "device": device}]
                            }
                        }
                    },
                }
            )
            prepared = (await kubelet.prepare(DRIVER, [("default", uid, "gopher")])).claims[uid]
            assert prepared.error == ""
            # What the kubelet gives a container whose resources.claims[] entry names request
            # "gopher": the CDI IDs of the devices whose request names contain it (cdiDevicesAsList
            # in pkg/kubelet/cm/dra/claiminfo.go). Had the driver answered "gopher/any", none.
            ids = kubelet.cdi_devices(uid, "gopher")
            assert ids == [i for d in prepared.devices for i in d.cdi_device_ids] != []
            tier.outputs["DRA: CDI device IDs"] = ids
            # The kubelet passes a claim's CDI devices in the CRI's CDI_devices field only
            # (kuberuntime_container.go makeCDIDevices; no annotations).
            cdi = [PB.CDIDevice(name=i) for i in ids]
            pod = Pod(tier, "dra-consumer")
            config = consumer_config(pod, CDI_devices=cdi)
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                consumer = pod.container_ids["consumer"]
                seen = await consumer_report(tier.containerd, consumer, str(path))
                # Its device metadata (KEP-5304), as the container itself reads it at the path the
                # protocol gives; and read-only there.
                metadata_path = f"{gp.DRA_METADATA_CONTAINER_DIR}/resourceclaims/gopher/gopher/{DRIVER}-metadata.json"
                read_code, metadata_text = await exec_sync(tier.containerd, consumer, "cat", metadata_path)
                write_code, refused = await exec_sync(tier.containerd, consumer, "sh", "-c", f"echo >> {metadata_path}")
            tier.outputs["DRA: consumer"] = seen
            tier.outputs["DRA: the consumer's device metadata"] = metadata_text.splitlines()
            # enable_cdi = false (containerd 1.7's default), the same spec directory: nothing fails.
            second = tier.containerd_for(tier.root / "ctrd2", enable_cdi=False)
            second.extra_cdi_dirs.append(tier.containerd.cdi_dir)
            tier.second = second
            await trio.to_thread.run_sync(second.start)
            for image in ("pause", "busybox"):
                await trio.to_thread.run_sync(second.import_image, tier.archives[image])
            pod = Pod(tier, "dra-consumer-no-cdi")
            config = consumer_config(pod, CDI_devices=cdi)
            async with running_pod(second, pod, pod.sandbox_config(), [config]):
                state = (await container_status(second, pod.container_ids["consumer"])).status.state
                unseen = await consumer_report(second, pod.container_ids["consumer"], str(path))
            tier.outputs["DRA: consumer under enable_cdi = false"] = unseen
    assert seen["ls exit"] == 0 and seen["ls -l"].startswith("crw-rw---- ") and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")
    assert {"GOPHER_DEVICES=gopher0", "GOPHER_DEVICES_GOPHER0=gopher0"} <= set(seen["env"]), seen
    # The metadata file, through containerd's CDI handling: the claim, the subrequest the scheduler
    # chose, and the device with the attributes the API server stand-in stored in its slice.
    assert read_code == 0, metadata_text
    beta = json.JSONDecoder().raw_decode(metadata_text)[0]
    assert (beta["kind"], beta["apiVersion"]) == ("DeviceMetadata", "metadata.resource.k8s.io/v1beta1")
    assert beta["metadata"] == {"name": "gopher", "namespace": "default", "uid": uid, "generation": 1}
    [request] = beta["requests"]
    assert request["name"] == "gopher/any"
    assert request["devices"] == [
        {"driver": DRIVER, "pool": pool, "name": device, "attributes": written["spec"]["devices"][0]["attributes"]}
    ]
    assert write_code != 0 and "Read-only file system" in refused, refused
    assert api.refused_tokens == 0  # every request from the pod carried the projected token
    assert state == PB.ContainerState.CONTAINER_RUNNING
    assert unseen["ls exit"] != 0 and "No such file or directory" in unseen["ls -l"]
    assert not any(line.startswith("GOPHER") for line in unseen["env"]), unseen["env"]
    assert not_granted_refused(seen) and not_granted_refused(unseen)
    # The CDI spec's device node rule, under the CDI-enabled containerd only.
    rule = f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw"
    assert rule in seen["device rules (host side)"] and rule not in unseen["device rules (host side)"]


#: How many consumers share the one device in the test below
SHARES = 3


async def test_dra_one_device_shared_by_three_claims_reaches_three_consumers_each_with_its_share(
    tier, nursery, monkeypatch
):
    """replicas: 3 in the shipped DRA pod's configuration (its one edit besides the directory): the
    slice offers gopher0 to 3 claims at once (KEP-5075). Three claims of the shipped DeviceClass,
    each allocated by the scheduler stand-in from the stored slice (a share of its own: a shareID,
    1 share consumed), are prepared, and a fourth is not allocated; three consumer
    pods, each created with its claim's CDI devices, all open the one node, and containerd reports
    for each another CDI device, whose env names that consumer's share. Unprepared, the shares'
    CDI devices are gone from the runtime's spec directory."""
    node = Node(tier, "daemonset-dra.yaml")
    node.config["resources"][0]["replicas"] = SHARES
    # The tier's pods are on the host's network, where another run of the tier may hold the
    # manifest's metrics port: a free one (metrics are not what this test is about).
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        node.config["metrics_address"] = f"127.0.0.1:{free.getsockname()[1]}"
    path = node.mknod("gopher0")
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool, device = gp.dra_pool_name(NODE_NAME, RESOURCE), gp.dra_device_name("gopher0")
    kind = node.config["resources"][0]["cdi"]["kind"]
    scheduler = standins.SchedulerSimulator(api, [_shipped_device_class()])

    def made(name: str) -> dict[str, Any]:
        """A claim for one device of the shipped class, asking no capacity: the policy's default."""
        request = {"name": "gopher", "exactly": {"deviceClassName": _device_class()}}
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"namespace": "default", "name": name, "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [request]}},
        }

    claims: list[tuple[str, str, str]] = []  # name, UID, shareID

    def shared() -> list[dict[str, Any]]:
        mine = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
        return [d for s in mine for d in s["spec"]["devices"] if d.get("allowMultipleAllocations")]

    seen: dict[str, dict[str, Any]] = {}
    reported: dict[str, dict[str, Any]] = {}
    with trio.fail_after(TIMEOUT):
        async with node.running():
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            while not shared():
                await api.changed.wait_touched()
            (published,) = shared()
            tier.outputs["DRA shares: the slice's device as stored"] = published
            results = {}
            for number in range(SHARES):
                claim = made(f"gopher-{number}")
                claim["status"] = {"allocation": scheduler.allocate(claim, NODE_NAME)}
                api.put_claim(claim)
                (result,) = claim["status"]["allocation"]["devices"]["results"]
                assert (result["pool"], result["device"]) == (pool, device), result
                claims.append((claim["metadata"]["name"], claim["metadata"]["uid"], result["shareID"]))
                results[claim["metadata"]["name"]] = result
            with pytest.raises(standins.UnschedulableError, match=r"^cannot allocate all claims$"):
                scheduler.allocate(made(f"gopher-{SHARES}"), NODE_NAME)  # the device's shares are all taken
            tier.outputs["DRA shares: allocation results"] = list(results.values())
            answer = await kubelet.prepare(DRIVER, [("default", uid, name) for name, uid, _ in claims])
            assert all(not answer.claims[uid].error for _, uid, _ in claims), answer
            async with contextlib.AsyncExitStack() as pods:
                for name, uid, _ in claims:
                    pod = Pod(tier, f"dra-{name}")
                    cdi = [PB.CDIDevice(name=i) for i in kubelet.cdi_devices(uid, "gopher")]
                    await pods.enter_async_context(
                        running_pod(tier.containerd, pod, pod.sandbox_config(), [consumer_config(pod, CDI_devices=cdi)])
                    )
                    container = pod.container_ids["consumer"]
                    seen[name] = await consumer_report(tier.containerd, container, str(path))
                    info = json.loads((await container_status(tier.containerd, container, verbose=True)).info["info"])
                    reported[name] = {
                        "CDI devices": [d["name"] for d in info["config"].get("CDI_devices", [])],
                        "env": sorted(e for e in info["runtimeSpec"]["process"]["env"] if e.startswith("GOPHER")),
                    }
            tier.outputs["DRA shares: consumers"] = seen
            tier.outputs["DRA shares: containerd's report"] = reported
            gone = await kubelet.unprepare(DRIVER, [("default", uid, name) for name, uid, _ in claims])
            assert all(not gone.claims[uid].error for _, uid, _ in claims), gone
            left = sorted(p.name for p in tier.containerd.cdi_dir.iterdir() if any(u in p.name for _, u, _ in claims))
    assert published["capacity"] == {
        gp.DRA_SHARES_CAPACITY: {
            "value": str(SHARES),
            "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": str(SHARES), "step": "1"}},
        }
    }
    for name, uid, share in claims:
        assert seen[name]["ls exit"] == 0 and f" {DEVICE_MAJOR}, {DEVICE_MINOR} " in seen[name]["ls -l"], seen[name]
        assert (seen[name]["open exit"], seen[name]["open rw"]) == (0, "opened rw"), seen[name]
        assert f"GOPHER_DEVICES_GOPHER0_SHARE={share}" in seen[name]["env"], seen[name]["env"]
        # Its share's CDI device, its request's env, and its device metadata's mount (dra.device_metadata,
        # on by default).
        metadata = f"{DRIVER}/metadata={uid}_gopher"
        assert reported[name]["CDI devices"] == [f"{kind}=gopher0-{share}", f"{kind}={uid}_gopher", metadata]
        assert f"GOPHER_DEVICES_GOPHER0_SHARE={share}" in reported[name]["env"], reported[name]
        assert "GOPHER_DEVICES=gopher0" in reported[name]["env"], reported[name]  # the device, once
        # Each share's CDI device node rule, in each consumer's device rules.
        assert f"c {DEVICE_MAJOR}:{DEVICE_MINOR} rw" in seen[name]["device rules (host side)"], seen[name]
    assert len({tuple(r["CDI devices"]) for r in reported.values()}) == SHARES  # three names, one device
    assert left == []


async def test_dra_a_claim_of_two_devices_gives_its_container_the_env_allocate_gives(tier, nursery, monkeypatch):
    """On a real containerd. The device-plugin pod (daemonset.yaml) is asked by the
    kubelet stand-in to Allocate gopher1 and gopher0, and a consumer created with its answer reports
    GOPHER_DEVICES. The DRA pod (daemonset-dra.yaml, on a node of its own) prepares a claim whose
    request "gopher" the scheduler gave gopher1, then gopher0, and whose request "more" it gave
    gopher2: a consumer created with the CDI devices of request "gopher" (whose pod sets a
    GOPHER_DEVICES of its own) reports the same GOPHER_DEVICES, through containerd's CDI, with each
    device's GOPHER_DEVICES_<ID>. One created with the whole claim's reports "more"'s list:
    containerd keeps the last value of a variable that two CDI devices set, as the unit tests'
    runtime (cdi_container_env) says, the README too."""
    plugin_node = Node(tier, "daemonset.yaml")
    del plugin_node.config["metrics_address"]  # the host's network, shared: not what this test is about
    dra_node = Node(tier, "daemonset-dra.yaml")
    for node in (plugin_node, dra_node):
        for name in ("gopher0", "gopher1", "gopher2"):
            node.mknod(name)
    kubelet = await nursery.start(gp.KubeletSimulator(str(plugin_node.device_plugin_dir)).run)
    api, dra_kubelet = await dra_cluster(dra_node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    reported: dict[str, dict[str, Any]] = {}

    async def consumer(name: str, **fields: Any) -> list[str]:
        """The env the consumer's container reports (`env` run inside it), and containerd's spec of it."""
        pod = Pod(tier, name)
        config = consumer_config(pod, **fields)
        async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
            container = pod.container_ids["consumer"]
            _, env = await exec_sync(tier.containerd, container, "env")
            info = json.loads((await container_status(tier.containerd, container, verbose=True)).info["info"])
        reported[name] = {
            "CDI devices": [d["name"] for d in info["config"].get("CDI_devices", [])],
            "runtime spec env": [e for e in info["runtimeSpec"]["process"]["env"] if e.startswith("GOPHER")],
        }
        return sorted(line for line in env.splitlines() if line.startswith("GOPHER"))

    with trio.fail_after(TIMEOUT):
        async with plugin_node.running():
            await kubelet.wait_until(lambda k: _listed(k, "gopher0", "gopher1", "gopher2"))
            answer = (await kubelet.allocate(RESOURCE, ["gopher1", "gopher0"])).container_responses[0]
            by_allocate = await consumer("env-device-plugin", **allocated_fields(answer))
        async with dra_node.running():
            await dra_kubelet.wait_until(lambda k: DRIVER in k.drivers)
            await stored_devices(api, pool, lambda devices: len(devices) == 3)
            results = [
                {"request": "gopher", "driver": DRIVER, "pool": pool, "device": "gopher1"},
                {"request": "gopher", "driver": DRIVER, "pool": pool, "device": "gopher0"},
                {"request": "more", "driver": DRIVER, "pool": pool, "device": "gopher2"},
            ]
            requests = [
                {"name": "gopher", "exactly": {"deviceClassName": _device_class(), "count": 2}},
                {"name": "more", "exactly": {"deviceClassName": _device_class()}},
            ]
            claim = dra_claim("gophers", requests, results)
            api.put_claim(claim)
            uid = claim["metadata"]["uid"]
            prepared = (await dra_kubelet.prepare(DRIVER, [("default", uid, "gophers")])).claims[uid]
            assert prepared.error == ""
            own = [PB.KeyValue(key="GOPHER_DEVICES", value="the pod's own")]
            ids = dra_kubelet.cdi_devices(uid, "gopher")
            by_claim = await consumer("env-dra", CDI_devices=[PB.CDIDevice(name=i) for i in ids], envs=own)
            whole_ids = dra_kubelet.cdi_devices(uid)
            whole = await consumer("env-dra-whole", CDI_devices=[PB.CDIDevice(name=i) for i in whole_ids])
            spec_dirs = [str(tier.containerd.cdi_dir)]
            said = {  # what the unit tests' runtime says of the same CDI devices, against the same files
                "gopher": standins.cdi_container_env(spec_dirs, ids, ["GOPHER_DEVICES=the pod's own"]),
                "whole": standins.cdi_container_env(spec_dirs, whole_ids),
            }
    tier.outputs["DRA env: consumer given the Allocate answer"] = by_allocate
    tier.outputs["DRA env: consumer given request gopher's CDI devices"] = by_claim
    tier.outputs["DRA env: consumer given the whole claim's CDI devices"] = whole
    tier.outputs["DRA env: containerd's report"] = reported
    assert dict(answer.envs) == {"GOPHER_DEVICES": "gopher1,gopher0"}
    assert "GOPHER_DEVICES=gopher1,gopher0" in by_allocate, by_allocate
    assert by_claim == [
        "GOPHER_DEVICES=gopher1,gopher0",  # Allocate's string, the pod's own replaced
        "GOPHER_DEVICES_GOPHER0=gopher0",
        "GOPHER_DEVICES_GOPHER1=gopher1",
    ], by_claim
    assert whole == [
        "GOPHER_DEVICES=gopher2",  # the last request's: containerd keeps a variable's last value
        "GOPHER_DEVICES_GOPHER0=gopher0",
        "GOPHER_DEVICES_GOPHER1=gopher1",
        "GOPHER_DEVICES_GOPHER2=gopher2",
    ], whole
    assert sorted(e for e in said["gopher"] if e.startswith("GOPHER")) == by_claim
    assert sorted(said["whole"]) == whole
    assert reported["env-dra"]["CDI devices"] == ids


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
async def test_dra_pod_taints_an_unhealthy_device_and_an_admin_claim_still_reaches_it(
    tier, nursery, monkeypatch, effect
):
    """The DRA rows the unit tests show with stand-ins, on the shipped pod in a real containerd:

    - claim c1 on gopher0 is prepared, its consumer opens gopher0, and the claim's status.devices
      as the API server stand-in stores it says which node file it is (KEP-4817);
    - gopher1 becomes unhealthy as the pod's health check sees it (mode 0000: root without
      capabilities may not open it): the stored slice gives it the taint <driver>/unhealthy,
      NoSchedule as shipped, NoExecute with dra.unhealthy_taint in the ConfigMap (KEP-5055);
    - an admin-access claim (KEP-5018) whose request tolerates the taint, allocated gopher0 (in use
      by c1) and gopher1 (tainted), is prepared, and its consumer, running beside c1's, opens both
      (the runtime's root keeps CAP_DAC_OVERRIDE, which the plugin's drops);
    - claim c3, allocated gopher1 while it was healthy, is refused with the reason (NoSchedule
      takes no allocation away; NoExecute has the eviction controller delete c3's pod, but a
      prepare the kubelet asks before that is refused all the same);
    - gopher1 recovers (its mode back): the stored slice has no taint on it any more, and c3's
      prepare, tried again as the kubelet does, succeeds."""
    node = Node(tier, "daemonset-dra.yaml")
    if effect != "NoSchedule":  # the default, and the shipped ConfigMap's
        node.config["dra"]["unhealthy_taint"] = effect
    paths = {name: node.mknod(name) for name in ("gopher0", "gopher1", "gopher2")}
    for path in paths.values():
        path.chmod(0o660)
        os.chown(path, HOST_UID, HOST_GID)
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    a, b = gp.dra_device_name("gopher0"), gp.dra_device_name("gopher1")
    taint_key = f"{DRIVER}/unhealthy"
    device_class = _device_class()
    plain = {"name": "gopher", "exactly": {"deviceClassName": device_class}}
    tolerations = [{"key": taint_key, "operator": "Exists"}]
    monitor = {
        "name": "monitor",
        "exactly": {
            "deviceClassName": f"{device_class}-admin",  # the shipped class for admin access
            "adminAccess": True,
            "count": 2,
            "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER}"].id in ["gopher0", "gopher1"]'}}],
            "tolerations": tolerations,
        },
    }

    def result(request: str, device: str, **copied: Any) -> dict[str, Any]:
        return {"request": request, "driver": DRIVER, "pool": pool, "device": device, **copied}

    c1 = dra_claim("c1", [plain], [result("gopher", a)])
    c3 = dra_claim("c3", [plain], [result("gopher", b)])
    admin = dra_claim(
        "admin",
        [monitor],
        [result("monitor", d, adminAccess=True, tolerations=tolerations) for d in (a, b)],
    )
    for claim in (c1, c3, admin):
        api.put_claim(claim)
    uid = {claim["metadata"]["name"]: claim["metadata"]["uid"] for claim in (c1, c3, admin)}
    seen: dict[str, Any] = {}
    with trio.fail_after(2 * TIMEOUT), _removed_afterwards(tier.containerd.cdi_dir):
        async with node.running():
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            healthy = await stored_devices(api, pool, lambda found: len(found) == 3)
            prepared = (await kubelet.prepare(DRIVER, [("default", uid["c1"], "c1")])).claims[uid["c1"]]
            assert prepared.error == ""
            first = Pod(tier, "c1-consumer")
            config = consumer_config(first, CDI_devices=[PB.CDIDevice(name=i) for i in kubelet.cdi_devices(uid["c1"])])
            async with running_pod(tier.containerd, first, first.sandbox_config(), [config]):
                seen["c1: gopher0"] = await consumer_report(
                    tier.containerd, first.container_ids["consumer"], str(paths["gopher0"])
                )
                paths["gopher1"].chmod(0)
                tainted = await stored_devices(api, pool, lambda found: "taints" in found[b])
                answer = await kubelet.prepare(DRIVER, [("default", uid["admin"], "admin")])
                assert answer.claims[uid["admin"]].error == ""
                ids = kubelet.cdi_devices(uid["admin"], "monitor")
                second = Pod(tier, "admin-consumer")
                config = consumer_config(second, CDI_devices=[PB.CDIDevice(name=i) for i in ids])
                async with running_pod(tier.containerd, second, second.sandbox_config(), [config]):
                    for name in ("gopher0", "gopher1"):
                        seen[f"admin: {name}"] = await consumer_report(
                            tier.containerd, second.container_ids["consumer"], str(paths[name])
                        )
                    state = (await container_status(tier.containerd, first.container_ids["consumer"])).status.state
            refused = (await kubelet.prepare(DRIVER, [("default", uid["c3"], "c3")])).claims[uid["c3"]]
            # status.devices is written after the kubelet has its answer: wait for the stored claims.
            while not all("devices" in api.claims["default", n]["status"] for n in ("c1", "admin")):
                await api.changed.wait_touched()
            statuses = {n: api.claims["default", n]["status"]["devices"] for n in ("c1", "admin")}
            paths["gopher1"].chmod(0o660)
            recovered = await stored_devices(api, pool, lambda found: "taints" not in found[b])
            # The kubelet retries a failed prepare while the pod waits: now it gets the device.
            retried = (await kubelet.prepare(DRIVER, [("default", uid["c3"], "c3")])).claims[uid["c3"]]
    tier.outputs[f"DRA rows ({effect}): slice devices before"] = healthy
    tier.outputs[f"DRA rows ({effect}): slice device gopher1, unhealthy"] = tainted[b]
    tier.outputs[f"DRA rows ({effect}): slice device gopher1, recovered"] = recovered[b]
    tier.outputs[f"DRA rows ({effect}): allocations"] = {
        n: api.claims["default", n]["status"]["allocation"] for n in ("c1", "admin", "c3")
    }
    tier.outputs[f"DRA rows ({effect}): admin claim CDI device IDs"] = ids
    tier.outputs[f"DRA rows ({effect}): c3 refused"] = refused.error
    tier.outputs[f"DRA rows ({effect}): claim status.devices"] = statuses
    tier.outputs[f"DRA rows ({effect}): consumers"] = seen
    assert not any("taints" in device for device in healthy.values())
    (taint,) = tainted[b]["taints"]
    assert taint["timeAdded"]  # the API server's
    assert {k: v for k, v in taint.items() if k != "timeAdded"} == {
        "key": taint_key,
        "value": "unhealthy",
        "effect": effect,
    }
    assert tainted[b]["attributes"]["healthy"] == {"bool": False}
    assert not any("taints" in tainted[n] for n in (a, gp.dra_device_name("gopher2")))
    assert recovered[b]["attributes"]["healthy"] == {"bool": True}
    # Both consumers open their devices, c1's still running beside the admin's.
    for what in ("c1: gopher0", "admin: gopher0", "admin: gopher1"):
        assert (seen[what]["ls exit"], seen[what]["open exit"], seen[what]["open rw"]) == (0, 0, "opened rw"), what
    assert state == PB.ContainerState.CONTAINER_RUNNING
    env = seen["admin: gopher0"]["env"]
    assert {"GOPHER_DEVICES_GOPHER0=gopher0", "GOPHER_DEVICES_GOPHER1=gopher1"} <= set(env), env
    assert refused.error.startswith(f"ResourceClaim default/c3: device gopher1 of {RESOURCE} is unhealthy: "), refused
    assert str(paths["gopher1"]) in refused.error and not refused.devices
    assert (retried.error, [d.device_name for d in retried.devices]) == ("", [b])

    def entry(device: str, name: str) -> dict[str, Any]:
        return {"driver": DRIVER, "pool": pool, "device": device, "data": {"id": name, "paths": [str(paths[name])]}}

    assert statuses == {"c1": [entry(a, "gopher0")], "admin": [entry(a, "gopher0"), entry(b, "gopher1")]}


def host_pci_backed_node() -> tuple[int, int, int, dict[str, Any]] | None:
    """A device node of this machine whose device is a PCI function's (a char device preferred: a
    block one is a disk), read from the host's sysfs apart from gopherplug's own walk: its type
    (stat.S_IFCHR or S_IFBLK), major and minor, and the standard attributes it must get
    (kubernetes/kubernetes staging/src/k8s.io/dynamic-resource-allocation/deviceattribute/pci.go):
    pciBusID the nearest function above it that /sys/bus/pci/devices lists, pcieRoot the directory
    under /sys/devices it hangs from, numaNode the function's when it has one. A node under a USB
    device has none (USB is not PCI even when its host controller is). None when there is no such node."""
    functions = Path("/sys/bus/pci/devices")
    listed = {entry.name for entry in functions.iterdir()} if functions.is_dir() else set()
    for kind, file_type in (("char", stat.S_IFCHR), ("block", stat.S_IFBLK)):
        for entry in sorted(Path("/sys/dev", kind).iterdir()):
            try:
                parts = (entry / "device").resolve(strict=True).relative_to("/sys/devices").parts
            except (OSError, ValueError):
                continue
            above = [Path("/sys/devices", *parts[: i + 1]) for i in range(len(parts))]
            if any((d / "subsystem").resolve().name == "usb" for d in above) or not listed & set(parts):
                continue
            bus_id = [part for part in parts if part in listed][-1]
            attributes: dict[str, Any] = {
                "resource.kubernetes.io/pciBusID": {"string": bus_id},
                "resource.kubernetes.io/pcieRoot": {"string": parts[0]},
            }
            numa = int((functions / bus_id / "numa_node").read_text())
            if numa >= 0:
                attributes["resource.kubernetes.io/numaNode"] = {"int": numa}
            major, minor = map(int, entry.name.split(":"))
            return file_type, major, minor, attributes
    return None


async def test_dra_pod_publishes_the_pci_address_of_a_host_device_node(tier, nursery, monkeypatch):
    """The standard attributes resource.kubernetes.io/pciBusID and pcieRoot (and numaNode) of a real
    PCI device's node, as the shipped pod finds them through its own /sys mount (the host's), in the
    slice the API server stand-in stores. The node is made in the run's directory of /dev with the
    real device's numbers, mode 0600: the plugin only looks at it (its device cgroup refuses it any
    open), and no consumer is given it."""
    found = host_pci_backed_node()
    if found is None:
        pytest.skip("this machine has no device node of a PCI device in /sys/dev (char or block)")
    file_type, major, minor, wanted = found
    node = Node(tier, "daemonset-dra.yaml")
    if file_type == stat.S_IFBLK:
        # A disk holds a mounted filesystem (here the one behind the pod's volumes), which gopherplug
        # skips unless told: told, in the ConfigMap, as the test gives the node to no consumer.
        node.config["resources"][0]["allow_mounted"] = True
    path = node.devices / "pci0"
    os.mknod(path, 0o600 | file_type, os.makedev(major, minor))
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    name = gp.dra_device_name("pci0")
    with trio.fail_after(TIMEOUT), _removed_afterwards(tier.containerd.cdi_dir):
        async with node.running():
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            stored = (await stored_devices(api, pool, lambda devices: name in devices))[name]
    kind = "char" if file_type == stat.S_IFCHR else "block"
    tier.outputs["DRA standard attributes: host node"] = f"{kind} {major}:{minor} -> {wanted}"
    tier.outputs["DRA standard attributes: slice device"] = stored
    standard = {k: v for k, v in stored["attributes"].items() if k.startswith("resource.kubernetes.io/")}
    assert standard == wanted


def allocated_claim(name: str, uid: str, pool: str, device: str) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it: one request, allocated one device of the pool."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gopher", "exactly": {"deviceClassName": "gopher"}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gopher", "driver": DRIVER, "pool": pool, "device": device}]}
            }
        },
    }


async def test_dra_rolling_update_two_pods_overlap_and_a_claim_prepared_meanwhile_reaches_a_consumer(
    tier, nursery, monkeypatch
):
    """daemonset-dra.yaml's rolling update (maxSurge: 1, maxUnavailable: 0) as the DaemonSet
    controller runs it on one node: the new pod starts while the old one serves, each with its own
    UID; both register, so the driver is never without a registered plugin. A claim prepared
    during the overlap reaches a consumer through containerd's CDI handling; the old pod then
    stops (SIGTERM, exit 0) and the new one unprepares both claims, the one the old pod prepared
    too, and still answers its liveness probe."""
    node = Node(tier, "daemonset-dra.yaml")
    (daemonset,) = [doc for doc in manifest_docs("daemonset-dra.yaml") if doc["kind"] == "DaemonSet"]
    strategy = daemonset["spec"]["updateStrategy"]
    assert strategy["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}  # else this overlap would not happen
    path = node.mknod("gopher0")
    node.mknod("gopher1")
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
    registry = node.kubelet_dir / "plugins_registry"
    registry_seen = Path(kubelet.registry)  # the same directory, as the kubelet stand-in names it

    def registered_sockets() -> list[str]:
        return [os.path.basename(p.registration_socket) for p in kubelet.plugins.get(DRIVER, [])]

    new_pod = node.surge()
    old_socket, new_socket = (f"{DRIVER}-{pod.uid}-reg.sock" for pod in (node.pod, new_pod))
    with trio.fail_after(TIMEOUT * 3):
        async with node.running() as old:
            await kubelet.wait_until(lambda k: registered_sockets() == [old_socket])
            while not any(s["spec"]["pool"]["name"] == pool for s in api.slices.values()):
                await api.changed.wait_touched()
            before = gp.dra_device_name("gopher0")
            api.put_claim(allocated_claim("before", "uid-before", pool, before))
            first = (await kubelet.prepare(DRIVER, [("default", "uid-before", "before")])).claims["uid-before"]
            assert first.error == ""
            async with node.running(new_pod) as new:
                await kubelet.wait_until(lambda k: registered_sockets() == [old_socket, new_socket])
                device = gp.dra_device_name("gopher1")
                during = allocated_claim("during", "uid-during", pool, device)
                api.put_claim(during)
                prepared = (await kubelet.prepare(DRIVER, [("default", "uid-during", "during")])).claims["uid-during"]
                assert prepared.error == ""
                ids = kubelet.cdi_devices("uid-during", "gopher")
                pod = Pod(tier, "dra-consumer-during-update")
                config = consumer_config(pod, CDI_devices=[PB.CDIDevice(name=i) for i in ids])
                async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                    seen = await consumer_report(
                        tier.containerd, pod.container_ids["consumer"], str(path.with_name("gopher1"))
                    )
                kubelet.wiping_delay = 0  # were the driver left without a plugin, its slices would go at once
                await node.stop_now(old)  # the controller deletes the old pod once the new one is ready
                await kubelet.wait_until(lambda k: registered_sockets() == [new_socket])
                gone = await kubelet.unprepare(
                    DRIVER, [("default", "uid-before", "before"), ("default", "uid-during", "during")]
                )
                code, said = await liveness_probe(node, new_pod)  # the new pod's own port
                full, full_said = await exec_sync(tier.containerd, new, "gopherplug", "probe", timeout=10)
                left = sorted(os.listdir(registry))
                events = list(kubelet.events)  # the new pod still serving: its own stop is not the update's
                (old_log,) = (node.pod.dir / "logs").glob("*/0.log")  # the old pod's, as the runtime kept it
                (stored,) = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
    tier.outputs["DRA rolling update: ResourceSlice devices as stored"] = stored["spec"]["devices"]
    tier.outputs["DRA rolling update: allocation used"] = during["status"]["allocation"]
    tier.outputs["DRA rolling update: registrations"] = [(e, os.path.basename(p)) for e, p in events]
    tier.outputs["DRA rolling update: consumer"] = seen
    tier.outputs["DRA rolling update: new pod's liveness probe"] = f"{code} {said.strip()}"
    assert ids == [i for d in prepared.devices for i in d.cdi_device_ids] != []
    assert seen["ls exit"] == 0 and " 10, 229 " in seen["ls -l"]
    assert (seen["open exit"], seen["open rw"]) == (0, "opened rw")
    assert any(line.endswith("=gopher1") for line in seen["env"]), seen["env"]
    assert [(uid, answer.error) for uid, answer in sorted(gone.claims.items())] == [
        ("uid-before", ""),
        ("uid-during", ""),
    ]
    assert code == 200, said
    assert full == 0, full_said
    assert left == [new_socket]  # the old pod removed its own socket, not the new one's
    # The kubelet's view, event by event: from the first registration on, never no plugin of the driver.
    count, seen_one = 0, False
    for event, _ in events:
        if event in ("registered", "deregistered"):
            count += 1 if event == "registered" else -1
            seen_one |= count > 0
            assert not (seen_one and count == 0), events
    assert seen_one and ("deregistered", str(registry_seen / old_socket)) in events
    assert ("wiped", DRIVER) not in events
    # The old pod left the slices to the new one once it saw it (both write them otherwise).
    said_old = [line for line in old_log.read_text().splitlines() if "the slices are left to it" in line]
    tier.outputs["DRA rolling update: the old pod's log"] = said_old
    assert len(said_old) == 1 and f"/var/lib/kubelet/plugins_registry/{new_socket}" in said_old[0], old_log.read_text()


########################################################################################################
# Moving a node from the device plugin to DRA: the same pod spec, served by each in turn


def _limits_pod(name: str) -> dict[str, Any]:
    """The pod spec a user wrote for the device plugin: one container, example.com/gopher: 1 in limits."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "containers": [{"name": "consumer", "image": BUSYBOX_IMAGE, "resources": {"limits": {RESOURCE: "1"}}}]
        },
    }


async def test_the_same_limits_pod_gets_the_device_from_the_device_plugin_then_from_dra_after_the_switch(
    tier, nursery, monkeypatch
):
    """Migration without touching pods. A pod spec with example.com/gopher: 1 in resources.limits is
    placed by the scheduler stand-in on a node that runs daemonset.yaml's pod: the node's allocatable
    has the name, so the device plugin serves it, and the consumer created with the Allocate answer
    opens the node. The node is then switched as the DaemonSets' node affinity does when it is
    labelled gopherplug.example.com/api=dra: the device-plugin pod stopped (the kubelet reports 0
    allocatable at once), daemonset-dra.yaml's pod started. The same spec is now placed through the
    shipped DeviceClass's extendedResourceName: a claim allocated from the slice the DRA pod published,
    prepared by the DRA pod, and the consumer created with the CDI devices of its mapped request opens
    the same node through containerd's CDI."""
    plugin_node = Node(tier, "daemonset.yaml", "switch")
    dra_node = Node(tier, "daemonset-dra.yaml", "switch")  # the same node: its kubelet dir and devices
    path = plugin_node.mknod("gopher0")
    for node in (plugin_node, dra_node):
        # The pods share the host's network here, and other tests (or runs) may hold the metrics
        # ports; metrics are not what this test is about.
        del node.config["metrics_address"]
    api, host_side = await _api_server_for(dra_node, nursery, monkeypatch)
    scheduler = standins.SchedulerSimulator(api, [_shipped_device_class()])
    kubelet = await nursery.start(gp.KubeletSimulator(str(plugin_node.device_plugin_dir)).run)
    dra_kubelet = standins.DraKubeletSimulator(str(host_side), wipe=lambda d: api.delete_node_slices(NODE_NAME, d))
    await nursery.start(dra_kubelet.run)
    node_uid = str(uuid.uuid4())

    def node_status() -> None:  # the kubelet's node status update: the device plugins' allocatable
        api.put_node(NODE_NAME, node_uid, allocatable={"cpu": "2", **kubelet.allocatable()})

    with trio.fail_after(TIMEOUT):
        async with plugin_node.running():
            await kubelet.wait_until(lambda k: _listed(k, "gopher0"))
            node_status()
            first = _limits_pod("before")
            placed = scheduler.schedule(first, NODE_NAME)
            assert (placed.device_plugin, placed.claim) == ({RESOURCE: 1}, None)
            answer = (await kubelet.allocate(RESOURCE, ["gopher0"])).container_responses[0]
            pod = Pod(tier, "limits-device-plugin")
            config = consumer_config(pod, **allocated_fields(answer))
            config.mounts.extend(allocated_mounts(answer))
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                by_device_plugin = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
        # The switch: the device-plugin pod is gone (stopped above), and the device manager marks its
        # devices unhealthy at once; the Node still says 1 until the kubelet's next status update
        # (every 10 s). The DRA pod, started meanwhile, holds the resource back: no slice while the
        # Node counts it, so no claim can get the device the device plugin may have given.
        await kubelet.wait_until(lambda k: k.allocatable() == {RESOURCE: "0"})
        assert api.nodes[NODE_NAME]["status"]["allocatable"][RESOURCE] == "1"
        async with dra_node.running():
            await dra_kubelet.wait_until(lambda k: DRIVER in k.drivers)
            # The driver lists its Node (it still counts 1: the resource is held back), then
            # watches it: the next node status update reaches it through the watch.
            while api.count("watch", "nodes") < 1:
                await api.changed.wait_touched()
            pool = gp.dra_pool_name(NODE_NAME, RESOURCE)
            held = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
            node_status()  # now 0
            while not any(s["spec"]["pool"]["name"] == pool and s["spec"]["devices"] for s in api.slices.values()):
                await api.changed.wait_touched()
            (published,) = [s for s in api.slices.values() if s["spec"]["pool"]["name"] == pool]
            second = _limits_pod("after")
            assert second["spec"]["containers"] == first["spec"]["containers"]  # the same spec
            placed = scheduler.schedule(second, NODE_NAME)
            assert placed.device_plugin == {} and placed.claim is not None
            await dra_kubelet.prepare_extended_resources(second, placed.claim)
            ids = dra_kubelet.extended_resource_cdi_devices(second, placed.claim, "consumer")
            pod = Pod(tier, "limits-dra")
            config = consumer_config(pod, CDI_devices=[PB.CDIDevice(name=i) for i in ids])
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                by_dra = await consumer_report(tier.containerd, pod.container_ids["consumer"], str(path))
            # The plugin's log as `kubectl logs` shows it (the runtime's file of its stderr).
            dra_log = (dra_node.pod.dir / "logs" / "gopherplug" / "0.log").read_text()
    warned = [line.split(" ", 3)[3] for line in dra_log.splitlines() if "held back" in line or "is 0 now" in line]
    tier.outputs["switch: the DRA pod's log while the Node still counted the device plugin's"] = warned
    assert held == [] and len(warned) == 2, dra_log
    assert "example.com/gopher: node tier-node's allocatable still has 1 of it" in warned[0]
    assert "example.com/gopher: node tier-node's allocatable for it is 0 now" in warned[1]
    tier.outputs["switch: ResourceSlice device as stored"] = published["spec"]["devices"]
    tier.outputs["switch: claim allocation"] = placed.claim["status"]["allocation"]
    tier.outputs["switch: pod extendedResourceClaimStatus"] = second["status"]["extendedResourceClaimStatus"]
    tier.outputs["switch: CDI device IDs"] = ids
    tier.outputs["switch: consumer served by the device plugin"] = by_device_plugin
    tier.outputs["switch: consumer served by DRA"] = by_dra
    assert "GOPHER_DEVICES=gopher0" in by_device_plugin["env"]
    assert by_device_plugin["ls -l"].startswith("crw") and " 10, 229 " in by_device_plugin["ls -l"]
    assert (by_device_plugin["open exit"], by_device_plugin["open rw"]) == (0, "opened rw")
    assert any(line.startswith("GOPHER_DEVICES_") and line.endswith("=gopher0") for line in by_dra["env"]), by_dra
    assert "GOPHER_DEVICES=gopher0" in by_dra["env"], by_dra  # the env the device plugin gave, through DRA
    assert by_dra["ls -l"].startswith("crw") and " 10, 229 " in by_dra["ls -l"]
    assert (by_dra["open exit"], by_dra["open rw"]) == (0, "opened rw")


########################################################################################################
# NVIDIA GPUs: examples/nvidia's configuration in the shipped pod, fake nodes with the driver's numbers

#: The nodes of a node with NVIDIA GPUs, with the numbers its driver gives them (major 195 for the
#: GPUs and nvidiactl, nvidia-uvm's dynamic one as recorded on a real node: 238). Nothing here
#: drives them: opening one the device rules allow fails with ENXIO, one they refuse with EPERM.
NVIDIA_NODES = {
    "nvidia0": (195, 0),
    "nvidia1": (195, 1),
    "nvidia2": (195, 2),
    "nvidiactl": (195, 255),
    "nvidia-uvm": (238, 0),
    "nvidia-uvm-tools": (238, 1),
}
NVIDIA_EXAMPLE = HERE / "examples" / "nvidia"


def nvidia_node(tier: Run, config_name: str, manifest: str) -> Node:
    """A Node whose devices are NVIDIA_NODES (three GPUs) and whose ConfigMap holds the example's
    resource, /dev in its paths standing for the run's directory of /dev."""
    node = Node(tier, manifest)
    for name, (major, minor) in NVIDIA_NODES.items():
        os.mknod(node.devices / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(node.devices / name, 0o666)  # crw-rw-rw- as the driver makes them, whatever the umask
    (resource,) = yaml.safe_load((NVIDIA_EXAMPLE / config_name).read_text())["resources"]
    resource["directory"] = str(node.devices)
    for spec in resource["device_specs"]:
        spec["host_path"] = spec["host_path"].replace("/dev/", f"{node.devices}/", 1)
    # The plugin's image has neither nvidia-smi nor the script (test_examples.py runs describe
    # with a fake nvidia-smi): without it here, the tier shows the nodes and the env.
    del resource["describe"]
    node.config["resources"] = [resource]
    return node


async def nvidia_consumer_report(containerd: Containerd, container_id: str) -> dict[str, Any]:
    """What a consumer sees of the NVIDIA nodes: its env, `ls -l` of each, what opening each says
    but nvidia2 (ENXIO: the device rules let it through to a driver that is not there), the same
    for nvidia2, which it was not given, made inside with mknod; and the major 195 and 238 rules of
    its cgroup."""
    _, env = await exec_sync(containerd, container_id, "env")
    listed, opened = {}, {}
    for name in NVIDIA_NODES:
        _, listed[name] = await exec_sync(containerd, container_id, "ls", "-l", f"/dev/{name}")
        if name != "nvidia2":  # (not there: the shell would create a file by that name)
            command = f"exec 3<>/dev/{name} && echo opened"
            _, opened[name] = await exec_sync(containerd, container_id, "sh", "-c", command)
    _, refused = await exec_sync(
        containerd, container_id, "sh", "-c", "mknod /tmp/nvidia2 c 195 2 && exec 3<>/tmp/nvidia2 && echo opened"
    )
    rules = await device_rules(containerd, container_id)
    return {
        "env": sorted(line for line in env.splitlines() if line.startswith("NVIDIA_")),
        "ls -l": {name: said.strip() for name, said in listed.items()},
        "open rw": {name: said.strip() for name, said in opened.items()},
        "nvidia2 made inside, open rw": refused.strip(),
        "device rules (host side)": [rule for rule in rules["rules"] if rule.startswith(("c 195:", "c 238:"))],
    }


def assert_given_two_gpus(seen: dict[str, Any]) -> None:
    """The consumer of GPUs 0 and 1: their nodes and the three shared ones in its /dev, with the
    host's numbers, and in its device rules; nvidia2 neither, and refused when made inside."""
    given = ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]
    for name in given:
        major, minor = NVIDIA_NODES[name]
        assert re.match(rf"crw-rw-rw- +1 0 +0 +{major}, +{minor} .* /dev/{name}$", seen["ls -l"][name]), seen
        # Past the device rules (EPERM), to the kernel's lookup of the driver: no such device.
        assert seen["open rw"][name].endswith("No such device or address"), seen
    assert seen["ls -l"]["nvidia2"].endswith("No such file or directory"), seen
    assert seen["nvidia2 made inside, open rw"].endswith("Operation not permitted"), seen
    rules = seen["device rules (host side)"]
    assert sorted(rules) == sorted(f"c {NVIDIA_NODES[name][0]}:{NVIDIA_NODES[name][1]} rw" for name in given), seen


async def test_nvidia_gpus_reach_a_consumer_with_the_shared_nodes_and_the_joined_env(tier, nursery):
    """examples/nvidia/config.yaml in daemonset.yaml's pod, on a node of three GPUs: the kubelet
    stand-in is offered 0, 1 and 2, and a consumer created with Allocate's answer for 0 and 1 finds
    /dev/nvidia0, /dev/nvidia1, nvidiactl, nvidia-uvm and nvidia-uvm-tools in its /dev and its device
    cgroup (not nvidia2), and NVIDIA_VISIBLE_DEVICES=0,1 in its environment."""
    node = nvidia_node(tier, "config.yaml", "daemonset.yaml")
    kubelet = await nursery.start(gp.KubeletSimulator(str(node.device_plugin_dir)).run)

    def listed(k: gp.KubeletSimulator) -> bool:
        resource = k.resources.get("nvidia.com/gpu")
        return resource is not None and resource.streaming and len(resource.devices) == 3

    with trio.fail_after(TIMEOUT):
        async with node.running():
            await kubelet.wait_until(listed)
            assert kubelet.resources["nvidia.com/gpu"].devices == dict.fromkeys(["0", "1", "2"], gp.HEALTHY)
            answer = (await kubelet.allocate("nvidia.com/gpu", ["0", "1"])).container_responses[0]
            pod = Pod(tier, "gpu-consumer")
            config = consumer_config(pod, **allocated_fields(answer))
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await nvidia_consumer_report(tier.containerd, pod.container_ids["consumer"])
    tier.outputs["nvidia (device plugin): consumer of GPUs 0 and 1"] = seen
    assert seen["env"] == ["NVIDIA_VISIBLE_DEVICES=0,1"]
    assert_given_two_gpus(seen)


async def test_nvidia_gpus_reach_a_dra_consumer_through_the_claims_cdi_devices(tier, nursery, monkeypatch):
    """examples/nvidia/config-dra.yaml in daemonset-dra.yaml's pod, on a node of three GPUs: the
    slice offers 0, 1 and 2; a claim allocated 0 and 1, prepared, gives a consumer created with its
    CDI device IDs alone (as the kubelet passes them) the two GPUs' nodes and the three shared ones,
    through containerd's CDI handling, and not nvidia2; and NVIDIA_VISIBLE_DEVICES=0,1, the string
    the device plugin's Allocate gives (beside each device's NVIDIA_VISIBLE_DEVICES_<N>)."""
    node = nvidia_node(tier, "config-dra.yaml", "daemonset-dra.yaml")
    api, kubelet = await dra_cluster(node, nursery, monkeypatch)
    pool = gp.dra_pool_name(NODE_NAME, "nvidia.com/gpu")
    with trio.fail_after(TIMEOUT):
        async with node.running():
            devices = await stored_devices(api, pool, lambda devices: len(devices) == 3)
            assert sorted(devices) == ["0", "1", "2"]
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            results = [{"request": "gpus", "driver": DRIVER, "pool": pool, "device": name} for name in ("0", "1")]
            made = dra_claim("gpus", [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com"}}], results)
            api.put_claim(made)
            uid = made["metadata"]["uid"]
            prepared = (await kubelet.prepare(DRIVER, [("default", uid, "gpus")])).claims[uid]
            assert prepared.error == ""
            ids = kubelet.cdi_devices(uid, "gpus")
            pod = Pod(tier, "gpu-dra-consumer")
            config = consumer_config(pod, CDI_devices=[PB.CDIDevice(name=i) for i in ids])
            async with running_pod(tier.containerd, pod, pod.sandbox_config(), [config]):
                seen = await nvidia_consumer_report(tier.containerd, pod.container_ids["consumer"])
    tier.outputs["nvidia (DRA): CDI device IDs"] = ids
    tier.outputs["nvidia (DRA): consumer of GPUs 0 and 1"] = seen
    assert_given_two_gpus(seen)
    assert "NVIDIA_VISIBLE_DEVICES=0,1" in seen["env"], seen["env"]
