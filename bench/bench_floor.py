"""Where a device plugin's start-up time and idle memory go: the interpreter, each dependency, the
module, the work. Run by hand, not by CI:

    .venv/bin/python bench/bench_floor.py [--runs 11] [--devices 8] [--idle 2] [--python PYTHON]
        [--root DIR] [--no-layers] [REV ...]        # default revisions: the work tree only ("tree")

The image itself (as root): unpack the dra image's one layer (it has the dra extra, for --dra)
from the archive `.ci/images OUT` writes, mount /proc, /dev and /tmp in it, and give its
interpreter, which each process then runs inside the image's files through chroot(2):

    mkdir -p root/proc root/dev root/tmp && tar -xOf OUT/dra.tar "$(tar -xOf OUT/dra.tar manifest.json |
      python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["Layers"][0])')" | tar -C root -xf -
    mount -t proc proc root/proc && mount --bind /dev root/dev && mount --bind /tmp root/tmp
    .venv/bin/python bench/bench_floor.py --root root --python /usr/bin/python3.11 --dra tree

The distroless image (examples/distroless/Dockerfile, OUT/distroless.tar) the same way, its
dependencies on the path its PYTHONPATH names: `--root root --python /usr/bin/python3.11
--pythonpath /opt/gopherplug --modes 'python -m gopherplug' tree`.

Every figure is a fresh process of ``--python`` (default: this one; the image's is Debian
bookworm's python3.11), run ``--runs`` times, the rows taking turns run by run so that a machine's
load drifts over all of them alike; printed: the median and the spread (min-max) of the time, and
the median VmRSS and VmHWM (the peak) from /proc, and the median CPU time the process had used by
then (user and system: steadier than the time on a busy machine). The rows:

- the layers (once, whatever the revisions): `python -S -c pass`, `python -c pass`, each design
  dependency imported alone (trio; purerpc with h2, anyio and attrs; google.protobuf's descriptor
  modules; inotify_simple; yaml), then all of them together: what any plugin built on them pays.
  Time: from the fork to the process's line on its pipe, written once the imports are done
  (the interpreter's teardown is not counted: `serve` never exits that way).
- per revision, ``import gopherplug`` the same way (its bytecode compiled beforehand, as the
  images ship it);
- with ``--dra``: what a DRA driver's API client adds, its imports (lightkube, httpx2, as
  KubeApi.connect makes them) alone and over the five, and per revision `import gopherplug` and
  KubeApi.connect, the client made for a plain-HTTP kubeconfig as bench_dra.py's stand-in
  serves (no certificate authority named: httpx2 loads the default trust store, which a pod's
  service account configuration, naming its ca.crt, does not);
- per revision and start mode, `serve` with one resource of ``--devices`` files: time from the
  fork until the kubelet (bench_gopherplug's grpcio kubelet in this process, which dials back
  inside Register and opens ListAndWatch, as the kubelet does) has the first list of every
  device; then, ``--idle`` seconds later, VmRSS and VmHWM. The modes: the console script (pip's
  script, as the images run it), `python -m gopherplug`, `python gopherplug.py` with the bytecode
  cached beside it, and `python gopherplug.py` with none anywhere (PYTHONDONTWRITEBYTECODE=1: a
  copy in a read-only image, or this sandbox), which compiles the file at every start. With
  ``--zipapp PYZ`` (what .ci/zipapp builds), the mode "zipapp" too: `python PYZ serve`, the same
  for every revision (the archive holds its own gopherplug.py and dependencies).

With ``--go``, the row "Go plugin" too: bench/go_plugin.go (built as bench_side_by_side.py builds
it: Debian's go and grpc-go), the same ``--devices`` files: time from the fork until a grpcio client,
dialing as soon as the plugin says it serves (it registers with no kubelet), has the first list
from ListAndWatch; then its VmRSS and VmHWM ``--idle`` s later; and the binary's size is printed.

Each revision's gopherplug.py (``git show REV:gopherplug.py``; "tree": the work tree's) is written
alone into a temporary directory, its time set an hour back (a file changed in the last 2 s is one
`python gopherplug.py` does not trust its compiled code for), then compiled.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import Kubelet, build_go_program, cpu_seconds, end_run, gp  # noqa: E402

#: What each row measures per run: ms, VmRSS MiB, VmHWM MiB, CPU ms (see probe and serve).
Figures = tuple[float, float, float, float]

RESOURCE = "example.com/gopher"

#: purerpc 0.8 cannot be imported under h2 4 without the name gopherplug adds (see its top).
PURERPC = (
    "import h2.events\n"
    "if not hasattr(h2.events, 'PingAcknowledged'): h2.events.PingAcknowledged = h2.events.PingAckReceived\n"
    "import purerpc\n"
)
DEPENDENCIES = {
    "trio": "import trio\n",
    "purerpc (h2, anyio, attrs)": PURERPC,
    "google.protobuf (descriptor modules)": (
        "from google.protobuf import descriptor_pb2, descriptor_pool, message_factory\n"
    ),
    "inotify_simple": "import inotify_simple\n",
    "yaml": "import yaml\n",
}
#: What KubeApi.connect imports for a DRA driver (the dra extra), and a client made as it makes one.
DRA_IMPORTS = (
    "import httpx2, lightkube\n"
    "from lightkube.generic_resource import create_global_resource, create_namespaced_resource\n"
    "from lightkube.resources.core_v1 import Node\n"
    "from lightkube.types import PatchType\n"
)
KUBECONFIG = (  # the API server as bench_dra.py's stand-in serves it: plain HTTP, a bearer token
    "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'http://127.0.0.1:1'}}]\n"
    "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
    "current-context: x\n"
)

#: Appended to every probe: the process's memory once its imports are done, then out without teardown.
REPORT = (
    "import os as _os\n"
    "_s = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
    "_t = _os.times()\n"
    "print(_s['VmRSS'].split()[0], _s['VmHWM'].split()[0], _t.user + _t.system, flush=True)\n"
    "_os._exit(0)\n"
)
CONSOLE_SCRIPT = (  # what pip writes for [project.scripts] gopherplug = "gopherplug:main"
    "import re\nimport sys\nfrom gopherplug import main\nif __name__ == '__main__':\n"
    "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n    sys.exit(main())\n"
)


#: --zipapp: the one-file build the "zipapp" mode runs (None: no such mode).
ZIPAPP: str | None = None

#: --root: the image's root filesystem the interpreter runs in (None: this machine's).
IMAGE_ROOT: str | None = None


def in_root() -> dict[str, Any]:
    """Popen's arguments that start the interpreter inside IMAGE_ROOT: chroot(2) in the child,
    after Popen's chdir to ``cwd`` (so the working directory stays, reached through the /tmp
    mounted into the root) and before the exec, which then finds --python in the image. Nothing
    runs between them: the time is the image's interpreter's own."""
    root = IMAGE_ROOT
    return {} if root is None else {"preexec_fn": lambda: os.chroot(root)}


#: --pythonpath: every process's PYTHONPATH (None: none).
PYTHONPATH: str | None = None


def environment(bytecode: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    if PYTHONPATH:
        env["PYTHONPATH"] = PYTHONPATH
    if not bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def probe(python: str, options: list[str], code: str, cwd: Path | None = None) -> Figures:
    """(ms from the fork to the report, VmRSS MiB, VmHWM MiB, CPU ms by then) of `python [options] -c code`."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [python, *options, "-c", code + REPORT],
        cwd=cwd,
        env=environment(True),
        stdout=subprocess.PIPE,
        text=True,
        **in_root(),
    )
    line = process.stdout.readline()
    took = time.perf_counter() - start
    process.wait()
    rss, hwm, cpu = line.split()
    return took * 1e3, int(rss) / 1024, int(hwm) / 1024, float(cpu) * 1e3


