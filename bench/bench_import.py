"""What importing gopherplug.py costs, at several commits in one run. Run by hand, not by CI:

    .venv/bin/python bench/bench_import.py [--runs 15] [REV ...]    # default: HEAD~1 and the work tree

Each revision's gopherplug.py (``git show REV:gopherplug.py``; "tree": the file in the work tree) is
copied alone into a temporary directory, compiled to bytecode once (as the images ship it), and then
imported in ``--runs`` fresh interpreters of this Python, each printing the wall time of ``import
gopherplug`` and its VmRSS right after. The revisions take turns run by run, so a machine's load
drifts over all of them alike. Printed per revision: the module's lines, and the median and minimum
of the import time and the RSS. The same third-party packages (this venv's) serve every revision.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "bench"))
from bench_gopherplug import revision_module  # noqa: E402

PROBE = (
    "import time\n"
    "start = time.perf_counter()\n"
    "import gopherplug\n"
    "took = time.perf_counter() - start\n"
    "rss = next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmRSS:'))\n"
    "print(took, rss)\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("revs", nargs="*", default=["HEAD~1", "tree"])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gp-import-") as root:
        places = {}
        for rev in args.revs:
            places[rev] = revision_module(rev, Path(root, rev.replace("/", "_").replace("~", "-"))).parent
        times: dict[str, list[float]] = {rev: [] for rev in args.revs}
        rss: dict[str, list[float]] = {rev: [] for rev in args.revs}
        for _ in range(args.runs):
            for rev, place in places.items():
                out = subprocess.run(
                    [sys.executable, "-c", PROBE], cwd=place, capture_output=True, text=True, check=True
                ).stdout.split()
                times[rev].append(float(out[0]) * 1e3)
                rss[rev].append(int(out[1]) / 1024)
        print(f"{'revision':<12} {'lines':>6} {'import ms (median, min)':>24} {'RSS MiB (median, min)':>22}")
        for rev, place in places.items():
            lines = len((place / "gopherplug.py").read_text().splitlines())
            t, r = times[rev], rss[rev]
            print(
                f"{rev:<12} {lines:>6} {statistics.median(t):>15.1f}, {min(t):>6.1f} "
                f"{statistics.median(r):>14.2f}, {min(r):>5.2f}"
            )


if __name__ == "__main__":
    main()
