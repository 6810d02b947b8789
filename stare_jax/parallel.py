"""The one place that knows about devices: meshes, partition rules and batch placement.

Mesh axes are `data` (pure data parallel), `fsdp` (data parallel with parameters and optimizer
state sharded) and `tensor` (Megatron-style model parallel over heads / MLP width / vocabulary).
Batches are split over `("data", "fsdp")`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Partition rules: (regex on the "/"-joined parameter path, spec). First match wins. Layer
# parameters carry a leading [num_layers] axis, which is never sharded.
PARAM_RULES: tuple[tuple[str, P], ...] = (
    (r"(^|/)embed$", P("tensor", "fsdp")),                  # [V, D]
    (r"(^|/)lm_head$", P("fsdp", "tensor")),                # [D, V]
    (r"(^|/)layers/w[qkv]$", P(None, "fsdp", "tensor")),    # [L, D, H*hd]
    (r"(^|/)layers/b[qkv]$", P(None, "tensor")),            # [L, H*hd]
    (r"(^|/)layers/wo$", P(None, "tensor", "fsdp")),        # [L, H*hd, D]
    (r"(^|/)layers/(w_gate|w_up)$", P(None, "fsdp", "tensor")),  # [L, D, F]
    (r"(^|/)layers/(b_gate|b_up)$", P(None, "tensor")),     # [L, F]
    (r"(^|/)layers/w_down$", P(None, "tensor", "fsdp")),    # [L, F, D]
    (r"(^|/)layers/(bo|b_down)$", P(None, None)),           # [L, D]
    (r".*norm$", P()),                                   # RMSNorm scales: replicated
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all); an axis of -1 takes what is left."""
    devices = list(jax.devices() if devices is None else devices)
    shape = [data, fsdp, tensor]
    known = int(np.prod([s for s in shape if s != -1]))
    if shape.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"{len(devices)} devices are not divisible by mesh {dict(zip(MESH_AXES, shape))}")
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} needs {int(np.prod(shape))} devices, "
                         f"{len(devices)} available")
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def mesh_from_config(mesh_cfg) -> Mesh:
    """`make_mesh` from a config's `mesh` section (keys data, fsdp, tensor)."""
    return make_mesh(int(mesh_cfg.data), int(mesh_cfg.fsdp), int(mesh_cfg.tensor))


def spec_for_param(path: str, shape: Sequence[int], mesh: Mesh | None = None,
                   rules: Sequence[tuple[str, P]] = PARAM_RULES) -> P:
    """The partition spec of parameter `path` ("/"-joined), from the first matching rule.

    A dimension whose size the mesh axis does not divide is left unsharded for that axis, so
    every rule is valid for every model size. Unmatched paths are replicated.
    """
    for pattern, spec in rules:
        if re.search(pattern, path):
            break
    else:
        return P()
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    if mesh is None:
        return P(*spec[:len(shape)])
    fitted = []
    for dim, axis in zip(shape, spec):
        size = 1 if axis is None else int(np.prod([mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis)]))
        fitted.append(axis if axis is not None and dim % size == 0 else None)
    return P(*fitted)


def path_to_str(path) -> str:
    """'/'-joined string form of a pytree or NNX state path."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue  # NNX Variable wrapper
        k = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(k))
    return "/".join(parts)


def param_shardings(state, mesh: Mesh):
    """A pytree of NamedShardings matching `state` (NNX state or any pytree of arrays/shapes)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, spec_for_param(path_to_str(path), x.shape, mesh)), state)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a batch-major array: leading axis over (data, fsdp), the rest replicated."""
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, P())


def replicated_in_trace(x: jax.Array) -> jax.Array:
    """x constrained to be whole on every device of the mesh the current trace runs on (the abstract
    mesh set by `jax.sharding.use_abstract_mesh`, as the update step sets its own), or x itself when
    the trace has no mesh or one device. One all-gather before a loop that reduces over x in every
    trip (token selection's bisection) leaves the loop without collectives: each device counts over
    the whole array, and no trip waits for another device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P())


