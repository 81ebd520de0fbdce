"""DArray: a global array stored as one block per device, described by a Spec.

The storage is one ``jax.Array``: every device's block, padded to the largest local shape, one after another
along dim 0 in mesh device order, with dim 0 sharded over all mesh axes (``Spec.block_shape``,
``block_sharding``), so every device holds exactly its own block.
That represents every placement alike (Partial, StridedShard, uneven shards).

A DArray is the array it stands for wherever JAX code meets it, as a ``jax.Array`` is: a leaf of ``jax.tree``
utilities (``jax.tree.map(lambda v: v.shape, tree)`` gives global shapes), and a value that ``jnp`` functions,
``jax.jit`` and JAX's transformations take. There it is the ``jax.Array`` with the equivalent ``NamedSharding``
(``DArray.as_jax``: zero copy where JAX expresses the layout; pending reductions completed and layouts JAX has no
sharding for gathered along their dims first), on the mesh's devices with Auto axes, so JAX plans it as GSPMD does
and gives ``jax.Array`` results. jshard's own programs take the block storage as it is.

>>> import jax, numpy as np
>>> from jshard import distribute, Shard, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> x = distribute(np.arange(20.0).reshape(10, 2), mesh, [Shard(0), Replicate()])
>>> x
DArray(f32[10,2] (S(0), R) on mesh(dp=2, tp=4))
>>> [a.shape for a in x.to_local()][::4]
[(5, 2), (5, 2)]
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .cost import CostModel
from .jaxcompat import register_array_type, source_info_util
from .lowering import compile_plan
from .placements import Placement, Replicate, format_placements
from .planner import check_cost_model, plan_redistribute
from .spec import Spec, block_sharding, check_dtype, check_mesh, format_mesh

__all__ = ["DArray", "DeletedArrayError", "abstract", "adopt", "distribute", "from_jax", "from_local",
           "from_process_local", "index_runs", "local_blocks", "on_devices", "process_rows", "rows_start",
           "same_devices", "shape_from_rows", "to_devices"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))


class DArray:
    """A distributed array: block storage plus the spec that says what each block means.

    Build one with ``distribute``, ``from_local``, ``from_process_local`` or ``from_jax``; the constructor takes
    the block array as is (its shape must be ``spec.block_shape``). Its arithmetic operators, indexing and reductions
    (``x + y``, ``x @ w``, ``x[1:]``, ``x.sum()``) are attached by ``jshard.operators``, above the engine.
    """

    __slots__ = ("_jax", "block", "spec")

    def __init__(self, block: jax.Array, spec: Spec):
        self.block = block
        self.spec = spec
        self._jax = None  # as_jax's answer where it had to move the value: a block never changes

    # -- attributes -------------------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.spec.placements

    @property
    def mesh(self) -> Mesh:
        return self.spec.mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape."""
        return self.spec.shape

    @property
    def dtype(self) -> np.dtype:
        return self.spec.dtype

    @property
    def ndim(self) -> int:
        return len(self.spec.shape)

    def __repr__(self) -> str:
        return f"DArray({self.spec})"

    def _check_live(self, where: str) -> None:
        """Raise ``DeletedArrayError`` if the block's storage is gone (donated or deleted): XLA can kill the
        process when a compiled program is handed a deleted buffer, so every reader checks first."""
        if isinstance(self.block, jax.core.Tracer) or not self.block.is_deleted():  # traced: nothing to read yet
            return
        went = donation_of(self.block)
        if went is None:
            raise DeletedArrayError(f"{where}: {self!r} has been deleted (its storage was freed or donated); "
                                    "use the array that replaced it")
        raise DeletedArrayError(f"{where}: {self!r} was donated to {went}; its storage now belongs to that call's "
                                "outputs. Use the outputs, or leave it out of donate_argnums")

    # -- conversions ------------------------------------------------------------------------------
    def redistribute(self, placements: Sequence[Placement], *, cost_model: CostModel | None = None) -> DArray:
        """The same value with new placements, Partial targets included.

        The plan (``jshard.plan_redistribute``) is the cheapest under ``cost_model`` and runs as one
        compiled program; both are cached.

        >>> import jax, numpy as np; from jshard import distribute, Shard, Partial, Replicate
        >>> x = distribute(np.ones((8, 4)), jax.make_mesh((2, 4), ("dp", "tp")), [Shard(0), Replicate()])
        >>> x.redistribute([Replicate(), Shard(1)]).placements
        (R, S(1))
        """
        self._check_live("redistribute")
        model = check_cost_model(cost_model, "redistribute")
        target = self.spec.with_placements(placements, where=f"redistribute from {self.spec}")
        plan = plan_redistribute(self.spec, target.placements, cost_model=model)
        if not plan.steps:
            return DArray(self.block, plan.dst)
        return DArray(compile_plan(plan)(self.block), plan.dst)

    def full(self) -> jax.Array:
        """The logical global value, replicated on every device of the mesh."""
        self._check_live("full")
        plan = plan_redistribute(self.spec, (Replicate(),) * len(self.placements))
        return compile_plan(plan, global_out=True)(self.block)

    # -- host conversions, as a jax.Array's ----------------------------------------------------------
    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __bool__(self) -> bool:
        size = math.prod(self.shape)
        # jax.Array's own errors, raised before anything is read
        if size == 0:
            raise ValueError("The truth value of an empty array is ambiguous. Use `array.size > 0` to check that an "
                             "array is not empty.")
        if size > 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. Use a.any() or "
                             "a.all()")
        return bool(self._value("bool"))

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of unsized object")  # jax.Array's (and numpy's) error
        return self.shape[0]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(x)``: the global value on the host."""
        return np.asarray(self._value("np.asarray"), dtype=dtype, copy=copy)

    def _scalar(self, where: str) -> np.ndarray | jax.Array:
        """The value of a 0-d DArray, which is all ``float(jax_array)`` takes."""
        self._check_live(where)  # a donated DArray says so before anything else
        if self.ndim:
            raise TypeError(f"{where}: {self!r} is not a scalar; only a 0-d DArray converts to a Python number "
                            "(x.full() gives the whole value)")
        return self._value(where)

    def _value(self, where: str) -> np.ndarray | jax.Array:
        """The global value for a host conversion named ``where``: one device's block where every device holds
        the value (a training step's loss), compiling nothing; else ``full()`` (traced inside ``jax.jit``, where
        JAX's own conversion error follows)."""
        self._check_live(where)
        if all(isinstance(p, Replicate) for p in self.placements) and not isinstance(self.block, jax.core.Tracer):
            return np.asarray(self.block.addressable_shards[0].data).reshape(self.shape)
        return self.full()

    def to_jax(self) -> jax.Array:
        """An ordinary ``jax.Array`` with the equivalent ``NamedSharding``, built without a collective.

        Raises ``LayoutError`` where JAX has no equivalent (uneven shards, Partial avg/max/min, strided
        layouts that are no shard order); ``full()`` always works.
        """
        self._check_live("to_jax")
        sharding = self.spec.to_named_sharding(where="to_jax")
        local = self.spec.local_block_shape
        return jax.make_array_from_single_device_arrays(
            self.shape, sharding, [s.data.reshape(local) for s in self.block.addressable_shards]
        )

    def as_jax(self) -> jax.Array:
        """The ``jax.Array`` plain JAX code sees for this DArray (``jnp.sum(x)``, ``jax.jit(f)(x)``): the same global
        value with a ``NamedSharding`` on the mesh's devices with Auto axes, so JAX's ops never raise
        explicit-sharding errors on it. Zero copy where the layout has a ``NamedSharding``; otherwise moved first to
        the nearest layout that has one (``Spec.nearest_jax_layout``: pending reductions completed, unevenly split
        dims gathered along those axes only), never to one device, and that move is made once per DArray.

        >>> import jax, jax.numpy as jnp, numpy as np; from jshard import distribute, Shard
        >>> x = distribute(np.arange(8.0), jax.make_mesh((8,), ("x",)), [Shard(0)])
        >>> float(jnp.sum(x)), tuple(x.as_jax().sharding.spec)
        (28.0, ('x',))
        """
        if not isinstance(self.block, jax.Array) or isinstance(self.block, jax.core.Tracer):
            # not a TypeError: JAX would put its own message ("a non-array argument") in place of this one
            raise ValueError(f"{self!r} holds no value here (its block is {type(self.block).__name__}): it is "
                            "jshard's stand-in while a step is traced or priced. Pass DArrays to the function "
                            "jshard.jit compiles, not to JAX inside it")
        self._check_live("as_jax")
        if self._jax is not None:
            return self._jax
        target = self.spec.nearest_jax_layout()
        near = self if target == self.placements else self.redistribute(target)
        local = near.spec.local_block_shape
        array = jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, [s.data.reshape(local) for s in near.block.addressable_shards])
        if near is not self:  # kept: it cost a program. A view of the block is not, so donating the block stays free
            self._jax = array
        return array

    @property
    def sharding(self) -> NamedSharding:
        """The sharding of ``as_jax()``, read off the spec (nothing moves): where ``jax.jit`` finds the argument."""
        target = self.spec.with_placements(self.spec.nearest_jax_layout(), where="sharding")
        return NamedSharding(auto_mesh(self.mesh), target.to_partition_spec(where="sharding"))

    def __jax_array__(self) -> jax.Array:
        return self.as_jax()

    def to_local(self) -> list[jax.Array | None]:
        """Every device's local array with its true (possibly uneven or empty) shape, in mesh device
        order (``mesh.devices.flat``). Devices this process cannot address (multi-host) give None."""
        self._check_live("to_local")
        blocks = {shard.device: shard.data for shard in self.block.addressable_shards}
        out = []
        for i, device in enumerate(self.mesh.devices.flat):
            if device not in blocks:
                out.append(None)
                continue
            shape = self.spec.local_shape(np.unravel_index(i, self.spec.mesh_shape))
            out.append(blocks[device][tuple(slice(0, n) for n in shape)] if shape else blocks[device].reshape(()))
        return out


