"""Stage partitioning follows execution order and balances costs optimally."""
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cdpjax import stages


class TwelveDense(nn.Module):
  """Dense_0 ... Dense_11: pytree order is Dense_0, Dense_1, Dense_10, Dense_11, Dense_2..."""

  @nn.compact
  def __call__(self, x):
    for _ in range(12):
      x = nn.Dense(4)(x)
    return x


class CallOrderNotNameOrder(nn.Module):
  """Calls z_first, then a non-param Dropout, a helper method of a_second, a shared module twice."""

  def setup(self):
    self.z_first = nn.Dense(3)
    self.drop = nn.Dropout(0.5)
    self.a_second = Block()
    self.m_shared = nn.Dense(3)

  def __call__(self, x, train=False):
    x = self.z_first(x)
    x = self.drop(x, deterministic=not train)
    x = self.m_shared(self.a_second(x, train=train))
    return self.m_shared(x)


class Block(nn.Module):

  @nn.compact
  def __call__(self, x, train):
    x = nn.BatchNorm(use_running_average=not train)(nn.Dense(3)(x))
    return self.activate(x)

  def activate(self, x):
    return nn.relu(x)


class SmallCNN(nn.Module):
  """Few-param convs on large maps (many FLOPs), a many-param head (few FLOPs)."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.Conv(16, (3, 3), strides=2)(x)
    x = nn.Conv(32, (3, 3), strides=2)(x)
    return nn.Dense(10)(x.reshape((x.shape[0], -1)))


class RootParam(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(x) * self.param("scale", nn.initializers.ones, (1, 2))


def _params(model, *args, **kwargs):
  return jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))["params"]


def _unit_params(sizes):
  return {f"u{i}": {"w": np.zeros(s, np.float32)} for i, s in enumerate(sizes)}


def test_twelve_dense_layers_follow_execution_order_not_pytree_order():
  x = jnp.ones((2, 4))
  params = _params(TwelveDense(), x)
  names = [f"Dense_{i}" for i in range(12)]
  pytree_order = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  assert pytree_order[::2][:4] == ["Dense_0", "Dense_1", "Dense_10", "Dense_11"]
  assert stages.execution_order(TwelveDense(), jax.ShapeDtypeStruct((2, 4), jnp.float32)) == names
  stage_ids = stages.model_stage_ids(TwelveDense(), params, 3, x)
  assert {k: stage_ids[k]["kernel"] for k in names} == {k: i // 4 for i, k in enumerate(names)}
  assert stage_ids["Dense_10"] == {"kernel": 2, "bias": 2}
  assert stages.stage_sizes(params, stage_ids) == [4 * 20] * 3


def test_call_order_differs_from_name_order():
  x = jnp.ones((2, 5))
  model = CallOrderNotNameOrder()
  for train in (False, True):
    assert stages.execution_order(model, x, train=train) == ["z_first", "a_second", "m_shared"]


def test_unit_costs_replay_train_mode_calls_and_sum_repeated_calls():
  x = jnp.ones((2, 5))
  costs = stages.unit_costs(CallOrderNotNameOrder(), x, train=True)  # BatchNorm mutates, dropout.
  assert list(costs) == ["z_first", "a_second", "m_shared"]
  assert [c.params for c in costs.values()] == [18, 18, 12]
  dense = nn.Dense(3)
  x_abstract = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  one_call = jax.jit(dense.apply).lower({"params": _params(dense, jnp.ones((2, 3)))}, x_abstract)
  assert costs["m_shared"].flops == 2 * one_call.compile().cost_analysis()["flops"]


def test_root_params_are_rejected():
  with pytest.raises(ValueError, match=r"\['scale'\].*Wrap parameters"):
    stages.execution_order(RootParam(), jnp.ones((1, 3)))


def _brute_force_max(costs, num_stages):
  return min(
      max(sum(costs[a:b]) for a, b in zip((0,) + cut, cut + (len(costs),)))
      for cut in itertools.combinations(range(1, len(costs)), num_stages - 1))


def test_params_split_is_the_hand_checked_optimum():
  # [1,2,3 | 4,5 | 6] has max 9; every other split has a larger maximum.
  params = _unit_params([1, 2, 3, 4, 5, 6])
  stage_ids = stages.partition(params, 3, order=list(params))
  assert [stage_ids[k]["w"] for k in params] == [0, 0, 0, 1, 1, 2]
  assert stages.stage_sizes(params, stage_ids) == [6, 9, 6]


@pytest.mark.parametrize("seed", range(5))
def test_params_split_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  sizes = rng.integers(1, 50, size=9).tolist()
  params = _unit_params(sizes)
  for num_stages in (1, 2, 4, 9):
    stage_ids = stages.partition(params, num_stages, order=list(params))
    per_stage = stages.stage_sizes(params, stage_ids)
    assert len(per_stage) == num_stages and min(per_stage) > 0
    assert max(per_stage) == _brute_force_max(sizes, num_stages)
    assert [stage_ids[k]["w"] for k in params] == sorted(stage_ids[k]["w"] for k in params)


def test_flops_split_balances_xla_flops():
  x = jnp.ones((1, 32, 32, 3))
  model = SmallCNN()
  params = _params(model, x)
  layers = [(nn.Conv(8, (3, 3)), x.shape), (nn.Conv(16, (3, 3), strides=2), (1, 32, 32, 8)),
            (nn.Conv(32, (3, 3), strides=2), (1, 16, 16, 16)), (nn.Dense(10), (1, 2048))]
  expected = []
  for name, (layer, shape) in zip(["Conv_0", "Conv_1", "Conv_2", "Dense_0"], layers):
    inp = jax.ShapeDtypeStruct(shape, jnp.float32)
    lowered = jax.jit(layer.apply).lower({"params": params[name]}, inp)
    expected.append(lowered.compile().cost_analysis()["flops"])

  costs = stages.unit_costs(model, x)
  assert list(costs) == ["Conv_0", "Conv_1", "Conv_2", "Dense_0"]
  assert [c.flops for c in costs.values()] == pytest.approx(expected)
  assert [c.params for c in costs.values()] == [224, 1168, 4640, 20490]
  # FLOPs sit in the convs and params in the head: the two splits differ.
  best = min(range(1, 4), key=lambda b: max(sum(expected[:b]), sum(expected[b:])))
  assert best == 2
  by_flops = stages.model_stage_ids(model, params, 2, x, by="flops")
  assert [by_flops[k]["kernel"] for k in costs] == [0, 0, 1, 1]
  by_params = stages.model_stage_ids(model, params, 2, x)
  assert [by_params[k]["kernel"] for k in costs] == [0, 0, 0, 1]


def test_boundaries_by_index_or_name():
  params = _unit_params([1, 2, 3, 4, 5])
  order = ["u4", "u3", "u2", "u1", "u0"]  # Execution order, not key order.
  for boundaries in ([1, 3], ["u3", "u1"], [1, "u1"]):
    stage_ids = stages.partition(params, 3, order=order, by="boundaries",
                                 boundaries=boundaries)
    assert {k: v["w"] for k, v in stage_ids.items()} == {
        "u4": 0, "u3": 1, "u2": 1, "u1": 2, "u0": 2}
  assert stages.stage_sizes(params, stage_ids) == [5, 7, 3]


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_stages=6), r"Cannot split 5 units .* at most 5 stages, or a model with more"),
    (dict(num_stages=0), r"num_stages must be an integer >= 1"),
    (dict(by="layers"), r"Unknown by='layers'"),
    (dict(by="flops"), r"Pass costs exactly when by='flops'"),
    (dict(costs={"u0": 1.0}), r"Pass costs exactly when by='flops'"),
    (dict(by="flops", costs={"u0": 1.0}), r"costs lacks units \['u1', 'u2', 'u3', 'u4'\]"),
    (dict(boundaries=[1]), r"Pass boundaries exactly when by='boundaries'"),
    (dict(by="boundaries", boundaries=[1, 2, 3]), r"3 stages need 2 boundaries.*got 3"),
    (dict(by="boundaries", boundaries=[1]), r"3 stages need 2 boundaries"),
    (dict(by="boundaries", boundaries=[3, 2]), r"strictly increasing unit indices in 1..4"),
    (dict(by="boundaries", boundaries=[2, 2]), r"strictly increasing"),
    (dict(by="boundaries", boundaries=[0, 2]), r"strictly increasing"),
    (dict(by="boundaries", boundaries=[2, 5]), r"strictly increasing"),
    (dict(by="boundaries", boundaries=["u1", "head"]), r"'head' is not a unit"),
    (dict(order=["u0", "u1", "u2", "u3"]), r"must list every top-level key"),
    (dict(order=["u0", "u1", "u2", "u3", "u3"]), r"must list every top-level key"),
])
def test_errors(kwargs, match):
  params = _unit_params([1, 2, 3, 4, 5])
  kwargs = {"num_stages": 3, "order": list(params), **kwargs}
  with pytest.raises(ValueError, match=match):
    stages.partition(params, kwargs.pop("num_stages"), **kwargs)


def test_variables_instead_of_params_names_the_fix():
  with pytest.raises(ValueError, match=r"Pass variables\['params'\]"):
    stages.partition({"params": _unit_params([1, 2])}, 2, order=["u0", "u1"])


def test_grouped_stage_ids():
  stage_list = [{"w": np.zeros(2), "b": np.zeros(1)}, {"w": np.zeros(3)}]
  assert stages.grouped(stage_list) == [{"w": 0, "b": 0}, {"w": 1}]
  assert stages.grouped({"first": np.zeros(2), "second": {"k": np.zeros(1)}}) == {
      "first": 0, "second": {"k": 1}}
