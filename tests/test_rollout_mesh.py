"""Rollouts on their own mesh (`mesh.rollout_devices`, `parallel.rollout_mesh`): the same batch as
on the update's mesh, the update's model left where it was, and bad values refused."""

import jax
import numpy as np
import pytest

from stare_jax import config as config_lib
from stare_jax import parallel
from stare_jax.compilation import CompilationCounter

PAD = 0


def test_rollout_mesh_takes_the_first_devices_of_each_process():
    mesh = parallel.make_mesh(data=2, fsdp=2, devices=jax.devices()[:4])
    assert parallel.rollout_mesh(mesh, 0) is mesh
    one = parallel.rollout_mesh(mesh, 1)
    assert dict(one.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert list(one.devices.flat) == [min(mesh.devices.flat, key=lambda d: d.id)]
    two = parallel.rollout_mesh(mesh, 2)
    assert dict(two.shape)["data"] == 2 and sorted(d.id for d in two.devices.flat) == sorted(
        d.id for d in mesh.devices.flat)[:2]
    with pytest.raises(ValueError, match="exceeds the 4 devices"):
        parallel.rollout_mesh(mesh, 5)


def test_rollout_placement_copies_nothing_when_the_mesh_already_is_the_rollout_mesh():
    """On one device, or a data-parallel mesh of exactly the rollout's devices, the rollout decodes
    the update's own model (no second copy of the weights); otherwise a copy on the rollout mesh."""
    from flax import nnx

    from stare_jax.models import ModelConfig, build_model

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    for devices, per_process, copies in ((1, 1, False), (2, 2, False), (2, 1, True)):
        mesh = parallel.make_mesh(data=devices, devices=jax.devices()[:devices])
        model = build_model(cfg, seed=0, mesh=mesh)
        got, got_mesh = parallel.rollout_placement(model, mesh, per_process)
        assert (got is not model) == copies and (got_mesh is not mesh) == copies
        if copies:
            leaf = jax.tree_util.tree_leaves(nnx.state(got))[0]
            assert {d.id for d in leaf.sharding.device_set} == {jax.devices()[0].id}


def test_config_refuses_rollout_devices_that_do_not_fit():
    c = config_lib.default_config()
    c.data.prompt_batch_size, c.rollout.group_size = 3, 2  # 6 responses a step
    c.mesh.rollout_devices = 3
    config_lib.validate(c, num_devices=6)
    c.mesh.rollout_devices = 4  # 6 responses do not split over 4 devices
    with pytest.raises(config_lib.ConfigError, match="mesh.rollout_devices: got 4"):
        config_lib.validate(c, num_devices=6)
    c.mesh.rollout_devices = 2
    with pytest.raises(config_lib.ConfigError, match="mesh.rollout_devices: got 2"):
        config_lib.validate(c, num_devices=1)


@pytest.mark.parametrize("rollout_devices", [1, 2])
def test_collect_batch_on_the_rollout_mesh_equals_the_update_mesh(tiny_model, rollout_devices):
    """The same sampled batch (tokens equal, log-probs within 1e-5) whether the rows are decoded on
    the update's 4-device data mesh or on `rollout_devices` of its devices; the model the update
    uses keeps its placement."""
    from stare_jax.models import from_pretrained
    from stare_jax.trainer import collect_batch

    class Pool:
        def score(self, texts, truths):
            return [float(len(t) % 2) for t in texts], {"reward_s": 0.0}

    model_dir, _ = tiny_model
    mesh = parallel.make_mesh(data=4, devices=jax.devices()[:4])
    policy = from_pretrained(model_dir, mesh=mesh)
    before = {str(leaf.sharding) for leaf in jax.tree_util.tree_leaves(policy.model) if hasattr(leaf, "sharding")}
    c = config_lib.default_config()
    c.data.prompt_batch_size, c.rollout.group_size, c.rollout.max_new_tokens = 4, 4, 8
    c.dynamic_sampling.enabled = False
    ids = np.random.RandomState(0).randint(3, 20, (4, 5)).astype(np.int32)
    prompts = {"prompt_ids": ids, "prompt_mask": np.ones_like(ids), "ground_truth": np.array(["1"] * 4)}

    def batch_with(devices):
        c.mesh.rollout_devices = devices
        return collect_batch(c, policy.model, policy.tokenizer, iter([prompts]), Pool(), jax.random.key(3),
                             eos_ids=(1,), pad_id=PAD, mesh=mesh)[0]

    ref, got = batch_with(0), batch_with(rollout_devices)
    counter = CompilationCounter()
    again = batch_with(rollout_devices)  # next step: the weights are placed again, nothing compiles
    assert counter.take() == 0
    np.testing.assert_array_equal(again["input_ids"], got["input_ids"])
    for k in ("input_ids", "attention_mask", "response_mask", "rewards"):
        np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
    np.testing.assert_allclose(got["old_log_probs"], ref["old_log_probs"], atol=1e-5)
    assert ref["response_mask"].sum(axis=1).min() < 8  # EOS ended some responses early
    after = {str(leaf.sharding) for leaf in jax.tree_util.tree_leaves(policy.model) if hasattr(leaf, "sharding")}
    assert after == before and policy.model.mesh is mesh
