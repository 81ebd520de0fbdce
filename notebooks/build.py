"""Writes the notebooks from the cells below and runs them, keeping their outputs (``python notebooks/build.py``;
``--no-execute`` writes the code alone, ``--check`` says whether the committed notebooks hold this code). The
cells live here as plain text so that reviews see code, not JSON; the test suite runs the written notebooks
and fails when a committed notebook's code differs from what this file writes."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "README.md")


def repository() -> str:
    """The repository's URL, from the one place that states it: the README's "Install" section."""
    with open(README) as f:
        found = re.search(r'pip install "git\+(https://[^"]+)"', f.read())
    if found is None:
        raise SystemExit("README.md: no 'pip install \"git+<repository URL>\"' line in its Install section")
    return found.group(1)


def colab(name: str) -> str:
    """The link that opens notebook ``name`` of the repository in Colab."""
    return repository().replace("https://github.com/", "https://colab.research.google.com/github/") + \
        f"/blob/main/notebooks/{name}"


INSTALL = """# Colab-ready: install jshard when this runtime lacks it, and say how. Inside a clone of the repository it
# is built from the clone; elsewhere from PyPI, then from the repository (README, "Install"). JSHARD_SOURCE
# (any pip requirement: a wheel, a path, a git URL) is tried first.
import importlib, importlib.metadata, importlib.util, os, pathlib, subprocess, sys
if importlib.util.find_spec("jshard") is None:
    clones = [str(d) for d in (pathlib.Path.cwd(), pathlib.Path.cwd().parent)
              if (d / "pyproject.toml").is_file() and 'name = "jshard"' in (d / "pyproject.toml").read_text()]
    sources = [os.environ.get("JSHARD_SOURCE"), *clones, "jshard", "git+REPOSITORY"]
    for source in filter(None, sources):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", source], capture_output=True, text=True)
        if done.returncode == 0:
            importlib.invalidate_caches()
            print(f"installed jshard: pip install {source}")
            break
        print(f"pip install {source} failed:", (done.stderr.strip().splitlines() or ["?"])[-1])
    else:
        raise RuntimeError("could not install jshard: set JSHARD_SOURCE to a wheel, a path or a git URL of it")
else:
    print("jshard", importlib.metadata.version("jshard"), "is installed")""".replace("REPOSITORY", repository())

SETUP = '''# emulate 8 CPU devices when there are not 8 accelerators (this must run before JAX starts)
import os
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, jax.numpy as jnp, numpy as np
import jshard
from jshard import Partial, Replicate, Shard, StridedShard
devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices[:8])
print(len(devices), devices[0].platform, "devices;", jshard.spec.format_mesh(mesh))'''


def title(name: str, text: str) -> tuple[str, str]:
    """The first cell: the title, a link to open the notebook in Colab, and the introduction."""
    heading, _, rest = text.partition("\n")
    badge = f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab(name)})"
    return ("md", f"{heading}\n\n{badge}\n{rest}")


PLACEMENTS = [
    title("01_placements.ipynb",
          "# jshard 1: placements, redistribution, Partial and linearity\n"
          "A `DArray` is a global array plus one placement per mesh axis: `Replicate()` (R), `Shard(d)` (S(d)), "
          "`StridedShard(d, sf)` and `Partial(op)` (a pending reduction). Every cell checks its claims against "
          "the plain numpy value (an `assert` fails the cell otherwise)."),
    ("code", INSTALL),
    ("code", SETUP),
    ("md", "## Placements and uneven shards\n10 columns over 4 devices are held as 3, 3, 3, 1 (torch.chunk sizes)."),
    ("code", '''g = np.arange(60.0, dtype=np.float32).reshape(6, 10)
x = jshard.distribute(g, mesh, [Shard(0), Shard(1)])
print(x)
print(jshard.visualize(x))'''),
    ("md", "## Redistribution plans\nAny layout to any other, with the cheapest explicit collectives."),
    ("code", '''plan = jshard.plan_redistribute(x, [Shard(1), Shard(0)])
print(plan)
y = x.redistribute([Shard(1), Shard(0)])
assert np.array_equal(np.asarray(y.full()), g)
assert [s.kind for s in plan.steps] == ["all_gather", "all_to_all", "slice"]  # two collectives, then a local slice
strided = jshard.distribute(g, mesh, [StridedShard(0, 2), Shard(0)])
gather = jshard.plan_redistribute(strided, [Replicate(), Replicate()])
print(gather)
assert len(gather.collectives) == 1  # one all_gather over the axis tuple (dp, tp)
assert np.array_equal(np.asarray(strided.redistribute([Replicate(), Replicate()]).full()), g)'''),
    ("md", "## Partial and linearity\nA sharded contraction leaves a `Partial(sum)`; linear ops keep it, others "
           "reduce first. The cast to int is the trap: truncating each part and then summing is wrong."),
    ("code", '''a = jshard.distribute(np.full((8, 4), 0.5, np.float32), mesh, [Replicate(), Shard(1)])
b = jshard.distribute(np.ones((4, 8), np.float32), mesh, [Replicate(), Shard(0)])
print(jshard.explain(lambda a, b: (a @ b).astype(jnp.int32), a, b))
c = jshard.jit(lambda a, b: (a @ b).astype(jnp.int32))(a, b)
print("jshard:", np.asarray(c.full())[0, :4], "(the truth is 2: 4 x 0.5)")
assert (np.asarray(c.full()) == 2).all()'''),
    ("md", "JAX 0.10.2's explicit sharding mode keeps the product *unreduced* through the cast and truncates each "
           "device's 0.5 to 0, then sums: 0."),
    ("code", '''from jax.sharding import AxisType, PartitionSpec as P
explicit = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices[:8], axis_types=(AxisType.Explicit,) * 2)
with jax.set_mesh(explicit):
    ea = jax.device_put(np.full((8, 4), 0.5, np.float32), P(None, "tp"))
    eb = jax.device_put(np.ones((4, 8), np.float32), P("tp", None))
    d = jnp.matmul(ea, eb, out_sharding=P(None, None, unreduced={"tp"}))
    print("JAX explicit mode:", np.asarray(jax.reshard(d.astype(jnp.int32), P()))[0, :4])'''),
    ("md", "## Partial(max) and a reduction over two mesh axes\nMonotone maps keep `P(max)`; a sum over both "
           "axes is one all-reduce over the axis tuple, and every replica is bitwise identical."),
    ("code", '''from jshard.validate.tolerance import is_close
v = np.random.default_rng(0).standard_normal((6, 10)).astype(np.float32)
m = jshard.from_local([v - (i % 3) for i in range(8)], mesh, [Partial("max"), Partial("max")])
e = jshard.jit(lambda t: jnp.exp(t) * 2.0)(m)
print(e.placements, is_close(e.full(), np.exp(v) * 2, terms=np.exp(v) * 2))  # exp rounds once per element
assert e.placements == (Partial("max"), Partial("max")) and is_close(e.full(), np.exp(v) * 2, terms=np.exp(v) * 2)
s = jshard.jit(jnp.sum, out_placements=(Replicate(), Replicate()))(jshard.distribute(v, mesh, [Shard(0), Shard(1)]))
sharded = jshard.distribute(v, mesh, [Shard(0), Shard(1)])
totals = jshard.explain(jnp.sum, sharded, out_placements=(Replicate(), Replicate())).totals
print(totals)
assert {k: count for k, (count, _) in totals.items()} == {"all_reduce": 1}  # one all-reduce over (dp, tp)
blocks = [np.asarray(t) for t in s.to_local()]
same = all(np.array_equal(blocks[0], t) for t in blocks)
print("value", float(s), "vs", float(v.sum()), "; replicas bitwise equal:", same)
assert same and is_close(float(s), v.sum(), n=v.size, terms=np.abs(v).sum())'''),
]

FLAX = [
    title("02_flax_tensor_parallel.ipynb",
          "# jshard 2: a Flax model, tensor / sequence / fully-sharded parallel\n"
          "A small GPT in Flax NNX (`jshard.gpt`), made parallel by naming styles per module path, trained with "
          "optax next to the same model on one device."),
    ("code", INSTALL),
    ("code", SETUP),
    ("code", '''import optax
from flax import nnx
from jshard.gpt import GPT, cross_entropy, plan
from jshard.parallel import ColwiseParallel, RowwiseParallel, TrainStep, parallelize, placements_of

V, D, H, L, T, B = 64, 32, 4, 2, 16, 8
make = lambda: GPT(V, D, H, L, T, rngs=nnx.Rngs(0))
loss_fn = lambda model, ids, labels: cross_entropy(model(ids), labels)
rng = np.random.default_rng(0)
batches = [tuple(rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(8)]
styles, _ = plan("tp")
for path, style in styles.items():
    print(f"{path:<14} {style}")'''),
    ("md", "## Tensor parallel: placements and what one step communicates"),
    ("code", '''# built sharded: parallelize runs the constructor so that each device draws only its own blocks
model = parallelize(make, mesh, *plan("tp")[:1])
print({k: v for k, v in placements_of(nnx.state(model.blocks[0], nnx.Param)).items() if k in ("q", "o")})
step = TrainStep(model, optax.adamw(3e-3), loss_fn)
# each process reads only its rows of a batch (one process here: all of them), as a per-host loader does
batch_axes = [Shard(0), Replicate()]
rows = jshard.process_rows(mesh, batch_axes, (B, T))
data = lambda b: [jshard.from_process_local(a[rows], mesh, batch_axes, shape=(B, T)) for a in b]
ex = step.explain(*data(batches[0]))
print(ex.totals)
print("\\n".join(str(ex).splitlines()[:12]))'''),
    ("md", "## Communication per style\nThe same step under each style (bytes per device per step, by collective)."),
    ("code", '''import matplotlib.pyplot as plt
volumes = {}
for style in ["dp", "tp", "sp", "fsdp"]:
    p, default = plan(style)
    s = TrainStep(parallelize(make, mesh, p, default=default), optax.adamw(3e-3), loss_fn)
    volumes[style] = {k: b for k, (c, b) in s.explain(*data(batches[0])).totals.items()}
kinds = sorted({k for v in volumes.values() for k in v})
fig, ax = plt.subplots(figsize=(7, 3))
bottom = np.zeros(len(volumes))
for k in kinds:
    vals = np.array([volumes[s].get(k, 0) / 1e3 for s in volumes])
    ax.bar(list(volumes), vals, bottom=bottom, label=k)
    bottom += vals
ax.set_ylabel("kB per device per step"); ax.legend(); plt.show()
print(volumes)
assert set(volumes["dp"]) == {"all_reduce"}  # data parallel: the gradients' all-reduce over dp, nothing else
assert {"all_gather", "reduce_scatter"} <= set(volumes["fsdp"])  # parameters gathered, gradients scattered'''),
    ("md", "## Training against one device"),
    ("code", '''from jshard.gpt import one_device_trainer, summed_terms
from jshard.validate.tolerance import curve_ratio
tx = optax.adamw(3e-3)
reference = one_device_trainer(make(), tx, loss_fn)  # plain jax.jit on one device
p, default = plan("sp")
sp_step = TrainStep(parallelize(make, mesh, p, default=default), tx, loss_fn)
ours, theirs = [], []
for ids, labels in batches:
    ours.append(float(sp_step(*data((ids, labels)))))
    theirs.append(reference(ids, labels))
print(np.round(ours, 4)); print(np.round(theirs, 4))
# within the rounding a reordered computation explains, step by step (jshard.validate.tolerance)
assert curve_ratio(ours, theirs, n_per_step=summed_terms(V, D, L, T, B)) <= 1'''),
    ("md", "## Checkpoints: save under one plan, restore under another\n"
           "`jshard.checkpoint.save` writes every parameter and optimizer state as its global array (Orbax's format), "
           "each device its own rows; `restore(like=...)` reads them into the template's placements, here fully "
           "sharded over all 8 devices instead of sequence parallel."),
    ("code", '''import tempfile
import jshard.checkpoint
path = tempfile.mkdtemp() + "/after_8_steps"
jshard.checkpoint.save(path, sp_step.state)
p, default = plan("fsdp")
fsdp_step = TrainStep(parallelize(make, mesh, p, default=default), tx, loss_fn)
fsdp_step.state = jshard.checkpoint.restore(path, like=fsdp_step.state)
kernel = lambda s: s.model.blocks[0].q.kernel.get_value()
print("sp:  ", kernel(sp_step).placements, "\\nfsdp:", kernel(fsdp_step).placements)
ids, labels = batches[0]
a, b = float(sp_step(*data((ids, labels)))), float(fsdp_step(*data((ids, labels))))
print(f"step 9: sp {a:.6f}, fsdp from the checkpoint {b:.6f}")
assert abs(a - b) <= 1e-6 * abs(a)'''),
]


LARGE = [
    title("03_large_models_and_checkpoints.ipynb",
          "# jshard 3: a model larger than one device, FSDP x TP, and checkpoints\n"
          "Emulated CPU devices share the host's memory, so here each device is given a notional budget, "
          "`BUDGET_MB`, and XLA's own memory analysis of each compiled step says what a device needs. The GPT "
          "below does not fit one device; built sharded from its constructor (no device or host ever holds it "
          "whole), it trains under FSDP x TP, is saved, and is restored under two other plans. The one-device "
          "reference that checks the losses runs on the host, which has no such budget."),
    ("code", INSTALL),
    ("code", SETUP),
    ("code", '''import optax
from flax import nnx
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import FullyShard, TrainStep, parallelize
from jshard.validate.tolerance import curve_ratio

V, D, H, L, T, B = 4096, 256, 8, 4, 32, 8
BUDGET_MB = 48
make = lambda: GPT(V, D, H, L, T, rngs=nnx.Rngs(0))
loss_fn = lambda model, ids, labels: cross_entropy(model(ids), labels)
tx = optax.adamw(1e-3)
MB = 2**20


def compiled_mb(lowered) -> float:
    """A device's memory for one compiled step: its arguments (the state it holds) and temporaries."""
    m = lowered.compile().memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes) / MB


