"""``parallelize``: a Flax NNX model's parameters become DArrays, placed by a plan of parallel styles.

The plan maps module paths (``"blocks/*/mlp/fc1"``, glob patterns over the path of attribute names and list
indices joined by ``/``) to styles; each parameter takes, per mesh axis, the placement its module's styles
give there, else its Flax sharding annotation (``nnx.with_partitioning`` names, resolved through ``rules``),
else Replicate; a ``FullyShard`` matched on a module also places the parameters of the modules inside it (FSDP's
unit, torch's ``fully_shard(block)``). Matched modules whose styles constrain their calls, and FSDP units, are
given a ``__call__`` that applies the styles' ``inputs`` / ``outputs`` through ``jshard.constrain`` (a unit's
parameters gathered together). Everything a style does is asked of the style (``styles``): this module knows
none of them, and runs five steps, ``_match``, ``_place``, ``_units``, ``_build``, ``_install``. A
parallelized module called eagerly (outside ``jshard.jit``, on DArray parameters) runs as one cached
``jshard.jit`` program and returns DArrays, so ``model(x)`` works as before.

It is all or nothing: arguments, plan and styles are checked and every parameter's DArray is built before the
model changes, so a mistake raises with the model untouched.

>>> import jax, jshard
>>> from flax import nnx
>>> from jshard.parallel import ColwiseParallel, RowwiseParallel, parallelize
>>> class MLP(nnx.Module):
...     def __init__(self, rngs):
...         self.up, self.down = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 8, rngs=rngs)
...     def __call__(self, x):
...         return self.down(jax.nn.gelu(self.up(x)))
>>> mesh = jax.make_mesh((2, 4), ("dp", "tp"))
>>> mlp = parallelize(MLP(nnx.Rngs(0)), mesh, {"up": ColwiseParallel("tp"), "down": RowwiseParallel("tp")})
>>> mlp.up.kernel.get_value().placements, mlp.down.kernel.get_value().placements
((R, S(1)), (R, S(0)))
>>> mlp(jax.numpy.ones((4, 8))).shape
(4, 8)
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import inspect
import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..api import constrain, jit
from ..arguments import is_darray
from ..caches import memo
from ..darray import DArray, abstract, distribute
from ..engine import tracing_mesh
from ..engine.constrain import partition_pins
from ..jaxcompat import source_info_util
from ..placements import Placement, Replicate
from ..spec import Spec, format_mesh, shard_order
from .initialise import Constructor, initialise, stack_members, trace_constructor
from .plan import Plan
from .stages import blocks_differ
from .styles import ParallelStyle, UnplacedParameter, is_array, style_classes

__all__ = ["blocks_differ", "module_key", "parallelize", "placements_of"]

# equations are attributed to the user's line: jshard's own wrappers are not it
source_info_util.register_exclusion(os.path.abspath(__file__))


def parallelize(model: nnx.Module | Callable[[], nnx.Module], mesh: Mesh,
                plan: Mapping[str, ParallelStyle | Sequence[ParallelStyle]] | Plan | None = None, *,
                default: ParallelStyle | Sequence[ParallelStyle] = (),
                rules: Mapping[str, Any] | Sequence[tuple[str, Any]] = ()) -> nnx.Module:
    """Distribute the parameters of ``model`` over ``mesh``: a constructor (a function of no arguments that builds
    the NNX module), or a built module (changed in place and returned).

    **Large models: pass the constructor**, ``parallelize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), mesh, plan)``. The
    constructor is traced once (``jshard.parallel.initialise.trace_constructor``): the abstract module it gives
    (shapes only) finds every parameter's placements, and its parameters are computed from the same trace by
    ``jshard.jit`` programs with their placements pinned, identical modules sharing one program called with each
    module's keys (so the time to compile does not grow with depth; ``jshard.parallel.initialise``). Each device
    draws only its own blocks of each parameter (no device and no host ever holds a sharded parameter whole) and the
    values are exactly those of the eager single-device construction. A built module is fine for small models: its
    parameters are distributed from where they are.

    ``plan``: ``{module path pattern: style or [styles]}``, or a ``Plan`` found by ``autoplan`` (with its blocks
    recomputing their activations where it says ``remat``; every pattern
    matching a module applies to it, its styles on different mesh axes composing; two that give one module
    different styles on one mesh axis are refused as a conflict; ``""`` is the model itself; ``*`` also matches
    ``/``; a ``FullyShard`` also takes the parameters of the modules inside its own, gathering them together);
    ``default``: styles applied to every parameter first (say ``FullyShard("dp")``), a module's own style on the
    same mesh axis replacing the default's there (``{"blocks/0*": DataParallel("dp")}``: block 0 replicated);
    ``rules``:
    ``(logical name, mesh axis)`` pairs resolving ``nnx.with_partitioning`` names. The parameters stay DArrays
    through ``nnx.split`` / ``nnx.merge`` / ``nnx.state`` and ``jshard.jit``.

    All or nothing: the plan is checked and every parameter's placements are found and its DArray built before
    the model changes, so a call that raises leaves the model as it was.

    >>> import jax, jshard
    >>> from flax import nnx
    >>> from jshard.parallel import FullyShard, parallelize
    >>> mesh = jax.make_mesh((8,), ("dp",))
    >>> lin = parallelize(lambda: nnx.Linear(16, 32, rngs=nnx.Rngs(0)), mesh, default=FullyShard("dp"))
    >>> lin.kernel.get_value().placements
    (S(0),)
    >>> bool((lin.kernel.get_value().full() == nnx.Linear(16, 32, rngs=nnx.Rngs(0)).kernel.get_value()).all())
    True
    """
    if not isinstance(model, nnx.Module) and not callable(model):
        raise TypeError(f"parallelize: model must be a Flax nnx.Module or a function of no arguments building "
                        f"one (lambda: GPT(cfg, rngs=nnx.Rngs(0))), got {kind_of(model)}; a pytree of arrays is "
                        "placed with jshard.distribute(x, mesh, placements) instead")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize: mesh must be a jax.sharding.Mesh (say jax.make_mesh((2, 4), ('dp', 'tp'))), "
                        f"got {kind_of(mesh)}")
    build = None
    if not isinstance(model, nnx.Module):
        build = _traced(model)
        model = build.module
    remat = isinstance(plan, Plan) and plan.detail.get("remat") and "pp" not in plan.roles.values()
    if isinstance(plan, Plan):  # autoplan's: its styles and default together
        plan, default = plan.styles, (*plan.default, *_styles(default, "default="))
    plan = _plan(plan)
    default = _styles(default, "default=")
    rules = _rules(rules, mesh)
    matched = _match(model, mesh, plan, default)
    rebuilds = _restructures(matched, mesh)
    params = _place(model, matched, mesh, rules, rebuilds)
    units = _units(matched, params)
    stacks = _stacks(params, rebuilds)
    values = _build(model, build, mesh, params, stacks)
    _install(matched, params, values, units, rebuilds)
    if remat:  # the blocks recompute as the plan was priced (a pipeline's do by its style)
        from .roles import recompute_blocks

        recompute_blocks(model)
    return model


def parallelize_shapes(model: nnx.Module, mesh: Mesh, plan: Mapping[str, Any] | None = None, *,
                       default: ParallelStyle | Sequence[ParallelStyle] = ()) -> nnx.Module:
    """``parallelize`` for an abstract module (``nnx.eval_shape``'s, shapes in place of values), changed in place:
    each parameter becomes a DArray that holds its spec alone (``jshard.darray.abstract``). Enough to trace, plan
    and lower a training step (``jshard.jit(...).trace``; ``autoplan`` prices plans so), never to run one."""
    plan, default = _plan(plan), _styles(default, "default=")
    matched = _match(model, mesh, plan, default)
    rebuilds = _restructures(matched, mesh)
    params = _place(model, matched, mesh, {}, rebuilds)
    units = _units(matched, params)

    def shaped(shape, dtype, placements):
        return abstract(Spec.create(mesh, placements, shape, dtype))

    values = [shaped(p.value.shape, p.value.dtype, p.placements) for p in params]
    for members, placements in _stacks(params, rebuilds):
        first = params[members[0]].value
        values[members[0]] = shaped((len(members), *first.shape), first.dtype, placements)
        for m in members[1:]:
            values[m] = None
    _install(matched, params, values, units, rebuilds)
    return model


def placements_of(tree: Any) -> Any:
    """The placements of every DArray in ``tree`` (other leaves: None), e.g. of ``nnx.state(model)``.

    A tree with leaves but no DArray among them is refused: asking where an unparallelized model's parameters
    live has no answer worth a tree of Nones."""
    if jax.tree.leaves(tree) and not holds_darray(tree):
        raise ValueError(f"placements_of: {kind_of(tree)} holds no DArray; pass DArrays or a parallelized model's "
                         "state, nnx.state(parallelize(model, mesh, plan))")
    return jax.tree.map(lambda a: a.placements if isinstance(a, DArray) else None, tree, is_leaf=is_darray)


def holds_darray(tree: Any) -> bool:
    """Whether any leaf of ``tree`` is a DArray (parallelized parameters, optimizer state)."""
    return any(map(is_darray, jax.tree.leaves(tree, is_leaf=is_darray)))


def kind_of(x: Any) -> str:
    """How an error message names a wrong argument: its type, and its value when that is short."""
    return f"{type(x).__name__} {x!r}" if isinstance(x, (str, int, float)) else type(x).__name__


def _plan(plan: Any) -> dict[str, tuple[ParallelStyle, ...]]:
    if plan is None:
        return {}
    if not isinstance(plan, Mapping):
        raise TypeError(f"parallelize: plan must be a mapping {{module path pattern: style or [styles]}}, such as "
                        f"{{'blocks/*/q': ColwiseParallel('tp')}}, got {kind_of(plan)}")
    for pattern in plan:
        if not isinstance(pattern, str):
            raise TypeError(f"parallelize: plan key {pattern!r} ({type(pattern).__name__}) is not a module path "
                            "pattern; keys are strings of attribute names and list indices joined by '/', with "
                            "glob wildcards ('blocks/*/q'; '' is the model itself)")
    return {pattern: _styles(styles, f"plan[{pattern!r}]") for pattern, styles in plan.items()}


def _styles(s: Any, where: str) -> tuple[ParallelStyle, ...]:
    styles = tuple(s) if isinstance(s, (list, tuple)) else (s,)
    for style in styles:
        if isinstance(style, ParallelStyle):
            continue
        if isinstance(style, type) and issubclass(style, ParallelStyle):
            fix = f"make one: {style.__name__}('tp')"
        elif isinstance(style, Placement):
            fix = ("styles (ColwiseParallel('tp'), FullyShard('dp'), ...) say how a module's parameters and "
                   "activations are placed; to place one parameter yourself annotate it with nnx.with_partitioning")
        else:
            fix = f"use one of {', '.join(c.__name__ for c in style_classes())}, e.g. ColwiseParallel('tp')"
        raise TypeError(f"parallelize: {where} holds {style!r} ({type(style).__name__}), which is not a parallel "
                        f"style; {fix}")
    return styles


def _rules(rules: Any, mesh: Mesh) -> dict[str, Any]:
    """``rules`` as ``{logical name: mesh axis, tuple of mesh axes or None}``, each target checked against the
    mesh."""
    how = "rules= takes (logical name, mesh axis) pairs, e.g. [('embed', 'dp'), ('mlp', 'tp')]"
    pairs = list(rules.items()) if isinstance(rules, Mapping) else rules
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise TypeError(f"parallelize: {how}; got {kind_of(rules)}")
    table: dict[str, Any] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"parallelize: {how}; got the entry {pair!r}")
        name, target = pair
        axes = target if isinstance(target, tuple) else (target,)
        if target is not None and not all(isinstance(a, str) and a in mesh.axis_names for a in axes):
            raise ValueError(f"parallelize: rules= maps {name!r} to {target!r}; a logical name maps to a mesh axis of "
                             f"{format_mesh(mesh)}, a tuple of them, or None")
        if name in table:
            raise ValueError(f"parallelize: rules= maps {name!r} twice ({table[name]!r} and {target!r}); give each "
                             "logical name one target")
        table[name] = target
    return table


def _traced(build: Callable[[], nnx.Module]) -> Constructor:
    """``build`` traced once: the module it makes, with shapes and dtypes in place of values (nothing is computed),
    and what ``initialise`` computes the values from."""
    try:  # a class's own signature (NNX's metaclass takes *args) is its __init__'s, less self
        if isinstance(build, type):
            inspect.signature(build.__init__).bind(None)
        else:
            inspect.signature(build).bind()
    except TypeError as e:  # a TypeError raised inside the constructor is the user's own, and passes as it is
        raise TypeError(f"parallelize: model is called with no arguments to build the module, and {kind_of(build)} "
                        f"needs some ({e}); pass lambda: {getattr(build, '__name__', 'Model')}(cfg, "
                        "rngs=nnx.Rngs(0))") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    try:
        return trace_constructor(build)
    except flax.errors.TraceContextError as e:
        raise ValueError("parallelize: the constructor uses NNX state made outside it (an nnx.Rngs or a module "
                         "created before the lambda), which it may not change while it is traced; make everything "
                         "inside it, lambda: Model(..., rngs=nnx.Rngs(0)). It runs more than once (shapes, then "
                         f"values), so it must build the same module each time ({e})") from None


class _Matched(NamedTuple):
    """The plan matched on a model: every module by path, the default styles, and each module's own styles."""

    modules: dict[tuple, nnx.Module]
    default: tuple[ParallelStyle, ...]
    styles: dict[tuple, tuple[ParallelStyle, ...]]


class _Placed(NamedTuple):
    """One parameter: its Variable and path, its value (a built model's, or the abstract one's shape), the path of
    the module holding it, its placements, and per mesh axis the style placing it and the unit gathering it."""

    var: nnx.Variable
    path: tuple
    value: Any
    owner: tuple
    placements: tuple[Placement, ...]
    placing: dict[str, tuple[ParallelStyle, tuple]]


def _match(model: nnx.Module, mesh: Mesh, plan: dict[str, tuple[ParallelStyle, ...]],
           default: tuple[ParallelStyle, ...]) -> _Matched:
    """Step 1, the plan: each module's styles, from every pattern matching its path, checked against the mesh and
    the module (a style that constrains calls needs a module that is called)."""
    names = list(mesh.axis_names)
    modules = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)}
    _check_axes(default, names, mesh, "default=")
    styles, used = {}, set()
    for path, module in modules.items():  # every module gets an entry: default styles may gather its params
        key = module_key(path)
        patterns = [p for p in plan if fnmatch.fnmatchcase(key, p)]
        used.update(patterns)
        styles[path] = _matched(plan, patterns, key)
        _check_axes(styles[path], names, mesh, key)  # a module's own style on an axis replaces the default's there
        constrains = [s for s in styles[path] if s.constrains]
        if constrains and not callable(module):
            raise ValueError(f"parallelize: {constrains[0]} at {key or 'the root module'} constrains the input and "
                             f"output of {type(module).__name__}, which is never called (it has no __call__); match "
                             "the modules inside it instead (say 'blocks/*')")
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"parallelize: plan pattern(s) {unused} match no module; module paths are "
                         f"{sorted(module_key(p) for p in modules if p)[:12]}")
    # the axes are checked: each style learns the mesh it runs on (ContextParallel, its axis size)
    return _Matched(modules, _on(default, mesh), {path: _on(s, mesh) for path, s in styles.items()})