# ---------------------------------------------------------------------------------------------------
# constructors


def abstract(spec: Spec) -> DArray:
    """A DArray holding its spec alone: its block a ``jax.ShapeDtypeStruct`` of the block storage (shape, dtype and
    sharding), no value. Enough to trace, plan and lower a ``jshard.jit`` program (``parallelize_shapes``'s
    parameters; ``autoplan`` prices and compiles plans on them), never to run one.

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> from jshard import Replicate, Shard
    >>> abstract(Spec.create(mesh, [Shard(0)], (16, 4), jnp.float32)).block.shape
    (16, 4)
    >>> abstract(Spec.create(mesh, [Replicate()], (3,), jnp.float32)).block.shape  # every device a whole copy
    (24,)
    """
    return DArray(jax.ShapeDtypeStruct(spec.block_shape, spec.dtype, sharding=block_sharding(spec.mesh)), spec)


def distribute(x, mesh: Mesh, placements: Sequence[Placement]) -> DArray:
    """Distribute the global value ``x`` (a host or jax array) over ``mesh`` with ``placements``.

    Each device keeps its own shards. A ``Partial`` placement is exact: for ``sum`` the value sits on
    coordinate 0 and zeros elsewhere; ``avg``, ``max`` and ``min`` keep the value on every coordinate.
    A host value (numpy, scalars, lists) is cut on the host: each device receives only its own block, with no
    collective. So is a ``jax.Array`` held elsewhere (on one device, as an eagerly built model's parameters), a
    block at a time from its shards: never whole on the host or on every device. A ``jax.Array`` already on the
    mesh's devices moves from its own layout by collectives. On multi-host meshes every process passes the same
    whole ``x`` and fills its own devices (``from_process_local`` takes only a process's part).

    >>> import jax, numpy as np; from jshard import Shard, Partial
    >>> x = distribute(np.arange(6.0), jax.make_mesh((2, 4), ("dp", "tp")), [Partial(), Shard(0)])
    >>> [a.tolist() for a in x.to_local()][:5]
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [], [0.0, 0.0]]
    """
    check_mesh(mesh, "distribute")
    if isinstance(x, DArray):
        raise TypeError(f"distribute: x is already a DArray ({x!r}); use x.redistribute(placements)")
    _check_array_live(x, "distribute: x")
    if not isinstance(x, (jax.Array, np.ndarray)):
        try:
            # scalars and lists: the dtype JAX gives them (weak types, x64), then back to the host; they are
            # built in Python, so small
            x = np.asarray(jnp.asarray(x))
        except (TypeError, ValueError) as e:
            raise TypeError(f"distribute: x must be an array (numpy, jax, or a nested list of numbers), got "
                            f"{type(x).__name__} {x!r:.60}: {e}") from None
    spec = Spec.create(mesh, placements, x.shape, x.dtype, where="distribute")
    if isinstance(x, np.ndarray):
        return DArray(_host_blocks(spec, _reader(x)), spec)
    replicated = spec.with_placements((Replicate(),) * len(spec.placements))
    keys = jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    if spec != replicated and not keys and not isinstance(x, jax.core.Tracer):
        if (isinstance(x.sharding, NamedSharding) and same_devices(x.sharding.mesh, mesh)
                and not any(p.is_partial for p in spec.placements)):
            # on the devices, by collectives (a Partial made from shards would be split otherwise than promised)
            return from_jax(x, mesh).redistribute(spec.placements)
        if x.is_fully_addressable:
            # elsewhere (one device: a model built eagerly): cut on the host, a block at a time, as a numpy
            # value is; putting it on every device first would hold one copy per device
            return DArray(_host_blocks(spec, _shards_reader(x)), spec)
    # replicated, PRNG keys, traced, or on other processes' devices: the device-side plan from Replicate
    plan = plan_redistribute(replicated, spec.placements)
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return DArray(compile_plan(plan, global_in=True)(x), spec)