# the whole model on one device, from shapes alone (nnx.eval_shape allocates nothing)
graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
n_params = sum(p.size for p in jax.tree.leaves(params))


def one_device_step(params, opt_state, ids, labels):
    loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), ids, labels))(params)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
opt_state = jax.eval_shape(tx.init, params)
whole_state_mb = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((params, opt_state))) / MB
whole_mb = compiled_mb(jax.jit(one_device_step).lower(params, opt_state, ids, ids))
print(f"{n_params / 1e6:.1f}M parameters, {whole_state_mb:.0f} MB with AdamW's state; one training step on one "
      f"device needs {whole_mb:.0f} MB (budget {BUDGET_MB} MB)")
assert whole_mb > BUDGET_MB'''),
    ("md", "## Built sharded, trained under FSDP x TP\n"
           "`parallelize` runs the constructor inside one sharded program: each device draws only its blocks. "
           "Megatron's tensor-parallel styles cut the layers over `tp`; `FullyShard(\"dp\")` cuts every "
           "parameter over `dp` as well, inside the tensor-parallel blocks. The token embedding is "
           "vocabulary-parallel (its rows split over `tp`); the position embedding, which no tensor-parallel "
           "style takes, is split over `dp` alone."),
    ("code", '''tp_styles, _ = plan("tp")
plans = {"FSDP2 x TP4": (mesh, tp_styles, (FullyShard("dp"),))}
step = TrainStep(parallelize(make, mesh, tp_styles, default=(FullyShard("dp"),)), tx, loss_fn)


def held_mb(tree) -> np.ndarray:
    """MB each device holds of the DArrays in ``tree`` (padding included: what is allocated)."""
    held = {}
    for x in jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, jshard.DArray)):
        if isinstance(x, jshard.DArray):
            for shard in x.block.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return np.array(list(held.values())) / MB


print(step.model.blocks[0].down.kernel.get_value())
state_mb = held_mb(step.state)
print(f"parameters and AdamW state: {state_mb.max():.1f} MB per device of {whole_state_mb:.0f} MB")
assert state_mb.max() <= whole_state_mb / 4