def _place(model: nnx.Module, matched: _Matched, mesh: Mesh, rules: dict[str, Any],
           rebuilds: list[tuple[tuple, Any]]) -> list[_Placed]:
    """Step 2, the placements: per parameter and mesh axis, the style placing it there (see ``_placing``), else its
    Flax sharding annotation, else Replicate; then as a style restructuring a module around it says."""
    names = list(mesh.axis_names)
    placed = []
    for path, var in nnx.iter_graph(model):
        if not isinstance(var, nnx.Param):
            continue
        owner = next(path[:i] for i in range(len(path) - 1, -1, -1) if path[:i] in matched.modules)
        value = var.get_value()
        full = value.full() if isinstance(value, DArray) else value
        shape = tuple(full.shape)
        placements = list(_annotated(var, mesh, shape, full.dtype, rules))
        placing = _placing(owner, matched.default, matched.styles)
        for style, _ in placing.values():
            placements[names.index(style.axis)] = _param(style, matched.modules[owner], owner, str(path[-1]), shape)
        placements = _fsdp_inside(placements, [s for s, _ in placing.values()], mesh)
        for at, rebuild in rebuilds:
            if path[:len(at)] == at:
                placements = rebuild.placements(path[len(at):], tuple(placements))
        placed.append(_Placed(var, path, full, owner, tuple(placements), placing))
    return placed