def place_revision(rev: str, directory: Path, python: str) -> Path:
    if rev == "tree":
        text = (HERE / "gopherplug.py").read_text()
    else:
        show = ["git", "show", f"{rev}:gopherplug.py"]
        text = subprocess.run(show, cwd=HERE, capture_output=True, text=True, check=True).stdout
    directory.mkdir(parents=True)
    module = directory / "gopherplug.py"
    module.write_text(text)
    an_hour_ago = time.time() - 3600
    os.utime(module, (an_hour_ago, an_hour_ago))
    (directory / "gopherplug-script").write_text(CONSOLE_SCRIPT)
    bare = directory / "bare"  # the same file, never compiled: `python gopherplug.py` with no bytecode
    bare.mkdir()
    shutil.copy2(module, bare / "gopherplug.py")
    # Compiled by the interpreter measured, where it caches it: `python -m gopherplug` finds it there.
    subprocess.run([python, "-c", f"import py_compile; py_compile.compile({str(module)!r})"], check=True, **in_root())
    return directory


def serve(python: str, directory: Path, mode: str, devices: int, idle: float) -> Figures:
    """(ms from the fork to the kubelet's first full list, VmRSS MiB and VmHWM MiB ``idle`` s later,
    the plugin's CPU ms by the first list)."""
    root = Path(tempfile.mkdtemp(prefix="gpf-", dir="/tmp"))  # short: unix socket paths
    kubelet = Kubelet(str(root / "dp"))
    plugin = None
    try:
        (root / "dp").mkdir()
        (root / "dev").mkdir()
        for i in range(devices):
            (root / "dev" / f"g{i}").touch()
        config = root / "config.yaml"
        config.write_text(
            f"device_plugin_dir: {root / 'dp'}\nresources:\n  - name: {RESOURCE}\n    directory: {root / 'dev'}\n"
        )
        kubelet.start()
        start = {
            "console script": [str(directory / "gopherplug-script")],
            "python -m gopherplug": ["-m", "gopherplug"],
            "python gopherplug.py": [str(directory / "gopherplug.py")],
            "python gopherplug.py, no bytecode": [str(directory / "bare" / "gopherplug.py")],
            "zipapp": [str(ZIPAPP)],
        }[mode]
        argv = [python, *start, "serve", "--config", str(config), "--log-level", "warning"]
        began = time.perf_counter()
        plugin = subprocess.Popen(argv, cwd=directory, env=environment("no bytecode" not in mode), **in_root())
        listed = kubelet.wait_for(lambda ids: len(ids) == devices, timeout=60)
        cpu = cpu_seconds(plugin.pid) * 1e3
        time.sleep(idle)
        status = dict(line.split(":", 1) for line in Path(f"/proc/{plugin.pid}/status").read_text().splitlines())
        rss, hwm = (int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))
        return (listed - began) * 1e3, rss, hwm, cpu
    finally:
        end_run(plugin, kubelet, root)


