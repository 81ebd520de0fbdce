"""``jshard.parallel`` under bad input: every mistake is a clear error, raised before any work, that names the
operation and the argument; the model it was given is left exactly as it was.

Also the regressions for what used to go wrong with good input: ``parallelize`` raising half-way (the model
half converted), a parallelized model called eagerly (``model(x)`` outside ``jshard.jit``), and a model
holding ``nnx.Rngs`` (dropout: typed PRNG keys in its state) trained through ``TrainStep``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from modules import Gain

import jshard
from conftest import make_mesh
from jshard import Replicate, Shard, StridedShard
from jshard.gpt import GPT, plan, summed_terms
from jshard.parallel import (
    ColwiseParallel,
    DataParallel,
    FullyShard,
    RowwiseParallel,
    SequenceParallel,
    TrainStep,
    init_optimizer,
    parallelize,
    placements_of,
)
from jshard.validate.tolerance import assert_close, curve_ratio

R = Replicate()
V, D, H, L, T, B = 16, 8, 2, 1, 4, 2  # a one-block GPT: every case builds a fresh one
X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)


def linear() -> nnx.Linear:
    return nnx.Linear(4, 8, rngs=nnx.Rngs(0))


def gpt() -> GPT:
    return GPT(V, D, H, L, T, rngs=nnx.Rngs(0))


class GainGPT(GPT):
    """The GPT with a gain on its logits, held last (``zgain``: parameters are placed in path order)."""

    def __init__(self):
        super().__init__(V, D, H, L, T, rngs=nnx.Rngs(0))
        self.zgain = Gain(V)

    def __call__(self, ids):
        return self.zgain(super().__call__(ids))


def ids() -> np.ndarray:
    return np.arange(B * T, dtype=np.int32).reshape(B, T) % V


def snapshot(model: nnx.Module) -> list:
    """Every variable's arrays (a DArray's block and spec) and every module's class: what a failing call must
    leave alone. (``get_value`` copies the pytree around the arrays, so the arrays are what keep identity.)"""
    def state(node):
        if isinstance(node, nnx.Module):
            return type(node), ()
        value = node.get_value()
        return jax.tree.structure(value), tuple(jax.tree.leaves(value))

    return [(node, state(node)) for _, node in nnx.iter_graph(model) if isinstance(node, (nnx.Variable, nnx.Module))]


def run(model: nnx.Module, x) -> np.ndarray:
    out = model(x)
    return np.asarray(out.full() if isinstance(out, jshard.DArray) else out)


def assert_untouched(model: nnx.Module, before: list, x, want: np.ndarray) -> None:
    after = snapshot(model)
    assert len(after) == len(before)
    for (node, was), (_, now) in zip(before, after):
        same = now[0] == was[0] and len(now[1]) == len(was[1]) and all(a is b for a, b in zip(now[1], was[1]))
        assert same, (node, was, now)
    np.testing.assert_array_equal(run(model, x), want)  # still callable, and the same computation


# parallelize(model, mesh): each case gets a fresh model and the (2, 4) mesh
PARALLELIZE = [
    ("model-dict", linear, lambda m, mesh: parallelize({"kernel": np.ones((4, 8))}, mesh), TypeError,
     "parallelize: model must be a Flax nnx.Module or a function of no arguments building one .* got dict"),
    ("model-object", linear, lambda m, mesh: parallelize(object(), mesh), TypeError, "model must be .* got object"),
    ("model-state", linear, lambda m, mesh: parallelize(nnx.state(m), mesh), TypeError, "model must be .* got State"),
    ("mesh-str", linear, lambda m, mesh: parallelize(m, "mesh"), TypeError, "mesh must be a jax.sharding.Mesh.*'mesh'"),
    ("mesh-tuple", linear, lambda m, mesh: parallelize(m, (2, 4)), TypeError, "mesh must be .* got tuple"),
    ("plan-list", linear, lambda m, mesh: parallelize(m, mesh, [("", ColwiseParallel("tp"))]), TypeError,
     "plan must be a mapping .* got list"),
    ("plan-str", linear, lambda m, mesh: parallelize(m, mesh, "tp"), TypeError, "plan must be a mapping .* got str"),
    ("plan-key-int", linear, lambda m, mesh: parallelize(m, mesh, {0: ColwiseParallel("tp")}), TypeError,
     "plan key 0 .* not a module path pattern"),
    ("style-str", linear, lambda m, mesh: parallelize(m, mesh, {"": "colwise"}), TypeError,
     r"plan\[''\] holds 'colwise' .* not a parallel style"),
    ("style-placement", linear, lambda m, mesh: parallelize(m, mesh, {"": Shard(0)}), TypeError,
     r"plan\[''\] holds S\(0\) \(Shard\).*with_partitioning"),
    ("style-list-int", gpt, lambda m, mesh: parallelize(m, mesh, {"head": [ColwiseParallel("tp"), 3]}), TypeError,
     r"plan\['head'\] holds 3 \(int\)"),
    ("style-class", linear, lambda m, mesh: parallelize(m, mesh, {"": ColwiseParallel}), TypeError,
     r"make one: ColwiseParallel\('tp'\)"),
    ("default-str", linear, lambda m, mesh: parallelize(m, mesh, default="fsdp"), TypeError,
     "default= holds 'fsdp'"),
    ("default-placement", linear, lambda m, mesh: parallelize(m, mesh, default=[Shard(0)]), TypeError,
     r"default= holds S\(0\)"),
    ("rules-str", linear, lambda m, mesh: parallelize(m, mesh, rules="embed"), TypeError,
     "rules= takes .* pairs.* got str 'embed'"),
    ("rules-entry", linear, lambda m, mesh: parallelize(m, mesh, rules=[("embed",)]), TypeError,
     r"rules= .* got the entry \('embed',\)"),
    ("rules-axis", linear, lambda m, mesh: parallelize(m, mesh, rules=[("embed", "model")]), ValueError,
     r"rules= maps 'embed' to 'model'.*mesh\(dp=2, tp=4\)"),
    ("rules-twice", linear, lambda m, mesh: parallelize(m, mesh, rules=[("embed", "dp"), ("embed", "tp")]),
     ValueError, "rules= maps 'embed' twice"),
    ("axis-not-in-mesh", gpt, lambda m, mesh: parallelize(m, mesh, {"head": ColwiseParallel("model")}), ValueError,
     r"mesh axis 'model'.*mesh\(dp=2, tp=4\)"),
    ("pattern-matches-nothing", gpt, lambda m, mesh: parallelize(m, mesh, {"blocks/*/mlp": ColwiseParallel("tp")}),
     ValueError, r"pattern\(s\) \['blocks/\*/mlp'\] match no module"),
    # two patterns on one module, one mesh axis, two styles: the conflict, not "matches no module" for the one
    # that lost (as when the first matching pattern won)
    ("patterns-conflict", gpt,
     lambda m, mesh: parallelize(m, mesh, {"*p": ColwiseParallel("tp"), "blocks/0/up": RowwiseParallel("tp")}),
     ValueError, r"plan patterns '\*p' and 'blocks/0/up' both match 'blocks/0/up' and give it different styles on "
                 r"mesh axis 'tp', ColwiseParallel\(axis='tp'.*\) and RowwiseParallel\(axis='tp'.*\); make the "
                 r"patterns disjoint"),
    ("patterns-conflict-in-a-list", gpt,
     lambda m, mesh: parallelize(m, mesh, {"blocks/*/[qkv]": [FullyShard("dp"), ColwiseParallel("tp")],
                                           "blocks/*/q": [FullyShard("dp"), RowwiseParallel("tp")]}),
     ValueError, r"'blocks/\*/\[qkv\]' and 'blocks/\*/q' both match 'blocks/0/q' .* on mesh axis 'tp'"),
    ("patterns-conflict-at-the-root", linear,
     lambda m, mesh: parallelize(m, mesh, {"*": FullyShard("dp"), "": DataParallel("dp")}), ValueError,
     r"plan patterns '\*' and '' both match the root module .* on mesh axis 'dp'"),
    ("two-styles-one-axis", gpt,
     lambda m, mesh: parallelize(m, mesh, {"head": [ColwiseParallel("tp"), RowwiseParallel("tp")]}), ValueError,
     "both place head on mesh axis 'tp'"),
    # the style fails on the last module, after blocks/*, head and ln were placed: nothing may have changed
    ("style-cannot-place-late", GainGPT,
     lambda m, mesh: parallelize(m, mesh, {**plan("tp")[0], "zgain": ColwiseParallel("tp")}, default=FullyShard("dp")),
     ValueError, r"ColwiseParallel\('tp'\): no placement for parameter 'gain' \(16,\) of Gain at zgain; it places "
                 r"Flax's Linear, LinearGeneral, .* by what their dims mean.*Give this module another style"),
    ("style-on-uncalled-list", gpt, lambda m, mesh: parallelize(m, mesh, {"blocks": SequenceParallel("tp")}),
     ValueError, "constrains the input and output of List, which is never called"),
]


@pytest.mark.parametrize("make,call,exc,match", [c[1:] for c in PARALLELIZE], ids=[c[0] for c in PARALLELIZE])
def test_parallelize_refuses_bad_input_and_leaves_the_model(make, call, exc, match):
    model = make()
    x = ids() if isinstance(model, GPT) else X
    want, before = run(model, x), snapshot(model)
    with pytest.raises(exc, match=match):
        call(model, make_mesh((2, 4)))
    assert_untouched(model, before, x, want)


def test_patterns_overlapping_without_conflict_all_apply():
    """Every pattern matching a module applies to it: styles on different mesh axes compose (as in one pattern's
    list), one style matched twice counts once; the module computes as before."""
    mesh = make_mesh((2, 4))
    model = parallelize(gpt(), mesh, {"*p": ColwiseParallel("tp"), "blocks/0/up": FullyShard("dp"),
                                      "blocks/*/[qkv]": ColwiseParallel("tp"), "blocks/0/q": ColwiseParallel("tp"),
                                      "blocks/0/down": RowwiseParallel("tp")})
    block = model.blocks[0]
    assert block.up.kernel.get_value().placements == (Shard(0), Shard(1))  # FSDP on dp and column parallel on tp
    assert block.q.kernel.get_value().placements == block.k.kernel.get_value().placements == (R, Shard(1))
    assert block.down.kernel.get_value().placements == (R, Shard(0))
    assert_close(model(ids()).full(), gpt()(ids()), n=summed_terms(V, D, L, T, B))


def test_an_unknown_logical_annotation_leaves_the_model():
    init = nnx.initializers.lecun_normal()
    with nnx.use_eager_sharding(False):
        model = nnx.Linear(4, 8, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, ("embed", "mlp")))
    want, before = run(model, X), snapshot(model)
    with pytest.raises(ValueError, match=r"names 'mlp', which is neither a mesh axis.*rules=\[\('embed', 'dp'\)\]"):
        parallelize(model, make_mesh((2, 4)), rules=[("embed", "dp")])
    assert_untouched(model, before, X, want)


STYLES = [
    ("axis-int", lambda: ColwiseParallel(3), TypeError, r"ColwiseParallel: axis must be a mesh axis name .* got 3"),
    ("axis-none", lambda: RowwiseParallel(axis=None), TypeError, "RowwiseParallel: axis must be .* got None"),
    ("axis-empty", lambda: FullyShard(""), TypeError, "FullyShard: axis must be .* got ''"),
    ("input-str", lambda: ColwiseParallel("tp", input="R"), TypeError,
     r"ColwiseParallel\('tp'\): input must be a placement .* got 'R'"),
    ("output-class", lambda: RowwiseParallel("tp", output=Shard), TypeError,
     r"RowwiseParallel\('tp'\): output must be a placement"),
    ("dim-str", lambda: SequenceParallel("tp", dim="1"), TypeError, r"SequenceParallel\('tp'\): dim must be an int"),
    ("dim-float", lambda: FullyShard("dp", dim=1.5), TypeError, r"FullyShard\('dp'\): dim must be an int, got 1.5"),
    ("dim-bool", lambda: DataParallel("dp", dim=True), TypeError, r"DataParallel\('dp'\): dim must be an int"),
    # input and output follow from dim: passing them is refused, never silently replaced
    ("sequence-input", lambda: SequenceParallel("tp", input=Shard(2)), TypeError,
     "unexpected keyword argument 'input'"),
    ("data-input", lambda: DataParallel("dp", input=Shard(1)), TypeError, "unexpected keyword argument 'input'"),
]


@pytest.mark.parametrize("make,exc,match", [c[1:] for c in STYLES], ids=[c[0] for c in STYLES])
def test_styles_refuse_bad_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


def parallel_linear() -> nnx.Linear:
    return parallelize(linear(), make_mesh((2, 4)), {"": ColwiseParallel("tp")})


def batch() -> jshard.DArray:
    return jshard.distribute(X, make_mesh((2, 4)), (Shard(0), R))


def mse(model, x):
    return jnp.mean(model(x) ** 2)


# (model, call): the model is parallelized; a failing call must leave it usable
TRAINING = [
    ("model-str", lambda m: TrainStep("model", optax.sgd(0.1), mse), TypeError,
     "TrainStep: model must be a Flax nnx.Module .* got str"),
    ("model-not-parallelized", lambda m: TrainStep(linear(), optax.sgd(0.1), mse), ValueError,
     "TrainStep: the parameters of Linear are not DArrays.*call jshard.parallel.parallelize"),
    ("tx-str", lambda m: TrainStep(m, "adam", mse), TypeError,
     "TrainStep: tx must be an optax.GradientTransformation.* got str 'adam'"),
    ("tx-factory", lambda m: TrainStep(m, optax.adamw, mse), TypeError, r"call it: adamw\(learning_rate\)"),
    ("loss-not-callable", lambda m: TrainStep(m, optax.sgd(0.1), "mse"), TypeError,
     "TrainStep: loss_fn must be a function"),
    ("donate-str", lambda m: TrainStep(m, optax.sgd(0.1), mse, donate="yes"), TypeError,
     "TrainStep: donate must be True or False"),
    ("cost-model-dict", lambda m: TrainStep(m, optax.sgd(0.1), mse, cost_model={"dp": 1.0}), TypeError,
     r"^TrainStep: cost_model must be a jshard.CostModel or None, got \{'dp': 1.0\}"),
    ("loss-not-scalar", lambda m: TrainStep(m, optax.sgd(0.1), lambda m, x: m(x))(batch()), TypeError,
     r"TrainStep: loss_fn .*<lambda> returned float32\[8, 8\]; it must return the loss alone, a float scalar"),
    ("loss-with-aux", lambda m: TrainStep(m, optax.sgd(0.1), lambda m, x: (mse(m, x), m(x)))(batch()), TypeError,
     "returned tuple; it must return the loss alone"),
    ("loss-int", lambda m: TrainStep(m, optax.sgd(0.1), lambda m, x: jnp.sum(m(x) > 0))(batch()), TypeError,
     r"returned int32\[\]"),
    ("init-tx-str", lambda m: init_optimizer("adam", nnx.state(m, nnx.Param)), TypeError,
     "init_optimizer: tx must be an optax.GradientTransformation"),
    ("init-params-module", lambda m: init_optimizer(optax.sgd(0.1), m), TypeError,
     r"init_optimizer: params is a whole nnx.Module; pass .* nnx.state\(model, nnx.Param\)"),
    ("init-params-str", lambda m: init_optimizer(optax.sgd(0.1), "params"), ValueError,
     "init_optimizer: params .*str.* hold no DArray"),
    ("init-params-plain", lambda m: init_optimizer(optax.sgd(0.1), nnx.state(linear(), nnx.Param)), ValueError,
     "init_optimizer: params .*State.* hold no DArray"),
    ("placements-of-int", lambda m: placements_of(3), ValueError, "placements_of: int 3 holds no DArray"),
    ("placements-of-plain-state", lambda m: placements_of(nnx.state(linear())), ValueError,
     "placements_of: State holds no DArray"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in TRAINING], ids=[c[0] for c in TRAINING])
def test_training_refuses_bad_input_and_leaves_the_model(call, exc, match):
    model = parallel_linear()
    want, before = run(model, X), snapshot(model)
    with pytest.raises(exc, match=match):
        call(model)
    assert_untouched(model, before, X, want)  # nothing was donated: the parameters still hold their values


def test_a_failing_parallelize_leaves_the_model_as_it_was():
    # before: blocks/* and head became DArrays before the last module's style failed, and the half-converted
    # model could neither run nor be parallelized again
    model = GainGPT()
    want, before = run(model, ids()), snapshot(model)
    mesh = make_mesh((2, 4))
    with pytest.raises(ValueError, match="'gain'"):
        parallelize(model, mesh, {**plan("tp")[0], "zgain": ColwiseParallel("tp")})
    assert_untouched(model, before, ids(), want)
    parallelize(model, mesh, plan("tp")[0])  # and the fixed plan goes through
    assert model.zgain.gain.get_value().placements == (R, R)
    assert_close(model(ids()).full(), want, n=summed_terms(V, D, L, T, B))


def test_parallelizing_again_replaces_the_styles():
    mesh = make_mesh((2, 4))
    model = parallelize(linear(), mesh, {"": ColwiseParallel("tp")})
    parallelize(model, mesh, {"": RowwiseParallel("tp")}, default=FullyShard("dp"))
    assert model.kernel.get_value().placements == (StridedShard(0, 4), Shard(0))  # FSDP inside the TP block
    assert type(model).__mro__[1] is nnx.Linear  # one wrapper, the new one: constraints never stack
    assert_close(model(X).full(), linear()(X), n=4)


def test_a_parallelized_gpt_runs_eagerly_like_the_original():
    mesh = make_mesh((2, 4))
    p, default = plan("tp")
    model = parallelize(gpt(), mesh, p, default=FullyShard("dp"))
    x = jshard.distribute(ids(), mesh, (Shard(0), R))
    n = summed_terms(V, D, L, T, B)
    for got in (model(ids()), model(x), TrainStep(model, optax.sgd(0.1), mse).model(ids())):
        assert isinstance(got, jshard.DArray)
        assert_close(got.full(), gpt()(ids()), n=n)
    # a submodule runs eagerly too
    assert_close(model.tok(ids()).full(), gpt().tok(ids()), n=1)


TRACES = []


class Counted(nnx.Module):
    """Counts its traces; a Python flag chooses its sign, as Flax modules take ``deterministic=``."""

    def __init__(self):
        self.lin = linear()

    def __call__(self, x, *, negate: bool = False):
        TRACES.append(negate)  # a Python side effect: once per trace, not per compiled call
        y = self.lin(x)
        return -y if negate else y


def test_eager_calls_reuse_the_program_and_keep_python_flags_static():
    mesh = make_mesh((2, 4))
    model = parallelize(Counted(), mesh, {"lin": ColwiseParallel("tp")})
    want = linear()(X)
    TRACES.clear()
    for x in (X, X + 0, X):
        assert_close(model(x).full(), want, n=4)
    assert_close(model(X, negate=True).full(), -want, n=4)
    assert TRACES == [False, True]  # one trace per flag value, each program reused


def test_a_closed_over_parallelized_model_is_named_inside_a_transformation():
    model = parallel_linear()
    with pytest.raises(TypeError, match=r"Linear: called inside a JAX transformation .* jshard.jit\(lambda m, x"):
        jax.jit(lambda x: model(x))(X)


class DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.gelu(self.up(x))))


def dropout_mlp() -> DropoutMLP:
    return DropoutMLP(nnx.Rngs(params=0, dropout=1))


def dropout_batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(8, 8)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32))
            for _ in range(steps)]


def regression(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def one_device_dropout_losses(tx: optax.GradientTransformation, batches) -> list[float]:
    """Plain jax/optax on one device, the RNG state carried from step to step (a fresh mask every step)."""
    graphdef, params, rest = nnx.split(dropout_mlp(), nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, rest, x, y):
        def loss_of(p):
            model = nnx.merge(graphdef, p, rest, copy=True)  # the dropout count is updated inside the grad trace
            return regression(model, x, y), nnx.state(model, nnx.Not(nnx.Param))

        (loss, rest), g = jax.value_and_grad(loss_of, has_aux=True)(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, rest, loss

    losses = []
    for x, y in batches:
        params, opt_state, rest, loss = step(params, opt_state, rest, x, y)
        losses.append(float(loss))
    return losses


def test_eager_calls_advance_the_dropout_rng_like_flax():
    # an eager call's state updates (the RNG count) live on in the model: each call draws the next mask
    model = parallelize(dropout_mlp(), make_mesh((2, 4)), {"up": ColwiseParallel("tp"), "down": RowwiseParallel("tp")})
    plain, x = dropout_mlp(), np.ones((8, 8), np.float32)
    outs = [model(x).full() for _ in range(2)]
    for got in outs:
        assert_close(got, plain(x), n=8 + 32)
    assert not np.array_equal(outs[0], outs[1])


def test_a_dropout_model_trains_like_one_device():
    # nnx.Rngs state (a typed PRNG key and a counter) travels through TrainStep's jshard.jit program and comes
    # back advanced, so each step draws a new mask: the same masks as one device
    mesh = make_mesh((2, 4))
    model = parallelize(dropout_mlp(), mesh, {"up": ColwiseParallel("tp"), "down": RowwiseParallel("tp")},
                        default=FullyShard("dp"))
    tx = optax.adam(1e-2)
    step = TrainStep(model, tx, regression)
    batches = dropout_batches(3)
    losses = [float(step(*(jshard.distribute(a, mesh, (Shard(0), R)) for a in b))) for b in batches]
    want = one_device_dropout_losses(tx, batches)
    # up contracts 8 terms, down 32, the mean 64; the backward pass as many again
    assert curve_ratio(losses, want, n_per_step=2 * (8 + 32 + 64)) <= 1, (losses, want)
    # dropout really ran (not the loss without it), with a fresh mask each step: the same batch at the same
    # parameters gives another loss
    plain = dropout_mlp()
    plain.eval()
    assert abs(losses[0] - float(regression(plain, *batches[0]))) > 1e-3
    frozen = TrainStep(parallelize(dropout_mlp(), mesh), optax.sgd(0.0), regression)
    x, y = (jshard.distribute(a, mesh, (Shard(0), R)) for a in batches[0])
    assert float(frozen(x, y)) != float(frozen(x, y))
