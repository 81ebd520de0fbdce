"""Context parallelism (``ContextParallel``, ``plan("cp")``, ``--style cp``): a GPT whose sequence is sharded over
a mesh axis trains like one device, on its own and beside data, FSDP and tensor parallelism, by each attention
method, striped (balanced) or in blocks, with a sequence the axis does not divide, on a size-1 axis and one
device; the method's own collectives are in the plan and the compiled program; steps donate their state; a
checkpoint saved under it resumes under another style; bad input is named."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard import Replicate, Shard
from jshard import demo as demo_module
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import ContextParallel, ParallelStyle, TrainStep, parallelize
from jshard.sharded_attention import balanced
from jshard.validate.tolerance import assert_close, curve_ratio
from oracle import stablehlo_collectives, tree_scale

R = Replicate()
V, D, H, L, B = 48, 16, 4, 1, 2  # 4 heads: all-to-all over 4 devices, or tensor parallelism over 4, cut them evenly
STEPS = 3


def mesh_of(axes: dict[str, int]) -> jax.sharding.Mesh:
    n = math.prod(axes.values())
    return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=jax.devices()[:n])


def gpt(seq):
    return GPT(V, D, H, L, seq, rngs=nnx.Rngs(0))


def loss_fn(model, ids, labels):
    return cross_entropy(model(ids), labels)


def batch(i, seq):
    rng = np.random.default_rng(i)
    return rng.integers(0, V, (B, seq)).astype(np.int32), rng.integers(0, V, (B, seq)).astype(np.int32)


def layout(mesh, style: ContextParallel, seq: int) -> tuple:
    """The data's placements: the batch over dp, the sequence over cp in the style's layout."""
    return tuple(Shard(0) if a == "dp" else style.sequence(seq, mesh.shape[a]) if a == "cp" else R
                 for a in mesh.axis_names)


def attention_rows(explanation):
    return [r for r in explanation.rows if r["primitive"].endswith(("jshard.attention_fwd", "jshard.attention_bwd"))]


def on_cp(spec):
    return spec.placements[spec.mesh.axis_names.index("cp")]


# (mesh, style, method, balance, sequence length): every method, each mesh of the issue, striped and in blocks, a
# sequence 8 devices do not divide (12 over 8: two stripes of 6, each cut like torch.chunk), a size-1 cp axis, and
# one device
CASES = [
    pytest.param({"cp": 8}, "cp", "ring", True, 12, id="cp8-ring-balanced-uneven"),
    pytest.param({"cp": 1}, "cp", "ring", True, 16, id="one-device", marks=pytest.mark.slow),
    pytest.param({"cp": 8}, "cp", "all_gather", False, 16, id="cp8-all_gather-blocks", marks=pytest.mark.slow),
    pytest.param({"cp": 8}, "cp", "auto", True, 32, id="cp8-auto-balanced", marks=pytest.mark.slow),
    pytest.param({"dp": 2, "cp": 4}, "dp+cp", "all_to_all", True, 16, id="dp2-cp4-all_to_all",
                 marks=pytest.mark.slow),
    pytest.param({"cp": 2, "tp": 4}, "cp+tp", "ring", True, 16, id="cp2-tp4-ring", marks=pytest.mark.slow),
    pytest.param({"dp": 2, "cp": 2, "tp": 2}, "fsdp+cp+tp", "all_gather", True, 16, id="fsdp2-cp2-tp2-all_gather",
                 marks=pytest.mark.slow),
    pytest.param({"cp": 2, "tp": 4}, "cp+sp", "ring", True, 16, id="cp2-sp4-ring", marks=pytest.mark.slow),
    pytest.param({"cp": 4}, "cp", "ring", False, 13, id="cp4-ring-blocks-uneven", marks=pytest.mark.slow),
    pytest.param({"dp": 2, "cp": 1, "tp": 4}, "dp+cp+tp", "ring", True, 16, id="size-1-cp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("axes,style,method,balance,seq", CASES)
def test_training_matches_one_device(axes, style, method, balance, seq):
    mesh = mesh_of(axes)
    styles, default = plan(style, method=method)
    styles[""] = cp = ContextParallel("cp", method=method, balance=balance)
    model = parallelize(lambda: gpt(seq), mesh, styles, default=default)
    tx = optax.sgd(0.1)
    step = TrainStep(model, tx, loss_fn)
    placements = layout(mesh, cp, seq)
    data = [[jshard.distribute(a, mesh, placements) for a in batch(i, seq)] for i in range(STEPS)]

    ex = step.explain(*data[0])
    rows = attention_rows(ex)
    assert len(rows) == 2 * L  # forward and backward, one equation each
    n = mesh.shape["cp"]
    if n == 1:  # nothing crosses a size-1 axis: no permute, no all-to-all, and one device moves nothing at all
        assert not {"permute", "all_to_all"} & set(ex.totals)
        assert ex.totals == {} or len(axes) > 1
    else:
        q, k = (on_cp(rows[0]["ins"][i]) for i in (0, 1))
        sequence = balanced(seq, n) if balance else Shard(1)
        if method == "ring":
            assert q == k == sequence and rows[0]["own"] == [("permute", ("cp",), rows[0]["own"][0][2], n - 1)]
        elif method == "all_gather":
            assert q == sequence and k == R and not [r for r in rows if r["own"]]
            assert any(kind == "all_gather" and "cp" in ax for r in ex.rows for _, kind, ax, _ in r["moves"])
        elif method == "all_to_all":
            assert q == k == Shard(2) and not [r for r in rows if r["own"]]
            assert any(kind == "all_to_all" and ax == ("cp",) for r in ex.rows for _, kind, ax, _ in r["moves"])
        if method in ("ring", "all_to_all"):  # and they are in the program XLA compiles
            hlo = stablehlo_collectives(step.lower(*data[0]).as_text())
            assert hlo["collective_permute" if method == "ring" else "all_to_all"] > 0, hlo

    losses = []
    for ids, labels in data:
        before = jax.tree.leaves(step.params, is_leaf=lambda a: isinstance(a, jshard.DArray))
        losses.append(float(step(ids, labels)))
        assert all(p.block.is_deleted() for p in before)  # donated to the step
    reference = one_device_trainer(gpt(seq), tx, loss_fn)
    want = [reference(*map(jnp.asarray, batch(i, seq))) for i in range(STEPS)]
    assert curve_ratio(losses, want, n_per_step=summed_terms(V, D, L, seq, B)) <= 1, (losses, want)
    want_params = jax.tree.leaves(reference.params())
    got = jax.tree.leaves(step.params, is_leaf=lambda a: isinstance(a, jshard.DArray))
    for g, w in zip(got, want_params, strict=True):
        assert_close(g.full(), w, n=summed_terms(V, D, L, seq, B, steps=STEPS), terms=tree_scale(want_params))
    assert all(on_cp(g.spec) == R for g in got if "cp" in mesh.axis_names)  # parameters replicated on cp


class Attend(nnx.Module):
    """Causal self-attention with one fused projection: a model whose root ContextParallel is matched on."""

    def __init__(self, rngs):
        self.qkv = nnx.Linear(8, 24, rngs=rngs)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 6, 4), 3, axis=2)
        return jshard.attention(q, k, v, is_causal=True).reshape(b, t, 8)


# 2 heads: all-to-all over 2 devices; on one device the style changes nothing and attention runs whole
@pytest.mark.parametrize("cp,method,balance", [(4, "ring", True), (2, "all_to_all", False), (4, "all_gather", True),
                                               (1, "ring", True)])
def test_the_style_lays_out_the_sequence_and_runs_attention_by_its_method(cp, method, balance):
    mesh = mesh_of({"cp": cp})
    x = np.random.default_rng(0).normal(size=(2, 16, 8)).astype(np.float32)
    model = parallelize(lambda: Attend(nnx.Rngs(0)), mesh, {"": ContextParallel("cp", method, balance)})
    n = mesh.shape["cp"]
    sequence = balanced(16, n) if balance else Shard(1)
    out = model(jnp.asarray(x))  # eager: one jshard.jit program, the output in the sequence layout
    assert out.placements == (sequence,)
    assert_close(out.full(), Attend(nnx.Rngs(0))(jnp.asarray(x)), n=16)
    ex = jshard.explain(lambda m, x: m(x), model, x)
    if n == 1:
        assert ex.totals == {}
        return
    (row,) = [r for r in ex.rows if r["primitive"] == "jshard.attention"]
    assert row["ins"][1].placements == {"ring": (sequence,), "all_gather": (R,), "all_to_all": (Shard(2),)}[method]
    assert ("permute" in ex.totals) == (method == "ring") and ("all_to_all" in ex.totals) == (method == "all_to_all")


def test_auto_leaves_an_outer_attention_method_in_force():
    """``method="auto"`` pins nothing, so a method the caller sets around the model still holds inside it."""
    mesh = mesh_of({"cp": 4})
    model = parallelize(lambda: Attend(nnx.Rngs(0)), mesh, {"": ContextParallel("cp")})
    x = np.ones((2, 16, 8), np.float32)
    with jshard.attention_method({"cp": "ring"}):
        ex = jshard.explain(lambda m, x: m(x), model, x)
    (row,) = [r for r in ex.rows if r["primitive"] == "jshard.attention"]
    assert row["own"] and row["own"][0][0] == "permute"


@pytest.mark.slow
def test_a_checkpoint_saved_under_context_parallelism_resumes_under_tensor_parallelism(tmp_path):
    seq, tx = 16, optax.adamw(1e-2, eps=1e-4)
    mesh = mesh_of({"cp": 8})
    styles, _ = plan("cp", method="ring")
    step = TrainStep(parallelize(lambda: gpt(seq), mesh, styles), tx, loss_fn)
    sequence = layout(mesh, styles[""], seq)
    losses = [float(step(*(jshard.distribute(a, mesh, sequence) for a in batch(i, seq)))) for i in range(2)]
    jshard.checkpoint.save(tmp_path / "k2", step.state)

    mesh2 = mesh_of({"dp": 2, "tp": 4})
    styles2, _ = plan("tp")
    resumed = TrainStep(parallelize(lambda: gpt(seq), mesh2, styles2), tx, loss_fn)
    resumed.state = jshard.checkpoint.restore(tmp_path / "k2", like=resumed.state)
    assert resumed.model.blocks[0].q.kernel.get_value().placements == (R, Shard(1))
    losses += [float(resumed(*(jshard.distribute(a, mesh2, (Shard(0), R)) for a in batch(i, seq))))
               for i in range(2, 4)]
    reference = one_device_trainer(gpt(seq), tx, loss_fn)
    want = [reference(*map(jnp.asarray, batch(i, seq))) for i in range(4)]
    assert curve_ratio(losses, want, n_per_step=summed_terms(V, D, L, seq, B)) <= 1, (losses, want)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["--style", "cp"], ["--style", "dp+cp", "--mesh", "dp=2,cp=4", "--method",
                                                        "all_to_all"]])
def test_the_demo_trains_with_context_parallelism_like_one_device(argv, capsys):
    assert demo_module.main([*argv, "--steps", "2", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "of the rounding bound -> OK" in out and "attention across 'cp'" in out
    communicates = out.split("one training step communicates:")[1].splitlines()[0]
    assert ("all_to_all x" if "all_to_all" in argv else "permute x") in communicates


def test_plan_combines_context_parallelism_with_the_other_styles():
    styles, default = plan("fsdp+cp+tp", dp="data", tp="model", cp="seq", method="ring")
    assert styles[""] == ContextParallel("seq", method="ring") and default == plan("fsdp", dp="data")[1]
    assert {k: v for k, v in styles.items() if k} == plan("tp", tp="model")[0]
    assert plan("cp+dp") == plan("cp") == ({"": ContextParallel("cp")}, ())  # the batch's axis is the caller's
    assert plan("sp+cp")[0] == {**plan("sp")[0], "": ContextParallel("cp")}
    assert plan("tp") == (plan("tp", cp="other")[0], ())  # no cp: as before


def test_mistakes_are_named():
    with pytest.raises(ValueError, match=r"ContextParallel\('cp'\): method 'zigzag' is not one of 'auto', 'ring'"):
        ContextParallel("cp", method="zigzag")
    with pytest.raises(TypeError, match="balance must be True"):
        ContextParallel("cp", balance="yes")
    with pytest.raises(TypeError):  # the layout comes from balance, never from input=
        ContextParallel("cp", input=Shard(1))
    mesh = mesh_of({"dp": 2, "tp": 4})
    with pytest.raises(ValueError, match=r"ContextParallel\(axis='cp'.*names mesh axis 'cp'.*pass axis= one of"):
        parallelize(lambda: Attend(nnx.Rngs(0)), mesh, {"": ContextParallel("cp")})
    flat = parallelize(lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)), mesh_of({"cp": 4}), {"": ContextParallel("cp")})
    with pytest.raises(ValueError, match=r"ContextParallel\('cp'\): argument 0 has shape \(8,\), with no sequence dim"):
        flat(jnp.ones(8))
    with pytest.raises(RuntimeError, match="before parallelize told it the mesh"):
        ContextParallel("cp").inputs((jnp.ones((2, 8)),), {})
    for style in ("cp+xx", "dp+fsdp+cp", "tp+sp", "", "cp+cp"):
        with pytest.raises(ValueError, match=re.escape(f"plan: style '{style}' is not one of 'tp', 'sp', 'fsdp'")):
            plan(style)
    with pytest.raises(ValueError, match="method='ring' is how context parallelism.*style 'tp' has none"):
        plan("tp", method="ring")
    with pytest.raises(SystemExit, match="axis named 'cp'.*--mesh dp=2,cp=4"):
        demo_module.main(["--style", "cp", "--mesh", "dp=8"])
    with pytest.raises(SystemExit, match="--style 'cp' --method 'fast'.*not one of"):
        demo_module.main(["--style", "cp", "--method", "fast", "--steps", "1"])


def test_a_style_that_misreports_its_mesh_is_refused():
    class Wrong(ParallelStyle):
        def on(self, mesh):
            return ParallelStyle("other")

    with pytest.raises(TypeError, match=r"Wrong\('tp'\).on\(mesh\) gave .*same axis"):
        parallelize(lambda: nnx.Linear(8, 8, rngs=nnx.Rngs(0)), mesh_of({"dp": 2, "tp": 4}), {"": Wrong("tp")})