def from_local(locals: Sequence, mesh: Mesh, placements: Sequence[Placement], shape=None) -> DArray:
    """Build a DArray from each device's local array, in mesh device order (``mesh.devices.flat``).

    Local shapes are the true ones (uneven and empty shards included); a ``Partial`` placement takes the
    locals as they are, so their reduction is the value. ``shape`` (the global shape) is inferred from
    the local shapes when omitted and checked against them when given. On multi-host meshes, entries for
    devices this process cannot address are ignored (pass None).

    >>> import jax, numpy as np; from jshard import Partial
    >>> mesh = jax.make_mesh((8,), ("x",))
    >>> from_local([np.full(3, float(i)) for i in range(8)], mesh, [Partial("max")]).full().tolist()
    [7.0, 7.0, 7.0]
    """
    devices = list(check_mesh(mesh, "from_local").devices.flat)
    if isinstance(locals, (str, bytes)) or not isinstance(locals, (Sequence, np.ndarray, jax.Array)):
        raise TypeError(
            f"from_local: locals must be a list of local arrays, one per device in mesh.devices.flat order, got "
            f"{type(locals).__name__}" + ("; pass list(...) of it" if hasattr(locals, "__iter__") else "")
        )
    if len(locals) != len(devices):
        raise ValueError(
            f"from_local: got {len(locals)} local arrays for {format_mesh(mesh)} with {len(devices)} devices; "
            "pass one per device, in mesh.devices.flat order"
        )
    mesh_shape = tuple(mesh.devices.shape)
    addressable = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    arrays = {i: _local_array(locals[i], i, mesh) for i in addressable}
    if not arrays:
        raise ValueError(f"from_local: this process (index {jax.process_index()}) holds no device of "
                         f"{format_mesh(mesh)}; call it on the processes that do")
    first = next(iter(arrays))
    for i, a in arrays.items():
        if a.ndim != arrays[first].ndim or a.dtype != arrays[first].dtype:
            raise ValueError(
                f"from_local: local array {i} is {a.dtype}{list(a.shape)} but local array {first} is "
                f"{arrays[first].dtype}{list(arrays[first].shape)}; the local arrays must share rank and dtype"
            )
    rank, dtype = arrays[first].ndim, arrays[first].dtype
    local_shapes = {tuple(int(c) for c in np.unravel_index(i, mesh_shape)): tuple(a.shape) for i, a in arrays.items()}
    if shape is None:
        shape = _infer_shape(local_shapes, mesh, placements, rank)
    spec = Spec.create(mesh, placements, shape, dtype, where="from_local")
    for coords, got in local_shapes.items():
        want = spec.local_shape(coords)
        if got != want:
            raise ValueError(
                f"from_local: device {coords} of {format_mesh(mesh)} has a local array of shape {got}, but {spec} "
                f"puts shape {want} there (shards follow torch.chunk sizes: ceil-divide, trailing shards short "
                "or empty)"
            )
    local = spec.local_block_shape
    shards = []
    for i, a in arrays.items():
        widths = [(0, n - s) for n, s in zip(local, a.shape, strict=True)]
        block = (jnp if isinstance(a, jax.Array) else np).pad(a, widths) if widths else a
        shards.append(jax.device_put(block.reshape(spec.device_block_shape), devices[i]))
    block = jax.make_array_from_single_device_arrays(spec.block_shape, block_sharding(mesh), shards)
    return DArray(block, spec)


