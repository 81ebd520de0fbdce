"""Small Flax modules the tests share."""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


class Gain(nnx.Module):
    """A learned gain per feature: a module of the user's own, whose parameter no style can tell the dims of."""

    def __init__(self, n: int):
        self.gain = nnx.Param(jnp.linspace(0.5, 1.5, n))

    def __call__(self, x):
        return x * self.gain[...]


class ExplicitGemma(nnx.Module):
    """A Gemma-shaped language model written for JAX's explicit sharding, annotated the way Flax's Gemma example
    is (``ShardingConfig.fsdp_tp_sharding()``): parameters carry ``out_sharding`` metadata and every projection is
    called with ``out_sharding=``. Grouped-query attention through ``nnx.Einsum``, rotary positions, RMSNorm, a
    gated MLP, sliding-window attention on every other layer, a tied embedding (``attend``). ``sharded=False``
    leaves every annotation out: the same model for one device."""

    def __init__(self, *, vocab=64, dim=32, heads=8, kv_heads=4, head_dim=4, hidden=64, layers=2, window=4,
                 fsdp="dp", tp="tp", sharded=True, rngs: nnx.Rngs):
        s = (lambda *spec: P(*spec)) if sharded else (lambda *spec: None)
        self.act = {"btd": s(fsdp, None, tp), "btf": s(fsdp, None, tp), "btnh": s(fsdp, None, tp, None),
                    "cbtkh": s(None, fsdp, None, tp, None)}
        meta = lambda spec: {"out_sharding": spec} if spec is not None else {}
        self.embed = nnx.Embed(vocab, dim, embedding_metadata=meta(s(tp, fsdp)), rngs=rngs)
        self.blocks = nnx.List([_GemmaBlock(dim, heads, kv_heads, head_dim, hidden, window if i % 2 == 0 else None,
                                            s, fsdp, tp, meta, self.act, rngs) for i in range(layers)])
        self.norm = _RMSNorm(dim, s(tp), rngs)

    def __call__(self, ids):
        x = self.embed(ids, out_sharding=self.act["btd"]) * jnp.sqrt(self.embed.features)
        t = ids.shape[1]
        positions, causal = jnp.arange(t)[None], jnp.tril(jnp.ones((t, t), bool))[None]
        for block in self.blocks:
            x = block(x, positions, causal)
        return self.embed.attend(self.norm(x), out_sharding=self.act["btd"])


class _RMSNorm(nnx.Module):
    def __init__(self, dim, spec, rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)), **({"out_sharding": spec} if spec is not None else {}))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + self.scale[...])


def _rope(x, positions, base=10_000):
    half = x.shape[-1] // 2
    angle = positions[..., None, None] / base ** (jnp.arange(half, dtype=jnp.float32) / half)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * jnp.cos(angle) - b * jnp.sin(angle), b * jnp.cos(angle) + a * jnp.sin(angle)], -1)


class _GemmaBlock(nnx.Module):
    def __init__(self, dim, heads, kv_heads, head_dim, hidden, window, s, fsdp, tp, meta, act, rngs):
        self.window, self.heads, self.kv_heads, self.act = window, heads, kv_heads, act
        self.pre_attn, self.pre_mlp = _RMSNorm(dim, s(tp), rngs), _RMSNorm(dim, s(tp), rngs)
        self.q = nnx.Einsum("BTD,NDH->BTNH", (heads, dim, head_dim), kernel_metadata=meta(s(tp, fsdp, None)),
                            rngs=rngs)
        self.kv = nnx.Einsum("BTD,CKDH->CBTKH", (2, kv_heads, dim, head_dim),
                             kernel_metadata=meta(s(None, tp, fsdp, None)), rngs=rngs)
        self.o = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, dim), kernel_metadata=meta(s(tp, None, fsdp)),
                            rngs=rngs)
        linear = lambda i, o, spec: nnx.Linear(i, o, use_bias=False, kernel_metadata=meta(spec), rngs=rngs)
        self.gate, self.up = linear(dim, hidden, s(fsdp, tp)), linear(dim, hidden, s(fsdp, tp))
        self.down = linear(hidden, dim, s(tp, fsdp))

    def __call__(self, x, positions, causal):
        h = self.pre_attn(x)
        q = _rope(self.q(h, out_sharding=self.act["btnh"]), positions)
        k, v = self.kv(h, out_sharding=self.act["cbtkh"])
        k = _rope(k, positions)
        b, t, n, d = q.shape
        groups = self.heads // self.kv_heads
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, self.kv_heads, groups, d) * d ** -0.5, k)
        mask = causal
        if self.window is not None:  # a sliding-window layer
            i = jnp.arange(t)
            mask = mask & (i[:, None] - i[None, :] < self.window)[None]
        probs = jax.nn.softmax(jnp.where(mask[:, :, None, None, :], logits, -2.3819763e38), -1)
        x = x + self.o(jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, n, d), out_sharding=self.act["btd"])
        h = self.pre_mlp(x)
        gated = nnx.gelu(self.gate(h, out_sharding=self.act["btf"])) * self.up(h, out_sharding=self.act["btf"])
        return x + self.down(gated, out_sharding=self.act["btd"])
