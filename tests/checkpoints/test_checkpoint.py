"""Checkpoints (``jshard.checkpoint``): every layout saves, restores into every target layout and mesh with each
device's block equal to what ``distribute`` of the saved value gives (bit for bit), through Orbax's managers too;
a layout a ``NamedSharding`` expresses is a plain Orbax array that JAX users restore with Orbax alone; training
resumes with the uninterrupted run's losses; bad input is refused and never damages a checkpoint."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jshard
from conftest import make_mesh
from jshard import DArray, LayoutError, Partial, Replicate, Shard, Spec, StridedShard
from jshard.gpt import GPT, cross_entropy, plan
from jshard.parallel import ColwiseParallel, FullyShard, TrainStep, parallelize

R = Replicate()

# (name, global shape, source placements on dp=2 x tp=4)
SOURCES = [
    ("even", (8, 12), [Shard(0), Shard(1)]),
    ("uneven", (10, 7), [Shard(0), Shard(1)]),
    ("nested-uneven", (10, 3), [Shard(0), Shard(0)]),
    ("strided", (16, 3), [StridedShard(0, 4), Shard(0)]),
    ("strided-uneven", (13, 2), [StridedShard(0, 4), Shard(0)]),
    ("replicated", (5, 3), [R, R]),
    ("partial-sum", (6, 5), [Partial("sum"), Shard(1)]),
    ("partial-max", (6, 5), [Shard(0), Partial("max")]),
    ("partial-avg", (4, 9), [Partial("avg"), Partial("sum")]),
]

# (name, mesh shape, placements for a rank-2 value)
TARGETS = [
    ("dp2xtp4", (2, 4), [Shard(1), Shard(0)]),
    ("fsdp8", (8,), [Shard(0)]),
    ("tp8", (8,), [Shard(1)]),
    ("2x2x2", (2, 2, 2), [Shard(0), R, Shard(1)]),
    ("2x2x2-strided", (2, 2, 2), [StridedShard(0, 2), Shard(1), Shard(0)]),
    ("partial", (2, 4), [Partial("sum"), Shard(0)]),
    ("4-devices", (4,), [Shard(1)]),
    ("1-device", (1,), [R]),
    ("1-device-shard", (1,), [Shard(1)]),
    ("1x8", (1, 8), [Shard(0), Shard(1)]),
    ("8x1-partial", (8, 1), [Shard(1), Partial("sum")]),
]


def mesh_of(shape):
    if shape == (4,):
        return jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    return make_mesh(shape)


def value_of(shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def source(shape, placements, seed=0):
    """A DArray of ``value_of(shape)``; Partial ones made of random parts whose reduction is that value."""
    mesh = make_mesh((2, 4))
    value = value_of(shape, seed)
    x = jshard.distribute(value, mesh, [R if p.is_partial else p for p in placements])
    if not any(p.is_partial for p in placements):
        return x, value
    # parts that are not the value on any device: a save that forgot to reduce would be caught
    noise = jshard.distribute(value_of(shape, seed + 1), mesh, [R] * 2)
    parts = jshard.jit(lambda a, b: a + b, out_placements=list(placements))(x, noise)
    return parts, np.asarray(parts.full())


def assert_blocks_equal(got: DArray, want: DArray):
    assert got.spec == want.spec
    for a, b in zip(got.to_local(), want.to_local()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture
def saved(tmp_path_factory):
    """Every source layout saved once, in one checkpoint."""
    tree, values = {}, {}
    for name, shape, placements in SOURCES:
        tree[name], values[name] = source(shape, placements)
    path = tmp_path_factory.mktemp("ckpt") / "layouts"
    jshard.checkpoint.save(path, tree)
    return path, tree, values


@pytest.mark.parametrize("target", TARGETS, ids=[t[0] for t in TARGETS])
def test_every_layout_restores_into_every_target(saved, target):
    path, tree, values = saved
    _, mesh_shape, placements = target
    mesh = mesh_of(mesh_shape)
    like = {name: Spec.create(mesh, placements, x.shape, x.dtype) for name, x in tree.items()}
    back = jshard.checkpoint.restore(path, like=like)
    for name, x in back.items():
        assert_blocks_equal(x, jshard.distribute(values[name], mesh, placements))


def test_restoring_into_the_saved_layouts_gives_the_same_blocks(saved):
    path, tree, values = saved
    back = jshard.checkpoint.restore(path, like=tree)
    for name, x in back.items():
        if any(p.is_partial for p in x.placements):  # the value, placed as distribute places a Partial
            assert_blocks_equal(x, jshard.distribute(values[name], x.mesh, x.placements))
        else:
            assert_blocks_equal(x, tree[name])


def test_a_mixed_tree_round_trips(tmp_path):
    mesh = make_mesh((2, 4))
    x = jshard.distribute(value_of((8, 4)), mesh, [Shard(0), Shard(1)])
    plain = jax.device_put(value_of((8, 4), 1), jax.sharding.NamedSharding(mesh, jax.P("tp", None)))
    key = jax.random.key(7)
    keys = jshard.distribute(jax.random.split(key, 8), mesh, [Shard(0), R])  # Orbax saves keys; a NamedSharding
    tree = {"x": x, "plain": plain, "np": np.arange(5), "step": 3, "lr": 0.5, "key": key, "nested": [x, (x,)],
            "keys": keys}
    jshard.checkpoint.save(tmp_path / "c", tree)
    back = jshard.checkpoint.restore(tmp_path / "c", like=tree)
    assert jax.tree.structure(back, is_leaf=lambda a: isinstance(a, DArray)) == \
        jax.tree.structure(tree, is_leaf=lambda a: isinstance(a, DArray))
    assert_blocks_equal(back["x"], x)
    assert_blocks_equal(back["nested"][1][0], x)
    assert back["plain"].sharding == plain.sharding
    np.testing.assert_array_equal(back["plain"], plain)
    np.testing.assert_array_equal(back["np"], np.arange(5))
    assert back["step"] == 3 and back["lr"] == 0.5
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(key))
    assert back["keys"].spec == keys.spec
    for got, want in zip(back["keys"].to_local(), keys.to_local(), strict=True):
        np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_orbax_arrays_and_darrays_read_each_other(tmp_path):
    """The checkpoint holds Orbax's own array format: a DArray restores as a jax.Array and the other way round."""
    mesh = make_mesh((2, 4))
    value = value_of((8, 6))
    x = jshard.distribute(value, mesh, [Shard(0), Shard(1)])
    jshard.checkpoint.save(tmp_path / "d", {"w": x})
    by_tp = jax.sharding.NamedSharding(mesh, jax.P("tp"))
    like = {"w": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=by_tp)}
    back = jshard.checkpoint.restore(tmp_path / "d", like=like)
    assert back["w"].sharding == by_tp
    np.testing.assert_array_equal(back["w"], value)
    sharding = jax.sharding.NamedSharding(mesh, jax.P(("dp", "tp")))
    with ocp.StandardCheckpointer() as c:
        c.save(tmp_path / "j", {"w": jax.device_put(value, sharding)})
    for placements in ([Shard(0), Shard(0)], [Shard(1), Shard(0)]):  # uneven; a NamedSharding's (Orbax reads it)
        target = Spec.create(mesh, placements, (8, 6), np.float32)
        back = jshard.checkpoint.restore(tmp_path / "j", like={"w": target})
        assert_blocks_equal(back["w"], jshard.distribute(value, mesh, placements))


