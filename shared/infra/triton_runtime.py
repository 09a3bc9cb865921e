"""Triton, when this machine has a usable one: every kernel module imports ``triton``/``tl`` from
here and checks :data:`HAS_TRITON` before launching.

Importing this file never fails: without Triton (CPU builds), or with a Triton whose backend cannot
initialise here, ``HAS_TRITON`` is False and ``triton``/``tl`` are a stand-in under which the
kernels' definitions still parse (``@triton.jit`` leaves the function as it is)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a backend that fails to initialise on this machine
    HAS_TRITON = False

    class _NoTriton:
        constexpr = None

        @staticmethod
        def jit(fn):  # noqa: ANN001, ANN205 - mirrors triton.jit
            return fn

    triton = tl = _NoTriton()  # type: ignore[assignment]

__all__ = ["HAS_TRITON", "tl", "triton"]
