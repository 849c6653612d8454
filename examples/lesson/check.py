"""Exercises that check themselves: `python check.py N` checks exercise N of EXERCISES.md.

A check plays the kubelet (gopherplug's KubeletSimulator) or, for DRA, the API server and the
scheduler (gopherplug_standins), against the lessons in this directory (or --lesson DIR): your
copy, as you edited it. It says "passed", or what the kubelet saw and a hint. `all` checks
every exercise. `--solution N` (or `all`) checks the reference solution instead: solutions/
exerciseN.py, its methods put in place of the lesson's in a copy of the lessons.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import errno
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import inotify_simple
import trio

HERE = os.path.dirname(os.path.abspath(__file__))
RESOURCE = "example.com/gopher"


class NotYetError(Exception):
    """What the kubelet (or the scheduler) saw, and a hint: the learner's next step."""

    def __init__(self, saw: str, hint: str, who: str = "the kubelet") -> None:
        super().__init__(saw)
        self.saw, self.hint, self.who = saw, hint, who


def numa_of(devices: dict[str, int], ids: list[str]) -> str:
    return ", ".join(f"{device_id} (NUMA {devices[device_id]})" for device_id in ids)


async def with_plugin(root: str, gophers: int, then: Callable[[Any, Any], Awaitable[None]]) -> None:
    """gopher_allocation.py's plugin, serving `gophers` gophers (NUMA 0, 1, 0, 1, ...) to a kubelet."""
    import gopher_allocation
    import gopher_plugin

    from gopherplug import KubeletSimulator

    plugin_dir = os.path.join(root, "device-plugins")
    os.mkdir(plugin_dir)
    os.mkdir(os.path.join(root, "cdi"))
    gopher_allocation.GopherAllocator.cdi_dir = os.path.join(root, "cdi")
    gopher_plugin.plug(root, *(f"gopher{number}" for number in range(gophers)))
    async with trio.open_nursery() as nursery:
        kubelet = await nursery.start(KubeletSimulator(plugin_dir).run)
        await nursery.start(
            gopher_plugin.serve, os.path.join(root, "gophers"), plugin_dir, gopher_allocation.GopherAllocator
        )
        await kubelet.wait_until(lambda k: RESOURCE in k.resources and len(k.resources[RESOURCE].devices) == gophers)
        await then(kubelet, gopher_allocation)
        nursery.cancel_scope.cancel()


async def exercise_1(root: str) -> None:
    """GetPreferredAllocation: the devices of one NUMA node."""

    async def check(kubelet: Any, lesson: Any) -> None:
        from gopherplug import RPCError

        resource = kubelet.resources[RESOURCE]
        if not resource.options.get_preferred_allocation_available:
            raise NotYetError(
                "GetDevicePluginOptions said get_preferred_allocation_available False: no GetPreferredAllocation",
                "keep GopherAllocator.GetDevicePluginOptions as lesson 3 has it",
            )
        numa = {device_id: nodes[0] for device_id, nodes in resource.topology.items()}
        if len(numa) != 5:
            raise NotYetError(
                f"ListAndWatch gave TopologyInfo for {sorted(numa) or 'no device'}", "keep lesson 3's device()"
            )
        everyone = sorted(numa)
        for available, must, size in [
            (everyone, [], 2),
            (everyone, ["gopher1"], 2),
            (["gopher0", "gopher1", "gopher3"], [], 2),
            (everyone, [], 3),
            (everyone, ["gopher3"], 3),  # NUMA 1 has only two: one node cannot do
        ]:
            asked = f"GetPreferredAllocation for {size} of {numa_of(numa, available)}, must include {must or 'none'}"
            try:
                chosen = await kubelet.preferred_allocation(RESOURCE, available, must, size)
            except RPCError as error:
                raise NotYetError(
                    f"{asked}: the call failed, {error}",
                    "your method raised it: the kubelet gets it as the call's error",
                ) from None
            said = f"{asked}, and got {numa_of(numa, chosen) if set(chosen) <= set(numa) else chosen}"
            if len(set(chosen)) != size or not set(must) <= set(chosen) or not set(chosen) <= set(available):
                raise NotYetError(
                    said, f"answer {size} distinct IDs, from available_deviceIDs, with every must_include"
                )
            can = {node for node in set(numa.values()) if sum(numa[d] == node for d in available) >= size}
            can = {node for node in can if all(numa[d] == node for d in must)}
            if can and len({numa[d] for d in chosen}) > 1:
                raise NotYetError(
                    said,
                    "in prefer(), group available by self.devices.value[id].numa (lesson 1), and answer from a "
                    "node that has `size` of them, the node of must_include's if it has any",
                )

    await with_plugin(root, 5, check)