rng = np.random.default_rng(0)
batches = [tuple(rng.integers(0, V, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(4)]
data = lambda m, b: [jshard.distribute(a, m, [Shard(0)] + [Replicate()] * (m.devices.ndim - 1)) for a in b]
reference = one_device_trainer(make(), tx, loss_fn)  # plain jax.jit on one device (the host: no budget)
ours, theirs = [], []
for b in batches[:3]:
    ours.append(float(step(*data(mesh, b))))
    theirs.append(reference(*b))
print(np.round(ours, 5)); print(np.round(theirs, 5))
assert curve_ratio(ours, theirs, n_per_step=summed_terms(V, D, L, T, B)) <= 1'''),
    ("md", "## Saved, then restored under other plans\n"
           "`jshard.checkpoint.save` writes each array as its global value in Orbax's format, every device its "
           "own rows; `restore(like=...)` reads each device's rows of the template's placements: FSDP over all "
           "8 devices of a one-axis mesh, and DP2 x TP4 (parameters replicated over `dp`). Each takes step 4, "
           "and so does the original plan: the three losses agree."),
    ("code", '''import tempfile
import jshard.checkpoint
path = tempfile.mkdtemp() + "/after_3_steps"
jshard.checkpoint.save(path, step.state)
mesh8 = jax.make_mesh((8,), ("dp",), devices=devices[:8])
plans["FSDP8"] = (mesh8, {}, (FullyShard("dp"),))
plans["DP2 x TP4"] = (mesh, tp_styles, ())
steps = {"FSDP2 x TP4": step}
for name in ["FSDP8", "DP2 x TP4"]:
    m, styles, default = plans[name]
    steps[name] = TrainStep(parallelize(make, m, styles, default=default), tx, loss_fn)
    steps[name].state = jshard.checkpoint.restore(path, like=steps[name].state)
step4 = {name: float(steps[name](*data(plans[name][0], batches[3]))) for name in steps}
print(step4)
first = step4["FSDP2 x TP4"]
assert all(abs(loss - first) <= 1e-5 * abs(first) for loss in step4.values())'''),
    ("md", "## Memory and communication per plan\n"
           "Per device: the state it holds, and what XLA says its compiled step needs (arguments and "
           "temporaries: gathered parameters, activations, gradients); per step: the bytes each device moves "
           "in collectives (`explain`)."),
    ("code", '''import matplotlib.pyplot as plt
rows = {}
for name, s in steps.items():
    batch = data(plans[name][0], batches[0])
    totals = s.explain(*batch).totals
    rows[name] = {"state": held_mb(s.state).max(), "step": compiled_mb(s.lower(*batch)),
                  "comm": sum(b for _, b in totals.values()) / MB, "collectives": sum(c for c, _ in totals.values())}
    print(f"{name:<12} state {rows[name]['state']:5.1f} MB   step {rows[name]['step']:5.1f} MB   "
          f"{rows[name]['collectives']:3d} collectives, {rows[name]['comm']:5.1f} MB per step")
fig, (mem, comm) = plt.subplots(1, 2, figsize=(10, 3.2))
x = np.arange(len(rows))
mem.bar(x - 0.2, [r["step"] for r in rows.values()], 0.4, label="compiled step")
mem.bar(x + 0.2, [r["state"] for r in rows.values()], 0.4, label="state held")
mem.axhline(BUDGET_MB, color="k", ls="--", lw=1, label="device budget")
mem.axhline(whole_mb, color="r", ls=":", lw=1, label="one device")
mem.set_xticks(x, list(rows)); mem.set_ylabel("MB per device"); mem.legend(fontsize=8)
comm.bar(list(rows), [r["comm"] for r in rows.values()], color="tab:green")
comm.set_ylabel("MB per device per step")
plt.tight_layout(); plt.show()
assert all(r["step"] < whole_mb for r in rows.values())
assert rows["FSDP2 x TP4"]["step"] <= BUDGET_MB'''),
]

LONG = [
    title("04_long_context_and_deep_models.ipynb",
          "# jshard 4: long context and deep models\n"
          "Long sequences: the sequence of every activation sharded over a mesh axis (context parallelism), and "
          "attention across it by passing key/value blocks around a ring, gathering them, or moving the sequence "
          "to the heads and back (all-to-all). Deep models: the blocks split into stages over a mesh axis "
          "(pipeline parallelism), microbatches flowing stage to stage by a schedule. `jshard.attention` is "
          "`jax.nn.dot_product_attention` wherever jshard does not shard it; every cell checks its claims against "
          "that function or one device."),
    ("code", INSTALL),
    ("code", SETUP),
    ("code", '''import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jshard.sharded_attention import balanced, load
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan, summed_terms
from jshard.parallel import TrainStep, parallelize
from jshard.validate.tolerance import assert_close, curve_ratio

# the sequence axis "cp" over all 8 devices (Auto axes: the GSPMD comparison at the end lets XLA choose)
cp8 = jax.make_mesh((8,), ("cp",), devices=devices[:8], axis_types=(AxisType.Auto,))
rng = np.random.default_rng(0)
# grouped-query attention: 16 query heads read 8 key/value heads
B, T, HQ, HKV, DH = 2, 256, 16, 8, 8
q = rng.normal(size=(B, T, HQ, DH)).astype(np.float32)
k, v = (rng.normal(size=(B, T, HKV, DH)).astype(np.float32) for _ in range(2))
want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
got = jshard.attention(q, k, v, is_causal=True)  # outside jshard.jit: jax.nn.dot_product_attention itself
n = DH + 2 * T  # what an output element sums: the scores' contraction, the softmax, the weighted values
print(type(got).__name__, got.shape, "largest difference from jax.nn.dot_product_attention:",
      float(jnp.abs(got - want).max()))
assert_close(got, want, n=n)'''),
    ("md", "## The sequence sharded: ring, all-gather, all-to-all\n"
           "With the sequence cut over `cp` (32 tokens a device), attention is one equation of the plan, crossing "
           "the axis by `method`: `\"ring\"` (each device keeps its queries; key/value blocks travel round the "
           "axis one `ppermute` a step, folded into a running softmax, so no device holds more than a "
           "`[32, 32]` score block per head), `\"all_gather\"` (keys and values gathered once, scores still "
           "blockwise) or `\"all_to_all\"` (sequence -> heads, attention on whole sequences of 2 key/value "
           "heads a device, and back). `{\"cp\": method}` pins the axis to a method; `\"auto\"` lets the cost "
           "model choose from the sizes. `explain` shows each one's collectives."),
    ("code", '''x = [jshard.distribute(a, cp8, [Shard(1)]) for a in (q, k, v)]
kinds = {"ring": "permute", "all_gather": "all_gather", "all_to_all": "all_to_all"}
for method in [*kinds, "auto"]:
    f = lambda q, k, v: jshard.attention(q, k, v, is_causal=True, method={"cp": method})
    out = jshard.jit(f)(*x)
    totals = jshard.explain(f, *x).totals
    print(f"{method:<11} {out.placements}  " + ", ".join(f"{kind} x{c} ({b:,} B)" for kind, (c, b) in totals.items()))
    assert_close(out.full(), want, n=n)
    if method in kinds:
        assert kinds[method] in totals'''),
    ("md", "## Causal load balance\n"
           "Under `is_causal` a query attends only to earlier keys, and the kernel skips key blocks lying wholly "
           "after its queries. Cut into contiguous blocks, the device holding the last tokens computes most of the "
           "scores; striped (`balanced(length, size)`: token `t` on device `t % size`, the placement "
           "`StridedShard(1, length / size)`), every device holds early and late tokens alike. `load` counts "
           "the score blocks each device computes (the kernel's block size and skip rule); numpy counts the "
           "causal (query, key) pairs each device's tokens have. Striped, attention still equals one device's, "
           "since every block knows its tokens' global positions."),
    ("code", '''N = 1024
layouts = {"contiguous": Shard(1), "striped": balanced(N, 8)}
tokens = np.arange(N)
held = {"contiguous": [tokens[c * N // 8:(c + 1) * N // 8] for c in range(8)],
        "striped": [tokens[tokens % 8 == c] for c in range(8)]}
for name, p in layouts.items():
    a = jshard.distribute(np.zeros((1, N, 4, 16), np.float32), cp8, [p])
    blocks = load(a, a, is_causal=True)
    pairs = np.array([(t + 1).sum() for t in held[name]])  # causal pairs: query t sees keys 0..t
    print(f"{name:<10} {str(p):<10} score blocks per device {blocks.tolist()}  max/mean "
          f"{blocks.max() / blocks.mean():.2f}   causal pairs max/mean {pairs.max() / pairs.mean():.2f}")
    if name == "striped":
        assert blocks.max() <= 1.05 * blocks.mean() and pairs.max() <= 1.05 * pairs.mean()
    else:
        assert blocks.max() >= 1.5 * blocks.mean() and np.all(np.diff(pairs) > 0)
striped = [jshard.distribute(a, cp8, [balanced(T, 8)]) for a in (q, k, v)]
out = jshard.jit(lambda q, k, v: jshard.attention(q, k, v, is_causal=True, method={"cp": "ring"}))(*striped)
print(out.placements)
assert_close(out.full(), want, n=n)'''),
    ("md", "## A GPT trained with context parallelism\n"
           "`plan(\"dp+cp\", method=\"ring\")`: the batch over `dp`, the sequence over `cp` (`ContextParallel` on "
           "the model: its ids and activations striped on the sequence, the parameters replicated there), "
           "every attention by ring. Trained next to the same model on one device."),
    ("code", '''V, D, H, L, S, BATCH = 64, 32, 4, 2, 64, 4
make = lambda: GPT(V, D, H, L, S, rngs=nnx.Rngs(0))
loss_fn = lambda model, ids, labels: cross_entropy(model(ids), labels)
tx = optax.adamw(3e-3)
dp_cp = jax.make_mesh((2, 4), ("dp", "cp"), devices=devices[:8])
styles, default = plan("dp+cp", method="ring")
step = TrainStep(parallelize(make, dp_cp, styles, default=default), tx, loss_fn)
layout = [Shard(0), balanced(S, 4)]
batches = [tuple(rng.integers(0, V, (BATCH, S)).astype(np.int32) for _ in range(2)) for _ in range(4)]
data = lambda b: [jshard.distribute(a, dp_cp, layout) for a in b]
print("one step communicates:", step.explain(*data(batches[0])).totals)
reference = one_device_trainer(make(), tx, loss_fn)  # plain jax.jit on one device
ours = [float(step(*data(b))) for b in batches]
theirs = [reference(*b) for b in batches]
print(np.round(ours, 5)); print(np.round(theirs, 5))
assert curve_ratio(ours, theirs, n_per_step=summed_terms(V, D, L, S, BATCH)) <= 1'''),
    ("md", "## Memory and step time against sequence length, jshard vs GSPMD\n"
           "One GPT layer (width 64, 4 heads, batch 1) trained at growing lengths on `cp8`: jshard with "
           "context parallelism (attention by ring), and `jax.jit` of the same step with the parameters "
           "replicated and the ids and labels sequence-sharded over `cp` by `NamedSharding` (GSPMD decides the "
           "rest). Per device, XLA's memory analysis of each compiled step (arguments and temporaries); the step "
           "time is the median of 3 steps after the first (the emulated devices share this machine's cores: the "
           "times compare the work per step, not an interconnect). Both start from the same parameters and "
           "batch, so their first losses agree. At the shortest length the replicated parameters and optimizer "
           "state dominate and GSPMD needs less; GSPMD's memory then grows with the whole score matrix, jshard's "
           "with a device's `[S/8, S/8]` score block, and jshard's step is the faster at the longest length."),
    ("code", '''import time
import matplotlib.pyplot as plt
MB = 2**20
V, D, H, L = 256, 64, 4, 1


def compiled_mb(compiled) -> float:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes) / MB


def median_seconds(run, times=3) -> float:
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        run()
        spent.append(time.perf_counter() - start)
    return float(np.median(spent))


lengths, rows = [256, 512, 1024], {"jshard (ring)": [], "GSPMD": []}
for S in lengths:
    make = lambda: GPT(V, D, H, L, S, rngs=nnx.Rngs(0))
    ids, labels = rng.integers(0, V, (2, 1, S)).astype(np.int32)
    styles, default = plan("cp", method="ring")
    step = TrainStep(parallelize(make, cp8, styles, default=default), tx, loss_fn)
    batch = [jshard.distribute(a, cp8, [balanced(S, 8)]) for a in (ids, labels)]
    memory = compiled_mb(step.lower(*batch).compile())
    first = float(step(*batch))
    rows["jshard (ring)"].append((memory, median_seconds(lambda: float(step(*batch)))))

    graphdef, params, rest = nnx.split(make(), nnx.Param, ...)

    def gspmd_step(params, opt_state, ids, labels):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), ids, labels))(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = jax.device_put((params, tx.init(params)), NamedSharding(cp8, P()))
    gbatch = [jax.device_put(a, NamedSharding(cp8, P(None, "cp"))) for a in (ids, labels)]
    compiled = jax.jit(gspmd_step).lower(*state, *gbatch).compile()
    theirs = float(compiled(*state, *gbatch)[2])
    rows["GSPMD"].append((compiled_mb(compiled), median_seconds(lambda: float(compiled(*state, *gbatch)[2]))))
    print(f"length {S:>5}: " + "   ".join(f"{name} {r[-1][0]:5.1f} MB {r[-1][1] * 1e3:6.0f} ms"
                                          for name, r in rows.items()) + f"   first losses {first:.5f} {theirs:.5f}")
    assert curve_ratio([first], [theirs], n_per_step=summed_terms(V, D, L, S, 1)) <= 1
fig, (mem, secs) = plt.subplots(1, 2, figsize=(10, 3.2))
for name, r in rows.items():
    mem.plot(lengths, [m for m, _ in r], "o-", label=name)
    secs.plot(lengths, [t for _, t in r], "o-", label=name)
mem.set_xlabel("sequence length"); mem.set_ylabel("MB per device"); mem.legend()
secs.set_xlabel("sequence length"); secs.set_ylabel("seconds per step"); secs.legend()
plt.tight_layout(); plt.show()
ours_mb, gspmd_mb = ([m for m, _ in r] for r in rows.values())
assert ours_mb[-1] < gspmd_mb[-1] and ours_mb[-1] - ours_mb[0] < gspmd_mb[-1] - gspmd_mb[0]
assert rows["jshard (ring)"][-1][1] < rows["GSPMD"][-1][1]'''),
    ("md", "## Deep models: pipeline parallelism\n"
           "`PipelineParallel(\"pp\", microbatches=m, schedule=...)` on the model's list of blocks stacks their "
           "parameters along a new dim 0 split over `pp` (stage `s` of 4 holds block `s`: no device holds another "
           "stage's blocks), and `TrainStep` runs each step as `m` microbatches flowing stage to stage, activations "
           "sent on and input gradients sent back by `ppermute`, in the step's one program. `plan(\"pp+dp\")` adds "
           "it to data parallelism on the other axis: a 4-layer GPT on (pp=4, dp=2), trained next to one device."),
    ("code", '''from jshard.parallel.schedule import make_schedule
V, D, H, L, S, BATCH = 64, 32, 4, 4, 64, 8
make = lambda: GPT(V, D, H, L, S, rngs=nnx.Rngs(0))
pp_dp = jax.make_mesh((4, 2), ("pp", "dp"), devices=devices[:8])
styles, default = plan("pp+dp", microbatches=4, schedule="1f1b")
step = TrainStep(parallelize(make, pp_dp, styles, default=default), tx, loss_fn)
kernel = step.model.blocks.layers.q.kernel.get_value()
print("q kernels of the 4 blocks:", kernel.shape, kernel.placements, "a device holds", kernel.spec.local_block_shape)
assert kernel.spec.local_block_shape == (1, D, D)
batches = [tuple(rng.integers(0, V, (BATCH, S)).astype(np.int32) for _ in range(2)) for _ in range(4)]
data = lambda b: [jshard.distribute(a, pp_dp, [Replicate(), Shard(0)]) for a in b]
print("one step communicates:", step.explain(*data(batches[0])).totals)
reference = one_device_trainer(make(), tx, loss_fn)
ours = [float(step(*data(b))) for b in batches]
theirs = [reference(*b) for b in batches]
print(np.round(ours, 5)); print(np.round(theirs, 5))
assert curve_ratio(ours, theirs, n_per_step=summed_terms(V, D, L, S, BATCH)) <= 1'''),
    ("md", "## The schedules\n"
           "`make_schedule(kind, stages, microbatches, virtual_stages)` gives the tables the step's loop reads: at "
           "each tick, the microbatch each stage runs forward (F) and backward (B). GPipe runs every forward, then "
           "every backward; 1F1B starts the backward wavefront as soon as the last stage has the first loss; "
           "interleaved gives each device 2 chunks of the model (virtual stages), so the wavefronts are twice as "
           "long and the idle corners (the bubble) half as large a share. Here p = 4 stages and m = 8 microbatches; "
           "each schedule's idle share is its theory, (p - 1) / (v m + p - 1), a backward costing two forwards."),
    ("code", '''from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch
stages, micro = 4, 8
schedules = {"gpipe": make_schedule("gpipe", stages, micro), "1f1b": make_schedule("1f1b", stages, micro),
             "interleaved, v=2": make_schedule("interleaved", stages, micro, 2)}
print(schedules["1f1b"].table())
colors = ListedColormap(["whitesmoke", "tab:blue", "tab:orange", "tab:purple"])


def units(s, t, d):
    """The cell's microbatches, forward then backward (with the chunk after a dot where there are several)."""
    return "\\n".join(f"{mb[t, d]}" + (f".{chunk[t, d]}" if s.virtual_stages > 1 else "")
                       for mb, chunk in ((s.forward, s.forward_chunk), (s.backward, s.backward_chunk)) if mb[t, d] >= 0)


fig, axes = plt.subplots(3, 1, figsize=(11, 6.5), sharex=True)
for ax, (name, s) in zip(axes, schedules.items(), strict=True):
    kind = (s.forward >= 0) + 2 * (s.backward >= 0)  # [ticks, stages]: 0 idle, 1 F, 2 B, 3 both
    ax.imshow(kind.T, cmap=colors, vmin=0, vmax=3, aspect="auto")
    for t in range(s.ticks):
        for d in range(stages):
            ax.text(t, d, units(s, t, d), ha="center", va="center", fontsize=5)
    ax.set_yticks(range(stages)); ax.set_ylabel("stage")
    ax.set_title(f"{name}: {s.ticks} ticks, idle {s.wasted():.1%} (theory {s.theory():.1%})", fontsize=9)
    assert np.isclose(s.wasted(), s.theory())
axes[-1].set_xlabel("tick")
fig.legend(handles=[Patch(color=colors(i), label=label) for i, label in
                    enumerate(["idle", "forward", "backward", "forward + backward"])], loc="upper right", ncol=4)
plt.tight_layout(rect=(0, 0, 1, 0.96)); plt.show()'''),
    ("md", "## Memory against microbatches\n"
           "A stage keeps the input of every microbatch whose forward it ran and whose backward it has not (the "
           "backward recomputes the stage's forward from it). `in_flight()` counts them per stage: GPipe holds all "
           "`m`, 1F1B at most `2(p - 1 - d)` on stage `d` whatever `m`. Then XLA's memory analysis of the compiled "
           "step of the GPT above for each schedule at `m` = 4 and 16 (the step trained above is the 1F1B, "
           "`m = 4` one), a "
           "microbatch of 2 rows, so the batch grows with `m`: its temporaries (activations, stashed stage inputs, "
           "gradients in flight). Both schedules also hold the embeddings' outputs and their gradients for the whole "
           "batch outside the pipeline, which grow with `m`; GPipe's stash grows on top of that, 1F1B's stops "
           "growing at 7 slots."),
    ("code", '''counts = [4, 8, 16]
for kind in ("gpipe", "1f1b"):
    held = [make_schedule(kind, 4, m).in_flight().tolist() for m in counts]
    print(f"{kind:<6} microbatches held per stage: " + "  ".join(f"m={m}: {h}" for m, h in zip(counts, held,
                                                                                              strict=True)))
assert [make_schedule("gpipe", 4, m).in_flight().max() for m in counts] == counts
assert [make_schedule("1f1b", 4, m).in_flight().max() for m in counts] == [4, 6, 6]  # at most 2(p - 1)
steps, temps = {("1f1b", 4): step}, {}  # the trained step's program is compiled already
compiled = [4, 16]  # each point compiles a step: the two ends of the range
for kind in ("gpipe", "1f1b"):
    for m in compiled:
        if (kind, m) not in steps:
            styles, default = plan("pp+dp", microbatches=m, schedule=kind)
            steps[kind, m] = TrainStep(parallelize(make, pp_dp, styles, default=default), tx, loss_fn)
        ids = jshard.distribute(np.zeros((m * BATCH // 4, S), np.int32), pp_dp, [Replicate(), Shard(0)])
        temps[kind, m] = steps[kind, m].lower(ids, ids).compile().memory_analysis().temp_size_in_bytes / MB
    print(f"{kind:<6} temporaries per device: " + "  ".join(f"m={m}: {temps[kind, m]:.2f} MB" for m in compiled))
fig, (held_ax, mem_ax) = plt.subplots(1, 2, figsize=(10, 3.2))
for kind in ("gpipe", "1f1b"):
    held_ax.plot(counts, [make_schedule(kind, 4, m).in_flight()[0] for m in counts], "o-", label=kind)
    mem_ax.plot(compiled, [temps[kind, m] for m in compiled], "o-", label=kind)
held_ax.set_xlabel("microbatches"); held_ax.set_ylabel("stage 0's stashed inputs"); held_ax.legend()
mem_ax.set_xlabel("microbatches"); mem_ax.set_ylabel("MB of temporaries per device"); mem_ax.legend()
plt.tight_layout(); plt.show()
assert temps["1f1b", 16] < temps["gpipe", 16]
assert temps["1f1b", 16] - temps["1f1b", 4] < temps["gpipe", 16] - temps["gpipe", 4]'''),
    ("md", "## Automatic plans\n"
           "`autoplan(make, mesh, loss_fn, *batch, memory_budget=)` finds the plan instead of being told it: it gives "
           "each mesh axis a role (here `styles=(\"dp\", \"fsdp\", \"tp\")`: the batch split with the parameters "
           "replicated, or sharded and gathered where used, or Megatron's tensor parallelism), prices every assignment "
           "on the training step traced on parameters that hold only their specs (nothing is built), and returns the "
           "fastest whose predicted memory per device fits the budget. The GPT of the context-parallel section (one "
           "block, 8 rows) on a (2, 4) mesh whose axes are named `a` and `b`, since the plan gives them their roles, "
           "under a shrinking budget: none first, then each budget just under the predicted memory of the plan found "
           "at the one before, down to 20% of the data-parallel plan's (`dp(a)+dp(b)`), or until no plan fits "
           "(autoplan then says so, naming the smallest). Every plan found is checked against the first search, which "
           "priced them all: it is the fastest of those predicted to fit, leaving out any the search compiled and "
           "found over the budget (the compiler has the last word; `plan.rejected` names them)."),
    ("code", '''from jshard.parallel import autoplan

V, D, H, L, S, BATCH = 64, 32, 4, 1, 64, 8
make = lambda: GPT(V, D, H, L, S, rngs=nnx.Rngs(0))
ab = jax.make_mesh((2, 4), ("a", "b"), devices=devices[:8])
ids_shape = jax.ShapeDtypeStruct((BATCH, S), jnp.int32)  # the batch at its global shape
roles = ("dp", "fsdp", "tp")


def search(budget):
    return autoplan(make, ab, loss_fn, ids_shape, ids_shape, tx=tx, memory_budget=budget, styles=roles,
                    runners_up=len(roles) ** 2)


free = search(None)
every = [free, *free.runners_up]  # with no budget every plan fits: all it priced, fastest first
floor = int(0.2 * next(p for p in every if set(p.roles.values()) == {"dp"}).memory.total)
print(free.explain(), "\\n")
print(f"{\'budget\':>12}  {\'plan found\':<16} {\'step ms\':>8} {\'MB\':>6}")
found, budget = {}, None
while True:
    fits = [p for p in every if budget is None or p.memory.total <= budget]
    label = "none" if budget is None else f"{budget / MB:.3f} MB"
    try:
        chosen = free if budget is None else search(budget)
    except ValueError as e:
        assert "no plan fits" in str(e) and (not fits or "once compiled" in str(e))
        print(f"{label:>12}  {e}")
        break
    compiled_over = {name for name, why in chosen.rejected if "compiled" in why}
    assert chosen.step_us == min(p.step_us for p in fits if p.name not in compiled_over)
    assert budget is None or chosen.memory.total <= budget
    found[chosen.name] = chosen
    print(f"{label:>12}  {chosen.name:<16} {chosen.step_us / 1e3:8.2f} {chosen.memory.total / MB:6.3f}")
    if budget == floor:
        break
    budget = max(chosen.memory.total - 1, floor)
assert len(found) >= 2 and list(found.values())[-1].memory.total < free.memory.total'''),
    ("md", "Each plan found, built and trained from the same parameters and batch as one device: its first loss "
           "matches one device's. Beside its predictions, XLA's memory analysis of its compiled step (arguments and "
           "temporaries, what the predicted memory counts) and the median of 3 steps (the emulated devices share "
           "this machine's cores, so the measured times compare the work per step; the prediction prices them by "
           "rates autoplan measured on these devices). Left: every plan priced, the ones found in colour."),
    ("code", '''ids, labels = rng.integers(0, V, (2, BATCH, S)).astype(np.int32)
first = one_device_trainer(make(), tx, loss_fn)(ids, labels)
measured = {}
for name, p in found.items():
    step = TrainStep(parallelize(make, ab, p), tx, loss_fn)  # parallelize takes the Plan: its styles and default
    batch = [jshard.distribute(a, ab, placements) for a, placements in zip((ids, labels), p.batch, strict=True)]
    memory = compiled_mb(step.lower(*batch).compile())
    loss = float(step(*batch))
    assert curve_ratio([loss], [first], n_per_step=summed_terms(V, D, L, S, BATCH)) <= 1
    measured[name] = (memory, median_seconds(lambda: float(step(*batch))) * 1e3)
    print(f"{name:<16} predicted {p.memory.total / MB:.3f} MB {p.step_us / 1e3:6.2f} ms   compiled {memory:.3f} MB, "
          f"measured {measured[name][1]:6.2f} ms   first loss {loss:.5f} (one device {first:.5f})")
fig, (space, mem, secs) = plt.subplots(1, 3, figsize=(14, 3.4))
space.scatter([p.memory.total / MB for p in every], [p.step_us / 1e3 for p in every], color="lightgray",
              label="every plan priced")
for name, p in found.items():
    space.scatter(p.memory.total / MB, p.step_us / 1e3, label=name)
space.set_xlabel("predicted MB per device"); space.set_ylabel("predicted ms per step"); space.legend(fontsize=7)
x = np.arange(len(found))
mem.bar(x - 0.2, [p.memory.total / MB for p in found.values()], 0.4, label="predicted")
mem.bar(x + 0.2, [m for m, _ in measured.values()], 0.4, label="compiled")
secs.bar(x - 0.2, [p.step_us / 1e3 for p in found.values()], 0.4, label="predicted")
secs.bar(x + 0.2, [t for _, t in measured.values()], 0.4, label="measured")
for ax, unit in ((mem, "MB per device"), (secs, "ms per step")):
    ax.set_xticks(x, list(found), fontsize=7, rotation=15); ax.set_ylabel(unit); ax.legend(fontsize=7)
plt.tight_layout(); plt.show()
first_mb, last_mb = measured[next(iter(found))][0], measured[list(found)[-1]][0]
print(f"the tightest budget's plan compiles to {last_mb / first_mb:.0%} of the unconstrained plan's memory")
assert last_mb < first_mb'''),
]

EXPERTS = [
    title("05_mixture_of_experts.ipynb",
          "# jshard 5: mixtures of experts\n"
          "A mixture of experts sends each token to the few experts its router chooses. `jshard.experts` does it "
          "dropless (every token computed, whatever the routing); under `jshard.jit` it is one equation that keeps "
          "the experts where they are and sends the tokens to them by all-to-all, in rounds of a fixed size. Every "
          "cell checks its claims against a dense mixture or one device."),
    ("code", INSTALL),
    ("code", SETUP),
    ("md", "## Routing, drawn\n16 tokens, 8 experts, 2 a token: the weights each token gives its experts (the "
           "softmax of its two largest logits), and the tokens each expert takes."),
    ("code", '''import matplotlib.pyplot as plt
from jshard.moe import imbalance, route
rng = np.random.default_rng(0)
E, K, D, H = 8, 2, 16, 32
x, logits = rng.normal(size=(16, D)).astype(np.float32), rng.normal(size=(16, E)).astype(np.float32)
up, gate = (rng.normal(size=(E, D, H)).astype(np.float32) / 4 for _ in range(2))
down = rng.normal(size=(E, H, D)).astype(np.float32) / 6
idx, w = route(logits, K)
weights = np.zeros((16, E)); np.put_along_axis(weights, np.asarray(idx), np.asarray(w), axis=1)
out, load = jshard.experts(x, logits, up, down, top_k=K, w_gate=gate, return_load=True)
dense = sum(weights[:, [e]] * ((jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]) for e in range(E))
assert np.allclose(out, dense, atol=1e-4) and load.tolist() == weights.astype(bool).sum(0).tolist()
fig, (route_ax, load_ax) = plt.subplots(1, 2, figsize=(10, 3.2))
route_ax.imshow(weights.T, cmap="Blues", aspect="auto"); route_ax.set_xlabel("token"); route_ax.set_ylabel("expert")
route_ax.set_title("routing weights")
load_ax.bar(range(E), np.asarray(load)); load_ax.set_xlabel("expert"); load_ax.set_ylabel("tokens")
load_ax.set_title(f"load (imbalance {imbalance(load):.2f}: the most over the mean)")
plt.tight_layout(); plt.show()'''),
    ("md", "## The experts stay, the tokens travel\nA block adds the mixture's output to its input. With 1,024 "
           "tokens and 8 experts split over all 8 devices (one expert a device, the tokens split alike), each "
           "device sends its tokens' copies to the devices holding their experts and takes the results back: "
           "`explain` shows the all-to-alls (a round's copies out, their slots, the results home), and no expert "
           "weight moves."),
    ("code", '''D2, H2 = 64, 256
tokens = rng.normal(size=(1024, D2)).astype(np.float32)
router = rng.normal(size=(1024, E)).astype(np.float32)
up2, gate2 = (rng.normal(size=(E, D2, H2)).astype(np.float32) / 8 for _ in range(2))
down2 = rng.normal(size=(E, H2, D2)).astype(np.float32) / 16
split = lambda a: jshard.distribute(a, mesh, [Shard(0), Shard(0)])
args = [split(a) for a in (tokens, router, up2, down2, gate2)]
block = lambda x, l, u, d, g: x + jshard.experts(x, l, u, d, top_k=K, w_gate=g)
explained = jshard.explain(block, *args)
print(explained)
got = jshard.jit(block)(*args)
assert np.allclose(got.full(), block(tokens, router, up2, down2, gate2), atol=1e-3)
assert set(explained.totals) == {"all_to_all"}'''),
    ("md", "## Training, with and without the balancer\nA GPT whose every block's MLP is a mixture of 8 experts "
           "(`GPT(..., experts=8)`), the experts split over `tp` by `ExpertParallel`, trained against one device. "
           "`balance=rate` moves each expert's routing bias by `rate` towards the mean load after every step "
           "(DeepSeek-V3's rule); `balance=0.0` counts the load and leaves the routing alone."),
    ("code", '''import optax
from flax import nnx
from jshard.gpt import GPT, cross_entropy, one_device_trainer, plan
from jshard.parallel import TrainStep, parallelize
loss_fn = lambda m, ids, labels: cross_entropy(m(ids), labels)
styles, default = plan("dp+ep", ep="tp")
data = rng.integers(0, 64, (12, 8, 17)).astype(np.int32)
curves, losses = {}, {}
for rate in (0.0, 0.05):
    make = lambda: GPT(64, 32, 4, 2, 16, rngs=nnx.Rngs(0), experts=8, top_k=2, balance=rate)
    step = TrainStep(parallelize(make, mesh, styles, default=default), optax.adamw(3e-3), loss_fn)
    ref = one_device_trainer(make(), optax.adamw(3e-3), loss_fn)
    curves[rate], losses[rate] = [], []
    for batch in data:
        ids, labels = batch[:, :-1], batch[:, 1:]
        losses[rate].append(float(step(*(jshard.distribute(a, mesh, [Shard(0), Shard(0)]) for a in (ids, labels)))))
        assert abs(losses[rate][-1] - ref(ids, labels)) < 1e-4 * abs(losses[rate][-1])
        curves[rate].append(max(imbalance(b.moe.load.get_value().full()) for b in step.model.blocks))
print({r: [round(v, 2) for v in c] for r, c in curves.items()})
fig, ax = plt.subplots(figsize=(7, 3))
for rate, c in curves.items():
    ax.plot(range(1, len(c) + 1), c, marker="o", label=f"balance={rate}")
ax.set_xlabel("step"); ax.set_ylabel("load imbalance (max / mean)"); ax.legend(); plt.show()
assert np.mean(curves[0.05][-4:]) <= np.mean(curves[0.0][-4:])'''),
    ("md", "## Memory and step time against the expert count\nMore experts, 2 a token: the parameters grow with "
           "the count, split 4 ways over `tp`, while the work a token costs stays the same."),
    ("code", '''import time
counts, mem_mb, step_ms = (4, 8, 16, 32), [], []
ids = jshard.distribute(data[0][:, :-1], mesh, [Shard(0), Shard(0)])
labels = jshard.distribute(data[0][:, 1:], mesh, [Shard(0), Shard(0)])
for e in counts:
    make = lambda: GPT(64, 32, 4, 2, 16, rngs=nnx.Rngs(0), experts=e, top_k=2)
    step = TrainStep(parallelize(make, mesh, styles, default=default), optax.adamw(3e-3), loss_fn)
    m = step.lower(ids, labels).compile().memory_analysis()
    mem_mb.append((m.temp_size_in_bytes + m.argument_size_in_bytes) / 2**20)
    step(ids, labels)
    times = []
    for _ in range(3):
        t = time.perf_counter(); float(step(ids, labels)); times.append(time.perf_counter() - t)
    step_ms.append(1e3 * sorted(times)[1])
    assert step.model.blocks[0].moe.w_up.get_value().spec.local_block_shape[0] == e // 4
print([f"{e} experts: {m:.2f} MB, {t:.1f} ms" for e, m, t in zip(counts, mem_mb, step_ms)])
fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 3.2))
mem_ax.plot(counts, mem_mb, marker="o"); mem_ax.set_xlabel("experts"); mem_ax.set_ylabel("MB per device")
time_ax.plot(counts, step_ms, marker="o", color="tab:orange"); time_ax.set_xlabel("experts")
time_ax.set_ylabel("ms per step"); plt.tight_layout(); plt.show()
assert mem_mb[-1] > mem_mb[0]'''),
]

CLUSTERS = [
    title("06_planning_a_cluster.ipynb",
          "# jshard 6: planning a cluster\n"
          "Llama 3 8B, 70B and 405B planned for 8 to 16,384 H100s and for TPU v5p, on no cluster at all: "
          "`jshard.parallel.predict` prices one layout's training step (its step time, tokens per second, MFU and "
          "memory per chip) and `autoplan` searches the layouts of a chip count, both on the model traced on shapes "
          "alone and planned by the engine on an abstract mesh of the cluster's size (nothing is built, no device is "
          "used: 405B on 16,384 chips costs seconds). The chips are the vendors' data sheets (`Hardware.h100()`, "
          "`Hardware.tpu_v5p()`); the share of peak a matmul reaches and the share of the data axes' collectives "
          "hidden behind compute are constants chosen, not yet fitted (`docs/design.md`, \"Clusters we cannot hold\"). "
          "So the predicted MFU is drawn against chip count with the published runs on the same axes, and the gap "
          "between them is printed, not hidden. Every cell asserts what it claims."),
    ("code", INSTALL),
    ("code", '''# nothing here runs on a device: each model is traced on shapes, its step planned on an abstract mesh
import math
import jax, jax.numpy as jnp, numpy as np
import matplotlib.pyplot as plt
from flax import nnx
from jax.sharding import AbstractMesh
from jshard.gpt import LLAMA3, cross_entropy, llama3
from jshard.parallel import Hardware, autoplan, predict

SEQ = 8192  # Llama 3's pre-training sequence
loss_fn = lambda model, ids, labels: cross_entropy(model(ids), labels)
models = {size: (lambda size=size: llama3(size, seq=SEQ, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)) for size in LLAMA3}
batch = lambda rows: [jax.ShapeDtypeStruct((rows, SEQ), jnp.int32)] * 2  # ids and labels, at global shape
h100, v5p = Hardware.h100(), Hardware.tpu_v5p()
META = {"8b": 8_030_261_248, "70b": 70_553_706_496, "405b": 405_853_388_800}  # Meta's parameter counts
for size, make in models.items():
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(nnx.eval_shape(make), nnx.Param)))
    print(f"Llama 3 {size:>4}: {params:,} parameters, {LLAMA3[size]}")
    assert params == META[size]