def from_process_local(local_rows, mesh: Mesh, placements: Sequence[Placement], shape=None) -> DArray:
    """Build a DArray from this process's part of the global value: ``jax.make_array_from_process_local_data``
    for placements.

    Each process passes only what its own devices hold (a per-host data loader's batch). Precisely: for every
    tensor dim, the shards held by this process's addressable devices must cover one contiguous range of global
    indices ``lo:hi`` (the whole dim where no mesh axis shards it), and ``local_rows`` is
    ``global_value[lo0:hi0, lo1:hi1, ...]``. On a ``(2, 4)`` mesh whose two processes each hold one ``dp`` row
    of devices, ``[Shard(0), Replicate()]`` of 8 rows has process 0 pass rows ``0:4`` and process 1 rows
    ``4:8``. In a single process the process-local data is the whole array.

    ``shape`` is the global shape. When omitted it is inferred assuming every process passes the same number
    of rows along each sharded dim (dims split evenly between processes); pass ``shape`` for anything else
    (uneven splits give processes different row counts). Each device receives only its own block, with no
    collective. ``Partial`` placements are refused: rows cannot express a pending reduction (``from_local``
    takes each device's part of one).

    >>> import jax, numpy as np; from jshard import Shard, Replicate
    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    >>> x = from_process_local(np.arange(8.0).reshape(4, 2), mesh, [Shard(0), Replicate()])
    >>> x.shape, [a.tolist() for a in x.to_local()][::4]
    ((4, 2), [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [6.0, 7.0]]])
    """
    where = "from_process_local"
    check_mesh(mesh, where)
    if isinstance(local_rows, DArray):
        raise TypeError(f"{where}: local_rows is a DArray ({local_rows!r}); pass this process's rows as a host "
                        "array (or use local_rows.redistribute(placements))")
    _check_array_live(local_rows, f"{where}: local_rows")
    if isinstance(local_rows, jax.Array) and jax.dtypes.issubdtype(local_rows.dtype, jax.dtypes.extended):
        raise TypeError(f"{where}: local_rows is a {local_rows.dtype} array, which cannot be cut on the host; "
                        "use distribute or from_local")
    try:
        rows = np.asarray(local_rows if isinstance(local_rows, (jax.Array, np.ndarray)) else jnp.asarray(local_rows))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: local_rows must be an array (numpy, jax, or a nested list of numbers), got "
                        f"{type(local_rows).__name__} {local_rows!r:.60}: {e}") from None
    probe = Spec.create(mesh, placements, rows.shape if shape is None else shape, rows.dtype, where=where)
    shown = f"{format_mesh(mesh)} with {format_placements(probe.placements)}"
    if any(p.is_partial for p in probe.placements):
        raise ValueError(f"{where}: {shown} has a Partial placement, which process-local rows cannot express (a "
                         "pending reduction has one part per device); use from_local with each device's part, or "
                         "distribute the reduced value")
    if probe.rank != rows.ndim:
        raise ValueError(f"{where}: local_rows has shape {rows.shape} but shape={probe.shape} has rank {probe.rank}; "
                         "pass this process's rows with the global array's rank")
    mine = _my_coords(mesh, where)
    inferred = shape is None
    if inferred:
        shape = shape_from_rows(probe, mine, rows.shape)
    spec = Spec.create(mesh, probe.placements, shape, rows.dtype, where=where)
    start = rows_start(spec, mine, rows.shape, inferred=inferred)
    return DArray(_host_blocks(spec, _reader(rows, start)), spec)