def _units(matched: _Matched, params: list[_Placed]) -> dict[tuple, tuple]:
    """Step 3, FSDP's units: per module gathering parameters while it runs (or pinning its own where they are,
    ``ParallelStyle.pin``), each one's path below it and its ``(mesh axis, placement while it runs)`` pairs, in
    ``nnx.iter_graph`` order."""
    gathers: dict[tuple, dict[tuple, list]] = {}
    casts: dict[tuple, Any] = {}  # (unit, path below it) -> the dtype a gathering style casts it to first
    for p in params:
        for style, unit in p.placing.values():
            if style.compute is not None:
                gathers.setdefault(unit, {}).setdefault(p.path[len(unit):], []).append((style.axis, style.compute))
                if getattr(style, "param_dtype", None) is not None:
                    casts[unit, p.path[len(unit):]] = style.param_dtype
            elif unit == p.owner and callable(matched.modules[unit]):  # a style keeping its parameter in place
                shape = tuple(np.shape(p.value))
                kept = style.pin(matched.modules[unit], str(p.path[-1]), shape)
                if kept is not None:
                    gathers.setdefault(unit, {}).setdefault(p.path[len(unit):], []).append((style.axis, kept))
    for unit in gathers:  # a default unit never called is gathered where used; a matched one would mislead
        gathering = [s for s in matched.styles[unit] if s.compute is not None]
        if gathering and not callable(matched.modules[unit]):
            raise ValueError(f"parallelize: {type(gathering[0]).__name__} at {module_key(unit) or 'the root module'} "
                             f"gathers the parameters inside it when {type(matched.modules[unit]).__name__} is called, "
                             "and it is never called (it has no __call__); match the modules it holds instead, one "
                             "unit each (say {f'blocks/{i}': FullyShard('dp') for i in range(layers)})")
    return {unit: tuple((rel, tuple(axes), casts.get((unit, rel))) for rel, axes in g.items())
            for unit, g in gathers.items()}