for hw in (h100, v5p):
    print(f"{hw.name}: {hw.flops / 1e12:.0f} TFLOP/s bf16, {hw.hbm_bytes / 1e9:.0f} GB HBM, {hw.chips_per_node:,} "
          f"chips a node (intra {hw.intra.bandwidth / 1e9:.0f} GB/s a chip), inter "
          f"{hw.inter.bandwidth / 1e9:.2f} GB/s")'''),
    ("md", "## The published runs\n"
           "The points the predictions are drawn against, each from its source:\n\n"
           "- **Llama 3 405B**, Meta's pre-training on H100 80 GB (Dubey et al. 2024, \"The Llama 3 Herd of Models\", "
           "Table 4): 8,192 GPUs as TP8 x PP16 x DP64, 430 TFLOP/s a GPU, 43% BF16 MFU; 16,384 GPUs as TP8 x PP16 x "
           "DP128, 400 TFLOP/s, 41%; and 16,384 GPUs with context parallelism, TP8 x CP16 x PP16 x DP8 at sequence "
           "131,072, 380 TFLOP/s, 38%. Each a batch of 16M tokens. The data-parallel sizes are the GPUs over the other "
           "axes; that 16M is 2^24 tokens (2,048 sequences of 8,192, so 32 and 16 a data-parallel replica) is our "
           "reading of the table, so the comparison keeps to its MFU figures.\n"
           "- **Llama 3.1 8B**, torchtitan's benchmark (pytorch/torchtitan, "
           "`benchmarks/llama3_h100_202412_torchtitan.md`, December 2024: bf16 with `torch.compile` (its "
           "elementwise operations fused, as XLA fuses jshard's), no Float8, selective activation checkpointing, 2 "
           "sequences of 8,192 a GPU, H100 96 GB HBM2e at 500 W): FSDP on 8 GPUs 6,667 tokens/s a GPU, on 128 GPUs "
           "6,514. torchtitan publishes tokens per second; the MFU below is ours, from the model's FLOPs a token.\n\n"
           "MFU counts the model's FLOPs as the Llama 3 paper does (Megatron-LM's and torchtitan's convention): 6 a "
           "matmul parameter a token, plus attention's scores and values at full length (12 x layers x dim x "
           "sequence), recomputation not counted, over the chip's dense bf16 peak (989 TFLOP/s an H100). `predict` "
           "counts them from the model's own forward pass; the cell checks its count against that formula. No "
           "published Llama 3 run on TPU v5p is cited here: TPU v5p has predictions only."),
    ("code", '''h100_96 = Hardware.h100(name="H100 SXM 96GB HBM2e 500W", hbm_bytes=96 * 2**30, hbm_bandwidth=2.4e12)