#: A live process of another user: init's pid. kill(1, 0) fails with EPERM for anyone but root, and
#: as_another_users_process makes it fail so for root too (root may signal any process).
OTHER_USERS = 1


@contextlib.contextmanager
def as_another_users_process(pid: int) -> Iterator[None]:
    """os.kill(pid, ...) refused with EPERM while inside, as the kernel refuses it to a process that may
    not signal ``pid``: the check runs as anyone, root included."""
    real = os.kill

    def kill(target: int, signal: int) -> None:
        if target == pid:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
        real(target, signal)

    os.kill = kill
    try:
        yield
    finally:
        os.kill = real


async def exercise_2(root: str) -> None:
    """PreStartContainer: a device a serial program holds (its UUCP lock) is busy."""

    async def check(kubelet: Any, lesson: Any) -> None:
        from gopherplug import RPCError, StatusCode

        if not kubelet.resources[RESOURCE].options.pre_start_required:
            raise NotYetError("GetDevicePluginOptions: pre_start_required False", "keep lesson 3's options")
        lesson.GopherAllocator.lock_dir = lock_dir = os.path.join(root, "lock")
        os.mkdir(lock_dir)
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        cases = [
            (os.getpid(), True, "alive", ""),
            (int(gone.stdout), False, "gone: a stale lock", "a stale lock is no lock: os.kill(pid, 0) raises "),
            (0, False, "no process: a broken lock", "os.kill(0, 0) asks about your own process group, which "),
            (OTHER_USERS, True, "alive, another user's", "os.kill(pid, 0) raising PermissionError (EPERM) says "),
        ]
        hints = {
            int(gone.stdout): "ProcessLookupError",
            0: "always exists: a pid below 1 is no holder",
            OTHER_USERS: "the process exists, and is not yours: it is busy",
        }
        opens = inotify_simple.INotify()  # a device opened to find out is a device disturbed (lesson 1)
        opens.add_watch(os.path.join(root, "gophers"), inotify_simple.flags.OPEN)
        for pid, busy, state, hint in cases:
            with open(os.path.join(lock_dir, "LCK..gopher1"), "w", encoding="ascii") as lock:
                lock.write(f"{pid:>10}\n")  # the UUCP format: the holder's pid, ten columns, a newline
            holder = f"LCK..gopher1 names process {pid} ({state})"
            try:
                with as_another_users_process(OTHER_USERS):
                    await kubelet.pre_start_container(RESOURCE, ["gopher0", "gopher1"])
            except RPCError as error:
                if not busy:
                    raise NotYetError(
                        f"PreStartContainer(gopher0, gopher1) -> {error}, while {holder}", hint + hints[pid]
                    ) from None
                if error.code != StatusCode.FAILED_PRECONDITION or "gopher1" not in error.message:
                    raise NotYetError(
                        f"PreStartContainer(gopher0, gopher1) -> {error}",
                        "raise RPCError(StatusCode.FAILED_PRECONDITION, ...) naming the busy device",
                    ) from None
            else:
                if busy:
                    raise NotYetError(
                        f"PreStartContainer(gopher0, gopher1) -> OK, while {holder}: it starts the container",
                        hint + hints[pid]
                        if pid in hints
                        else "in PreStartContainer, read lock_dir/LCK..<id>: the holder's pid; busy while it lives",
                    )
            if opened := sorted({event.name for event in opens.read(timeout=0) if event.name}):
                raise NotYetError(
                    f"PreStartContainer(gopher0, gopher1) opened {', '.join(opened)}, while {holder}",
                    "never open a device to find out whether it is busy (opening a serial port can reset what "
                    "is on it): the lock file says it, read without touching the device",
                )
        opens.close()
        os.unlink(os.path.join(lock_dir, "LCK..gopher1"))
        await kubelet.pre_start_container(RESOURCE, ["gopher1"])

    await with_plugin(root, 2, check)


