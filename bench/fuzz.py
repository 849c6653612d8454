"""Run every property of test_properties.py for as long as asked, and say how many inputs it tried
and how many raised ("bench/fuzz.py runs them for as long as asked and writes how many
inputs it tried and how many crashed").

    python bench/fuzz.py --seconds 600                 # every property, in turns, for 600 s
    python bench/fuzz.py --inputs 1000000 --seconds 900  # until a million inputs in all, or 900 s
    python bench/fuzz.py --inputs 20000 -k describe    # the properties whose name has "describe"
    python bench/fuzz.py --soak 1000                   # the soak: a serving plugin fed 1000 of each
    python bench/fuzz.py --list                        # the properties, one a line

A property is a function of test_properties.py that hypothesis made (it has a ``.hypothesis``
attribute); each is run as it is, without pytest, with its settings replaced: no database, random
(not derandomized) inputs, and no shrinking, so that a run ends at its first crash (printed, with the
input) and the next run goes on. Runs are of a few thousand inputs each: hypothesis keeps what one
run tried, to try something new, and that grows with the run. An input is one call of the property's
body (its ``inner_test``); a crash is one that raised.

The properties take turns (TURN seconds each) until --inputs inputs were tried in all or --seconds
have passed: each gets the same time, so a fast parser tries more inputs than a slow one (a YAML
document costs milliseconds, a quantity microseconds).

The table (property, inputs, crashes, seconds, inputs/s) goes to stdout; with --write it is also
appended to bench/RESULTS.md, under a heading with the date and the machine's Python. Standard
library and hypothesis only.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

#: Inputs a run tries before the next run starts afresh (see the module's docstring).
RUN = 4000
#: A property's turn, in seconds.
TURN = 20.0


@dataclass
class Tally:
    """What one property's runs tried."""

    name: str
    inputs: int = 0
    crashes: int = 0
    seconds: float = 0.0
    #: a crash's kind (exception type and first line) -> the first input that raised it
    kinds: dict[str, str] = field(default_factory=dict)


def properties(module: Any) -> dict[str, Callable[..., None]]:
    """The module's hypothesis properties, by name, in the order the module defines them."""
    return {name: value for name, value in vars(module).items() if callable(value) and hasattr(value, "hypothesis")}


def fuzz(test: Callable[..., None], tally: Tally, inputs: int, seconds: float) -> None:
    """Run ``test`` until it has tried ``inputs`` inputs or ``seconds`` have passed."""
    handle = test.hypothesis  # type: ignore[attr-defined]
    body = handle.inner_test
    replay = [False]  # after a crash, hypothesis runs its input once more, to report it: not a new input

    def counted(*args: Any, **kwargs: Any) -> None:
        if replay[0]:
            replay[0] = False
            return body(*args, **kwargs)
        tally.inputs += 1
        try:
            return body(*args, **kwargs)
        except Exception as error:
            tally.crashes += 1
            replay[0] = True
            kind = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
            if kind not in tally.kinds:
                where = "".join(traceback.format_exception(error, limit=-2, chain=False))
                tally.kinds[kind] = f"{_shown(args, kwargs)[:300]}\n{where}"
            raise

    parent = test._hypothesis_internal_use_settings  # type: ignore[attr-defined]
    start = time.monotonic()
    handle.inner_test = counted
    try:
        run = 100  # then as many as the time left holds at the rate so far, up to RUN
        while tally.inputs < inputs and (spent := time.monotonic() - start) < seconds:
            if tally.inputs:
                run = max(10, min(RUN, 2 * run, int(tally.inputs / spent * (seconds - spent)) + 1))
            # The settings @given reads at each call: the module's, but for as many inputs as are left.
            test._hypothesis_internal_use_settings = settings(  # type: ignore[attr-defined]
                parent,
                max_examples=min(run, inputs - tally.inputs),
                derandomize=False,
                database=None,
                phases=[Phase.generate],
                deadline=None,
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            )
            before, crashes, replay[0] = tally.inputs, tally.crashes, False
            try:
                test()
            except Exception as error:  # counted, its first input kept: the next run goes on
                if tally.crashes == crashes:  # not an input's: the property cannot run here (a fixture?)
                    print(f"{tally.name}: cannot be run: {type(error).__name__}: {error}", file=sys.stderr)
                    break
            if tally.inputs == before:
                break  # nothing left to try (a strategy of few values), or every input refused
    finally:
        handle.inner_test = body
        test._hypothesis_internal_use_settings = parent  # type: ignore[attr-defined]
        tally.seconds += time.monotonic() - start