titan = {gpus: predict(models["8b"], loss_fn, *batch(2 * gpus), hardware=h100_96, roles={"fsdp": gpus},
                       remat="block") for gpus in (8, 128)}  # FSDP, 2 sequences a GPU, every block recomputed
flops_per_token = titan[8].model_flops / (16 * SEQ)
d, L, V = (LLAMA3["8b"][k] for k in ("dim", "layers", "vocab"))
matmul_params = META["8b"] - V * d - (2 * L + 1) * d  # all but the embedding table and the norms' scales
print(f"Llama 3 8B at sequence {SEQ:,}: {flops_per_token / 1e9:.2f} GFLOP a token = 6 x {matmul_params / 1e9:.3f}B "
      f"matmul parameters + attention's {12 * L * d * SEQ / 1e9:.2f} GFLOP")
assert math.isclose(flops_per_token, 6 * matmul_params + 12 * L * d * SEQ, rel_tol=1e-9)
LLAMA_PAPER, TORCHTITAN = "Llama 3 paper, Table 4", "torchtitan, Dec 2024"
published = [dict(model="405b", gpus=8192, layout="TP8 x PP16 x DP64", tflops=430, mfu=0.43, source=LLAMA_PAPER),
             dict(model="405b", gpus=16384, layout="TP8 x PP16 x DP128", tflops=400, mfu=0.41, source=LLAMA_PAPER),
             dict(model="405b", gpus=16384, layout="TP8 x CP16 x PP16 x DP8, seq 131,072", tflops=380, mfu=0.38,
                  source=LLAMA_PAPER),
             dict(model="8b", gpus=8, layout="FSDP8", tokens=6667, source=TORCHTITAN),
             dict(model="8b", gpus=128, layout="FSDP128", tokens=6514, source=TORCHTITAN)]