def serve_go(go_plugin: str, devices: int, idle: float) -> Figures:
    """serve()'s figures for bench/go_plugin.go, dialed by a grpcio client once it serves."""
    import grpc

    root = Path(tempfile.mkdtemp(prefix="gpf-", dir="/tmp"))
    (root / "dev").mkdir()
    for i in range(devices):
        (root / "dev" / f"g{i}").touch()
    socket = root / "go.sock"
    began = time.perf_counter()
    plugin = subprocess.Popen([go_plugin, str(socket), str(root / "dev"), "GOPHER"], stdout=subprocess.PIPE)
    try:
        assert plugin.stdout is not None and plugin.stdout.readline() == b"serving\n"
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            watch = channel.unary_stream(
                "/v1beta1.DevicePlugin/ListAndWatch",
                request_serializer=gp.v1beta1.Empty.SerializeToString,
                response_deserializer=gp.v1beta1.ListAndWatchResponse.FromString,
            )
            stream = watch(gp.v1beta1.Empty())
            assert len(next(stream).devices) == devices
            listed = time.perf_counter()
            cpu = cpu_seconds(plugin.pid) * 1e3
            time.sleep(idle)
            stream.cancel()
        status = dict(line.split(":", 1) for line in Path(f"/proc/{plugin.pid}/status").read_text().splitlines())
        rss, hwm = (int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))
        return (listed - began) * 1e3, rss, hwm, cpu
    finally:
        plugin.terminate()
        plugin.wait(30)
        shutil.rmtree(root, ignore_errors=True)


