"""Exercise 3's solution: the DRA driver publishes each gopher's NUMA node as an attribute.

`python check.py --solution 3` puts this describe() in place of gopher_dra.py's, in a copy.
"""

from __future__ import annotations

from typing import Any

import gopher_dra
from gopher_devices import Gopher


class Driver(gopher_dra.Driver):
    def describe(self, gopher: Gopher) -> dict[str, Any]:
        # numaNode an int, so that CEL compares it with 1, not with "1". A device whose node is
        # unknown goes without it: a selector for all devices asks `"numaNode" in ...` first.
        attributes: dict[str, Any] = {"model": {"string": gopher.properties.get("model", "gopher")}}
        if gopher.numa is not None:
            attributes["numaNode"] = {"int": gopher.numa}
        return {"attributes": attributes, "capacity": {"memory": {"value": gopher.properties.get("memory", "0")}}}