for row in published:
    if "tokens" in row:  # torchtitan's tokens/s as MFU
        row["mfu"] = row["tokens"] * flops_per_token / h100.flops
    else:  # the paper's MFU is its TFLOP/s over the H100's peak
        assert abs(row["tflops"] * 1e12 / h100.flops - row["mfu"]) < 0.01
    figure = f"{row['tokens']:,} tokens/s a GPU" if "tokens" in row else f"{row['tflops']} TFLOP/s a GPU"
    print(f"{row['source']:<23} {row['model']:>4} on {row['gpus']:>6,} H100s  {row['layout']:<38} {figure:<22} "
          f"MFU {row['mfu']:.1%}")'''),
    ("md", "## The published configurations, predicted\n"
           "torchtitan's two runs as they ran (FSDP over all the GPUs; their selective checkpointing priced as every "
           "block recomputed, the nearest `predict` offers, which recomputes more). Llama 3 405B's runs in their "
           "published layout: 16 pipeline stages (its 126 layers uneven over them, 8 a stage and 6 on the last), "
           "TP8 (as `sp`: tensor parallelism with the norms sequence parallel) and DP64 or DP128 as `zero` "
           "(parameters and optimizer state sharded over the data axis, the stages taking theirs whole as the "
           "pipeline starts), on 8,192 and 16,384 GPUs, the published batch of 2,048 sequences in microbatches of "
           "one sequence a replica. A stage keeps its layers' residuals for twice the microbatches an asynchronous "
           "1F1B holds, so its memory is over what the run held (`python benchmarks/published.py` prints the same "
           "on Megatron-LM's deepest pipeline, whose MFU it predicts within 6%). The cell checks torchtitan's rows "
           "within a factor 1.5 (the issue's target is 20%) and Llama 3's within a factor 3; the printed error is "
           "the figure to read."),
    ("code", '''print(f"{'run':<46} {'published':>10} {'predicted':>10} {'error':>7} {'GiB a chip':>11}")
