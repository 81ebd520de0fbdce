"""Writes the notebooks from the cells below (``python notebooks/build.py``): the cells live here as plain
text so that reviews see code, not JSON. The test suite executes the written notebooks."""

from __future__ import annotations

import json
import os

SETUP = '''# Colab-ready set-up: install jshard when it is missing, and emulate 8 CPU devices when there are not 8
# accelerators (this must run before JAX starts)
import os, subprocess, sys
try:
    import jshard
except ImportError:
    repo = os.environ.get("JSHARD_REPO", "https://github.com/jshard/jshard")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", f"git+{repo}"], check=True)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, jax.numpy as jnp, numpy as np
import jshard
from jshard import Partial, Replicate, Shard, StridedShard
devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
mesh = jax.make_mesh((2, 4), ("dp", "tp"), devices=devices[:8])
print(len(devices), devices[0].platform, "devices;", jshard.spec.format_mesh(mesh))'''

PLACEMENTS = [
    ("md", "# jshard 1: placements, redistribution, Partial and linearity\n\n"
           "A `DArray` is a global array plus one placement per mesh axis: `Replicate()` (R), `Shard(d)` (S(d)), "
           "`StridedShard(d, sf)` and `Partial(op)` (a pending reduction). Everything below is checked against "
           "the plain numpy value."),
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
strided = jshard.distribute(g, mesh, [StridedShard(0, 2), Shard(0)])
print(jshard.plan_redistribute(strided, [Replicate(), Replicate()]))'''),
    ("md", "## Partial and linearity\nA sharded contraction leaves a `Partial(sum)`; linear ops keep it, others "
           "reduce first. The cast to int is the trap: truncating each part and then summing is wrong."),
    ("code", '''a = jshard.distribute(np.full((8, 4), 0.5, np.float32), mesh, [Replicate(), Shard(1)])
b = jshard.distribute(np.ones((4, 8), np.float32), mesh, [Replicate(), Shard(0)])
print(jshard.explain(lambda a, b: (a @ b).astype(jnp.int32), a, b))
c = jshard.jit(lambda a, b: (a @ b).astype(jnp.int32))(a, b)
print("jshard:", np.asarray(c.full())[0, :4], "(the truth is 2: 4 x 0.5)")'''),
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
s = jshard.jit(jnp.sum, out_placements=(Replicate(), Replicate()))(jshard.distribute(v, mesh, [Shard(0), Shard(1)]))
sharded = jshard.distribute(v, mesh, [Shard(0), Shard(1)])
print(jshard.explain(jnp.sum, sharded, out_placements=(Replicate(), Replicate())).totals)
blocks = [np.asarray(t) for t in s.to_local()]
same = all(np.array_equal(blocks[0], t) for t in blocks)
print("value", float(s), "vs", float(v.sum()), "; replicas bitwise equal:", same)'''),
]

FLAX = [
    ("md", "# jshard 2: a Flax model, tensor / sequence / fully-sharded parallel\n\n"
           "A small GPT in Flax NNX (`jshard.gpt`), made parallel by naming styles per module path, trained with "
           "optax next to the same model on one device."),
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
    ("code", '''import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
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
print(volumes)'''),
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


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    for name, cells in [("01_placements.ipynb", PLACEMENTS), ("02_flax_tensor_parallel.ipynb", FLAX)]:
        with open(os.path.join(here, name), "w") as f:
            json.dump(notebook(cells), f, indent=1)
            f.write("\n")
        print("wrote", name)