def test_checkpoint_manager_keeps_the_last_n_and_saves_asynchronously(tmp_path):
    mesh = make_mesh((2, 4))
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    values = {}
    with ocp.CheckpointManager(tmp_path, options=options) as manager:
        for step in range(1, 4):
            x = jshard.distribute(value_of((9, 4), step), mesh, [Shard(0), Shard(1)])
            manager.save(step, args=jshard.checkpoint.Save({"w": x, "step": step}))
            values[step] = value_of((9, 4), step)
            # the array may go at once, donated to the next step, while the save still writes
            jshard.jit(lambda a: a * 0 - 1, donate_argnums=0)(x)
            x.block.delete()
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 3]
        like = {"w": Spec.create(make_mesh((8,)), [Shard(1)], (9, 4), np.float32), "step": 0}
        back = manager.restore(manager.latest_step(), args=jshard.checkpoint.Restore(like))
    assert back["step"] == 3
    np.testing.assert_array_equal(np.asarray(back["w"].full()), values[3])


def test_composite_args_hold_a_darray_tree_next_to_json(tmp_path):
    x = jshard.distribute(value_of((4, 4)), make_mesh((2, 4)), [Shard(0), Shard(1)])
    with ocp.CheckpointManager(tmp_path, item_names=("state", "meta")) as manager:
        manager.save(0, args=ocp.args.Composite(state=jshard.checkpoint.Save({"x": x}),
                                                meta=ocp.args.JsonSave({"note": "hi"})))
        manager.wait_until_finished()
        back = manager.restore(0, args=ocp.args.Composite(state=jshard.checkpoint.Restore({"x": x}),
                                                          meta=ocp.args.JsonRestore()))
    assert back.meta == {"note": "hi"}
    assert_blocks_equal(back.state["x"], x)


