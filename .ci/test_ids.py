"""No test lost: the collected tests against the list committed beside this script.

    python .ci/test_ids.py check     every name in .ci/test-ids.txt (after .ci/test-renames.txt) is collected
    python .ci/test_ids.py record    write .ci/test-ids.txt from what is collected now

A test's id is file::name, and moving a test to another file changes the file part only: the
comparison is by name (with its parameters), so tests move between files freely. A test renamed
for good is listed in .ci/test-renames.txt ("old new", one a line); one removed for good leaves the
list in the same commit. New tests need no entry (record adds them).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOP = HERE.parent
IDS, RENAMES = HERE / "test-ids.txt", HERE / "test-renames.txt"


def collected() -> set[str]:
    """The names of the tests collected from testpaths and the runtime tier (skipped or not)."""
    paths = tomllib.loads((TOP / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    paths = [*paths, "test_runtime.py"] if (TOP / "test_runtime.py").exists() else paths
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        cwd=TOP,
        capture_output=True,
        text=True,
    )
    names = {line.partition("::")[2] for line in run.stdout.splitlines() if "::" in line}
    if run.returncode != 0 or not names:
        sys.exit(f"test_ids: collection failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return names


def main(command: str) -> int:
    names = collected()
    if command == "record":
        IDS.write_text("".join(f"{name}\n" for name in sorted(names)))
        print(f"test_ids: {len(names)} tests recorded in {IDS.relative_to(TOP)}")
        return 0
    renames = dict(
        line.split() for line in RENAMES.read_text().splitlines() if line.strip() and not line.startswith("#")
    )
    expected = {renames.get(name, name) for name in IDS.read_text().splitlines() if name}
    lost = sorted(expected - names)
    for name in lost:
        print(f"test_ids: {name} is no longer collected (renamed? list it in .ci/test-renames.txt)")
    print(f"test_ids: {len(expected) - len(lost)} of {len(expected)} recorded tests collected, {len(names)} in all")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "check"))