def platform_of(tree) -> str:
    """The platform ("cpu", "gpu", "tpu") of the devices the first placed array of `tree` lives on
    (the default backend's when no leaf is placed)."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if callable(getattr(leaf, "devices", None)):
            return next(iter(leaf.devices())).platform
    return jax.default_backend()


def batch_divisor(mesh: Mesh) -> int:
    """The number of batch shards: |data| * |fsdp|."""
    return int(mesh.shape["data"] * mesh.shape["fsdp"])


def host_to_global(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds in full (each process places only
    its addressable shards; no device ever receives more than its shard)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def partial_sum_sharding(mesh: Mesh | None) -> NamedSharding | None:
    """Where a replicated weight's gradient may be summed as per-device partial sums.

    On a purely data-parallel mesh (fsdp = tensor = 1, |data| > 1) every device holds the whole
    weight and its own rows of the batch, so a loop that adds up gradient pieces (the vocabulary
    pass's dW, chunk by chunk) can keep one partial sum per device, `[|data|, ...]` split over
    `data`, and reduce once after the loop instead of all-reducing inside every trip. Returns the
    sharding of that leading axis (`P("data")`), or None where the weight is sharded or there is one
    device (the loop then accumulates as before)."""
    if mesh is None or mesh.shape["data"] == 1 or mesh.shape["fsdp"] * mesh.shape["tensor"] != 1:
        return None
    return NamedSharding(mesh, P("data"))


def rollout_mesh(mesh: Mesh, per_process: int, process_of: Callable[[Any], int] | None = None) -> Mesh:
    """The mesh rollouts decode on: `mesh` itself (`per_process` 0), or a purely data-parallel mesh
    over the first `per_process` devices of every process of `mesh` (`process_of(device)`, default
    its `process_index`; the dry run passes one that simulates several processes).

    A decode step of a model larger than the cache is bound by reading every weight: on a
    data-parallel mesh each device reads its own replica, so on a CPU host split into one device
    per core (`mesh.cpu_devices`) one device decoding all rows, with every core inside each matmul,
    reads each weight once per step instead of once per core (`mesh.rollout_devices`)."""
    if per_process == 0:
        return mesh
    by_process: dict[int, list] = {}
    for d in mesh.devices.flat:
        by_process.setdefault(process_of(d) if process_of else d.process_index, []).append(d)
    if any(per_process > len(v) for v in by_process.values()):
        raise ValueError(f"mesh.rollout_devices={per_process} exceeds the "
                         f"{min(len(v) for v in by_process.values())} devices of a process")
    chosen = [d for p in sorted(by_process) for d in sorted(by_process[p], key=lambda d: d.id)[:per_process]]
    return make_mesh(data=len(chosen), devices=chosen)


def rollout_placement(model, mesh: Mesh, per_process: int):
    """(model, mesh) a rollout decodes with: the update's own when `per_process` is 0 or when
    `rollout_mesh(mesh, per_process)` is that mesh (a data-parallel mesh of exactly those devices,
    as one device is), else that rollout mesh and the model's copy placed there (`model_on_mesh`)."""
    if per_process == 0:
        return model, mesh
    target = rollout_mesh(mesh, per_process)
    if target == mesh:
        return model, mesh  # no copy: the update's placement already is the rollout's
    return model_on_mesh(model, target), target


def model_on_mesh(model, mesh: Mesh):
    """A copy of an NNX model whose arrays are placed on `mesh` by `PARAM_RULES` (and whose `mesh`
    attribute, where it has one, names it): the model a rollout on another mesh decodes with. The
    model itself is unchanged."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.device_put(state, param_shardings(state, mesh)))
    if hasattr(copy, "mesh"):
        copy.mesh = mesh
    return copy


def shard_batch(tree, mesh: Mesh):
    """Places a global batch held in full by every process on `mesh`, leading axis split over
    (data, fsdp)."""
    return jax.tree_util.tree_map(lambda x: host_to_global(x, batch_sharding(mesh, np.ndim(x))), tree)


def to_host(x) -> np.ndarray:
    """The full value of a (possibly multi-process) array as NumPy on every process: a replicated
    array from this process's own copy, a sharded one gathered from every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:  # every process holds the whole value: no collective
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def gather_hosts(local: np.ndarray) -> np.ndarray:
    """Concatenates each process's `local` array along axis 0, in process order (a no-op on one
    process). Every process must pass the same shape."""
    if jax.process_count() == 1:
        return np.asarray(local)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(np.asarray(local), tiled=True))


def local_slice(num_rows: int) -> slice:
    """The rows [i * n / P, (i + 1) * n / P) that process i owns in a batch of `num_rows` rows
    gathered in process order."""
    per = num_rows // jax.process_count()
    return slice(jax.process_index() * per, (jax.process_index() + 1) * per)


def replicated_key(key: jax.Array, mesh: Mesh) -> jax.Array:
    """A typed PRNG key replicated over `mesh` as a global array (usable across processes)."""
    if jax.process_count() == 1:
        return key
    data = host_to_global(np.asarray(jax.random.key_data(key)), replicated(mesh))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))