def stored_metadata(path) -> dict:
    """Orbax's metadata of every saved value (shape, dtype, sharding, chunks), keyed by name."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.metadata(path).tree
    finally:
        handler.close()


def named_sharding(spec: Spec):
    """The NamedSharding of ``spec``'s value (Partial axes reduced to Replicate, as saved), or None where JAX has
    none: the layouts that Orbax's own array handler writes."""
    try:
        return spec.with_placements([R if p.is_partial else p for p in spec.placements]).to_named_sharding()
    except LayoutError:
        return None


def test_the_layouts_a_named_sharding_expresses_are_plain_orbax_arrays(saved):
    """Orbax alone (no jshard args) restores them with the NamedSharding they were saved under; the others have no
    sharding recorded, and JAX users read every one of them given a target sharding."""
    path, tree, values = saved
    metadata = stored_metadata(path)
    plain = {name for name, x in tree.items() if named_sharding(x.spec) is not None}
    assert plain == {"even", "strided", "replicated", "partial-max", "partial-avg"}
    assert {name for name, m in metadata.items() if m.sharding is not None} == plain
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(path)
    for name in plain:
        assert back[name].sharding == named_sharding(tree[name].spec), name
        np.testing.assert_array_equal(back[name], values[name])


def orbax_target(mesh, x, axes):
    """A ShapeDtypeStruct of ``x``'s shape on ``mesh``: dim ``d`` cut over the mesh axis ``axes[d]`` where it
    divides evenly (JAX needs that), else whole."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    spec = [a if a is not None and n % sizes[a] == 0 else None for n, a in zip(x.shape, axes, strict=True)]
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, jax.P(*spec)))


@pytest.mark.parametrize("mesh_shape,axes", [((8,), ("x", None)), ((2, 4), ("tp", "dp")), ((1, 8), ("dp", "tp")),
                                             ((1,), ("x", None))], ids=["8", "2x4", "1x8", "1-device"])
def test_orbax_restores_every_layout_into_named_shardings(saved, mesh_shape, axes):
    """A JAX user's Orbax restore (``StandardCheckpointer`` with a target) reads every saved layout."""
    path, tree, values = saved
    mesh = make_mesh(mesh_shape)
    target = {name: orbax_target(mesh, x, axes) for name, x in tree.items()}
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(path, target)
    for name, x in back.items():
        assert x.sharding == target[name].sharding
        np.testing.assert_array_equal(x, values[name])