for row in [r for r in published if "tokens" in r]:
    p = titan[row["gpus"]]
    error = p.tokens_per_s_per_chip / row["tokens"] - 1
    print(f"{'8B ' + row['layout'] + ' (tokens/s a GPU)':<46} {row['tokens']:>10,} {p.tokens_per_s_per_chip:>10,.0f} "
          f"{error:>+7.0%} {p.memory.total / 2**30:>5.1f} of {h100_96.hbm_bytes / 2**30:.0f}")
    assert abs(error) < 0.5 and p.fits
as_priced = {}
for row, dp, micro in ((published[0], 64, 32), (published[1], 128, 16)):
    p = predict(models["405b"], loss_fn, *batch(2048), hardware=h100, roles={"zero": dp, "pp": 16, "sp": 8},
                microbatches=micro)
    as_priced[row["gpus"]] = p
    label = f"405B zero{dp} x pp16 x sp8, {p.chips:,} GPUs (MFU)"
    print(f"{label:<46} {row['mfu']:>10.1%} {p.mfu:>10.1%} {p.mfu / row['mfu'] - 1:>+7.0%} "
          f"{p.memory.total / 2**30:>5.0f} of {h100.hbm_bytes / 2**30:.0f}")
    assert 1 / 3 < p.mfu / row["mfu"] < 3 and p.chips == row["gpus"] == dp * 16 * 8