def _shown(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """An input, for a person: its repr (which a 5000-digit int refuses, past Python's limit)."""
    try:
        return repr(args or kwargs)
    except ValueError as error:
        return f"<an input without a repr: {error}>"


def table(tallies: list[Tally]) -> str:
    rows = ["| property | inputs | crashes | seconds | inputs/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for t in [*tallies, total(tallies)]:
        rate = t.inputs / t.seconds if t.seconds else 0.0
        rows.append(f"| {t.name} | {t.inputs} | {t.crashes} | {t.seconds:.0f} | {rate:.0f} |")
    return "\n".join(rows)


def total(tallies: list[Tally]) -> Tally:
    return Tally(
        "all", sum(t.inputs for t in tallies), sum(t.crashes for t in tallies), sum(t.seconds for t in tallies)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run test_properties.py's properties; count inputs and crashes.")
    parser.add_argument("--seconds", type=float, help="stop after this long (the properties take turns)")
    parser.add_argument("--inputs", type=int, help="stop once this many inputs were tried in all")
    parser.add_argument("-k", dest="select", action="append", default=[], help="only properties whose name has this")
    parser.add_argument("--soak", type=int, metavar="N", help="run the soak with N configurations and N outputs")
    parser.add_argument("--list", action="store_true", help="list the properties and stop")
    parser.add_argument("--write", action="store_true", help="also add the table to bench/RESULTS.md, first")
    args = parser.parse_args(argv)
    import test_properties

    if args.soak is not None:
        started, counts = time.monotonic(), dict[str, int]()
        try:
            tried = test_properties.soak(args.soak, args.soak, counts)
        except BaseException as error:  # the plugin ended, or a check failed: after how many
            print(f"soak: FAILED after {counts}: {''.join(traceback.format_exception(error, limit=-4))}")
            return 1
        print(f"soak: {tried} in {time.monotonic() - started:.0f} s; the plugin served its devices after each")
        return 0
    chosen = {
        name: test
        for name, test in properties(test_properties).items()
        if not args.select or any(re.search(word, name) for word in args.select)
    }
    if args.list or not chosen:
        print("\n".join(chosen) or "no property matches")
        return 0 if chosen else 2
    if args.seconds is None and args.inputs is None:
        parser.error("say how long: --seconds and/or --inputs")
    seconds = args.seconds if args.seconds is not None else float("inf")
    inputs = args.inputs if args.inputs is not None else sys.maxsize
    tallies = {name: Tally(name.removeprefix("test_")) for name in chosen}
    started, turns = time.monotonic(), dict(chosen)
    while turns and (left := seconds - (time.monotonic() - started)) > 0:
        for name, test in list(turns.items()):
            tally, before = tallies[name], tallies[name].inputs
            wanted = inputs - sum(t.inputs for t in tallies.values())
            if wanted <= 0:
                turns.clear()
                break
            fuzz(test, tally, tally.inputs + max(1, wanted // len(turns)), min(TURN, left / len(turns)))
            if tally.inputs == before:
                del turns[name]  # nothing more to try
        for tally in tallies.values():
            print(
                f"{tally.name}: {tally.inputs} inputs, {tally.crashes} crashes, {tally.seconds:.0f} s", file=sys.stderr
            )
    for tally in tallies.values():
        for kind, first in tally.kinds.items():
            print(f"{tally.name}: crash {kind}\n    first input: {first}", file=sys.stderr)
    result = table(list(tallies.values()))
    print(result)
    if args.write:  # a section of its own, newest first as RESULTS.md keeps them
        section = (
            f"## {datetime.date.today()}, bench/fuzz.py {' '.join(sys.argv[1:])} (Python {platform.python_version()})"
        )
        path = os.path.join(HERE, "RESULTS.md")
        with open(path, encoding="utf-8") as file:
            text = file.read()
        at = text.find("\n## ") + 1 or len(text)
        with open(path, "w", encoding="utf-8") as file:
            file.write(f"{text[:at]}{section}\n\n{result}\n\n{text[at:]}")
    return 1 if total(list(tallies.values())).crashes else 0


if __name__ == "__main__":
    sys.exit(main())