@pytest.mark.parametrize("name,shape,placements", SOURCES, ids=[s[0] for s in SOURCES])
def test_each_chunk_lies_in_one_block(tmp_path, name, shape, placements):
    """The stored array's chunks never straddle two devices' blocks, so no chunk has writers on two processes
    (one's rows would be lost: the multi-process test saves such layouts across processes)."""
    x, _ = source(shape, placements)
    jshard.checkpoint.save(tmp_path / "c", {"x": x})
    chunk = stored_metadata(tmp_path / "c")["x"].storage.chunk_shape
    spec = x.spec.with_placements([R if p.is_partial else p for p in placements])
    for corner in itertools.product(*[range(0, n, c) for n, c in zip(shape, chunk, strict=True)]):
        box = [np.arange(a, min(a + c, n)) for a, c, n in zip(corner, chunk, shape, strict=True)]
        assert any(all(np.isin(b, held).all() for b, held in zip(box, spec.global_indices(coords), strict=True))
                   for coords in np.ndindex(*spec.mesh_shape)), (name, chunk, corner)


# -- training resumes ------------------------------------------------------------------------------


def gpt_step(style, mesh_shape):
    mesh = make_mesh(mesh_shape)
    styles, default = plan(style, dp=mesh.axis_names[0], tp=mesh.axis_names[-1])
    model = parallelize(lambda: GPT(64, 32, 4, 2, 16, rngs=nnx.Rngs(0)), mesh, styles, default=default)
    return TrainStep(model, optax.adamw(1e-2), lambda m, ids, labels: cross_entropy(m(ids), labels)), mesh


def batches(mesh, n):
    rng = np.random.default_rng(0)
    rows = [Shard(0)] + [R] * (len(mesh.axis_names) - 1)
    return [[jshard.distribute(rng.integers(0, 64, (8, 16)).astype(np.int32), mesh, rows) for _ in range(2)]
            for _ in range(n)]


# another parallelism runs in the multi-process test too (TP on 2x4 resumed as FSDP8): here it is a slow case
@pytest.mark.parametrize("style,mesh_shape", [("tp", (2, 4)), pytest.param("fsdp", (8,), marks=pytest.mark.slow)])
def test_training_resumes_with_the_uninterrupted_losses(tmp_path, style, mesh_shape):
    step, mesh = gpt_step("tp", (2, 4))
    data = batches(mesh, 6)
    losses = [float(step(*b)) for b in data[:3]]
    jshard.checkpoint.save(tmp_path / "k3", step.state)
    losses += [float(step(*b)) for b in data[3:]]

    resumed, mesh2 = gpt_step(style, mesh_shape)
    resumed.state = jshard.checkpoint.restore(tmp_path / "k3", like=resumed.state)
    data2 = batches(mesh2, 6)
    again = [float(resumed(*b)) for b in data2[3:]]
    if (style, mesh_shape) == ("tp", (2, 4)):
        assert again == losses[3:]  # the same program on the same values: bit for bit
    else:
        np.testing.assert_allclose(again, losses[3:], rtol=1e-6)


def test_train_step_state_refuses_another_layout():
    mesh = make_mesh((2, 4))
    linear = lambda: nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    mse = lambda m, x: jnp.mean(m(x) ** 2)
    step = TrainStep(parallelize(linear, mesh, {"": ColwiseParallel("tp")}), optax.sgd(0.1), mse)
    other = TrainStep(parallelize(linear, mesh, default=FullyShard("dp")), optax.sgd(0.1), mse)
    with pytest.raises(ValueError, match="restore with like=step.state"):
        step.state = other.state
    with pytest.raises(TypeError, match="keys params, opt_state and rest"):
        step.state = {"params": step.params}


# -- errors -------------------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    x = jshard.distribute(value_of((6, 4)), make_mesh((2, 4)), [Shard(0), Shard(1)])
    jshard.checkpoint.save(tmp_path / "ok", {"w": x, "step": 1})
    return tmp_path / "ok", x