def process_rows(mesh: Mesh, placements: Sequence[Placement], shape: Sequence[int]) -> tuple[slice, ...]:
    """The part of a global array of ``shape`` that this process passes to ``from_process_local`` under
    ``placements``: what its data loader reads (``global_batch[process_rows(...)]``), one slice per dim.

    >>> import jax; from jshard import Shard, Replicate
    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    >>> process_rows(mesh, [Shard(0), Replicate()], (8, 3))  # one process: it holds every device, so every row
    (slice(0, 8, None), slice(0, 3, None))
    """
    where = "process_rows"
    spec = Spec.create(check_mesh(mesh, where), placements, tuple(shape), np.float32, where=where)
    shown = f"{format_mesh(mesh)} with {format_placements(spec.placements)}"
    if any(p.is_partial for p in spec.placements):
        raise ValueError(f"{where}: {shown} has a Partial placement, which has no rows: a pending reduction has one "
                         "part per device (from_local takes them)")
    start, length = _process_span(spec, _my_coords(mesh, where), shown, where)
    return tuple(slice(s, s + n) for s, n in zip(start, length, strict=True))


def from_jax(x: jax.Array, mesh: Mesh | None = None) -> DArray:
    """Wrap a ``jax.Array`` with a ``NamedSharding`` as a DArray, without a collective or a host transfer: each
    device's shard becomes its block (in multi-process mode, each process wraps the shards it holds).

    An ``unreduced`` axis becomes ``Partial(sum)``; an axis tuple in non-mesh order becomes StridedShard.
    ``mesh`` (optional) is the mesh the DArray is described on, when it is the same devices with the same axis
    names as ``x``'s (a mesh made separately, or with other axis types).

    >>> import jax, numpy as np, jshard
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    >>> x = jax.device_put(np.arange(16.0).reshape(4, 4), NamedSharding(mesh, P("tp", "dp")))
    >>> jshard.from_jax(x).placements
    (S(1), S(0))
    """
    if not isinstance(x, jax.Array):
        raise TypeError(f"from_jax: expected a jax.Array with a NamedSharding, got {type(x).__name__}")
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"from_jax: got a traced array ({x.aval}); call from_jax outside jax.jit (inside a traced "
                        "function, use jshard.jit on DArrays instead)")
    _check_array_live(x, "from_jax: x")
    spec = Spec.from_named_sharding(x.sharding, x.shape, x.dtype, where="from_jax")
    if mesh is not None and mesh != spec.mesh:
        if not same_devices(mesh, spec.mesh):
            raise ValueError(f"from_jax: x lives on {format_mesh(spec.mesh)}, which is not mesh= "
                             f"{format_mesh(mesh)} (other devices or axis names); move it with "
                             "jax.device_put(x, NamedSharding(mesh, spec)) first")
        spec = Spec.create(mesh, spec.placements, spec.shape, spec.dtype, where="from_jax")
    shards = [s.data.reshape(spec.device_block_shape) for s in x.addressable_shards]
    block = jax.make_array_from_single_device_arrays(spec.block_shape, block_sharding(spec.mesh), shards)
    return DArray(block, spec)


def adopt(x: jax.Array, mesh: Mesh, what: str) -> DArray | None:
    """``x`` (a ``jax.Array`` with a ``NamedSharding``) as a DArray on ``mesh`` where it already lives on its
    devices (``from_jax``); None where the caller may copy it through the host (every shard is addressable);
    else (it spans other processes, on other devices) a ValueError naming ``what``."""
    if same_devices(x.sharding.mesh, mesh):
        return from_jax(x, mesh)
    if x.is_fully_addressable:
        return None
    raise ValueError(f"jshard.jit: {what} is a jax.Array {x.aval.str_short()} on {format_mesh(x.sharding.mesh)}, "
                     f"spanning other processes, but the call runs on {format_mesh(mesh)}; put it on that mesh "
                     "(jax.device_put(x, NamedSharding(mesh, spec))) or use jshard.from_jax")