async def exercise_3(root: str) -> None:
    """DRA: publish numaNode, and a claim's CEL selector picks the gophers of one NUMA node."""
    try:  # the API server stand-in speaks HTTP/1.1 with h11, the scheduler's CEL is cel-python's
        import celpy  # noqa: F401
        import h11  # noqa: F401
    except ImportError as error:
        raise NotYetError(f"no stand-ins ({error})", "pip install '.[dra,cel]' in a checkout", "the check") from None
    import gopher_claims
    import gopher_dra
    import gopher_plugin

    from gopherplug_standins import ApiServerSimulator, DraKubeletSimulator, SchedulerSimulator, UnschedulableError

    kubelet_dir, cdi = os.path.join(root, "kubelet"), os.path.join(root, "cdi")
    for directory in (os.path.join(kubelet_dir, "plugins_registry"), cdi):
        os.makedirs(directory)
    gopher_plugin.plug(root, "gopher0", "gopher1", "gopher2", "gopher3")  # NUMA 0, 1, 0, 1
    with open(os.path.join(root, "gophers", "gopher4"), "x", encoding="utf-8") as gopher:
        gopher.write("memory=5Gi\nmodel=giant\n")  # no numa line: its node unknown, as sysfs's -1 says
    async with trio.open_nursery() as nursery:
        api = await nursery.start(ApiServerSimulator().run)
        kubelet = DraKubeletSimulator(kubelet_dir, wipe=lambda name: api.delete_node_slices("node-1", name))
        await nursery.start(kubelet.run)
        driver = gopher_dra.Driver(os.path.join(root, "gophers"), "node-1", api.url, cdi)
        await nursery.start(driver.serve, kubelet_dir)
        await kubelet.wait_until(lambda k: gopher_dra.DRIVER in k.drivers)
        while sum(len(s["spec"]["devices"]) for s in api.slices.values()) < 5:
            await api.changed.wait_touched()
        if api.refused:
            raise NotYetError(f"the API server refused the ResourceSlice: {api.refused[-1][1]}", "see its words")
        devices = {d["name"]: d.get("attributes", {}) for s in api.slices.values() for d in s["spec"]["devices"]}
        if (published := devices["gopher1"].get("numaNode")) is not None and "int" not in published:
            raise NotYetError(
                f"gopher1's numaNode {published}",
                'publish it as an int ({"int": ...}): CEL compares the string "1" with 1 as unequal',
                "the scheduler",
            )
        if (published := devices["gopher4"].get("numaNode")) is not None:
            raise NotYetError(
                f"gopher4, whose NUMA node is unknown (its file has no numa line), with numaNode {published}",
                "publish numaNode only where the node is known (gopher.numa is None where not): a claim for "
                "that node would get a device that may be on another",
                "the scheduler",
            )
        scheduler = SchedulerSimulator(api, [gopher_claims.DEVICE_CLASS])
        for node, wanted in [(1, ["gopher1", "gopher3"]), (0, ["gopher0", "gopher2"])]:
            has = '"numaNode" in device.attributes["gopher.example.com"]'  # a device without it: an error
            selector = f'{has} && device.attributes["gopher.example.com"].numaNode == {node}'
            claim = gopher_claims.resource_claim(f"numa-{node}", selector, count=2)
            saw = f"{selector} on the ResourceSlice's devices, gopher1's attributes {devices['gopher1']}"
            hint = (
                'in Driver.describe(), give each device the attribute "numaNode" that the selector reads, of the '
                "type it compares with (lesson 1 knows each gopher's node)"
            )
            try:
                claim["status"] = {"allocation": scheduler.allocate(claim, "node-1")}
            except UnschedulableError as error:
                raise NotYetError(f"{saw}: {error}", hint, "the scheduler") from None
            chosen = sorted(result["device"] for result in claim["status"]["allocation"]["devices"]["results"])
            if chosen != wanted:
                raise NotYetError(f"{saw}, and allocated {chosen} for NUMA node {node}", hint, "the scheduler")
            api.put_claim(claim)
            answer = (
                await kubelet.prepare(gopher_dra.DRIVER, [("default", f"uid-numa-{node}", f"numa-{node}")])
            ).claims
            if refused := answer[f"uid-numa-{node}"].error:
                raise NotYetError(f"NodePrepareResources(default/numa-{node}) -> {refused}", "keep lesson 4's")
        nursery.cancel_scope.cancel()


EXERCISES: dict[int, Callable[[str], Awaitable[None]]] = {1: exercise_1, 2: exercise_2, 3: exercise_3}


