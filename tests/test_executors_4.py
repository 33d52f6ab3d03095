"""The executor contract through the launcher at N = J = 4: tests/test_executors.py's checks."""
import pytest

from test_executors import MODELS, PARALLELISMS, RULES, check_against_the_engine
from test_executors import workdir_root  # noqa: F401  pylint: disable=unused-import  (a fixture)

pytestmark = pytest.mark.slow  # Not in the fast subset (README, Tests).


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("parallelism", PARALLELISMS)
@pytest.mark.parametrize("model", MODELS)
def test_every_model_parallelism_and_rule_runs_the_engines_run(model, parallelism, rule,
                                                               workdir_root, capsys):  # pylint: disable=redefined-outer-name
  check_against_the_engine(model, parallelism, rule, 4, workdir_root, capsys)
