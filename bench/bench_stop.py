"""How long the DRA driver takes to stop on SIGTERM, at several commits in one run. Run by hand, not by CI:

    .venv/bin/python bench/bench_stop.py [--runs 15] [--health] [--metrics] [REV ...]   # default: HEAD~1, tree

Each revision's gopherplug.py (``git show REV:gopherplug.py``; "tree": the work tree's) is copied alone
into a temporary directory and compiled to bytecode, as the images ship it; the plugin runs from there
(`python -m gopherplug serve`, at debug level) as a DRA-only driver of one resource, against this
process's stand-ins: the API server (gopherplug_standins.ApiServerSimulator over HTTPS with a bearer
token file, as the tests run it: a long-lived watch over TLS) and the kubelet's plugin watcher and DRA
manager (DraKubeletSimulator). Once the kubelet registered it and its slice is on the API server, and
half a second later (the start's last writes done), it gets SIGTERM. Printed per revision, over
``--runs`` stops taking turns with the other revisions: the median, minimum and maximum of SIGTERM ->
exit as this process sees it, and of the plugin's own "stop: done in N ms" (its trio run ending; the
rest is the interpreter's teardown), for revisions that log it; then each part's own "stop: <part>:
done in N ms".

``--health`` keeps the kubelet's NodeWatchResources stream open through the stop, as a kubelet with
the ResourceHealthStatus feature gate does; ``--metrics`` serves metrics on 127.0.0.1 (any port), as
daemonset-dra.yaml does. The stand-ins and the third-party packages are this checkout's and this venv's
for every revision.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import trio
import trustme
import yaml

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import revision_module  # noqa: E402

import gopherplug_standins as standins  # noqa: E402

DRIVER = "gopherplug.example.com"
NODE = "node-1"
WAIT = 30  # seconds: the bound of any one wait


def figures(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):7.1f} ({min(values):.1f}-{max(values):.1f})"


async def stop_once(root: Path, place: Path, api: standins.ApiServerSimulator, kubelet, args, env) -> tuple:
    """Start the plugin at ``place``, wait until it serves, SIGTERM it: (ms to exit, its "stop: done" ms or None)."""
    log_path = root / "plugin.log"
    with open(log_path, "wb") as log:
        plugin = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "gopherplug",
                "serve",
                "--config",
                str(root / "config.yaml"),
                "--log-level",
                "debug",
            ],
            cwd=place,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        with trio.fail_after(WAIT):
            await kubelet.wait_until(lambda k: DRIVER in k.drivers)
            while not any(s["spec"]["driver"] == DRIVER for s in api.slices.values()):
                await api.changed.wait_touched()
        await trio.sleep(0.5)  # the start's last writes and log lines are done
        async with contextlib.AsyncExitStack() as stack:
            if args.health:
                responses = await stack.enter_async_context(kubelet.watch_health(DRIVER))
                await responses.__anext__()
            began = trio.current_time()
            plugin.send_signal(signal.SIGTERM)
            with trio.fail_after(WAIT):
                code = await plugin.wait()
            took = 1e3 * (trio.current_time() - began)
        with trio.fail_after(WAIT):  # gone for the kubelet too, before the next start
            await kubelet.wait_until(lambda k: DRIVER not in k.drivers)
    finally:
        if plugin.returncode is None:
            plugin.kill()
            await plugin.wait()
    text = log_path.read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"exit code {code}:\n{text}")
    parts = {part: float(ms) for part, ms in re.findall(r" stop: (.+?): done in (\d+) ms", text)}
    done = re.search(r" stop: done in (\d+) ms", text)
    return took, float(done.group(1)) if done else None, parts


async def main_async(args, places: dict[str, Path], root: Path) -> None:
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(root / "ca.crt"))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    (root / "token").write_text("token-1")
    api = standins.ApiServerSimulator(ssl_context=context, tokens={"token-1"})
    api.put_node(NODE, "0b6f8a5e-4c1d-4e0a-9f3b-2d7c1e9a8b01")
    kubelet = standins.DraKubeletSimulator(str(root / "k"))
    (root / "dev").mkdir()
    (root / "dev" / "gopher0").touch()
    config = {
        "dra": {"driver": DRIVER, "kubelet_dir": str(root / "k")},
        "resources": [
            {
                "name": "example.com/gopher",
                "directory": str(root / "dev"),
                "api": "dra",
                "cdi": {"kind": "example.com/gopher", "spec_dir": str(root / "cdi")},
            }
        ],
    }
    if args.metrics:
        config["metrics_address"] = "127.0.0.1:0"
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env.update(NODE_NAME=NODE, KUBECONFIG=str(root / "kubeconfig"))
    async with trio.open_nursery() as nursery:
        await nursery.start(api.run)
        await nursery.start(kubelet.run)
        cluster = {"server": api.url, "certificate-authority": str(root / "ca.crt")}
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "c", "cluster": cluster}],
            "users": [{"name": "u", "user": {"tokenFile": str(root / "token")}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }
        (root / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        exits: dict[str, list[float]] = {rev: [] for rev in places}
        trio_parts: dict[str, list[float]] = {rev: [] for rev in places}
        each_part: dict[str, dict[str, list[float]]] = {rev: {} for rev in places}
        for _ in range(args.runs):
            for rev, place in places.items():
                took, done, parts = await stop_once(root, place, api, kubelet, args, env)
                exits[rev].append(took)
                if done is not None:
                    trio_parts[rev].append(done)
                for part, ms in parts.items():
                    each_part[rev].setdefault(part, []).append(ms)
        nursery.cancel_scope.cancel()
    options = ", ".join(name for name in ("health", "metrics") if getattr(args, name)) or "plain stand-ins"
    print(f"{args.runs} stops per revision ({options}); ms, median (min-max)")
    print(f"{'revision':<12} {'SIGTERM -> exit':>24} {'stop: done in (trio run)':>28}")
    for rev in places:
        print(f"{rev:<12} {figures(exits[rev]):>24} {figures(trio_parts[rev]):>28}")
    for rev in places:
        if each_part[rev]:
            print(f"{rev}, each part as its trace says (ms, median (min-max)):")
            for part, values in each_part[rev].items():
                print(f"  {part:<24} {figures(values)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("revs", nargs="*", default=["HEAD~1", "tree"])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--health", action="store_true", help="keep the kubelet's health stream open")
    parser.add_argument("--metrics", action="store_true", help="serve metrics, as daemonset-dra.yaml does")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gps-", dir="/tmp") as root:  # short: unix socket paths
        places = {}
        for rev in args.revs:
            places[rev] = revision_module(rev, Path(root, "rev-" + rev.replace("/", "_").replace("~", "-"))).parent
        trio.run(main_async, args, places, Path(root))


if __name__ == "__main__":
    main()