def run(number: int, lesson_dir: str) -> int:
    """Check one exercise against the lessons in lesson_dir: 0 passed, 1 not yet."""
    sys.path.insert(0, lesson_dir)
    logging.disable(logging.CRITICAL)  # a broken handler's log is not the learner's answer: the check says it
    name, narration = f"exercise {number}", io.StringIO()  # the lessons narrate: not here
    try:
        with tempfile.TemporaryDirectory(prefix="check-") as root, contextlib.redirect_stdout(narration):
            trio.run(bounded, EXERCISES[number], root)
    except Exception as raised:
        error: BaseException = raised
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]  # a nursery's: the one error inside
        if isinstance(error, NotYetError):
            print(f"{name}: not yet.\n  {error.who} saw: {error.saw}\n  hint: {error.hint}")
        elif isinstance(error, trio.TooSlowError):
            print(f"{name}: not yet.\n  the kubelet saw: no answer within 30 s\n  hint: run the lesson's --demo")
        else:  # the learner's code, broken: one line saying what, never a traceback
            print(f"{name}: not yet.\n  the lesson failed: {type(error).__name__}: {error}")
        return 1
    print(f"{name}: passed")
    return 0


async def bounded(exercise: Callable[[str], Awaitable[None]], root: str) -> None:
    with trio.fail_after(30):
        await exercise(root)


def apply_solution(number: int, lesson_dir: str) -> None:
    """Put each method of solutions/exerciseN.py's classes in place of the method of that name in
    the lesson class it subclasses (class Driver(gopher_dra.Driver) -> gopher_dra.py's Driver),
    or at the end of that class; its imports join the lesson's."""
    with open(os.path.join(HERE, "solutions", f"exercise{number}.py"), encoding="utf-8") as file:
        solution = file.read()
    lines = solution.splitlines()
    imports = [
        ast.get_source_segment(solution, node) or ""
        for node in ast.parse(solution).body
        if isinstance(node, ast.ImportFrom | ast.Import)
    ]
    for node in ast.parse(solution).body:
        if not isinstance(node, ast.ClassDef):
            continue
        (base,) = node.bases
        assert isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
        path = os.path.join(lesson_dir, f"{base.value.id}.py")
        with open(path, encoding="utf-8") as file:
            target = file.read().splitlines()
        for method in node.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            new = lines[method.lineno - 1 - len(method.decorator_list) : method.end_lineno]
            tree = ast.parse("\n".join(target))
            (cls,) = [c for c in tree.body if isinstance(c, ast.ClassDef) and c.name == base.attr]
            old = [
                m for m in cls.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) and m.name == method.name
            ]
            start, end = (
                (old[0].lineno - 1, old[0].end_lineno or 0) if old else (cls.end_lineno or 0, cls.end_lineno or 0)
            )
            target[start:end] = new if old else ["", *new]
        last = max(
            n.end_lineno or 0 for n in ast.parse("\n".join(target)).body if isinstance(n, ast.Import | ast.ImportFrom)
        )
        target[last:last] = [
            i for i in imports if "__future__" not in i and not i.startswith(f"import {base.value.id}")
        ]
        with open(path, "w", encoding="utf-8") as file:
            file.write("\n".join(target) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercise", choices=[*map(str, EXERCISES), "all"])
    parser.add_argument("--solution", action="store_true", help="check the reference solution, not your copy")
    parser.add_argument("--lesson", default=HERE, help="the directory of the lessons to check (this one)")
    args = parser.parse_args()
    numbers = list(EXERCISES) if args.exercise == "all" else [int(args.exercise)]
    if len(numbers) == 1 and not args.solution:
        return run(numbers[0], args.lesson)
    failed = 0
    for number in numbers:  # each in its own process: a fresh import of its own copy
        with tempfile.TemporaryDirectory(prefix="lesson-copy-") as copy:
            lesson_dir = args.lesson
            if args.solution:
                for name in os.listdir(args.lesson):
                    if name.startswith("gopher_") and name.endswith(".py"):
                        shutil.copy(os.path.join(args.lesson, name), copy)
                apply_solution(number, copy)
                lesson_dir = copy
            command = [sys.executable, os.path.abspath(__file__), str(number), "--lesson", lesson_dir]
            failed |= subprocess.run(command, check=False).returncode
    return failed


if __name__ == "__main__":
    sys.exit(main())
