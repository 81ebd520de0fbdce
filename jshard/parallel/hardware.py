"""``Hardware``: what a chip computes and how fast its links move bytes, described or measured.

A step is priced (``jshard.parallel.pricing``) on a ``Hardware``: its matmuls at ``flops * efficiency``, the
bytes its equations write at ``hbm_bandwidth``, and its collectives by the alpha-beta cost model
(``jshard.cost.CostModel``) whose axes the hardware fills in: a mesh axis that stays inside a node (the axis and
every axis inside it, those after it in mesh order, span at most ``chips_per_node`` chips) runs on the ``intra``
link (NVLink, ICI), any other on the ``inter`` link (InfiniBand or RoCE between hosts, DCN between TPU slices).

Two ways to get one, and one cost model behind both:

- described: the presets (``Hardware.h100()``, ``a100()``, ``tpu_v5p()``, ``tpu_v6e()``) from the vendors' data
  sheets, for clusters no one here holds (``jshard.parallel.predict``, ``autoplan`` with a chip count);
- measured: ``Hardware.measure(mesh)`` times a matmul and collectives of two sizes on the mesh's own devices and
  fits a launch cost and a rate to each (what ``autoplan`` on a mesh it holds prices with).

>>> h100 = Hardware.h100()
>>> h100.chips_per_node, round(h100.flops / 1e12)
(8, 989)
>>> mesh = jax.sharding.AbstractMesh((4, 2, 8), ("dp", "pp", "tp"))
>>> [h100.level(mesh, a) for a in mesh.axis_names]  # tp inside a node, pp and dp across nodes
['inter', 'inter', 'intra']
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ..cost import AxisCost, CostModel

__all__ = ["Hardware", "Link"]

LEVELS = ("intra", "inter")


@dataclasses.dataclass(frozen=True)
class Link:
    """One level of the network, per chip: ``bandwidth`` in bytes/s one way, ``latency`` in seconds a hop; ``tree``:
    a collective takes ``log2 n`` hops, not a ring's ``n - 1`` (NCCL's trees and PAT across nodes, which it picks
    where latency counts: the presets' ``inter`` links)."""

    bandwidth: float
    latency: float
    tree: bool = False

    def axis_cost(self) -> AxisCost:
        return AxisCost(latency_us=self.latency * 1e6, bandwidth_gbps=self.bandwidth / 1e9, tree=self.tree)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A chip and its network.

    ``flops``: dense bf16 FLOP/s per chip (the peak MFU is quoted against); ``efficiency``: the share of it the
    model's matmuls reach (0.667 in the presets, fitted to published runs: ``docs/design.md``); ``hbm_bytes`` /
    ``hbm_bandwidth``: the chip's memory and its bandwidth (bytes/s); ``chips_per_node``: chips joined by
    ``intra``; ``launch``: seconds a kernel or a collective costs besides its work; ``overlap``: the share of the
    data axes' collectives (gradient reduce-scatters, parameter gathers) that runs hidden behind compute, as
    Megatron's and FSDP's prefetching run them (0.8 in the presets, fitted likewise; 0 for a measured machine, whose
    programs XLA schedules as it schedules them); ``tensor_overlap``: the share of every other axis's collectives
    (tensor, sequence and context parallelism's, a pipeline's sends) hidden likewise, as Megatron-LM's
    ``--tp-comm-overlap`` runs a tensor-parallel layer's (0 in the presets: a step's program runs them in line).
    """

    name: str
    flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    chips_per_node: int
    intra: Link
    inter: Link
    efficiency: float = 1.0
    launch: float = 0.0
    overlap: float = 0.0
    tensor_overlap: float = 0.0

    def __post_init__(self):
        for field in ("flops", "hbm_bytes", "hbm_bandwidth", "chips_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Hardware({self.name!r}): {field} must be a positive number, got {value!r}")
        for field in ("efficiency", "overlap", "tensor_overlap"):
            value = getattr(self, field)
            if not 0 <= value <= 1 or (field == "efficiency" and value == 0):
                raise ValueError(f"Hardware({self.name!r}): {field} is a share, in (0, 1] for efficiency and "
                                 f"[0, 1] for {field}; got {value!r}")
        for field in ("intra", "inter"):
            if not isinstance(getattr(self, field), Link):
                raise TypeError(f"Hardware({self.name!r}): {field} must be a Link(bandwidth=bytes/s, "
                                f"latency=seconds), got {getattr(self, field)!r}")

    # -- presets --------------------------------------------------------------------------------------------
    @classmethod
    def h100(cls, **changes: Any) -> Hardware:
        """NVIDIA H100 SXM5 80 GB, 8 a node (DGX H100 / HGX): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3; NVLink 4
        900 GB/s per GPU both ways (450 one way); one 400 Gb/s NIC per GPU across nodes (ConnectX-7, 50 GB/s).
        Sources: NVIDIA H100 Tensor Core GPU data sheet; DGX H100 user guide. ``changes`` override fields (the
        96 GB HBM2e part of torchtitan's runs: ``hbm_bytes=96 * 2**30, hbm_bandwidth=2.4e12``).

        >>> Hardware.h100(hbm_bytes=96 * 2**30).hbm_bytes // 2**30
        96
        """
        return cls._preset(dict(name="H100 SXM", flops=989e12, hbm_bytes=80 * 10**9, hbm_bandwidth=3.35e12,
                                chips_per_node=8, intra=Link(450e9, 3e-6), inter=Link(50e9, 10e-6, tree=True)), changes)

    @classmethod
    def a100(cls, **changes: Any) -> Hardware:
        """NVIDIA A100 SXM4 80 GB, 8 a node (DGX A100): 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e; NVLink 3 600 GB/s
        per GPU both ways; one 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s). Sources: NVIDIA A100 data sheet; DGX
        A100 user guide."""
        return cls._preset(dict(name="A100 SXM 80GB", flops=312e12, hbm_bytes=80 * 10**9, hbm_bandwidth=2.04e12,
                                chips_per_node=8, intra=Link(300e9, 3e-6), inter=Link(25e9, 10e-6, tree=True)), changes)

    @classmethod
    def tpu_v5p(cls, **changes: Any) -> Hardware:
        """Google Cloud TPU v5p: 459 TFLOP/s bf16, 95 GB HBM2e at 2.765 TB/s; inter-chip interconnect 4,800 Gb/s
        per chip (600 GB/s over its 6 links, 3-D torus), up to 8,960 chips in a pod, one ICI domain (``intra``);
        between slices the data-center network, 200 Gb/s per host of 4 chips (6.25 GB/s a chip). Source: Cloud
        TPU documentation, "TPU v5p" system architecture."""
        return cls._preset(dict(name="TPU v5p", flops=459e12, hbm_bytes=95 * 10**9, hbm_bandwidth=2.765e12,
                                chips_per_node=8960, intra=Link(600e9, 5e-6), inter=Link(6.25e9, 20e-6, tree=True)),
                           changes)

    @classmethod
    def tpu_v6e(cls, **changes: Any) -> Hardware:
        """Google Cloud TPU v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM at 1.64 TB/s; inter-chip interconnect
        3,584 Gb/s per chip (448 GB/s, 2-D torus), 256 chips a pod (``intra``); between pods the data-center
        network, 100 Gb/s per chip (12.5 GB/s). Source: Cloud TPU documentation, "TPU v6e"."""
        return cls._preset(dict(name="TPU v6e", flops=918e12, hbm_bytes=32 * 10**9, hbm_bandwidth=1.64e12,
                                chips_per_node=256, intra=Link(448e9, 5e-6), inter=Link(12.5e9, 20e-6, tree=True)),
                           changes)

    @classmethod
    def _preset(cls, fields: dict, changes: dict) -> Hardware:
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"Hardware: {unknown} are not fields of Hardware; the fields are "
                            f"{[f.name for f in dataclasses.fields(cls)]}")
        return cls(**{**fields, **_FITTED, **changes})

    @classmethod
    def measure(cls, mesh: Mesh, dtype: Any = jnp.float32) -> Hardware:
        """The hardware ``mesh``'s devices are measured to be, all of them at once (once per process and set of
        devices): matmuls and elementwise writes of two sizes in ``dtype`` (the model's) give a launch cost and
        a rate; all-reduces of two sizes and an all-gather give the links' latency and bandwidth. Every process
        of a multi-controller run takes process 0's figures, so that all find the same plan. The whole mesh is
        one node (its devices are what it measured), ``efficiency`` 1 (the rate is what the matmul reached).

        >>> h = Hardware.measure(jax.make_mesh((8,), ("x",)))
        >>> h.chips_per_node, h.flops > 0
        (8, True)
        """
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Hardware.measure: mesh must be a jax.sharding.Mesh of devices to time, got "
                            f"{type(mesh).__name__}; an abstract mesh has nothing to measure (use a preset, "
                            "Hardware.h100())")
        return _measured(tuple(mesh.devices.flat), np.dtype(dtype).name)

    # -- what pricing reads ---------------------------------------------------------------------------------
    def level(self, mesh: Mesh | AbstractMesh, axis: str) -> str:
        """``"intra"`` where ``axis`` and the axes inside it (after it in mesh order) span at most a node, else
        ``"inter"``."""
        names, sizes = list(mesh.axis_names), list(mesh.axis_sizes)
        i = names.index(axis)
        return "intra" if math.prod(sizes[i:]) <= self.chips_per_node else "inter"

    def levels(self, mesh: Mesh | AbstractMesh, axes: tuple[str, ...]) -> str:
        """The level of a collective over ``axes``: ``"inter"`` where any of them leaves the node."""
        return "inter" if any(self.level(mesh, a) == "inter" for a in axes) else "intra"

    def costs(self, mesh: Mesh | AbstractMesh) -> CostModel:
        """The cost model of collectives on ``mesh``: each axis priced by its level's link."""
        link = {"intra": self.intra.axis_cost(), "inter": self.inter.axis_cost()}
        return CostModel(launch_us=self.launch * 1e6, default=link["inter"],
                         axes={a: link[self.level(mesh, a)] for a in mesh.axis_names},
                         memory_gbps=self.hbm_bandwidth / 1e9, kernel_us=self.launch * 1e6)

    @property
    def flops_per_us(self) -> float:
        """The matmul FLOPs a chip runs per µs: its peak at the model's efficiency."""
        return self.flops * self.efficiency / 1e6

    @property
    def bytes_per_us(self) -> float:
        return self.hbm_bandwidth / 1e6


# the constants a described chip is priced with: the share of peak the matmuls of a transformer's step reach and
# the share of the collectives that hides behind compute, fitted to every other published run of
# benchmarks/published.py (`--fit`: Megatron-LM's 1.7B, 16B, 70B, 177B and 462B rows, torchtitan's 8B on 128 GPUs;
# docs/design.md); a launch's 5 µs chosen
_FITTED = dict(efficiency=0.667, launch=5e-6, overlap=0.8)


@functools.cache
def _measured(devices: tuple, dtype: str) -> Hardware:
    mesh = Mesh(np.array(devices), ("d",))
    n = len(devices)
    split, whole = NamedSharding(mesh, PartitionSpec("d")), NamedSharding(mesh, PartitionSpec())

    def fitted(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
        """``(fixed seconds, seconds per unit)`` of the line through two ``(units, seconds)`` points."""
        (u0, t0), (u1, t1) = small, large
        rate = max(t1 - t0, 1e-12) / (u1 - u0)
        return max(t0 - rate * u0, 0.0), rate

    def matmul(rows: int, k: int) -> tuple[float, float]:
        a, b = _ones((n * rows, k), split, dtype), _ones((k, k), whole, dtype)
        return 2 * 2 * rows * k * k, _seconds(jax.jit(lambda a, b: (a @ b) @ b), a, b)

    def write(size: int) -> tuple[float, float]:
        itemsize = np.dtype(dtype).itemsize
        return 2 * itemsize * size, _seconds(jax.jit(lambda x: x * 2 + 1), _ones((n * size,), split, dtype))

    launch, per_flop = fitted(matmul(64, 128), matmul(256, 512))
    _, per_byte = fitted(write(2**16), write(2**20))
    figures = [1 / per_flop, 1 / per_byte, launch, 0.0, 0.0]
    if n > 1:
        def timed(collective, size):
            x = _ones((n * size,), split, dtype)
            f = jax.jit(jax.shard_map(collective, mesh=mesh, in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d")))
            return _seconds(f, x)

        def summed(x):
            return jax.lax.psum(x, "d")

        def gathered(x):
            return jax.lax.all_gather(x, "d", tiled=True)

        itemsize = np.dtype(dtype).itemsize
        small, large, gather = timed(summed, 256), timed(summed, 2**20), timed(gathered, 256)
        # a small all-reduce takes 2 (n - 1) steps of a ring, a small all-gather n - 1: a collective's fixed cost
        # (launch) and each step's (latency) from the two; the bandwidth from the large one's extra time
        latency = max(small - gather, 0.0) / (n - 1)
        volume = itemsize * 2**20 * 2 * (n - 1) / n
        figures[3:] = [latency, volume / max(large - small, 1e-9)]
        figures[2] = max(small - 2 * (n - 1) * latency, 0.0)
    if jax.process_count() > 1:  # every process must find the same plan: process 0's measurements for all
        from jax.experimental import multihost_utils
        figures = np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(figures, np.float32)), np.float64)
    flops, bandwidth, launch, latency, link = (float(f) for f in figures)
    one = Link(bandwidth=link if n > 1 else 1e12, latency=latency)
    mine = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
    return Hardware(name=f"measured: {n} x {devices[0].device_kind}", flops=flops, hbm_bytes=_memory(mine),
                    hbm_bandwidth=bandwidth, chips_per_node=n, intra=one, inter=one, launch=launch)


def _memory(device) -> int:
    """The device's memory in bytes where it says (accelerators; a device of this process), else the host's RAM
    (XLA:CPU's emulated devices share it: a budget is then the caller's to give)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  (XLA:CPU and older plugins say nothing, or refuse)
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        import os
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**40


def _ones(shape: tuple, sharding: NamedSharding, dtype: str) -> jax.Array:
    """Ones where ``sharding`` puts them, each device given its own block from the host (no program to compile),
    no device or host the whole."""
    block = sharding.shard_shape(shape)
    return jax.make_array_from_callback(shape, sharding, lambda index: np.ones(block, dtype))


def _seconds(f: Callable, *args) -> float:
    """The fastest of up to five timed calls of ``f`` (compiled and run once first), fewer where they add up to a
    quarter of a second (a large all-reduce across the processes of a CPU run takes seconds a call)."""
    jax.block_until_ready(f(*args))
    best, spent = math.inf, 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent > 0.25:
            break
    return best
