"""Every parser gopherplug has, proven by properties over generated inputs (hypothesis).

Each parser takes what someone else wrote: the configuration file, a capacity or attribute file,
the output of `describe`, a kubelet's or a peer's request. The rule at that boundary is that an input
costs a refusal (one line) and never the process. The properties here say so for every parser, and
say what each one keeps: a quantity's value, a name as Go's rules count it, a label NFD accepts.

In CI (CI=true) the examples are derandomized, with a fixed budget: the same inputs on every run, so
that a submission lands or not on its own merits. Locally they vary; HYPOTHESIS_EXAMPLES=5000 searches
harder, and bench/fuzz.py runs every property here for as long as it is asked to, counting the inputs
it tried and the ones that raised.

The properties take no pytest fixtures: bench/fuzz.py calls them as they are.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings  # noqa: F401
from hypothesis import strategies as st  # noqa: F401

import gopherplug as gp  # noqa: F401

PROPERTIES = settings(
    max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow],
)


# Quantities; attribute and capacity names and values; CDI names (issue 44, helper "rules")


# NFD label names and values; HTTP request heads (issue 44, helper "boundary")


# Configuration documents; describe output (issue 44, helper "fuzz")
