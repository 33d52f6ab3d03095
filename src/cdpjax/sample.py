"""Text from a trained language model: ``cdpjax-sample --workdir runs/lm --prompt "def "``.

Restores the newest checkpoint of a ``configs/lm.py`` workdir (any rule and
parallelism: the run is rebuilt from the config it saved, as a resume does)
and prints the prompt followed by ``--length`` sampled bytes. Each byte is
drawn from the model's next-byte distribution at ``--temperature`` (0: the
most likely byte) given the last ``seq_len`` bytes; ``--seed`` fixes the draws.

  cdpjax-sample --workdir runs/lm --prompt "def " --length 200
  cdpjax-sample --workdir runs/lm --prompt "import " --temperature 0.5 --seed 1
"""
import contextlib
import functools
import sys

from absl import app
from absl import flags
from absl import logging
import jax  # The device count is read when the backend starts, not at import.
import jax.numpy as jnp
import numpy as np

from cdpjax import distributed

_WORKDIR = flags.DEFINE_string("workdir", None, "A language-model run's workdir (cdpjax-train's).")
_PROMPT = flags.DEFINE_string("prompt", "\n", "Text the sample continues (UTF-8 bytes).")
_LENGTH = flags.DEFINE_integer("length", 200, "Bytes to sample.", lower_bound=0)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0 takes the most "
                                  "likely byte.", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the draws.")


def load_config(workdir: str):
  """The config a run saved in ``workdir/config.json``; a clear error when it is no LM run."""
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  c = config_lib.saved(workdir)
  if c.model != "transformer":
    raise ValueError(f"{workdir} holds a run of model={c.model!r}: sampling needs a language "
                     "model (configs/lm.py).")
  return c


def restore_params(c, workdir: str):
  """``(model, params)`` of the newest checkpoint in ``workdir``, on the host."""
  from cdpjax import train  # pylint: disable=g-import-not-at-top
  with contextlib.redirect_stdout(sys.stderr):  # Its "runs as" line: stdout is the sample.
    run, state, _ = train.restore(c, workdir)
  params = jax.device_get(run.runner.variables(state)["params"])
  return run.model, params


@functools.partial(jax.jit, static_argnames=("model", "temperature"))
def _draw(model, params, window, last, key, temperature: float):
  """The next byte after ``window[last]``, drawn (or the argmax at temperature 0)."""
  logits = model.apply({"params": params}, window[None])[0, last]
  if temperature == 0:
    return jnp.argmax(logits)
  return jax.random.categorical(key, logits / temperature)


def sample(model, params, prompt: bytes, length: int, *, temperature: float, seed: int) -> bytes:
  """``prompt`` and ``length`` bytes drawn one at a time from ``model``.

  Every draw reads one fixed-shape window (the last ``seq_len`` bytes, padded
  on the right), so one compiled forward serves every step: the model is
  causal, so the padding does not reach the position read.
  """
  if not prompt:
    raise ValueError("--prompt is empty: give at least one character to continue.")
  out = list(prompt)
  window = np.zeros(model.seq_len, np.int32)
  for key in jax.random.split(jax.random.key(seed), length):
    context = out[-model.seq_len:]
    window[:len(context)] = context
    out.append(int(_draw(model, params, window, len(context) - 1, key, temperature)))
  return bytes(out)


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    c = load_config(_WORKDIR.value)
  except ValueError as e:
    sys.exit(f"cdpjax-sample: error: {e}")
  from cdpjax import config as config_lib  # pylint: disable=g-import-not-at-top
  distributed.emulate_cpu_devices(config_lib.num_devices(c))  # The run's mesh, as it trained.
  try:
    model, params = restore_params(c, _WORKDIR.value)
    text = sample(model, params, _PROMPT.value.encode(), _LENGTH.value,
                  temperature=_TEMPERATURE.value, seed=_SEED.value)
  except ValueError as e:
    sys.exit(f"cdpjax-sample: error: {e}")
  print(text.decode("utf-8", errors="replace"))


def run():
  """Console-script entry point."""
  flags.mark_flag_as_required("workdir")
  app.run(main)


if __name__ == "__main__":
  run()
