"""How the model's low-precision matrix products are written for the backend's kernels.

Every product of the model accumulates in float32. On a GPU or TPU a bfloat16 product rounds its
own result and takes its operands in any layout. XLA:CPU (jaxlib 0.10.2) runs a bf16 x bf16
product in YNNPACK's bf16 kernels (AMX tiles, or AVX512-BF16 dot products, where the CPU has them)
only when the product returns float32 and both operands reach it row-major with the contraction on
the left operand's last axis and the right operand's first (or on both last axes); anything else it
converts both operands to float32 and multiplies at the float32 rate. Measured on an Intel Xeon
with AMX (2 cores, the update's and the decode's shapes; docs/performance.md, "bfloat16 products on
a CPU with AMX"): a float32 result 820-1,550 GFLOP/s against 190-240 for a bfloat16 one; the
backward's g @ w^T with an explicit transpose 170-226 against 500-1,320 contracting w's last axis;
h^T @ g 190-210 against 500-800 with h^T written out. So on a CPU backend the projections'
products return float32 and are cast after (`product_dtype`), and the backward's two products use
`dot_nt` and `dot_tn`. Float32 products, and every product off a CPU, keep their plain forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: Whether low-precision products take the CPU forms above on a CPU backend. The dry run turns it
#: off: its CPU compiles stand in for an accelerator's programs.
CPU_FLOAT32_PRODUCTS = True


def cpu_low_precision(dtype) -> bool:
    """Whether products of `dtype` operands take the CPU forms (module docstring): a dtype other
    than float32 on a CPU backend, unless the dry run turned them off."""
    return CPU_FLOAT32_PRODUCTS and jnp.dtype(dtype) != jnp.float32 and jax.default_backend() == "cpu"


def einsum_f32(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """einsum(spec, a, b) with both operands cast to the compute `dtype` and the products accumulated
    and returned in float32 (the attention's batched products)."""
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def product_dtype(out_dtype):
    """The dtype a product whose caller wants `out_dtype` returns before the cast: float32 where
    `cpu_low_precision(out_dtype)`, else `out_dtype` itself (on a GPU a separate cast is a kernel
    of its own, so the product rounds its own result)."""
    return jnp.float32 if cpu_low_precision(out_dtype) else out_dtype


def dot_nt(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """a [M, K] @ b[N, K]^T -> [M, N], accumulated in float32 and returned in `out_dtype`. In the
    CPU form the product contracts b's last axis itself; an explicit b.T would be laid out
    column-major and the product run at the float32 rate."""
    if cpu_low_precision(a.dtype):
        y = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return y.astype(out_dtype)
    return jnp.dot(a, b.T, preferred_element_type=out_dtype)


def _two_block_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a^T @ b over axis -2 (even length K), written as a sum over two blocks of K/2 rows."""
    K = a.shape[-2]
    a2 = a.reshape(a.shape[:-2] + (2, K // 2, a.shape[-1]))
    b2 = b.reshape(b.shape[:-2] + (2, K // 2, b.shape[-1]))
    return jnp.einsum("...skm,...skn->...mn", a2, b2, preferred_element_type=jnp.float32)


def dot_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a[..., K, M]^T @ b[..., K, N] -> float32 [..., M, N] (leading axes batched): the weight
    gradient h^T g over K tokens. In the CPU form the contraction over K is written as two blocks
    of K/2, which makes XLA write the transposed operand out row-major before the product (a plain
    a^T is laid out column-major and sends the product to the float32 kernels), and the narrower
    operand is the one transposed: with N < M the product computes (b^T a)^T, its [N, M] result
    transposed behind an optimisation barrier (folded into the product, that transpose sends it
    to XLA's own kernels, which fail on bf16 x bf16 -> f32 at run time). Transposing a [6144,
    1536] bf16 operand took 43 ms against 3.5 ms for a [6144, 576] one. With K odd the plain form."""
    K = a.shape[-2]
    if cpu_low_precision(a.dtype) and K % 2 == 0:
        if b.shape[-1] < a.shape[-1]:
            return jnp.swapaxes(jax.lax.optimization_barrier(_two_block_tn(b, a)), -1, -2)
        return _two_block_tn(a, b)
    if a.ndim == 2:
        return jnp.dot(a.T, b, preferred_element_type=jnp.float32)
    return jnp.einsum("...km,...kn->...mn", a, b, preferred_element_type=jnp.float32)