def _build(model: nnx.Module, build: Constructor | None, mesh: Mesh, params: list[_Placed],
           stacks: list[tuple[list[int], tuple]]) -> list[DArray | None]:
    """Step 4, the values: a built model's parameters distributed from where they are; a constructor's computed in
    their placements, its other state (RNG streams) going into the abstract model, a pipeline's blocks drawn
    stacked where they can be (``stacks``: the first block's parameter then holds the stack, the others None)."""
    if build is None:
        return stack_members([distribute(p.value, mesh, list(p.placements)) for p in params], stacks)
    values, other = initialise(build, mesh, [p.placements for p in params], stacks)
    nnx.update(model, other)
    return values


def _install(matched: _Matched, params: list[_Placed], values: list[DArray], units: dict[tuple, tuple],
             rebuilds: list[tuple[tuple, Any]]) -> None:
    """Step 5, the change, all at once: each parameter takes its DArray, and each callable module that constrains
    its calls, gathers a unit or holds parameters (the model itself among them) takes a class whose ``__call__``
    does so and runs eagerly on DArrays."""
    holders = {p.owner[:i] for p in params for i in range(len(p.owner) + 1)}
    classes = {}
    for path, styles in matched.styles.items():
        module = matched.modules[path]
        if not callable(module):
            continue
        constraining = tuple(s for s in styles if s.constrains)
        base = getattr(type(module), "_unconstrained", type(module))  # parallelizing again replaces, never stacks
        wrap = constraining or path in units or path in holders
        classes[path] = _constrained(base, constraining, units.get(path, ())) if wrap else base
    for p, value in zip(params, values, strict=True):
        if value is not None:  # None: a parameter drawn into another's stack
            p.var.set_value(value)
    for path, cls in classes.items():
        matched.modules[path].__class__ = cls
    for path, rebuild in rebuilds:
        module = matched.modules[path]
        new = rebuild.install(module)
        if new is not module:
            setattr(matched.modules[path[:-1]], path[-1], new)


