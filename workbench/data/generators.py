"""Synthetic data generators, usable from ``source: synthetic`` manifests."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = ["GENERATORS", "Generator", "register_generator"]


@dataclass(frozen=True)
class Generator:
    """A deterministic data generator usable from ``source: synthetic`` manifests."""

    name: str
    write: Callable[[BinaryIO, dict[str, Any], int], None]
    defaults: Mapping[str, Any]
    description: str


#: Generators by name; add your own with :func:`register_generator`.
GENERATORS: dict[str, Generator] = {}


def register_generator(name: str, defaults: Mapping[str, Any]) -> Callable:
    """Decorator registering ``fn(out: BinaryIO, params: dict, seed: int)``.

    ``defaults`` lists every accepted parameter; manifests may override them,
    and an unknown parameter is a manifest error. The output must depend only
    on params and seed, byte for byte, on every platform.
    """

    def decorate(fn: Callable[[BinaryIO, dict[str, Any], int], None]) -> Callable:
        doc = (fn.__doc__ or "").strip().splitlines()
        GENERATORS[name] = Generator(name, fn, dict(defaults), doc[0] if doc else "")
        return fn

    return decorate


def _normal(rng: random.Random) -> float:
    # Irwin-Hall approximation: only IEEE additions of random.random(), whose
    # stream Python guarantees, so bytes match on every platform. gauss() uses
    # libm, and sum() changed its float algorithm in Python 3.12.
    acc = 0.0
    for _ in range(12):
        acc += rng.random()
    return acc - 6.0


def _positive_int(params: Mapping[str, Any], key: str, upper: int | None = None) -> int:
    value = params[key]
    if type(value) is not int or value < 1 or (upper is not None and value > upper):
        bound = f" and at most {upper}" if upper is not None else ""
        raise ValueError(
            f"generator parameter {key!r} must be an integer of at least 1{bound}, got {value!r}"
        )
    return value


def _write_csv_row(out: BinaryIO, values: Sequence[float], last: str = "") -> None:
    # Fixed-precision formatting is correctly rounded by CPython: stable bytes.
    text = ",".join(f"{v:.6f}" for v in values)
    out.write((text + ("," + last if last else "") + "\n").encode("ascii"))


@register_generator(
    "gaussian-blobs",
    {"n_samples": 300, "n_features": 2, "centers": 3, "cluster_std": 1.0, "center_box": 10.0},
)
def _gaussian_blobs(out: BinaryIO, params: dict[str, Any], seed: int) -> None:
    """CSV of Gaussian clusters for classification: x0..x{d-1},label."""
    n, d, k = (_positive_int(params, key) for key in ("n_samples", "n_features", "centers"))
    rng = random.Random(seed)
    box = params["center_box"]
    centers = [[(2.0 * rng.random() - 1.0) * box for _ in range(d)] for _ in range(k)]
    out.write((",".join(f"x{j}" for j in range(d)) + ",label\n").encode("ascii"))
    for i in range(n):
        label = i % k
        row = [c + params["cluster_std"] * _normal(rng) for c in centers[label]]
        _write_csv_row(out, row, str(label))


@register_generator("linear-regression", {"n_samples": 200, "n_features": 4, "noise": 0.1})
def _linear_regression(out: BinaryIO, params: dict[str, Any], seed: int) -> None:
    """CSV for regression, y = x.w + noise with fixed random w: x0..x{d-1},y."""
    n, d = _positive_int(params, "n_samples"), _positive_int(params, "n_features")
    rng = random.Random(seed)
    weights = [2.0 * rng.random() - 1.0 for _ in range(d)]
    out.write((",".join(f"x{j}" for j in range(d)) + ",y\n").encode("ascii"))
    for _ in range(n):
        x = [_normal(rng) for _ in range(d)]
        y = 0.0
        for w, xj in zip(weights, x):
            y += w * xj
        _write_csv_row(out, [*x, y + params["noise"] * _normal(rng)])


@register_generator("random-tokens", {"vocab_size": 256, "length": 100_000})
def _random_tokens(out: BinaryIO, params: dict[str, Any], seed: int) -> None:
    """Uniform random token ids as little-endian uint16 (numpy: np.fromfile(p, "<u2"))."""
    vocab = _positive_int(params, "vocab_size", upper=65536)
    length = _positive_int(params, "length")
    rng = random.Random(seed)
    for start in range(0, length, 65536):
        count = min(65536, length - start)
        tokens = [min(vocab - 1, int(rng.random() * vocab)) for _ in range(count)]
        out.write(struct.pack(f"<{count}H", *tokens))
