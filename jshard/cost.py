"""The alpha-beta cost model that ranks redistribution plans.

A collective over a group of ``n`` devices costs a launch, a latency per hop and the bytes each device
moves divided by the link bandwidth. Mesh axes can be given their own latency and bandwidth (a fast
intra-host axis next to a slow inter-host one); a collective over an axis tuple runs at the pace of its
slowest axis. Costs are in microseconds. A device writing its own memory is priced too (``memory_gbps``, and
``kernel_us`` a kernel): the planner weighs a move it adds against the bytes a smaller local block saves writing,
and the lowering weighs the latency that arrays sharing one collective save against the kernels that pack them.

>>> model = CostModel(axes={"dp": AxisCost(latency_us=10.0, bandwidth_gbps=5.0)})
>>> model.collective("all_reduce", ("dp",), 4, 1 << 20) > model.collective("all_reduce", ("tp",), 4, 1 << 20)
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["AxisCost", "COLLECTIVES", "Communication", "CostModel"]

# bytes a device moves, as a multiple of its input buffer, for a group of n devices (ring algorithms)
_VOLUME = {
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "permute": lambda n: 1,
}
_HOPS = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1}
COLLECTIVES = tuple(_VOLUME)


@dataclass(frozen=True)
class AxisCost:
    """Latency per hop (µs) and bandwidth per device (GB/s) of one mesh axis; ``tree``: a collective over it takes
    ``log2 n`` hops (NCCL's trees and PAT between nodes, which it picks where latency counts), not a ring's
    ``n - 1``, at the ring's bandwidth."""

    latency_us: float = 2.7
    bandwidth_gbps: float = 19.3
    tree: bool = False


@dataclass(frozen=True)
class CostModel:
    """Alpha-beta costs per mesh axis; ``axes`` maps axis names to their ``AxisCost``.

    Defaults are DTensor's inter-host figures (2.7 µs per hop, 19.3 GB/s, 6.6 µs launch); ``memory_gbps`` is a
    device's bandwidth to its own memory, ten times the link's; ``kernel_us`` what one more local kernel costs
    besides its bytes (a GPU kernel's launch is a few µs). ``scatter_first_rows``: how many rows a contraction
    must sum on each device before a transposed weight gradient is reduce-scattered where the contraction made
    it, not after the transpose at its consumer. Scattering first keeps the contraction in its fast form but
    makes XLA:CPU copy the gradient to scatter a non-leading dim: the copy's time grows with the gradient, the
    saving with the rows too. Measured on XLA:CPU with the GPT's FSDP steps, scattering first changed a step by
    +4% at width 512 and 256 rows a device, -3 to -4.5% at 1024 rows; +6% at width 1024 and 512 rows, -5% at
    2048 rows.
    """

    launch_us: float = 6.6
    default: AxisCost = AxisCost()
    axes: Mapping[str, AxisCost] = field(default_factory=dict)
    memory_gbps: float = 200.0
    kernel_us: float = 4.0
    scatter_first_rows: int = 1024

    def __post_init__(self):
        # frozen + hashable: plans are cached per cost model
        object.__setattr__(self, "axes", tuple(sorted(dict(self.axes).items())))
        if not (_number(self.memory_gbps) and self.memory_gbps > 0):
            raise ValueError(f"CostModel: memory_gbps is a device's bandwidth to its own memory in GB/s, a positive "
                             f"number; got {self.memory_gbps!r} (the default is 200.0)")
        if not (_number(self.kernel_us) and self.kernel_us >= 0):
            raise ValueError(f"CostModel: kernel_us is what one more local kernel costs in µs besides its bytes, a "
                             f"number >= 0; got {self.kernel_us!r} (the default is 4.0)")
        if not (isinstance(self.scatter_first_rows, int) and not isinstance(self.scatter_first_rows, bool)
                and self.scatter_first_rows >= 0):
            raise ValueError(f"CostModel: scatter_first_rows is a count of rows a contraction sums on a device, an "
                             f"int >= 0; got {self.scatter_first_rows!r} (the default is 1024)")

    def axis(self, name: str) -> AxisCost:
        return dict(self.axes).get(name, self.default)

    def local(self, nbytes: float, kernels: int = 0) -> float:
        """Cost in µs of a device writing ``nbytes`` of its own memory (an equation's output block), in ``kernels``
        kernels of its own (0: written by a kernel it runs anyway)."""
        return kernels * self.kernel_us + nbytes / (self.memory_gbps * 1e3)

    def collective(self, kind: str, axis_names: tuple[str, ...], group_size: int, nbytes: float, *,
                   launch: bool = True, sizes: Mapping[str, int] | None = None) -> float:
        """Cost in µs of one collective ``kind`` over ``axis_names`` (``group_size`` devices) with
        ``nbytes`` of input per device. ``launch=False`` prices a step merged into the previous one. With the
        axes' ``sizes``, a group over tree axes and ring axes both (nodes and the chips inside them) is priced as
        NCCL runs it, level by level: each axis's hops at its own latency (a tree's ``log2 n``, a ring's
        ``n - 1``), not one ring through every chip at the slowest latency."""
        if group_size <= 1:
            return 0.0
        costs = [self.axis(a) for a in axis_names]
        bandwidth = min(c.bandwidth_gbps for c in costs)
        if kind == "permute":  # one point-to-point hop
            hops_us = max(c.latency_us for c in costs)
        elif all(c.tree for c in costs):
            hops_us = _HOPS[kind] * math.ceil(math.log2(group_size)) * max(c.latency_us for c in costs)
        elif sizes is not None and any(c.tree for c in costs):
            hops_us = _HOPS[kind] * sum((math.ceil(math.log2(sizes[a])) if c.tree else sizes[a] - 1) * c.latency_us
                                        for a, c in zip(axis_names, costs, strict=True) if sizes[a] > 1)
        else:
            hops_us = _HOPS[kind] * (group_size - 1) * max(c.latency_us for c in costs)
        return (self.launch_us if launch else 0.0) + hops_us + nbytes * _VOLUME[kind](group_size) / (bandwidth * 1e3)


class Communication(NamedTuple):
    """Collectives an equation's own local computation runs (a rule whose kernel communicates: a ring of
    ``ppermute`` steps), as its rule declares them: ``count`` collectives ``kind`` (one of ``COLLECTIVES``) over mesh
    axes ``axes``, each with ``nbytes`` of input per device.

    >>> ring = Communication("permute", ("x",), 4096, count=7)
    >>> round(ring.cost(CostModel(), {"x": 8}), 1)  # 7 x (launch + one hop + 4 KiB at 19.3 GB/s)
    66.6
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: float
    count: int = 1

    def cost(self, model: CostModel, sizes: Mapping[str, int]) -> float:
        """µs under ``model`` on a mesh whose axes have ``sizes`` (name -> devices)."""
        group = math.prod(sizes[a] for a in self.axes)
        return self.count * model.collective(self.kind, tuple(self.axes), group, self.nbytes, sizes=sizes)


def _number(x) -> bool:
    """An int or float, not a bool (``True`` is an int to Python, never a meant cost)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