@functools.lru_cache(maxsize=64)
def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis Auto: what a DArray is on when plain JAX reads it (``DArray.as_jax``)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def same_devices(a: Mesh, b: Mesh) -> bool:
    """Whether two meshes lay out the same devices under the same axis names (axis types aside)."""
    ids = lambda m: [d.id for d in m.devices.flat]  # noqa: E731
    return a.axis_names == b.axis_names and a.devices.shape == b.devices.shape and ids(a) == ids(b)


def _host_blocks(spec: Spec, read: Callable[[tuple[np.ndarray, ...]], np.ndarray]) -> jax.Array:
    """Block storage of ``spec`` made on the host: ``read(idx)`` gives the global value at the indices ``idx``
    (one index array per dim, ``Spec.global_indices``). Each addressable device receives only its own block.

    Blocks are made one at a time and moved to their devices at once, so the host holds about one block beyond
    what the devices hold; replicas share one host copy.
    """
    arrays = {}
    for idx, devices in local_blocks(spec).values():
        arrays.update(_put_block(spec, idx, devices, None if idx is None else read(idx)))
    return on_devices(spec, arrays)


def local_blocks(spec: Spec) -> dict[tuple, tuple[tuple[np.ndarray, ...] | None, list]]:
    """This process's devices grouped by the block they hold (replicas share a key): key -> (the block's global
    indices per dim, or None for a Partial(sum) block off coordinate 0, which holds zeros; the devices)."""
    sums = [a for a, p in enumerate(spec.placements) if p.is_partial and p.op == "sum"]
    cuts = [a for a, p in enumerate(spec.placements) if p.is_shard]
    groups: dict[tuple, tuple] = {}
    for i, device in enumerate(spec.mesh.devices.flat):
        if device.process_index != jax.process_index():
            continue
        coords = tuple(int(c) for c in np.unravel_index(i, spec.mesh_shape))
        zero = any(coords[a] for a in sums)  # Partial(sum): the value on coordinate 0, the identity elsewhere
        key = ("zero",) if zero else tuple(coords[a] for a in cuts)
        groups.setdefault(key, (None if zero else spec.global_indices(coords), []))[1].append(device)
    return groups


def _put_block(spec: Spec, idx: tuple[np.ndarray, ...] | None, devices: list, value: np.ndarray | None) -> dict:
    """``value`` (the block at global indices ``idx``; zeros where ``idx`` is None) padded with zeros to the block
    shape, on each of ``devices``: device -> array. The padded copy is fresh: on CPU, JAX may alias a host
    array, and the DArray must not follow later writes to ``value``."""
    out = np.zeros(spec.device_block_shape, spec.dtype)
    if idx is not None:
        out.reshape(spec.local_block_shape)[tuple(slice(0, len(i)) for i in idx)] = value
    return to_devices(out, devices)


def to_devices(block: np.ndarray, devices: list) -> dict:
    """One host block on each of ``devices`` (replicas): device -> array. ``block`` is given away: on CPU the
    arrays may alias it."""
    with jax.ensure_compile_time_eval():  # made while a JAX trace runs (a Python scalar operand): still concrete
        return dict(zip(devices, jax.device_put([block] * len(devices), devices), strict=True))


def on_devices(spec: Spec, arrays: dict) -> jax.Array:
    """The block-storage array of ``spec`` from every addressable device's block (``_put_block``'s arrays)."""
    sharding = block_sharding(spec.mesh)
    return jax.make_array_from_single_device_arrays(
        spec.block_shape, sharding, [arrays[d] for d in spec.mesh.devices.flat if d in arrays])


def _reader(value: np.ndarray, start: Sequence[int] | None = None) -> Callable[[tuple[np.ndarray, ...]], np.ndarray]:
    """``_host_blocks``' reader of ``value``, the part of the global value that starts at global index ``start``
    (default: the whole value)."""
    start = (0,) * value.ndim if start is None else tuple(start)
    return lambda idx: value[_host_index(idx, start)]


def _shards_reader(x: jax.Array) -> Callable[[tuple[np.ndarray, ...]], np.ndarray]:
    """``_host_blocks``' reader of a fully addressable ``x``, from its shards: each block is put together from
    the parts of the shards it overlaps, so the host holds a block and a shard at a time, never a sharded ``x``
    whole; and no copy stays cached on ``x`` (``np.asarray(x)`` keeps one for as long as it lives). On CPU a
    shard is read in place."""
    if x.is_fully_replicated:
        return _reader(np.asarray(x.addressable_data(0)))
    spans = {tuple((sl.start or 0, n if sl.stop is None else sl.stop)
                   for sl, n in zip(s.index, x.shape, strict=True)): s
             for s in x.addressable_shards}  # one replica of each part

    def read(idx):
        block = np.empty([len(i) for i in idx], x.dtype)
        for span, shard in spans.items():
            inside = [np.nonzero((i >= a) & (i < b))[0] for i, (a, b) in zip(idx, span, strict=True)]
            if all(len(p) for p in inside):
                at = [i[p] - a for i, p, (a, _) in zip(idx, inside, span, strict=True)]
                part = np.asarray(shard.data)[np.ix_(*at)]
                block[np.ix_(*inside)] = part
        return block

    return read


