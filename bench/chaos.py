"""Run the chaos scenario of test_chaos.py for as many seeds as asked, and say what it injected and found.

    python bench/chaos.py --seeds 1000                  # seeds 0 to 999
    python bench/chaos.py --start 4242 --seeds 1        # replay one seed, with gopherplug's log
    python bench/chaos.py --seeds 1000 --write          # and add the figures to bench/RESULTS.md

Each seed is one run_seed of test_chaos.py (its docstring says what a seed does): gopherplug serving
a device plugin and a DRA driver in this process, the stand-ins, faults on, then off, and the
invariants checked. The figures: seeds tried, faults injected by kind (and in how many seeds),
restarts of supervised tasks (gopherplug_task_restarts), the time to converge once the faults stop
(p50, p90, max, over the seeds that converged), seconds per seed, and every invariant violation with
its seed. ``--seconds`` stops starting new seeds after that long (the figures say how many ran).
With one seed gopherplug's log goes to stderr; with more it is silenced. Standard library, and what
the test suite installs.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import itertools
import logging
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import test_chaos  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _worker(bound: float) -> None:
    """A worker process's start: gopherplug's log silenced, the bound of the command line."""
    logging.disable(logging.CRITICAL)
    test_chaos.CONVERGE_BOUND = bound


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=100, help="how many seeds to run (default 100)")
    parser.add_argument("--start", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--seconds", type=float, default=0, help="start no seed after this long (0: no limit)")
    parser.add_argument(
        "--bound", type=float, default=test_chaos.CONVERGE_BOUND, help="seconds to converge once the faults stop"
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="seeds run at once, each in a process of its own (a seed mostly waits)"
    )
    parser.add_argument("--write", action="store_true", help="also add the figures to bench/RESULTS.md, first")
    args = parser.parse_args()
    test_chaos.CONVERGE_BOUND = args.bound
    if args.seeds > 1:
        logging.disable(logging.CRITICAL)
    else:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    began = time.monotonic()
    injected: collections.Counter[str] = collections.Counter()
    seeds_with: collections.Counter[str] = collections.Counter()
    converged, seconds, violations = [], [], []
    restarts = tried = 0

    def reports() -> Iterator[test_chaos.Report]:
        seeds = iter(range(args.start, args.start + args.seeds))
        if args.jobs <= 1:
            for seed in seeds:
                if args.seconds and time.monotonic() - began > args.seconds:
                    return
                yield test_chaos.run_seed(seed)
            return
        # Each seed in a fresh process (trio.run, the environment's KUBECONFIG, gopherplug's globals)
        with multiprocessing.get_context("forkserver").Pool(
            args.jobs, _worker, (args.bound,), maxtasksperchild=1
        ) as pool:
            running = collections.deque(
                pool.apply_async(test_chaos.run_seed, (seed,)) for seed in itertools.islice(seeds, args.jobs)
            )
            while running:
                report = running.popleft().get()
                if not args.seconds or time.monotonic() - began <= args.seconds:
                    running.extend(
                        pool.apply_async(test_chaos.run_seed, (seed,)) for seed in itertools.islice(seeds, 1)
                    )
                yield report

    for report in reports():
        seed = report.seed
        tried += 1
        kinds = [kind for kind, _ in report.injected]
        injected.update(kinds)
        seeds_with.update(set(kinds))
        restarts += report.restarts
        seconds.append(report.seconds)
        if report.converged_in is not None:
            converged.append(report.converged_in)
        violations += [(seed, violation) for violation in report.violations]
        if report.violations or args.seeds == 1:
            print(report.summary(), flush=True)
        elif tried % 50 == 0:
            print(f"{tried} seeds, {len(violations)} violations, {time.monotonic() - began:.0f} s", flush=True)
    seeds_run = sorted({seed for seed, _ in violations})
    lines = [
        f"Seeds from {args.start}: {tried} tried in {time.monotonic() - began:.0f} s "
        f"({statistics.mean(seconds):.2f} s a seed, max {max(seconds):.1f}), "
        f"{sum(injected.values())} faults injected, {restarts} restarts of supervised tasks "
        f"(gopherplug_task_restarts), {len(violations)} invariant violations in "
        f"{len(seeds_run)} seeds ({args.jobs} at a time).",
        "",
    ]
    if converged:
        lines += [
            f"Convergence once the faults stop ({len(converged)} seeds): p50 {percentile(converged, 0.5):.2f} s, "
            f"p90 {percentile(converged, 0.9):.2f} s, max {max(converged):.2f} s "
            f"(bound {test_chaos.CONVERGE_BOUND:g} s).",
            "",
        ]
    lines += ["| fault | where | injected | in seeds |", "| --- | --- | ---: | ---: |"]
    for kind, (where, what) in test_chaos.FAULTS.items():
        lines.append(f"| `{kind}` | {where}: {what} | {injected[kind]} | {seeds_with[kind]} |")
    if violations:
        by_text: dict[str, list[int]] = collections.defaultdict(list)
        for seed, violation in violations:
            by_text[re.sub(r"\[[^]]*\]|\b\d[\w-]*", "…", violation)].append(seed)  # its kind, not its values
        lines += ["", "| violation | seeds | first seeds |", "| --- | ---: | --- |"]
        for text, seeds in sorted(by_text.items(), key=lambda item: -len(item[1])):
            lines.append(f"| {text} | {len(seeds)} | {', '.join(map(str, seeds[:8]))} |")
    result = "\n".join(lines)
    print(result)
    if args.write:  # a section of its own, newest first as RESULTS.md keeps them
        path = os.path.join(HERE, "RESULTS.md")
        with open(path, encoding="utf-8") as file:
            text = file.read()
        today = datetime.date.today().isoformat()
        section = (
            f"## Chaos: faults injected at every call to the environment ({today}, "
            f"Python {platform.python_version()}, `python bench/chaos.py --start {args.start} --seeds {args.seeds}`)"
        )
        at = text.index("\n## ") + 1 if "\n## " in text else len(text)
        with open(path, "w", encoding="utf-8") as file:
            file.write(f"{text[:at]}{section}\n\n{result}\n\n{text[at:]}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
