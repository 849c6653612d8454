"""The runtime tier's figures, over several runs: gopherplug's pods in a real containerd and runc.

    sudo GOPHERPLUG_RUNTIME=DIR .venv/bin/python bench/bench_runtime.py [--runs 3]

Each run is `pytest test_runtime.py` (docs/development.md, "The runtime tier"), which measures as it goes and
writes its figures as JSON (GOPHERPLUG_TIER_RESULTS): how the figures are taken is written beside
each one in test_runtime.py. This script only repeats the tier and lines the runs up, one column
per run, since the machine's timings vary from one minute to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def one_run(timeout: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as directory:
        results = Path(directory) / "tier.json"
        env = {**os.environ, "GOPHERPLUG_TIER_RESULTS": str(results), "GOPHERPLUG_RUNTIME_REQUIRED": "1"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_runtime.py"]
        done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            sys.exit(f"the tier failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
        return json.loads(results.read_text())["figures"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    args = parser.parse_args()
    runs = [one_run(args.timeout) for _ in range(args.runs)]
    print("| figure | " + " | ".join(f"run {n + 1}" for n in range(len(runs))) + " |")
    print("| --- |" + " --- |" * len(runs))
    for name in runs[0]:
        cells = []
        for figures in runs:
            value = figures.get(name, "")
            if isinstance(value, dict):
                value = ", ".join(f"{key} {number}" for key, number in value.items())
            cells.append(str(value))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
