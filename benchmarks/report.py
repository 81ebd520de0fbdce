"""What every benchmark does last: write its results as JSON, stamped with the JAX version."""

from __future__ import annotations

import json
import os


def write_json(path: str, **results) -> None:
    import jax

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(results, jax=jax.__version__), f, indent=1)
    print(f"wrote {path}")