MODES = ("console script", "python -m gopherplug", "python gopherplug.py", "python gopherplug.py, no bytecode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("revs", nargs="*", default=["tree"])
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--idle", type=float, default=2.0, help="seconds between the first list and the RSS")
    parser.add_argument("--python", default=sys.executable, help="the interpreter measured (default: this one)")
    parser.add_argument("--no-layers", action="store_true", help="only the module and serve rows")
    parser.add_argument("--modes", default=";".join(MODES), help="serve's start modes, separated by ; (none: '')")
    parser.add_argument("--go", action="store_true", help="the row of bench/go_plugin.go (needs go, grpc-go)")
    parser.add_argument("--pythonpath", help="PYTHONPATH for every process (an image's dependencies)")
    parser.add_argument("--zipapp", help="a one-file build (.ci/zipapp) to serve from: the mode 'zipapp'")
    parser.add_argument("--dra", action="store_true", help="rows for the DRA driver's API client (the dra extra)")
    parser.add_argument(
        "--root",
        help="run --python inside this root filesystem (an image's; /proc, /dev and /tmp mounted in it), as root",
    )
    args = parser.parse_args()
    global IMAGE_ROOT, ZIPAPP, PYTHONPATH
    IMAGE_ROOT, ZIPAPP, PYTHONPATH = args.root, args.zipapp and os.path.abspath(args.zipapp), args.pythonpath
    if ZIPAPP and "zipapp" not in args.modes.split(";"):
        args.modes += ";zipapp"
    version = subprocess.run([args.python, "-VV"], capture_output=True, text=True, check=True, **in_root())
    version = version.stdout.split("\n")[0]
    print(f"{args.python}: {version}; {os.cpu_count()} cores; load {os.getloadavg()[0]:.1f}", flush=True)
    rows: dict[str, list[Figures]] = {}
    jobs = []
    if not args.no_layers:
        jobs.append(("python -S -c pass", lambda: probe(args.python, ["-S"], "")))
        jobs.append(("python -c pass", lambda: probe(args.python, [], "")))
        for name, code in DEPENDENCIES.items():
            jobs.append((f"{name} alone", lambda code=code: probe(args.python, [], code)))
        jobs.append(("all five together", lambda: probe(args.python, [], "".join(DEPENDENCIES.values()))))
        if args.dra:
            five = "".join(DEPENDENCIES.values())
            jobs.append(("lightkube, httpx2 alone", lambda: probe(args.python, [], DRA_IMPORTS)))
            jobs.append(("the five + lightkube, httpx2", lambda: probe(args.python, [], five + DRA_IMPORTS)))
    with tempfile.TemporaryDirectory(prefix="gp-floor-") as place:
        if args.go:
            go_plugin, why_not = build_go_program(place, "go_plugin")
            if go_plugin is None:
                sys.exit(f"--go: {why_not}")
            print(f"bench/go_plugin.go built: {os.path.getsize(go_plugin) / 2**20:.1f} MiB", flush=True)
            jobs.append(("Go plugin (bench/go_plugin.go)", lambda: serve_go(go_plugin, args.devices, args.idle)))
        for rev in args.revs:
            directory = place_revision(rev, Path(place, rev.replace("/", "_").replace("~", "-")), args.python)
            jobs.append(
                (f"{rev}: import gopherplug", lambda d=directory: probe(args.python, [], "import gopherplug\n", d))
            )
            if args.dra:
                kubeconfig = directory / "kubeconfig"
                kubeconfig.write_text(KUBECONFIG)
                code = f"import gopherplug\ngopherplug.KubeApi.connect(kubeconfig={str(kubeconfig)!r})\n"
                jobs.append(
                    (
                        f"{rev}: import gopherplug, KubeApi.connect",
                        lambda c=code, d=directory: probe(args.python, [], c, d),
                    )
                )
            for mode in filter(None, args.modes.split(";")):
                jobs.append(
                    (
                        f"{rev}: serve, {mode}",
                        lambda d=directory, m=mode: serve(args.python, d, m, args.devices, args.idle),
                    )
                )
        for run in range(args.runs):
            for name, job in jobs:
                rows.setdefault(name, []).append(job())
            print(f"run {run + 1} of {args.runs} done, load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    print("\n| what | ms, median (min-max) | CPU ms, median | VmRSS MiB | VmHWM MiB |\n| --- | --- | --- | --- | --- |")
    for name, figures in rows.items():
        took, rss, hwm, cpu = ([f[i] for f in figures] for i in range(4))
        print(
            f"| {name} | {statistics.median(took):.1f} ({min(took):.1f}-{max(took):.1f}) "
            f"| {statistics.median(cpu):.0f} | {statistics.median(rss):.1f} | {statistics.median(hwm):.1f} |"
        )


if __name__ == "__main__":
    main()