def _restructures(matched: _Matched, mesh: Mesh) -> list[tuple[tuple, Any]]:
    """The modules a style rebuilds (``ParallelStyle.restructure``), each with the style's answer, asked before
    anything changes (it checks the module). One per module, and none inside another."""
    found = []
    for path, styles in matched.styles.items():
        for style in styles:
            rebuild = style.restructure(matched.modules[path], module_key(path), mesh)
            if rebuild is not None:
                found.append((path, style, rebuild))
    for (a, s, _), (b, t, _) in itertools.combinations(found, 2):
        if a[:len(b)] == b or b[:len(a)] == a:
            raise ValueError(f"parallelize: {s.label} at {module_key(a) or 'the root module'} and {t.label} at "
                             f"{module_key(b) or 'the root module'} both rebuild the modules there, one inside the "
                             "other's; match one of them")
    return [(path, rebuild) for path, _, rebuild in found]


def _stacks(params: list[_Placed], rebuilds: list[tuple[tuple, Any]]) -> list[tuple[list[int], tuple]]:
    """The parameters drawn as one stacked parameter (their indices into ``params``, the first holding the stack)
    and the stack's placements, as each restructuring style says."""
    stacks = []
    for at, rebuild in rebuilds:
        inside = [i for i, p in enumerate(params) if p.path[:len(at)] == at]
        for members, placements in rebuild.stacks([params[i].path[len(at):] for i in inside],
                                                   [params[i].placements for i in inside]):
            stacks.append(([inside[m] for m in members], placements))
    return stacks


def module_key(path: Sequence, *, any_index: bool = False) -> str:
    """A module's path as plan patterns match it: attribute names and list indices joined by '/'; ``any_index``
    writes each index as ``*``, the pattern matching that module in every block of a list.

    >>> module_key(("blocks", 3, "q")), module_key(("blocks", 3, "q"), any_index=True)
    ('blocks/3/q', 'blocks/*/q')
    """
    return "/".join("*" if any_index and isinstance(p, int) else str(p) for p in path)