def test_a_template_of_another_shape_or_dtype_is_refused(small):
    path, x = small
    with pytest.raises(ValueError, match=r"w: the checkpoint holds f32\[6, 4\], like asks for f32\[4, 6\]"):
        jshard.checkpoint.restore(path, like={"w": Spec.create(x.mesh, x.placements, (4, 6), np.float32), "step": 0})
    with pytest.raises(ValueError, match=r"w: the checkpoint holds f32\[6, 4\], like asks for bf16\[6, 4\]"):
        jshard.checkpoint.restore(path, like={"w": Spec.create(x.mesh, x.placements, (6, 4), jnp.bfloat16),
                                              "step": 0})


def test_a_shape_template_without_a_sharding_is_refused(small):
    path, _ = small
    with pytest.raises(ValueError, match=r"ShapeDtypeStruct in like needs sharding="):
        jshard.checkpoint.restore(path, like={"w": jax.ShapeDtypeStruct((6, 4), np.float32), "step": 0})


def test_a_template_of_another_structure_is_refused(small):
    path, x = small
    with pytest.raises(ValueError, match=r"(?s)leaves of like the checkpoint lacks \(1\): b\n"
                                         r"  values of the checkpoint like lacks \(1\): step"):
        jshard.checkpoint.restore(path, like={"w": x, "b": x})


def test_missing_and_unfinished_checkpoints_are_refused(small, tmp_path):
    path, x = small
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere"):
        jshard.checkpoint.restore(tmp_path / "nowhere", like={"w": x})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no Orbax tree checkpoint"):
        jshard.checkpoint.restore(tmp_path / "empty", like={"w": x})
    unfinished = tmp_path / "step_2.orbax-checkpoint-tmp-123"
    path.rename(unfinished)
    with pytest.raises(ValueError, match="save did not finish"):
        jshard.checkpoint.restore(unfinished, like={"w": x, "step": 0})


def test_a_failed_save_leaves_the_checkpoints_as_they_were(small, tmp_path):
    path, x = small
    with pytest.raises(FileExistsError, match="exists; save to a new directory"):
        jshard.checkpoint.save(path, {"w": x})
    assert jshard.checkpoint.restore(path, like={"w": x, "step": 0})["step"] == 1
    gone = jshard.distribute(value_of((6, 4)), x.mesh, x.placements)
    gone.block.delete()
    with pytest.raises(ValueError, match="w.*deleted"):
        jshard.checkpoint.save(tmp_path / "new", {"w": gone})
    assert not (tmp_path / "new").exists()
    with ocp.CheckpointManager(tmp_path / "m") as manager:
        manager.save(1, args=jshard.checkpoint.Save({"w": x}))
        manager.wait_until_finished()
        with pytest.raises(ValueError, match="deleted"):
            manager.save(2, args=jshard.checkpoint.Save({"w": gone}))
        assert manager.all_steps() == [1]
        assert_blocks_equal(manager.restore(1, args=jshard.checkpoint.Restore({"w": x}))["w"], x)


def test_keys_in_a_layout_no_named_sharding_expresses_are_refused(tmp_path):
    mesh = make_mesh((2, 4))
    keys = jax.random.split(jax.random.key(0), 10)
    uneven = jshard.distribute(keys, mesh, [Shard(0), Shard(0)])
    with pytest.raises(ValueError, match=r"^jshard.checkpoint.save: k is a key array laid out as "
                                         r"key<fry>\[10\] \(S\(0\), S\(0\)\).*even Shards and Replicate"):
        jshard.checkpoint.save(tmp_path / "bad", {"k": uneven})
    jshard.checkpoint.save(tmp_path / "ok", {"k": jshard.distribute(keys, mesh, [Shard(0), R])})
    with pytest.raises(ValueError, match=r"^jshard.checkpoint.restore: like's k is a key array laid out as "
                                         r"key<fry>\[10\] \(S\(0\), S\(0\)\)"):
        jshard.checkpoint.restore(tmp_path / "ok", like={"k": uneven.spec})


def test_restore_without_a_template_says_what_to_pass(small):
    path, _ = small
    with ocp.Checkpointer(jshard.checkpoint.Handler()) as c, pytest.raises(ValueError, match="needs like="):
        c.restore(path, args=jshard.checkpoint.Restore())
