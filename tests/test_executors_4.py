"""The executor contract through the launcher at N = J = 4: tests/test_executors.py's checks.

Every rule on the residual MLP; the larger models, whose compiles are the suite's longest,
the rules whose code differs: dp (GPipe, ZeRO-3) on ResNet-18 and the transformer, cdp-v2 on
all. cdp-v1 differs from cdp-v2 in its delay tables alone, which the residual MLP covers here
and every model but ResNet-50 at N = J = 2; ResNet-18 covers the ResNets' GPipe and ZeRO-3
(cut by FLOPs, with BatchNorm, as ResNet-50 is).
"""
import pytest

from test_executors import PARALLELISMS, RULES, check_against_the_engine
from test_executors import workdir_root  # noqa: F401  pylint: disable=unused-import  (a fixture)

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).

MODEL_RULES = {"residual_mlp": RULES, "resnet18": ("dp", "cdp-v2"), "resnet50": ("cdp-v2",),
               "transformer": ("dp", "cdp-v2")}


@pytest.mark.parametrize("parallelism", PARALLELISMS)
@pytest.mark.parametrize("model,rule", [(m, r) for m, rules in MODEL_RULES.items()
                                        for r in rules])
def test_every_model_parallelism_and_rule_runs_the_engines_run(model, parallelism, rule,
                                                               workdir_root, capsys):  # pylint: disable=redefined-outer-name
  check_against_the_engine(model, parallelism, rule, 4, workdir_root, capsys)