def _param(style: ParallelStyle, module: nnx.Module, owner: tuple, name: str, shape: tuple) -> Placement:
    """``style.param``, its refusal naming the module's path and its answer checked."""
    try:
        placement = style.param(module, name, shape)
    except UnplacedParameter as e:
        raise e.at(module_key(owner)) from None
    if not isinstance(placement, Placement):
        raise TypeError(f"parallelize: {style.label}.param gave {placement!r} for parameter {name!r} {shape} of "
                        f"{type(module).__name__} at {module_key(owner) or 'the root module'}; a style's param returns "
                        "a placement (Replicate(), Shard(d), ...)")
    return placement


def _matched(plan: dict[str, tuple[ParallelStyle, ...]], patterns: list[str], where: str) -> tuple[ParallelStyle, ...]:
    """The styles of the module at ``where``: those of every plan pattern matching it, in plan order (styles on
    different mesh axes compose, as in one pattern's list; one style matched twice counts once). Two patterns
    giving it different styles on one mesh axis are a conflict, refused naming both."""
    styles, by_axis = [], {}
    for pattern in patterns:
        for style in plan[pattern]:
            first = by_axis.setdefault(style.axis, (pattern, style))
            if first[0] == pattern:  # two styles of one pattern on one axis: _check_axes names them
                styles.append(style)
            elif first[1] != style:
                module = repr(where) if where else "the root module"
                raise ValueError(f"parallelize: plan patterns {first[0]!r} and {pattern!r} both match {module} and "
                                 f"give it different styles on mesh axis {style.axis!r}, {first[1]} and {style}; "
                                 "make the patterns disjoint (every pattern that matches a module applies to it: "
                                 "name the module in one pattern only, say with fnmatch's [!...] to leave it out of "
                                 "the other), or give both one style")
    return tuple(styles)


def _on(styles: tuple[ParallelStyle, ...], mesh: Mesh) -> tuple[ParallelStyle, ...]:
    """Each style as it runs on ``mesh`` (``ParallelStyle.on``), its answer checked."""
    bound = tuple(s.on(mesh) for s in styles)
    for s, b in zip(styles, bound, strict=True):
        if not isinstance(b, type(s)) or b.axis != s.axis:
            raise TypeError(f"parallelize: {s.label}.on(mesh) gave {b!r}; a style's on returns the style itself or a "
                            f"copy of it on the same axis")
    return bound


def _check_axes(styles, names, mesh, where) -> None:
    seen = {}
    for s in styles:
        if s.axis not in names:
            raise ValueError(f"parallelize: {s} at {where or 'the root module'} names mesh axis {s.axis!r}, but the "
                             f"mesh is {format_mesh(mesh)}; pass axis= one of {names}")
        if s.axis in seen and seen[s.axis] != s:  # one style named twice counts once
            raise ValueError(f"parallelize: {seen[s.axis]} and {s} both place {where or 'the root module'} on mesh "
                             f"axis {s.axis!r}; give each axis one style")
        seen[s.axis] = s


def _fsdp_inside(placements: list[Placement], styles: tuple[ParallelStyle, ...], mesh: Mesh) -> list[Placement]:
    """Where a gathered style (FullyShard) and another style cut the same dim, the gathered one cuts inside: each
    tensor-parallel block stays contiguous, so FSDP's gather is one all-gather over its axis and the gradient one
    reduce-scatter of the block (torch's FSDP2 + TP order, GSPMD's ``P(('tp', 'dp'))``), whatever the mesh order.
    """
    names = list(mesh.axis_names)
    gathered = {names.index(s.axis) for s in styles if s.compute is not None}
    out = list(placements)
    for d in {p.dim for p in placements if p.is_shard}:
        axes = [a for a, p in enumerate(placements) if p.is_shard and p.dim == d]
        if len(axes) > 1 and gathered & set(axes):
            order = [a for a in axes if a not in gathered] + [a for a in axes if a in gathered]
            for a, p in shard_order(d, order, tuple(mesh.axis_sizes)).items():
                out[a] = p
    return out


def _annotated(var, mesh: Mesh, shape, dtype, rules: dict[str, Any]) -> tuple[Placement, ...]:
    """Placements from a Flax sharding annotation (mesh axis or logical names per dim), else Replicate."""
    meta = var.get_metadata()
    names = meta.get("out_sharding") or meta.get("sharding_names") or meta.get("sharding")
    if not names:
        return (Replicate(),) * len(mesh.axis_names)

    def resolve(n):
        if n is None or n in mesh.axis_names:
            return n
        if isinstance(n, tuple):
            return tuple(resolve(m) for m in n)
        if n in rules:
            return rules[n]
        raise ValueError(f"parallelize: sharding annotation {tuple(names)} names {n!r}, which is neither a mesh axis "
                         f"of {format_mesh(mesh)} nor a logical name in rules={list(rules.items())}")

    spec = PartitionSpec(*map(resolve, names))
    return Spec.from_named_sharding(NamedSharding(mesh, spec), tuple(shape), dtype).placements