print(as_priced[8192].explain())'''),
    ("md", "## MFU against chip count\n"
           "Each model on 8 to 16,384 H100s and on TPU v5p up to 8,192 chips (a v5p pod holds 8,960, one ICI domain), "
           "in layouts fixed by rule, those autoplan chose at most of the points it was tried on (a search at every "
           "point would cost minutes; it runs at two of them below):\n\n"
           "- the batch grows with the chips, 2 sequences of 8,192 a chip for 8B (torchtitan's) and one sequence "
           "per 8 chips for 70B and 405B (Llama 3 405B's 16M-token batch on 16,384 GPUs is one per 8), up to "
           "Llama 3's 2,048 sequences (16M tokens); past that the work a chip gets shrinks as the chips grow;\n"
           "- 8B: FSDP over a node's 8 chips, data parallel across nodes (HSDP), adding `sp=8` once there are more "
           "chips than sequences; 70B: `sp=8` inside a node, FSDP over 16 nodes, data parallel across them; 405B: "
           "`sp=8` inside a node, FSDP over all the nodes (autoplan, below, also tries HSDP and pipelines);\n"
           "- every block recomputed in the backward pass (`remat=\"block\"`), as autoplan chooses at these "
           "batches.\n\n"
           "The tensor axis is innermost, so on H100 it stays inside a node (checked with `Hardware.level`, which "
           "says the link an axis runs on). No pipeline: autoplan, below, weighs those."),
    ("code", '''def layout(size, chips):
    """The batch (sequences of SEQ) and the roles (outermost first) of `size` on `chips` chips."""
    rows = min(2 * chips, 2048) if size == "8b" else min(chips // 8, 2048)
    sp = 1 if size == "8b" and rows >= chips else 8
    fsdp = min({"8b": 8, "70b": 16, "405b": chips}[size], chips // sp)
    roles = {"dp": chips // (sp * fsdp), "fsdp": fsdp, "sp": sp}
    return rows, {role: n for role, n in roles.items() if n > 1}


SWEEP = {h100: {"8b": [8, 64, 512, 4096, 16384], "70b": [64, 512, 4096, 16384], "405b": [2048, 4096, 8192, 16384]},
         v5p: {"8b": [64, 512, 4096], "70b": [64, 512, 4096], "405b": [2048, 8192]}}
sweep = {}
print(f"{'':<9} {'model':>5} {'chips':>7}  {'layout':<18} {'rows':>5} {'MFU':>6} {'tokens/s':>9} {'step s':>7}  "
      "GiB a chip")
for hw, sizes in SWEEP.items():
    for size, counts in sizes.items():
        for chips in counts:
            rows, roles = layout(size, chips)
            p = sweep[hw.name, size, chips] = predict(models[size], loss_fn, *batch(rows), hardware=hw, roles=roles,
                                                      remat="block")
            name = "x".join(f"{role}{n}" for role, n in roles.items())
            print(f"{hw.name:<9} {size:>5} {chips:>7,}  {name:<18} {rows:>5} {p.mfu:>6.1%} "
                  f"{p.tokens_per_s_per_chip:>9,.0f} {p.step_s:>7.2f}  {p.memory.total / 2**30:5.1f} of "
                  f"{hw.hbm_bytes / 2**30:.0f}{'' if p.fits else ' (over)'}")
            mesh = AbstractMesh(tuple(roles.values()), tuple(roles))
            assert p.chips == chips and 0 < p.mfu < 1
            assert "sp" not in roles or hw.level(mesh, "sp") == "intra"  # the tensor axis inside a node
            assert size == "405b" or p.fits  # 405B is at the edge of the HBM: printed, drawn hollow when over
mfu = lambda hw, size, chips: sweep[hw.name, size, chips].mfu
# the batch grows with the chips: with FSDP inside a node, 8B holds its MFU from 8 to 512 H100s
assert mfu(h100, "8b", 512) > 0.9 * mfu(h100, "8b", 8)
# past 2,048 sequences it does not: each chip's share of the step shrinks, its collectives do not
assert mfu(h100, "8b", 16384) < mfu(h100, "8b", 4096)
# 405B's FSDP spans every node: its gathers cross more of them the more chips there are
assert all(mfu(h100, "405b", a) > mfu(h100, "405b", b) for a, b in zip([2048, 4096, 8192], [4096, 8192, 16384]))
# a v5p pod is one ICI domain: none of its collectives leaves it, where every H100 layout past a node crosses NICs
assert all(p.comm_s["inter"] == 0 for (hw, _, _), p in sweep.items() if hw == v5p.name)
assert all(p.comm_s["inter"] > 0 for (hw, _, chips), p in sweep.items() if hw == h100.name and chips > 8)
for size, counts in SWEEP[v5p].items():
    print(f"{size} on {counts[-1]:,} chips: TPU v5p {mfu(v5p, size, counts[-1]):.1%}, H100 "
          f"{mfu(h100, size, counts[-1]):.1%}")'''),
    ("md", "Left: predicted MFU against chips (solid H100, dashed TPU v5p; a hollow marker is a step predicted over "
           "its chip's HBM), with the published runs: stars Llama 3 405B's, diamonds torchtitan's 8B, crosses Llama "
           "3's layouts as `predict` prices them (above). Right: predicted memory a chip against each chip's "
           "HBM (the same layout holds the same bytes on either chip, so the dashed lines lie under the solid)."),
    ("code", '''from matplotlib.lines import Line2D
from matplotlib.ticker import PercentFormatter
colors = {"8b": "tab:blue", "70b": "tab:orange", "405b": "tab:green"}
fig, (mfu_ax, mem_ax) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
for hw, line in ((h100, "-"), (v5p, "--")):
    for size, counts in SWEEP[hw].items():
        ps = [sweep[hw.name, size, c] for c in counts]
        mfu_ax.plot(counts, [p.mfu for p in ps], line, color=colors[size])
        mfu_ax.scatter(counts, [p.mfu for p in ps], color=[colors[size] if p.fits else "white" for p in ps],
                       edgecolors=colors[size], zorder=3)
        mem_ax.plot(counts, [p.memory.total / 2**30 for p in ps], line, marker="o", color=colors[size])
    mem_ax.axhline(hw.hbm_bytes / 2**30, ls=line, color="gray", lw=1, label=f"{hw.name} HBM")
for row in published:
    mfu_ax.scatter(row["gpus"], row["mfu"], marker="*" if row["source"] == LLAMA_PAPER else "D",
                   s=200 if row["source"] == LLAMA_PAPER else 70, color=colors[row["model"]], edgecolors="black",
                   zorder=4)
for p in as_priced.values():
    mfu_ax.scatter(p.chips, p.mfu, marker="X", s=90, color=colors["405b"], edgecolors="black", zorder=4)
mfu_ax.annotate("CP16, seq 131,072", (16384, 0.38), xytext=(6, -14), textcoords="offset points", fontsize=7)
ticks = [8, 64, 512, 4096, 16384]
for ax in (mfu_ax, mem_ax):
    ax.set_xscale("log", base=2); ax.set_xticks(ticks, [f"{t:,}" for t in ticks]); ax.set_xlabel("chips")
mfu_ax.yaxis.set_major_formatter(PercentFormatter(1.0)); mfu_ax.set_ylabel("MFU"); mfu_ax.set_ylim(0, 0.6)
mem_ax.set_ylabel("predicted GiB a chip"); mem_ax.legend(fontsize=7, loc="lower left")
handles = [Line2D([], [], color=c, label=f"Llama 3 {s.upper()}") for s, c in colors.items()]
handles += [Line2D([], [], color="black", ls="-", label="H100 (predicted)"),
            Line2D([], [], color="black", ls="--", label="TPU v5p (predicted)"),
            Line2D([], [], marker="*", ls="", color="gray", markeredgecolor="black", ms=12,
                   label="Llama 3 paper (published)"),
            Line2D([], [], marker="D", ls="", color="gray", markeredgecolor="black", label="torchtitan (published)"),
            Line2D([], [], marker="X", ls="", color="gray", markeredgecolor="black", ms=9,
                   label="Llama 3's layouts, predicted")]
mfu_ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper right")
plt.tight_layout(); plt.show()
assert len(mfu_ax.collections) == sum(map(len, SWEEP.values())) + len(published) + len(as_priced)  # every point'''),
    ("md", "## What autoplan chooses\n"
           "`autoplan(make, chips, loss_fn, *batch, hardware=)` searches the layouts of a chip count: the data "
           "axis (FSDP, data parallel where the state fits a chip, HSDP), a pipeline (its stages holding the layers "
           "evenly or not, none left without one), "
           "the tensor axis inside a node, and blocks recomputed or gradients accumulated over microbatches (a "
           "pipeline of one stage, `pp1`) where a step is over the chip's HBM; it returns the "
           "fastest predicted to fit, with `explain()` saying why it beats the runners-up. On 8 H100s for 8B (the "
           "batch of torchtitan's run) and on 16,384 for 405B (Llama 3's batch): each plan fits its chip, keeps its "
           "tensor axis inside a node, and is at least as fast as the layout the sweep gave that point, which is "
           "one of the candidates it priced. Where none fits, autoplan says so and names the smallest."),
    ("code", '''plans = {}
for size, chips in (("8b", 8), ("405b", 16384)):
    rows, _ = layout(size, chips)
    try:
        plan = plans[size] = autoplan(models[size], chips, loss_fn, *batch(rows), hardware=h100)
    except ValueError as e:  # no layout predicted to fit: autoplan names the smallest
        assert "no plan fits" in str(e)
        print(f"{size} on {chips:,} H100s: {e}")
        continue
    print(plan.explain(), "\\n")
    mesh = AbstractMesh(plan.mesh_shape, plan.axis_names)
    tensor = [a for a in plan.axis_names if plan.roles[a] in ("sp", "tp")]
    assert plan.memory.total <= h100.hbm_bytes and all(h100.level(mesh, a) == "intra" for a in tensor)
    assert math.prod(plan.mesh_shape) == chips and plan.mfu >= sweep[h100.name, size, chips].mfu * (1 - 1e-9)
assert plans  # at least one searched'''),
    ("md", "## Reading the gaps\n"
           "Where the predictions sit under the published points, the cells above say why:\n\n"
           "- **Collectives over thousands of chips.** Across nodes the cost model takes a tree's `log2 n` hops "
           "(NCCL's trees and PAT, which it picks where latency counts) at a ring's bandwidth, so a parameter gather "
           "over 2,048 data replicas starts at 11 hops of 10 µs, not 2,047; a 405B step still runs one for every "
           "weight of each of its 126 layers in each pass, and the cell below prints how much of the step is "
           "inter-node collectives.\n"
           "- **Pipelines.** On Megatron-LM's pipelined rows the predicted MFU is within 6% (`python "
           "benchmarks/published.py`); a stage holds its residuals for twice the microbatches of an asynchronous "
           "1F1B (the lockstep schedule's), so the deepest pipeline (462B over 16 stages) is predicted over its "
           "chip's HBM.\n"
           "- **Constants and checkpointing.** The share of peak a matmul reaches and the share of the "
           "collectives hidden behind compute are fitted on half the published rows (printed below), and "
           "torchtitan keeps its matmuls' outputs where `predict` recomputes whole blocks: the error on "
           "torchtitan's rows is theirs as much as the model's.\n\n"
           "TPU v5p runs all of a pod's 8,960 chips on one ICI domain, so its predictions keep more of their MFU "
           "as the chips grow; what a real v5p reaches is not checked here."),
    ("code", '''p = sweep[h100.name, "405b", 16384]
hops = math.ceil(math.log2(p.roles["fsdp"])) * h100.inter.latency
print(f"405B on 16,384 H100s ({'x'.join(f'{r}{n}' for r, n in p.roles.items())}): step {p.step_s:.1f} s, compute "
      f"{p.compute_s:.1f} s, inter-node collectives {p.comm_s['inter']:.1f} s ({p.hidden_s:.1f} s hidden); one "
      f"gather over {p.roles['fsdp']:,} replicas starts at {hops * 1e6:.0f} µs of hops")
assert p.step_s >= p.compute_s and p.comm_s["inter"] > 0  # the collectives not hidden add to the chips' time
for hw in (h100, v5p):
    best = max((k for k in sweep if k[0] == hw.name), key=lambda k: sweep[k].mfu)
    print(f"{hw.name}: best predicted MFU {sweep[best].mfu:.1%} ({best[1]} on {best[2]:,} chips)")
    assert sweep[best].mfu < hw.efficiency  # never above the share of peak a matmul is priced at
print(f"fitted constants: matmuls at {h100.efficiency:.1%} of peak, {h100.overlap:.0%} of the data axes' "
      "collectives hidden behind compute")'''),
]

NOTEBOOKS = {"01_placements.ipynb": PLACEMENTS, "02_flax_tensor_parallel.ipynb": FLAX,
             "03_large_models_and_checkpoints.ipynb": LARGE, "04_long_context_and_deep_models.ipynb": LONG,
             "05_mixture_of_experts.ipynb": EXPERTS, "06_planning_a_cluster.ipynb": CLUSTERS}


def notebook(cells) -> dict:
    def cell(i, kind, text):
        lines = text.splitlines(keepends=True)
        if kind == "md":
            return {"cell_type": "markdown", "id": f"cell-{i}", "metadata": {}, "source": lines}
        return {"cell_type": "code", "id": f"cell-{i}", "metadata": {}, "execution_count": None, "outputs": [],
                "source": lines}

    return {"cells": [cell(i, k, t) for i, (k, t) in enumerate(cells)], "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                         "language_info": {"name": "python"}}}


def code_of(nb: dict) -> list[tuple[str, str]]:
    """What a notebook says, without its outputs: (cell type, source) per cell."""
    text = lambda src: src if isinstance(src, str) else "".join(src)
    return [(c["cell_type"], text(c["source"])) for c in nb["cells"]]


def execute(nb: dict) -> dict:
    """``nb`` run top to bottom in a Jupyter kernel, as Colab runs it (an error stops it and raises)."""
    import nbformat
    from nbclient import NotebookClient

    forced = os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend is what shows the figures
    try:
        ran = nbformat.reads(json.dumps(nb), as_version=4)
        NotebookClient(ran, timeout=900, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": HERE}}).execute()
    finally:
        if forced is not None:
            os.environ["MPLBACKEND"] = forced
    ran.metadata = nbformat.from_dict(nb["metadata"])  # the kernel's own details change with every machine
    return json.loads(nbformat.writes(ran))  # multi-line text as lists of lines, as notebook() writes it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks to write (default: all)")
    parser.add_argument("--no-execute", action="store_true", help="write the code without running it")
    parser.add_argument("--check", action="store_true", help="exit 1 when a committed notebook's code differs")
    args = parser.parse_args(argv)
    stale = []
    for name in args.names or list(NOTEBOOKS):
        nb, path = notebook(NOTEBOOKS[name]), os.path.join(HERE, name)
        if args.check:
            with open(path) as f:
                if code_of(json.load(f)) != code_of(nb):
                    stale.append(name)
            continue
        if not args.no_execute:
            nb = execute(nb)
        with open(path, "w") as f:
            json.dump(nb, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print("wrote", name, "" if args.no_execute else "(executed)")
    if stale:
        print("stale (run python notebooks/build.py):", ", ".join(stale))
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