def _host_index(idx: Sequence[np.ndarray], start: Sequence[int]):
    """numpy index of global indices ``idx`` (one list per dim) in a part starting at ``start``: slices (a view)
    when every list is a contiguous run, as for Shard, else an outer-product gather (StridedShard)."""
    if all((np.diff(i) == 1).all() for i in idx):
        return tuple(slice(int(i[0]) - s, int(i[-1]) + 1 - s) if len(i) else slice(0, 0)
                     for i, s in zip(idx, start, strict=True))
    return np.ix_(*[i - s for i, s in zip(idx, start, strict=True)])


def shape_from_rows(spec: Spec, coords: Sequence[tuple[int, ...]], rows_shape: Sequence[int]) -> tuple[int, ...]:
    """The global shape when the devices at mesh coordinates ``coords`` (one process's) hold rows of ``rows_shape``
    and every process passes as many rows: a sharded dim grows by the number of its shards over the number those
    devices hold (``from_process_local`` without ``shape=``). ``spec.shape`` is not used.

    >>> import jax, numpy as np; from jshard import Shard, Replicate
    >>> spec = Spec.create(jax.make_mesh((2, 4), ("dp", "tp")), [Shard(0), Replicate()], (0, 0), np.float32)
    >>> shape_from_rows(spec, [(1, t) for t in range(4)], (5, 6))  # the second dp row of devices: half the rows
    (10, 6)
    """
    mine = [tuple(c) for c in coords]
    shape = []
    for d, n in enumerate(rows_shape):
        axes = [a for a, _ in spec.chain(d)]
        total = math.prod(spec.mesh_shape[a] for a in axes)
        held = len({tuple(c[a] for a in axes) for c in mine})
        if n * total % held:
            raise ValueError(f"from_process_local: this process's devices hold {held} of the {total} shards of dim {d} "
                             f"under {_shown(spec)}, so its {n} rows do not scale to a whole global size; pass shape=")
        shape.append(n * total // held)
    return tuple(shape)


def rows_start(spec: Spec, coords: Sequence[tuple[int, ...]], rows_shape: Sequence[int], *,
               inferred: bool = False) -> tuple[int, ...]:
    """The global index per dim where the rows held by the devices at mesh coordinates ``coords`` (one process's)
    start, after checking that ``rows_shape`` is the shape of the one range of indices they hold together: the
    rows ``from_process_local`` takes. ``inferred`` says the global shape came from ``shape_from_rows`` (the error
    then says so).

    >>> import jax, numpy as np; from jshard import Shard
    >>> spec = Spec.create(jax.make_mesh((2, 4), ("dp", "tp")), [Shard(0), Shard(0)], (10, 6), np.float32)
    >>> rows_start(spec, [(0, 2), (0, 3), (1, 0)], (3, 6))  # rows 4:5, 5:5 and 5:7
    (4, 0)
    """
    mine = [tuple(c) for c in coords]
    start, want = _process_span(spec, mine, _shown(spec), "from_process_local")
    if tuple(want) != tuple(rows_shape):
        how = " (inferred assuming every process passes as many rows; pass shape= otherwise)" if inferred else ""
        rows = ", ".join(f"{s}:{s + n}" for s, n in zip(start, want, strict=True))
        raise ValueError(
            f"from_process_local: local_rows has shape {tuple(rows_shape)}, but under {_shown(spec)} with global "
            f"shape {spec.shape}{how} process {jax.process_index()} holds [{rows}], of shape {tuple(want)}; pass "
            "exactly those rows (jshard.process_rows(mesh, placements, shape) gives them)"
        )
    return start


def index_runs(idx: np.ndarray) -> list[tuple[int, int]]:
    """``(start, stop)`` of each run of consecutive integers in ``idx``, in order: the global indices a device
    holds along one dim (``Spec.global_indices``) as ranges. One run for a Shard, several for a StridedShard.

    >>> index_runs(np.array([0, 1, 2, 8, 9, 10, 4]))
    [(0, 3), (8, 11), (4, 5)]
    """
    breaks = [0, *(np.flatnonzero(np.diff(idx) != 1) + 1).tolist(), len(idx)]
    return [(int(idx[a]), int(idx[b - 1]) + 1) for a, b in itertools.pairwise(breaks) if b > a]


def _process_span(spec: Spec, mine: list[tuple[int, ...]], shown: str, where: str) -> tuple[tuple, tuple]:
    """(start, length) per dim of the one contiguous range of global indices this process's devices (``mine``)
    hold; a ValueError naming ``where`` when some dim's range has holes."""
    start, length = [], []
    for d in range(spec.rank):
        held = np.unique(np.concatenate([spec.global_indices(c)[d] for c in mine]))
        if len(held) and held[-1] - held[0] + 1 != len(held):
            ranges = ", ".join(f"{a}:{b}" for a, b in index_runs(held))
            raise ValueError(
                f"{where}: under {shown}, the devices of process {jax.process_index()} hold indices "
                f"{ranges} of dim {d} of {spec.shape}, not one contiguous range, so no rows of one local array "
                "match them; use from_local (each device's part) or distribute, or a placement whose shards of a "
                "process are adjacent (Shard instead of StridedShard)"
            )
        start.append(int(held[0]) if len(held) else 0)
        length.append(len(held))
    return tuple(start), tuple(length)


def _my_coords(mesh: Mesh, where: str) -> list[tuple[int, ...]]:
    """Mesh coordinates of this process's devices; a ValueError naming ``where`` when it has none."""
    mine = [tuple(int(c) for c in np.unravel_index(i, mesh.devices.shape))
            for i, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]
    if not mine:
        raise ValueError(f"{where}: this process (index {jax.process_index()}) holds no device of "
                         f"{format_mesh(mesh)}; call it on the processes that do")
    return mine


def _shown(spec: Spec) -> str:
    return f"{format_mesh(spec.mesh)} with {format_placements(spec.placements)}"


def _check_array_live(a, where: str) -> None:
    """A deleted ``jax.Array`` (freed or donated) as a DeletedArrayError, before JAX fails (or XLA crashes)
    on it."""
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted():
        raise DeletedArrayError(f"{where} ({a.dtype}{list(a.shape)}) has been deleted (freed or donated)")


def _local_array(a, i: int, mesh: Mesh) -> jax.Array | np.ndarray:
    """Entry ``i`` of ``from_local``'s locals as an array of a DArray dtype, or a clear error."""
    coords = tuple(int(c) for c in np.unravel_index(i, mesh.devices.shape))
    where = f"from_local: local array {i} (device {coords} of {format_mesh(mesh)})"
    if a is None:
        raise ValueError(f"{where} is None, but this process holds that device: pass its local array (None stands "
                         "only for other processes' devices, and then shape= must give the global shape)")
    if isinstance(a, DArray):
        raise TypeError(f"{where} is a DArray ({a!r}); pass plain local arrays (x.to_local() gives a DArray's)")
    _check_array_live(a, where)
    if not isinstance(a, jax.Array):
        try:
            a = np.asarray(a)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where} is not an array ({type(a).__name__} {a!r:.40}): {e}") from None
    check_dtype(a.dtype, where)
    return a