def _placing(owner: tuple, default: tuple, matched: dict) -> dict[str, tuple[ParallelStyle, tuple]]:
    """Per mesh axis, the style placing the parameters of the module at ``owner`` and the module that gathers
    them (FSDP's unit): the module's own styles, else a gathered style (``FullyShard``) matched on the nearest
    module above it, as torch's ``fully_shard(block)`` takes every parameter inside the block that no nested
    ``fully_shard`` took, else the default styles (each module its own unit)."""
    placing = {s.axis: (s, owner) for s in default}
    for i in range(len(owner)):  # from the root down: a nearer unit takes over
        for s in matched.get(owner[:i], ()):
            if s.compute is not None:
                placing[s.axis] = (s, owner[:i])
    placing.update((s.axis, (s, owner)) for s in matched[owner])
    return placing


@memo(1024)
def _constrained(cls: type, styles: tuple[ParallelStyle, ...], gather: tuple) -> type:
    """``cls`` whose ``__call__`` constrains its inputs and outputs where ``styles`` place them, runs inside their
    ``context()``, and with the parameters it gathers at their compute placements (FSDP's gather, of a unit's
    parameters together; the gradient is left to find its way back to the shard). ``gather``: per parameter, its
    path below the module, its ``(axis, compute placement)`` pairs and the dtype it is cast to on its shard before
    it is gathered (None: its own; ``FullyShard.param_dtype``). Called outside ``jshard.jit`` (its parameters
    DArrays, not tracers), it runs itself through ``jshard.jit`` (see ``_eagerly``)."""
    computes = [dict(axes) for _, axes, _ in gather]
    casts = [dtype for _, _, dtype in gather]

    def __call__(self, *args, **kwargs):
        if _outside_jit(self, args, kwargs):
            return _eagerly(self, args, kwargs)
        mesh = tracing_mesh()
        if mesh is None:  # plain JAX (jax.jit of a loop over the model's state): no plan to pin
            return super(sub, self).__call__(*args, **kwargs)
        # a Flax layer's out_sharding= (a model written for JAX's explicit sharding) is a pin on its output, not a
        # sharded type: no mesh context needed, and JAX's explicit-mode type errors never reach the code after it
        pin = kwargs.pop("out_sharding", None) if takes_out_sharding else None
        args, kwargs = _constrain_inputs(self, styles, args, kwargs)
        params = [_below(self, rel) for rel, _, _ in gather]
        stored = [v.get_value() for v in params]
        for v, value, compute, dtype in zip(params, stored, computes, casts, strict=True):
            if dtype is not None and jnp.issubdtype(value.dtype, jnp.floating):
                value = value.astype(dtype)
            v.set_value(constrain(value, compute, pin_gradient=False))
        try:
            with contextlib.ExitStack() as contexts:
                for s in styles:
                    contexts.enter_context(s.context())
                out = super(sub, self).__call__(*args, **kwargs)
        finally:
            for v, value in zip(params, stored, strict=True):
                v.set_value(value)
        if pin is not None:
            out = _constrain_arrays(out, partition_pins(_partition_spec(pin, cls), mesh), True)
        outputs = {s.axis: p for s in styles if (p := s.outputs(out)) is not None}
        return _constrain_arrays(out, outputs, True)

    takes_out_sharding = "out_sharding" in _parameters(cls.__call__)
    # the layer's other methods that take out_sharding= (Flax's Embed.attend) pin their outputs alike
    pinned = {name: _pinning(getattr(cls, name), cls) for name in dir(cls)
              if not name.startswith("_") and inspect.isfunction(getattr(cls, name, None))
              and "out_sharding" in _parameters(getattr(cls, name))}
    sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "_unconstrained": cls, **pinned})
    return sub


def _pinning(method: Callable, cls: type) -> Callable:
    """``method`` whose ``out_sharding=`` is, under ``jshard.jit``, a pin on its output (see ``_constrained``)."""

    @functools.wraps(method)
    def pinned(self, *args, **kwargs):
        mesh = tracing_mesh()
        if mesh is None or kwargs.get("out_sharding") is None:
            return method(self, *args, **kwargs)
        pin = kwargs.pop("out_sharding")
        return _constrain_arrays(method(self, *args, **kwargs), partition_pins(_partition_spec(pin, cls), mesh), True)

    return pinned


