"""Checkpoints of trees that hold DArrays, through Orbax: each device's block is written by the process that owns
it, and a checkpoint restores into any placements on any mesh.

A DArray is stored as its *global* array (true shape and dtype, Orbax's own zarr / OCDBT format), never gathered.
Where a ``NamedSharding`` expresses its layout (Replicate, and Shard or a StridedShard that is a shard order, on
evenly divided dims), it goes through Orbax's own array handler as the ``jax.Array`` it converts to without a
collective: the checkpoint is then a plain Orbax one, its sharding recorded, which JAX users restore with Orbax
alone. Other layouts (uneven shards, other strided ones) go through a handler of jshard's: every device whose
block is not a replica writes the rows it holds, in chunks that each lie in one block. Restoring reads, for every
block of the target layout this process holds, exactly the rows that block covers (Orbax's handler where a
``NamedSharding`` expresses the target, jshard's otherwise), so a checkpoint saved under DP2 x TP4 restores under
FSDP8, on a (4,) mesh or on one device, uneven and strided layouts included. The rest of the tree (``jax.Array``s,
numpy arrays, scalars, PRNG keys, optax and NNX containers) goes through Orbax's own handlers.

``Partial`` values are reduced on save (one all-reduce of the pending axes): the checkpoint holds the value, which
is what any other layout needs. A ``Partial`` target is restored as ``distribute`` makes one (``sum``: the value
on coordinate 0 of the partial axes, zeros elsewhere).

>>> import jax, numpy as np, tempfile, jshard
>>> from jshard import Shard, Replicate
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> w = jshard.distribute(np.arange(30.0).reshape(10, 3), mesh, [Shard(0), Shard(0)])   # uneven: 10 rows on 8
>>> path = tempfile.mkdtemp() + "/step_1"
>>> jshard.checkpoint.save(path, {"w": w, "step": 1})
>>> like = {"w": jshard.Spec.create(jax.make_mesh((4,), ("x",), devices=jax.devices()[:4]), [Shard(1)], (10, 3),
...                                 np.float32), "step": 0}
>>> back = jshard.checkpoint.restore(path, like=like)
>>> back["w"], back["step"], bool((np.asarray(back["w"].full()) == np.asarray(w.full())).all())
(DArray(f32[10,3] (S(1)) on mesh(x=4)), 1, True)

With Orbax's managers (keep-last-N, asynchronous saves), pass ``Save`` and ``Restore`` as the args:

>>> import orbax.checkpoint as ocp
>>> with ocp.CheckpointManager(tempfile.mkdtemp(), options=ocp.CheckpointManagerOptions(max_to_keep=2)) as m:
...     _ = m.save(5, args=jshard.checkpoint.Save({"w": w}))
...     m.wait_until_finished()
...     m.restore(5, args=jshard.checkpoint.Restore({"w": w}))["w"].placements
(S(0), S(0))

Orbax's ``StandardSave`` of a tree with DArrays sees only their block storage (a DArray's pytree leaf, laid out by
mesh coordinates): use these args, which save the global arrays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath
from jax.sharding import NamedSharding
from orbax.checkpoint import future as ocp_future
from orbax.checkpoint import type_handlers as th

from .caches import memo
from .darray import DArray, from_jax, index_runs, local_blocks, on_devices, to_devices
from .operators import stack, unstack
from .placements import Replicate, shift_dims
from .spec import LayoutError, Spec, dtype_short

__all__ = ["Handler", "Restore", "Save", "restore", "save"]


# ---------------------------------------------------------------------------------------------------
# the convenience API


def save(directory: str | os.PathLike, tree: Any) -> None:
    """Save ``tree`` (DArrays, ``jax.Array``s, numpy arrays, scalars, in any pytree) to the new directory
    ``directory``, every process writing its own devices' blocks. Call it on every process.

    The checkpoint appears whole or not at all: Orbax writes a temporary directory and renames it when every
    process has finished. An existing ``directory`` is an error (a failed save would otherwise have removed it):
    save each step to its own directory, or use ``ocp.CheckpointManager`` with ``Save``.

    >>> import jax, numpy as np, tempfile, jshard
    >>> x = jshard.distribute(np.ones((4, 4)), jax.make_mesh((2, 4), ("dp", "tp")), [jshard.Shard(0)] * 2)
    >>> jshard.checkpoint.save(tempfile.mkdtemp() + "/ckpt", {"x": x})
    """
    path = epath.Path(os.fspath(directory)).absolute()
    if path.exists():
        raise FileExistsError(f"jshard.checkpoint.save: {path} exists; save to a new directory (one per step), or "
                              "use ocp.CheckpointManager(...).save(step, args=jshard.checkpoint.Save(tree)), which "
                              "keeps the last N checkpoints")
    with ocp.Checkpointer(Handler()) as checkpointer:
        checkpointer.save(path, args=Save(tree))


def restore(directory: str | os.PathLike, like: Any) -> Any:
    """The tree saved in ``directory``, laid out like ``like``: a tree of the same structure whose leaves say what
    each value becomes. A ``DArray`` or a ``jshard.Spec`` gives the target placements and mesh (any, not only the
    saved ones); a ``jax.Array`` or ``jax.ShapeDtypeStruct`` with a sharding gives a ``jax.Array``; a numpy array,
    a Python scalar give those. Shapes and dtypes must match the checkpoint's.

    >>> import jax, numpy as np, tempfile, jshard
    >>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    >>> x = jshard.distribute(np.arange(8.0), mesh, [jshard.Shard(0), jshard.Replicate()])
    >>> path = tempfile.mkdtemp() + "/ckpt"; jshard.checkpoint.save(path, [x])
    >>> jshard.checkpoint.restore(path, like=[x.spec.with_placements([jshard.Replicate(), jshard.Shard(0)])])
    [DArray(f32[8] (R, S(0)) on mesh(dp=2, tp=4))]
    """
    path = epath.Path(os.fspath(directory)).absolute()
    _check_restorable(path)
    with ocp.Checkpointer(Handler()) as checkpointer:
        return checkpointer.restore(path, args=Restore(like))


# ---------------------------------------------------------------------------------------------------
# Orbax's args and handler


class Handler(ocp.AsyncCheckpointHandler):
    """Orbax ``CheckpointHandler`` for trees that hold DArrays; ``Save`` and ``Restore`` select it, so Orbax's
    ``Checkpointer``, ``AsyncCheckpointer`` and ``CheckpointManager`` (also inside ``ocp.args.Composite``) use it.

    It flattens the tree itself (to a nested dict keyed by the tree's paths) and hands it to Orbax's
    ``PyTreeCheckpointHandler`` with each DArray as a ``jax.Array`` where a ``NamedSharding`` expresses its layout,
    else behind a leaf that ``_DArrayHandler`` writes and reads.
    """

    def __init__(self):
        self._pytree = ocp.PyTreeCheckpointHandler()

    async def async_save(self, directory: epath.Path, args: Save) -> list[ocp_future.Future] | None:
        return await self._pytree.async_save(directory, args=ocp.args.PyTreeSave(_to_stored(args.item)))

    def save(self, directory: epath.Path, args: Save) -> None:
        self._pytree.save(directory, args=ocp.args.PyTreeSave(_to_stored(args.item)))

    def restore(self, directory: epath.Path, args: Restore | None = None) -> Any:
        if args is None or args.like is None:
            raise ValueError(f"jshard.checkpoint: restoring {directory} needs like=, a tree of the saved structure "
                             "whose leaves give each value's layout (DArrays or Specs, arrays, ShapeDtypeStructs)")
        saved = self._pytree.metadata(directory).tree
        paths, leaves, treedef = _flatten(args.like, "like")
        targets, assemble = _regrouped(dict(_walk_saved(saved)), paths, leaves)
        _check_template(directory, saved, list(targets), list(targets.values()))
        item, restore_args = {}, {}
        for path, leaf in targets.items():
            target = _orbax_target(leaf, path)
            _insert(item, path, _template_value(target))
            _insert(restore_args, path, _restore_args(target))
        out = self._pytree.restore(directory, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
        got = {p: _restored(_lookup(out, p), leaf) for p, leaf in targets.items()}
        return jax.tree.unflatten(treedef, [make(got) for make in assemble])

    def metadata(self, directory: epath.Path) -> Any:
        return self._pytree.metadata(directory)

    def finalize(self, directory: epath.Path) -> None:
        self._pytree.finalize(directory)

    def close(self) -> None:
        self._pytree.close()


@ocp.args.register_with_handler(Handler, for_save=True)
@dataclasses.dataclass
class Save(ocp.args.CheckpointArgs):
    """Orbax save args for a tree that holds DArrays: ``manager.save(step, args=jshard.checkpoint.Save(tree))``."""

    item: Any


@ocp.args.register_with_handler(Handler, for_restore=True)
@dataclasses.dataclass
class Restore(ocp.args.CheckpointArgs):
    """Orbax restore args: ``manager.restore(step, args=jshard.checkpoint.Restore(like))``; ``like`` as for
    ``jshard.checkpoint.restore``."""

    like: Any = None


# ---------------------------------------------------------------------------------------------------
# errors


def _check_restorable(path: epath.Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"jshard.checkpoint.restore: no checkpoint at {path} (the directory does not exist)")
    if not ocp.utils.is_checkpoint_finalized(path):
        raise ValueError(f"jshard.checkpoint.restore: {path} is a checkpoint whose save did not finish (a temporary "
                         "directory Orbax never renamed); restore the last complete one")
    if not (path / "_METADATA").exists():
        raise ValueError(f"jshard.checkpoint.restore: {path} holds no Orbax tree checkpoint (no _METADATA): it was not "
                         "written by jshard.checkpoint.save, or its save did not finish")


def _check_not_keys(spec: Spec, what: str) -> None:
    """PRNG keys go only through Orbax's array handler, which needs a ``NamedSharding``; jshard's handler writes
    and reads host bytes, which key arrays have none of."""
    if jax.dtypes.issubdtype(spec.dtype, jax.dtypes.prng_key):
        raise ValueError(f"{what} is a key array laid out as {spec}, which no NamedSharding expresses, and keys "
                         "are checkpointed only as jax.Arrays; use a layout of even Shards and Replicate for it "
                         "(redistribute, or a Spec with such placements)")


def _regrouped(saved: dict, paths: list[tuple[str, ...]], leaves: list[Any]) -> tuple[dict, list]:
    """What to restore for like's leaves, and per leaf how to make it from what was restored: each as it is, but
    where like and the checkpoint hold a pipeline's blocks the other way round. A pipelined model holds its
    blocks' parameters (and their optimizer state) stacked, ``blocks.layers.q.kernel`` of shape ``[L, ...]``
    (``jshard.parallel.stages``); the same model not pipelined holds ``blocks.0.q.kernel`` ... ``blocks.{L-1}``.
    Restoring one into the other reads the blocks one by one (each replicated along the stack's pipeline axis,
    then stacked: each device keeps its own) or the stack whole on its dim 0 (then sliced: as a model that is
    not pipelined holds every block)."""
    targets: dict = {}
    assemble: list = []
    slices: dict = {}  # stacked path -> its blocks, sliced once for every block of like that reads them
    for path, leaf in zip(paths, leaves, strict=True):
        spec = leaf.spec if isinstance(leaf, DArray) else leaf if isinstance(leaf, Spec) else None
        if path in saved or spec is None:
            targets[path] = leaf
            assemble.append(lambda got, p=path: got[p])
            continue
        blocks = _as_blocks(saved, path, spec)
        if blocks is not None:  # like stacked, the checkpoint block by block
            per = Spec.create(spec.mesh, [Replicate() if q.is_shard and q.dim == 0 else q
                                          for q in shift_dims(spec.placements, -1)], spec.shape[1:], spec.dtype)
            targets.update((b, per) for b in blocks)
            assemble.append(lambda got, bs=blocks, sp=spec: stack([got[b] for b in bs], sp.placements))
            continue
        stacked = _as_stack(saved, path)
        if stacked is not None:  # like block by block, the checkpoint stacked
            where, i = stacked
            depth = tuple(saved[where].shape)[0]
            whole = Spec.create(spec.mesh, shift_dims(spec.placements, 1), (depth, *spec.shape), spec.dtype)
            targets.setdefault(where, whole)
            assemble.append(lambda got, w=where, i=i, sp=spec: _sliced(slices, got, w, sp)[i])
            continue
        targets[path] = leaf
        assemble.append(lambda got, p=path: got[p])
    return targets, assemble


def _as_blocks(saved: dict, path: tuple[str, ...], spec: Spec) -> list[tuple[str, ...]] | None:
    """The checkpoint's paths of the blocks a stacked leaf of like at ``path`` (``...layers...``) holds, or None."""
    if "layers" not in path or not spec.shape:
        return None
    k = path.index("layers")
    blocks = [path[:k] + (str(i),) + path[k + 1:] for i in range(spec.shape[0])]
    more = path[:k] + (str(spec.shape[0]),) + path[k + 1:]
    return blocks if all(b in saved for b in blocks) and more not in saved else None


def _as_stack(saved: dict, path: tuple[str, ...]) -> tuple[tuple[str, ...], int] | None:
    """The checkpoint's stacked path holding block ``i`` of like's leaf at ``path`` (``...i...``), and ``i``."""
    for k, name in enumerate(path):
        if name.isdigit():
            where = path[:k] + ("layers",) + path[k + 1:]
            shape = tuple(getattr(saved.get(where), "shape", ()) or ())
            if shape and int(name) < shape[0]:
                return where, int(name)
    return None


def _sliced(cache: dict, got: dict, where: tuple[str, ...], spec: Spec) -> list:
    if where not in cache:
        cache[where] = unstack(got[where], spec.placements)
    return cache[where]


def _check_template(directory, saved: Any, paths: list[tuple[str, ...]], leaves: list[Any]) -> None:
    """Every leaf of ``like`` must name a saved value of the same shape and dtype, and cover them all."""
    flat = dict(_walk_saved(saved))
    wanted = {p: leaf for p, leaf in zip(paths, leaves, strict=True)}
    missing = sorted(set(wanted) - set(flat))
    extra = sorted(set(flat) - set(wanted))
    problems = []
    if missing:
        problems.append(f"leaves of like the checkpoint lacks ({len(missing)}): {_names(missing)}")
    if extra:
        problems.append(f"values of the checkpoint like lacks ({len(extra)}): {_names(extra)}")
    for path in sorted(set(wanted) & set(flat)):
        want, got = _shape_dtype(wanted[path]), _shape_dtype(flat[path])
        if want is not None and got is not None and (want[0] != got[0] or want[1] != got[1]):
            problems.append(f"{'.'.join(path)}: the checkpoint holds {dtype_short(got[1])}{list(got[0])}, like "
                            f"asks for {dtype_short(want[1])}{list(want[0])}")
    if problems:
        raise ValueError(f"jshard.checkpoint.restore: like does not match the checkpoint at {directory}:\n  "
                         + "\n  ".join(problems[:20])
                         + "\nPass a template of the saved tree (say the state of a model built the same way, under "
                           "any placements)")


def _names(paths: list[tuple[str, ...]]) -> str:
    shown = ", ".join(".".join(p) or "<root>" for p in paths[:8])
    return shown + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    return tuple(shape), np.dtype(dtype)


def _walk_saved(tree: Any, prefix: tuple[str, ...] = ()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk_saved(v, prefix + (k,))
    else:
        yield prefix, tree


# ---------------------------------------------------------------------------------------------------
# the tree as Orbax sees it: a nested dict of leaves keyed by the tree's paths


def _flatten(tree: Any, what: str) -> tuple[list[tuple[str, ...]], list[Any], Any]:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda a: isinstance(a, DArray))
    paths = [tuple(_key_name(k) for k in path) or ("value",) for path, _ in with_paths]
    if len(set(paths)) != len(paths):
        seen = [p for p in paths if paths.count(p) > 1]
        raise ValueError(f"jshard.checkpoint: two leaves of {what} have the same name {'.'.join(seen[0])} (a dict with "
                         "both the key 0 and the key '0'?); rename one")
    return paths, [leaf for _, leaf in with_paths], treedef


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _insert(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _lookup(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _to_stored(tree: Any) -> dict:
    paths, leaves, _ = _flatten(tree, "the tree")
    out: dict = {}
    for path, leaf in zip(paths, leaves, strict=True):
        if isinstance(leaf, DArray):
            leaf._check_live(f"jshard.checkpoint.save of {'.'.join(path)}")
            leaf = _reduced(leaf)
            if _named_sharding(leaf.spec) is None:
                _check_not_keys(leaf.spec, f"jshard.checkpoint.save: {'.'.join(path)}")
                leaf = _Stored(leaf)
            else:
                leaf = leaf.to_jax()
        elif isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(f"jshard.checkpoint.save: {'.'.join(path)} ({leaf.dtype}{list(leaf.shape)}) has been "
                             "deleted (freed or donated); save the live value")
        _insert(out, path, leaf)
    return out


def _reduced(x: DArray) -> DArray:
    """``x`` with every pending reduction done (Partial -> Replicate): the checkpoint holds values."""
    if not any(p.is_partial for p in x.placements):
        return x
    return x.redistribute([Replicate() if p.is_partial else p for p in x.placements])


def _orbax_target(leaf: Any, path: tuple[str, ...]) -> Any:
    """A leaf of like (at ``path``) as Orbax's array handler restores it: a DArray or Spec whose layout a
    ``NamedSharding`` expresses as a ``jax.ShapeDtypeStruct`` with that sharding (``_restored`` wraps the array);
    others as they are."""
    if isinstance(leaf, (DArray, Spec)):
        spec = leaf.spec if isinstance(leaf, DArray) else leaf
        sharding = _named_sharding(spec)
        if sharding is not None:
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        _check_not_keys(spec, f"jshard.checkpoint.restore: like's {'.'.join(path)}")
    return leaf


def _template_value(leaf: Any) -> Any:
    if isinstance(leaf, (DArray, Spec)):
        return _Stored(None)
    if isinstance(leaf, jax.Array):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
    return leaf


def _restore_args(leaf: Any) -> th.RestoreArgs:
    if isinstance(leaf, (DArray, Spec)):
        return _DArrayRestoreArgs(restore_type=_Stored, spec=leaf.spec if isinstance(leaf, DArray) else leaf)
    sharding = getattr(leaf, "sharding", None)
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        if sharding is None:
            raise ValueError("jshard.checkpoint.restore: a jax.ShapeDtypeStruct in like needs sharding= (where the "
                             f"restored array lives), got {leaf}")
        return th.ArrayRestoreArgs(restore_type=jax.Array, sharding=sharding, global_shape=leaf.shape,
                                   dtype=leaf.dtype)
    if isinstance(leaf, np.ndarray):
        return th.RestoreArgs(restore_type=np.ndarray)
    return th.RestoreArgs(restore_type=type(leaf))


def _restored(value: Any, leaf: Any) -> Any:
    """``value`` as Orbax restored it, as ``leaf`` of like asks: a DArray that Orbax read as a ``jax.Array``
    (its layout a ``NamedSharding``) wrapped where it is."""
    if isinstance(leaf, (DArray, Spec)) and isinstance(value, jax.Array):
        return from_jax(value, leaf.mesh)
    return value


def _named_sharding(spec: Spec) -> NamedSharding | None:
    """The ``NamedSharding`` of ``spec``'s layout where one expresses it (no Partial; even shards; strided only as a
    shard order), else None. Such DArrays go through Orbax's own array handler, as the ``jax.Array``s they convert
    to without a collective: the checkpoint is then a plain Orbax one that JAX users restore as they restore
    theirs (the sharding recorded too)."""
    if any(p.is_partial for p in spec.placements):
        return None
    try:
        return spec.to_named_sharding(where="jshard.checkpoint")
    except LayoutError:
        return None


# ---------------------------------------------------------------------------------------------------
# the DArray type handler, for the layouts no NamedSharding expresses


class _Stored:
    """A DArray as one Orbax leaf (a DArray itself is a pytree node, which Orbax would walk into)."""

    __slots__ = ("x",)

    def __init__(self, x: DArray | None):
        self.x = x


@dataclasses.dataclass
class _DArrayRestoreArgs(th.RestoreArgs):
    spec: Spec | None = None


class _DArrayHandler(th.TypeHandler):
    """Writes a DArray's global array block by block and reads any layout's blocks back (Orbax's array format)."""

    def typestr(self) -> str:
        return "jshard.DArray"

    async def metadata(self, infos: Sequence[th.ParamInfo]) -> Sequence[Any]:
        return await th.NumpyHandler().metadata(infos)

    async def serialize(self, values: Sequence[_Stored], infos: Sequence[th.ParamInfo],
                        args: Sequence[th.SaveArgs] | None = None) -> list[ocp_future.Future]:
        args = args or [th.SaveArgs()] * len(values)
        # devices -> host now, while the arrays are alive (the caller may donate them once save returns)
        writes = [_host_parts(v.x) for v in values]

        async def write_all():
            await asyncio.gather(*[_write(spec, parts, info, arg)
                                   for (spec, parts), info, arg in zip(writes, infos, args, strict=True)])

        return [ocp_future.CommitFutureAwaitingContractedSignals(write_all(), name="jshard_darray_handler")]

    async def deserialize(self, infos: Sequence[th.ParamInfo],
                          args: Sequence[th.RestoreArgs] | None = None) -> list[DArray]:
        if args is None or any(getattr(a, "spec", None) is None for a in args):
            raise ValueError("jshard.checkpoint: a DArray restores only into a layout; pass like= "
                             "(jshard.checkpoint.restore) or args=jshard.checkpoint.Restore(like)")
        return list(await asyncio.gather(*[_read(info, arg.spec) for info, arg in zip(infos, args, strict=True)]))


th.register_type_handler(_Stored, _DArrayHandler(), override=True)


def _host_parts(x: DArray) -> tuple[Spec, list[tuple[tuple[np.ndarray, ...], np.ndarray]]]:
    """What this process writes, on the host: each of its devices' part (``_writers``) with the global indices it
    covers."""
    spec = x.spec
    writers = _writers(spec)
    coords_of = {d: np.unravel_index(i, spec.mesh_shape) for i, d in enumerate(spec.mesh.devices.flat)}
    mine = []
    for shard in x.block.addressable_shards:
        local, idx = writers[tuple(int(c) for c in coords_of[shard.device])]
        if idx is not None:
            mine.append((idx, local, shard.data))
    for _, _, data in mine:
        data.copy_to_host_async()  # all transfers in flight at once
    # np.asarray waits for the host copy (on CPU: a view of the device buffer, which the view then keeps alive: a
    # later donation of the array copies instead, so the bytes being written never change)
    return spec, [(idx, np.asarray(data).reshape(spec.local_block_shape)[local]) for idx, local, data in mine]


@memo(1024)
def _writers(spec: Spec) -> dict[tuple[int, ...], tuple[tuple[slice, ...] | None, tuple[np.ndarray, ...] | None]]:
    """Per device (mesh coordinates): the part of its block it writes, as (local box, global indices per dim), or
    (None, None). Replicas of a block split it: the ``r`` devices holding one block each write a torch.chunk
    piece of its first dim of at least ``r`` indices, so every block is written once and by all its holders."""
    copies = [a for a, p in enumerate(spec.placements) if not p.is_shard]
    sizes = [spec.mesh_shape[a] for a in copies]
    r = math.prod(sizes)
    out = {}
    for coords in np.ndindex(*spec.mesh_shape):
        idx = spec.global_indices(coords)
        j = int(np.ravel_multi_index([coords[a] for a in copies], sizes)) if copies else 0
        local = [slice(0, len(i)) for i in idx]
        d = next((d for d, i in enumerate(idx) if len(i) >= r), None)
        if d is not None:
            c = -(-len(idx[d]) // r)
            local[d] = slice(min(j * c, len(idx[d])), min((j + 1) * c, len(idx[d])))
        part = tuple(i[s] for i, s in zip(idx, local, strict=True))
        # too small to split (a scalar, say): the first replica writes it
        writes = all(len(i) for i in part) and (d is not None or j == 0)
        out[coords] = (tuple(local), part) if writes else (None, None)
    return out


def _write_grid(spec: Spec) -> tuple[int, ...]:
    """Per dim, the zarr chunk length: the gcd of every written part's run boundaries, so that each chunk lies in
    one part and has one writer (two processes writing parts of one chunk would lose one's rows)."""
    cuts: list[set[int]] = [set() for _ in spec.shape]
    for _, part in _writers(spec).values():
        for d, idx in enumerate(part or ()):
            for run in index_runs(idx):
                cuts[d].update(run)
    return tuple(math.gcd(*(c for c in cut if 0 < c < n)) or max(n, 1) for cut, n in zip(cuts, spec.shape, strict=True))


def _boxes(idx: tuple[np.ndarray, ...]):
    """(global box, local box) pairs of slices covering a block whose dims hold the indices ``idx``."""
    per_dim = []
    for i in idx:
        boxes, at = [], 0  # a run's place in the block: after the runs before it
        for start, stop in index_runs(i):
            boxes.append((slice(start, stop), slice(at, at + stop - start)))
            at += stop - start
        per_dim.append(boxes)
    for boxes in itertools.product(*per_dim):
        yield tuple(g for g, _ in boxes), tuple(local for _, local in boxes)


async def _write(spec: Spec, parts, info: th.ParamInfo, arg: th.SaveArgs) -> None:
    await info.await_path_creation()
    use_ocdbt = info.is_ocdbt_checkpoint
    tspec = th.get_json_tspec_write(info, use_ocdbt, global_shape=spec.shape, local_shape=_write_grid(spec),
                                    dtype=spec.dtype, process_index=jax.process_index() if use_ocdbt else None,
                                    arg=arg)
    # process 0 writes the zarr metadata; the others only their chunks
    if jax.process_index() == 0:
        t = await ts.open(ts.Spec(tspec), create=True, open=True, context=info.ts_context)
    elif parts:
        t = await ts.open(ts.Spec(tspec), open=True, assume_metadata=True, context=info.ts_context)
    else:
        return
    # the parts stay as they are until written: tensorstore may keep them instead of copying
    await asyncio.gather(*[t[box].write(data[local], can_reference_source_data_indefinitely=True)
                           for idx, data in parts for box, local in _boxes(idx)])


async def _read(info: th.ParamInfo, spec: Spec) -> DArray:
    """The DArray of ``spec`` from the stored array: each block this process holds read once (exactly its rows)
    and moved to its devices as soon as it arrives."""
    await info.await_path_creation()
    tspec = th.get_json_tspec_read(info, info.is_ocdbt_checkpoint)
    t = await ts.open(ts.Spec(tspec), open=True, context=info.ts_context)
    if tuple(t.shape) != spec.shape:
        raise ValueError(f"jshard.checkpoint.restore: {info.name} holds shape {tuple(t.shape)}, the template "
                         f"{spec.shape}")
    async def block(idx, devices) -> dict:
        # read straight into the padded block (tensorstore copies into numpy memory): no copy in between
        out = np.zeros(spec.device_block_shape, spec.dtype)
        view = ts.array(out.reshape(spec.local_block_shape))
        if idx is not None and all(len(i) for i in idx):
            await asyncio.gather(*[view[local].write(t[box]) for box, local in _boxes(idx)])
        return to_devices(out, devices)

    arrays = {}
    for placed in await asyncio.gather(*[block(*group) for group in local_blocks(spec).values()]):
        arrays.update(placed)
    return DArray(on_devices(spec, arrays), spec)