def _infer_shape(local_shapes: dict, mesh: Mesh, placements, rank: int) -> tuple[int, ...]:
    """Global shape from local shapes: the shards of a dim held by the devices at coordinate 0 of
    every axis that does not shard it, counted once each (the caller then checks every device)."""
    probe = Spec.create(mesh, placements, (0,) * rank, np.float32, where="from_local")
    if len(local_shapes) != probe.mesh.devices.size:
        raise ValueError("from_local: shape=None needs every device's local array (multi-host: pass shape=)")
    shape = []
    for d in range(rank):
        sharding_axes = {a for a, _ in probe.chain(d)}
        shape.append(sum(s[d] for coords, s in local_shapes.items()
                         if all(c == 0 for a, c in enumerate(coords) if a not in sharding_axes)))
    return tuple(shape)


# ---------------------------------------------------------------------------------------------------
# donations: where a deleted block went (the error that names it runs only when a deleted block shows up)

class DeletedArrayError(ValueError):
    """A DArray whose storage is gone: donated to a ``jshard.jit`` call (``donate_argnums``) or deleted."""


class DonationSlot:
    """A donating program's record of its latest call: ``blocks`` (set on every call, one attribute write; only
    one call's worth is kept alive) and ``describe(i)``, where block ``i`` went. The common mistake, passing the
    previous step's parameters again, is named exactly; an older reference gets the generic message."""

    __slots__ = ("blocks", "describe")

    def __init__(self, describe: Callable[[int], str]):
        self.blocks: Sequence[jax.Array] = ()
        self.describe = describe


_DONORS: collections.deque = collections.deque(maxlen=64)  # the slots of the latest donating programs


def donation_slot(describe: Callable[[int], str]) -> DonationSlot:
    """A new donating program's slot, searched by ``donation_of``."""
    slot = DonationSlot(describe)
    _DONORS.append(slot)
    return slot


def donation_of(block: jax.Array) -> str | None:
    """Where ``block`` was donated, if a donating program's latest call took it."""
    for slot in reversed(_DONORS):
        for i, b in enumerate(slot.blocks):
            if b is block:
                return slot.describe(i)
    return None


# JAX code meets a DArray as the jax.Array it stands for: jnp functions, jax.jit arguments, transformations
register_array_type(DArray, DArray.as_jax)