def _parameters(fn: Callable) -> frozenset:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # no signature to read
        return frozenset()


def _partition_spec(pin: Any, cls: type) -> PartitionSpec:
    """A layer's ``out_sharding=`` as a ``PartitionSpec`` (JAX takes one, or a ``NamedSharding`` holding one)."""
    spec = getattr(pin, "spec", pin)
    if not isinstance(spec, PartitionSpec):
        raise TypeError(f"{cls.__name__}: out_sharding={pin!r} is neither a PartitionSpec nor a NamedSharding; "
                        "jshard reads it as where the layer's output lives (jax.P('dp', None, 'tp'))")
    return spec


def _constrain_inputs(module: nnx.Module, styles: tuple[ParallelStyle, ...], args: tuple,
                      kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments constrained where the styles place them: one constraint per argument over every axis a
    style places it on (so the engine plans one move), its gradient pinned unless such a style says not to."""
    if not styles:
        return args, kwargs
    positional, keywords = [[] for _ in args], {k: [] for k in kwargs}
    for s in styles:
        at, by_name = s.inputs(args, kwargs)
        if len(at) != len(args) or not set(by_name) <= set(kwargs):
            raise TypeError(f"{s.label}.inputs gave {len(at)} positional placements and keywords {sorted(by_name)} "
                            f"for a call of {type(module).__name__} with {len(args)} positional arguments and keywords "
                            f"{sorted(kwargs)}; give one per positional argument, and keywords of the call")
        for picks, p in zip(positional, at, strict=True):
            picks.append((s, p))
        for k, p in by_name.items():
            keywords[k].append((s, p))

    def constrained(value, picks):
        placing = [(s, p) for s, p in picks if p is not None]
        pin = all(s.pin_input_gradient for s, _ in placing)
        return _constrain_arrays(value, {s.axis: p for s, p in placing}, pin)

    return (tuple(constrained(a, picks) for a, picks in zip(args, positional, strict=True)),
            {k: constrained(v, keywords[k]) for k, v in kwargs.items()})


def _constrain_arrays(tree: Any, placements: dict[str, Placement], pin: bool) -> Any:
    if not placements:
        return tree
    return jax.tree.map(lambda a: constrain(a, placements, pin_gradient=pin) if is_array(a) else a, tree)


def _below(module: nnx.Module, path: tuple) -> Any:
    """The node at ``path`` (attribute names and list indices, as ``nnx.iter_graph`` gives them) below ``module``."""
    for key in path:
        module = getattr(module, key) if isinstance(key, str) and hasattr(module, key) else module[key]
    return module


def _outside_jit(module: nnx.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a module call sees DArrays (it runs eagerly) rather than the tracers ``jshard.jit`` gives it."""
    leaves = jax.tree.leaves((module, args, kwargs), is_leaf=is_darray)
    if not any(isinstance(a, DArray) for a in leaves):
        return False
    if any(isinstance(a, jax.core.Tracer) for a in leaves):
        raise TypeError(f"{type(module).__name__}: called inside a JAX transformation while holding DArray "
                        "parameters (the model was closed over); pass it as an argument instead: "
                        "jshard.jit(lambda m, x: m(x))(model, x), or train with TrainStep")
    return True


def _call(module: nnx.Module, static: tuple, *arrays) -> tuple[Any, nnx.State]:
    """``module(*args, **kwargs)`` with the arguments rebuilt from their arrays and static leaves; also returns
    the state the call changed (RNG counts, batch statistics), which lives on in the caller's module."""
    tree, constants = static
    it = iter(arrays)
    args, kwargs = jax.tree.unflatten(tree, [next(it) if c is _ARRAY else c for c in constants])
    return module(*args, **kwargs), nnx.state(module, nnx.Not(nnx.Param))


_ARRAY = object()  # in _call's static leaves: an array argument's place
_EAGER = jit(_call, static_argnums=1)  # one program per model structure, argument specs and static values


def _eagerly(module: nnx.Module, args: tuple, kwargs: dict) -> Any:
    """Run an eager call of a parallelized module as one ``jshard.jit`` program (cached): array arguments are
    traced, everything else (flags like ``deterministic=True``, sizes) is static as in an eager Flax call."""
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=is_darray)
    is_array = [isinstance(a, (DArray, jax.Array, np.ndarray, np.generic)) for a in leaves]
    static = (tree, tuple(_ARRAY if arr else a for a, arr in zip(leaves, is_array, strict=True)))
    out, state = _EAGER(module, static, *[a for a, arr in zip(leaves, is_array, strict=True) if arr])
    nnx.update(module, state)
    return out
