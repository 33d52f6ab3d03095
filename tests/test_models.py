"""Models: shapes, torchvision parameter counts, BatchNorm state, pure MLP parts."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import models


def _num_params(params):
  return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def _abstract_params(model, image_shape):
  variables = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, *image_shape)), train=False))
  return variables["params"]


# torchvision counts resnet18 at 11,689,512 and resnet50 at 25,557,032 parameters
# (1000 classes, 7x7 stem). The CIFAR stem has 3*3*3*64 = 1,728 instead of 9,408
# weights (-7,680), and a 10-class head drops (512+1)*990 = 507,870 (ResNet-18) or
# (2048+1)*990 = 2,028,510 (ResNet-50): 11,173,962 and 23,520,842.
@pytest.mark.parametrize("name,stem,num_classes,expected", [
    ("resnet18", "imagenet", 1000, 11_689_512),
    ("resnet18", "cifar", 10, 11_173_962),
    ("resnet50", "imagenet", 1000, 25_557_032),
    ("resnet50", "cifar", 10, 23_520_842),
])
def test_resnet_parameter_counts_match_torchvision(name, stem, num_classes, expected):
  model = models.create_model(name, num_classes, stem=stem)
  assert _num_params(_abstract_params(model, (32, 32, 3))) == expected


@pytest.mark.parametrize("name,num_blocks", [("resnet18", 8), ("resnet50", 16)])
def test_resnet_top_level_units(name, num_blocks):
  params = _abstract_params(models.create_model(name, 10), (32, 32, 3))
  expected = {"stem_conv", "stem_bn", "head"} | {f"block_{i}" for i in range(num_blocks)}
  assert set(params) == expected


@pytest.mark.parametrize("stem,image_shape", [("cifar", (32, 32, 3)), ("imagenet", (224, 224, 3))])
def test_resnet50_output_shape(stem, image_shape):
  model = models.create_model("resnet50", 7, stem=stem)
  x = jnp.zeros((2, *image_shape))
  variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
  logits = jax.eval_shape(lambda v: model.apply(v, x, train=False), variables)
  assert logits.shape == (2, 7)


def _numpy_variables(model, x):
  """Random variables with the model's structure; eager ``init`` compiles per shape (slow)."""
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
  rng = np.random.default_rng(0)

  def fill(path, leaf):
    if path[0].key == "batch_stats":
      return np.full(leaf.shape, path[-1].key == "var", np.float32)
    return (0.1 * rng.standard_normal(leaf.shape)).astype(np.float32)

  return jax.tree_util.tree_map_with_path(fill, abstract)


def test_resnet18_runs_and_updates_batch_stats():
  model = models.create_model("resnet18", 10)
  x = jax.random.normal(jax.random.key(1), (1, 32, 32, 3))
  variables = _numpy_variables(model, x)
  logits, updates = model.apply(
      variables, x, train=True, mutable=["batch_stats", "intermediates"],
      capture_intermediates=lambda m, _: m.name == "stem_conv")
  assert logits.shape == (1, 10)
  assert jax.tree.structure(updates["batch_stats"]) == jax.tree.structure(variables["batch_stats"])
  # Momentum 0.9 from a zero running mean: one step moves it a tenth of the way.
  (conv_out,) = updates["intermediates"]["stem_conv"]["__call__"]
  np.testing.assert_allclose(
      updates["batch_stats"]["stem_bn"]["mean"], 0.1 * jnp.mean(conv_out, axis=(0, 1, 2)),
      rtol=1e-5, atol=1e-7)
  # Eval mode reads the statistics and leaves them alone.
  _, eval_updates = model.apply(variables, x, train=False, mutable=["batch_stats"])
  assert all(jax.tree.leaves(jax.tree.map(
      np.array_equal, eval_updates["batch_stats"], variables["batch_stats"])))


def test_resnet_rejects_unknown_stem():
  with pytest.raises(ValueError, match="cifar"):
    _abstract_params(models.create_model("resnet18", 10, stem="tiny"), (32, 32, 3))


def test_create_model_names_valid_models():
  with pytest.raises(ValueError, match="resnet18, resnet50, residual_mlp"):
    models.create_model("vit", 10)


def test_residual_mlp_has_identical_blocks_and_no_state():
  model = models.create_model("residual_mlp", 10, width=16, hidden=32, num_blocks=3)
  x = jax.random.normal(jax.random.key(1), (5, 8, 8, 1))
  variables = _numpy_variables(model, x)
  assert set(variables) == {"params"}
  params = variables["params"]
  shapes = [jax.tree.map(jnp.shape, params[f"block_{i}"]) for i in range(3)]
  assert shapes[0] == shapes[1] == shapes[2]
  assert model.apply(variables, x, train=True).shape == (5, 10)
