"""Exercise 1's solution: GetPreferredAllocation keeps to one NUMA node.

`python check.py --solution 1` puts this prefer() in place of gopher_allocation.py's, in a copy.
"""

from __future__ import annotations

import gopher_allocation


class GopherAllocator(gopher_allocation.GopherAllocator):
    def prefer(self, available: list[str], must_include: list[str], size: int) -> list[str]:
        # Group what the kubelet offers by NUMA node (None: unknown). A node that has `size` of
        # them, and holds every must_include, wins; the node of must_include's first, then the
        # node with the most devices (what stays free suits the next container better).
        devices = self.devices.value
        nodes: dict[int | None, list[str]] = {}
        for device_id in sorted(available):
            nodes.setdefault(devices[device_id].numa if device_id in devices else None, []).append(device_id)
        wanted = {devices[d].numa if d in devices else None for d in must_include}
        fitting = [
            (node in wanted, len(ids), node)
            for node, ids in nodes.items()
            if node is not None and len(ids) >= size and wanted <= {node}
        ]
        if not fitting:  # no one node can: must_include, then the rest by name, as before
            return [*must_include, *[d for d in sorted(available) if d not in must_include]][:size]
        node = max(fitting, key=lambda fit: (fit[0], fit[1], -(fit[2] or 0)))[2]
        return [*must_include, *[d for d in nodes[node] if d not in must_include]][:size]
