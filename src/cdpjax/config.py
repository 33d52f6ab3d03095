"""Config defaults, the ``get_config(arg)`` argument parser and validation.

No JAX import here: the launcher reads the config before JAX starts, to set
the emulated device count.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os

import ml_collections

from cdpjax import schedule

PARALLELISMS = ("data", "model", "zero")
BACKENDS = ("shard_map", "pmap")
LR_SCHEDULES = ("constant", "cosine", "step")
STAGES_BY = ("params", "flops", "blocks")
GRADIENT_REDUCTIONS = ("all-reduce", "permutes")  # engine.REDUCTIONS (no JAX import here).


def load(path: str, arg: str | None = None, **overrides) -> ml_collections.ConfigDict:
  """``get_config(arg)`` of the config file ``path``, as ``--config path:arg`` gives it.

  ``overrides`` set keys afterwards, as ``--config.KEY=VALUE`` does.
  """
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f"cdpjax_config_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(arg)
  for key, value in overrides.items():
    c[key] = value
  return c


def parse_arg(arg: str | None, **defaults):
  """Parses ``"rule=cdp-v2,smoke"`` into a ConfigDict over ``defaults``.

  A bare word sets a boolean default to True; values take the type of their
  default. Unknown keys raise, so a typo fails loudly.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, value = item.partition("=")
    if key not in defaults:
      raise ValueError(f"Unknown config argument {key!r}; valid: {sorted(defaults)}.")
    default = defaults[key]
    if not eq:
      if not isinstance(default, bool):
        raise ValueError(f"Config argument {key!r} needs a value: {key}=...")
      out[key] = True
    elif isinstance(default, bool):
      out[key] = value.lower() in ("1", "true", "yes")
    else:
      out[key] = type(default)(value)
  return out


def base_config() -> ml_collections.ConfigDict:
  """Keys every config has, with the defaults of the digits quick start."""
  c = ml_collections.ConfigDict()
  c.dataset = "digits"
  c.data_dir = ""  # tfds data_dir; "" = the tfds default.
  c.model = "residual_mlp"
  c.model_kwargs = ml_collections.ConfigDict({"width": 128, "hidden": 256, "num_blocks": 4})

  c.rule = "cdp-v2"
  # Delays that change every step (rule=random or straggler, parallelism=data):
  # the state keeps max_delay + 1 versions; the draws depend on (seed, step) only.
  c.max_delay = 2
  c.delay_distribution = "uniform"  # random: uniform or geometric on 0..max_delay.
  c.delay_geometric_p = 0.5  # P(k) ~ p (1-p)^k, truncated at max_delay.
  c.num_stragglers = 1  # straggler: the last workers read theta_{t - max_delay}.
  c.parallelism = "data"
  c.backend = "shard_map"
  c.num_workers = 8
  c.num_stages = 4
  c.stages_by = "blocks"  # How the model is cut into stages: blocks, params or flops.
  # A pod's second mesh axis. parallelism=model|zero: R copies of the executed
  # schedule, each on its own N = J micro-batches (R*N per step), each stage's
  # gradient summed over the copies. parallelism=data: a worker is F devices,
  # over which its state is sharded (same numbers as F = 1).
  c.num_replicas = 1  # R.
  c.devices_per_worker = 1  # F.
  # parallelism=data: the backward runs stage by stage and each stage's gradient is
  # all-reduced right after it, the next stage's backward waiting for it, so the J
  # all-reduces stay apart over the backward (the TPU compiler merges them otherwise).
  # Same numbers and state; needs a model the executed schedules can cut into stages.
  c.tied_backward = False
  # parallelism=data: how each stage's gradient is summed over the workers: all-reduce
  # (one psum per stage), or permutes (collective-permutes around the ring of workers and
  # an all-gather, the same bytes), which the TPU compiler runs beside the backward where
  # it runs all-reduces after it. Same numbers up to float rounding.
  c.gradient_reduction = "all-reduce"
  # parallelism=model: a forward keeps the activations its backward needs, which then
  # recomputes nothing of them (every stage but the first, whose input is the batch);
  # the default stashes each stage's input and recomputes its forward. Same numbers.
  c.keep_activations = False

  c.per_worker_batch_size = 16
  c.eval_batch_size = 128
  c.num_epochs = 40.0
  c.num_train_steps = -1  # -1: derived from num_epochs.

  c.optimizer = "sgd"  # sgd (with momentum), adam or adamw.
  c.learning_rate = 0.05
  c.momentum = 0.9
  c.adam_b1 = 0.9  # adam and adamw: the decay of the first moment (optax's b1),
  c.adam_b2 = 0.999  # and of the second (b2; language models often train with 0.95).
  c.weight_decay = 0.0
  c.lr_schedule = "cosine"
  c.lr_decay_factor = 0.1
  c.lr_decay_every_epochs = 30.0
  c.warmup_epochs = 0.0
  c.warmup_steps = 0  # > 0: warm-up in steps, instead of warmup_epochs.
  c.grad_clip_norm = 0.0  # > 0: clip the gradient to this global norm (parallelism=data).
  # Delay compensation, under every parallelism: a stale read of theta_{t-d} uses
  # theta_{t-d} + d * (theta_{t-d} - theta_{t-d-1}); a stage read stale keeps one more version.
  c.weight_prediction = False
  # DC-ASGD's correction: a worker's gradient g of a stage it read stale counts
  # as g + dc_lambda * g * g * (theta_t - theta_read); 0 is off.
  c.dc_lambda = 0.0
  # A delay-aware learning rate: stage j's update is scaled by
  # 1 / (1 + lr_delay_scale * mean_i min(d[i, j], t)); 0 is off.
  c.lr_delay_scale = 0.0

  c.seed = 0
  # Also evaluate and save the authors' final model (the mean over workers of
  # each worker's view; any parallelism) next to theta_T.
  c.final_mean_view = False
  c.log_every_steps = 10
  c.eval_every_steps = 100
  c.checkpoint_every_steps = 200
  c.keep_checkpoints = 3
  c.resume_step = -1  # The checkpoint a resume starts from: -1, the newest; N, step N's.
  # Steps per compiled call (one lax.scan): an executed pipeline fills and
  # drains once per call, not once per step. K divides eval_every_steps and
  # checkpoint_every_steps (`train.steps_per_call`): 0 picks the smallest whose
  # idle fraction is under 0.05 (16 at most for the engine); K > 0, the largest
  # up to K. 1 for the engine with a ResNet on the CPU, whose scanned backward
  # convolutions XLA runs on a slow path.
  c.steps_per_call = 0
  return c


def saved(workdir: str) -> ml_collections.ConfigDict:
  """The config a cdpjax-train run saved in ``workdir/config.json``; a clear error without one."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{path} does not exist: give the --workdir of a cdpjax-train run that "
                     "saved a checkpoint.")
  with open(path) as f:  # A key added since: the value the run ran with.
    return ml_collections.ConfigDict({**ADDED_KEYS, **json.load(f)})


def shrink_for_smoke(c: ml_collections.ConfigDict, num_train_steps: int) -> None:
  """A few steps that log, evaluate and checkpoint: for tests and a first look."""
  c.num_train_steps = num_train_steps
  c.log_every_steps = 1
  c.eval_every_steps = 2
  c.checkpoint_every_steps = 2
  # One step per call: XLA:CPU compiles a scan of a ResNet step ~30 s longer
  # than the step itself, which a few steps never pay back.
  c.steps_per_call = 1


# Keys renamed since a release: old name -> new name (a config or checkpoint may use the old).
RENAMED_KEYS = {"stage_strategy": "stages_by"}
# Keys added since, with the value a checkpoint that lacks them ran with.
ADDED_KEYS = {"num_replicas": 1, "devices_per_worker": 1, "resume_step": -1,
              "tied_backward": False, "keep_activations": False,
              "gradient_reduction": "all-reduce", "adam_b1": 0.9, "adam_b2": 0.999}


def validate(c: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the fix for a config that cannot run."""
  for old, new in RENAMED_KEYS.items():
    if old in c:
      raise ValueError(f"The config key {old!r} is now {new!r}: set c.{new} (or "
                       f"--config.{new}=...) instead.")
  rules = schedule.RULES + schedule.DYNAMIC_RULES
  if c.rule not in rules:
    raise ValueError(f"Unknown rule {c.rule!r}: set --config.rule to one of {', '.join(rules)}.")
  if c.rule in schedule.DYNAMIC_RULES:
    if c.parallelism != "data":
      raise ValueError(
          f"rule={c.rule!r} changes the delays every step, which only the update-rule engine "
          "runs: use --config.parallelism=data.")
    delay_rule(c)  # Raises on a bad max_delay, distribution or straggler count.
  for key, valid in (("parallelism", PARALLELISMS), ("backend", BACKENDS),
                     ("lr_schedule", LR_SCHEDULES), ("stages_by", STAGES_BY),
                     ("gradient_reduction", GRADIENT_REDUCTIONS)):
    if c[key] not in valid:
      raise ValueError(f"Unknown {key} {c[key]!r}: set --config.{key} to one of {valid}.")
  if c.resume_step < -1:
    raise ValueError(f"--config.resume_step must be -1 (the newest checkpoint) or a step, got "
                     f"{c.resume_step}.")
  for key in ("num_workers", "num_stages", "num_replicas", "devices_per_worker",
              "per_worker_batch_size", "eval_batch_size",
              "log_every_steps", "eval_every_steps", "checkpoint_every_steps",
              "keep_checkpoints"):
    if c[key] < 1:
      raise ValueError(f"--config.{key} must be >= 1, got {c[key]}.")
  if c.steps_per_call < 0:
    raise ValueError(f"--config.steps_per_call must be >= 0 (0: chosen by the run), got "
                     f"{c.steps_per_call}.")
  if c.num_train_steps < 1 and c.num_epochs <= 0:
    raise ValueError("Set --config.num_train_steps >= 1 or --config.num_epochs > 0.")
  _validate_mesh(c)
  if c.eval_batch_size % num_devices(c):
    raise ValueError(
        f"--config.eval_batch_size={c.eval_batch_size} must be a multiple of the {num_devices(c)} "
        "devices of the mesh (evaluation is sharded over them).")
  if c.warmup_steps and c.warmup_epochs:
    raise ValueError("Set --config.warmup_steps or --config.warmup_epochs, not both.")
  for key in ("adam_b1", "adam_b2"):
    if not 0 <= c[key] < 1:
      raise ValueError(f"--config.{key} is a decay rate in [0, 1), got {c[key]}.")
  for key in ("dc_lambda", "lr_delay_scale"):
    if c[key] < 0:
      raise ValueError(f"--config.{key} must be >= 0 (0: off), got {c[key]}.")
  if c.grad_clip_norm and c.parallelism != "data":
    raise ValueError(
        f"--config.grad_clip_norm={c.grad_clip_norm} clips by the norm over all stages, but "
        f"parallelism={c.parallelism!r} updates each stage on its own device: set "
        "--config.grad_clip_norm=0 or --config.parallelism=data.")
  if c.parallelism in ("model", "zero") and c.num_workers != c.num_stages:
    raise ValueError(
        f"parallelism={c.parallelism!r} runs N = J micro-batches: set --config.num_workers equal "
        f"to --config.num_stages (now {c.num_workers} and {c.num_stages}).")


def _validate_mesh(c: ml_collections.ConfigDict) -> None:
  """``num_replicas`` only for the executed schedules, ``devices_per_worker`` only for the engine."""
  if c.num_replicas != 1 and c.parallelism == "data":
    raise ValueError(
        f"--config.num_replicas={c.num_replicas} copies an executed schedule "
        "(parallelism=model or zero); parallelism=data runs every worker on the 'data' axis: "
        "set --config.num_replicas=1 and raise --config.num_workers instead.")
  if c.tied_backward and (c.parallelism != "data" or c.devices_per_worker != 1):
    raise ValueError(
        "--config.tied_backward=True ties the engine's per-stage all-reduces into its backward "
        "on a 1-D mesh: use parallelism='data' with devices_per_worker=1, or "
        "--config.tied_backward=False (the executed schedules reduce each stage where it runs).")
  if c.gradient_reduction != "all-reduce" and (c.parallelism != "data"
                                               or c.devices_per_worker != 1):
    raise ValueError(
        f"--config.gradient_reduction={c.gradient_reduction} sums the engine's gradients over a "
        "1-D mesh of workers: use parallelism='data' with devices_per_worker=1, or "
        "--config.gradient_reduction=all-reduce (the executed schedules reduce each stage where "
        "it runs).")
  if c.keep_activations and c.parallelism != "model":
    raise ValueError(
        "--config.keep_activations=True keeps the executed pipeline's activations "
        "(parallelism='model'); the engine keeps them already and CDP+ZeRO recomputes: use "
        "parallelism='model' or --config.keep_activations=False.")
  if c.devices_per_worker != 1 and c.parallelism != "data":
    raise ValueError(
        f"--config.devices_per_worker={c.devices_per_worker} shards the engine's state inside a "
        f"worker (parallelism=data); parallelism={c.parallelism!r} already places one stage per "
        "device: set --config.devices_per_worker=1 (and --config.num_replicas for more devices).")


def delay_rule(c: ml_collections.ConfigDict):
  """The rule the engine runs: a ``schedule.DelayRule`` for ``random``/``straggler``.

  Its draws are a pure function of ``(config.seed, step)``, so the delays of a
  run can be replayed with ``delay_rule(config)(step)``.
  """
  return schedule.make_rule(
      c.rule, c.num_workers, c.num_stages, max_delay=c.max_delay,
      distribution=c.delay_distribution, p=c.delay_geometric_p, stragglers=c.num_stragglers,
      seed=c.seed)


def mesh_axes(c: ml_collections.ConfigDict) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """``(shape, axis names)`` of the run's mesh.

  ``model``: ``(stage,)``, or ``(replica, stage)`` with ``num_replicas > 1``;
  ``zero``: ``(data,)`` or ``(replica, data)``; ``data``: ``(data,)``, or
  ``(data, fsdp)`` with ``devices_per_worker > 1``.
  """
  if c.parallelism == "data":
    inner = ((c.num_workers,), ("data",))
    return inner if c.devices_per_worker == 1 else (
        (c.num_workers, c.devices_per_worker), ("data", "fsdp"))
  inner = ((c.num_stages,), ("stage",)) if c.parallelism == "model" else ((c.num_workers,), ("data",))
  if c.num_replicas == 1:
    return inner
  return (c.num_replicas, *inner[0]), ("replica", *inner[1])


def num_devices(c: ml_collections.ConfigDict) -> int:
  """Devices the run's mesh needs: ``R*J``, ``R*N`` or ``N*F``."""
  return math.prod(mesh_axes(c)[0])


def global_batch_size(c: ml_collections.ConfigDict) -> int:
  """Rows per step: ``R*N*b`` (``R = 1`` under parallelism=data)."""
  return c.num_replicas * c.num_workers * c.per_worker_batch_size


# The paper's recipes (Fournier & Oyallon 2024, section 5): 8 workers, 4 stages.
PAPER_RECIPES = {
    "cifar10": dict(per_worker_batch_size=64, learning_rate=0.05, weight_decay=5e-4,
                    num_epochs=101.0, lr_decay_factor=0.2, lr_decay_every_epochs=30.0,
                    stem="cifar", eval_batch_size=512),
    "imagenet2012": dict(per_worker_batch_size=32, learning_rate=0.1, weight_decay=1e-4,
                         num_epochs=91.0, lr_decay_factor=0.1, lr_decay_every_epochs=30.0,
                         stem="imagenet", eval_batch_size=256),
}


def paper_config(dataset: str, model: str, arg: str | None) -> ml_collections.ConfigDict:
  """A ResNet run of the paper, with ``rule=``, ``parallelism=`` and ``smoke``.

  ``parallelism=model`` and ``zero`` run N = J = 4 workers (the executed
  timetables need one micro-batch per stage) of twice the recipe's rows, so a
  step still sees the recipe's global batch (8 x b) that its learning rate is for.
  """
  arg = parse_arg(arg, rule="cdp-v2", parallelism="data", smoke=False)
  recipe = dict(PAPER_RECIPES[dataset])
  c = base_config()
  c.dataset = dataset
  c.model = model
  c.model_kwargs = ml_collections.ConfigDict({"stem": recipe.pop("stem")})
  c.rule = arg.rule
  c.parallelism = arg.parallelism
  c.stages_by = "flops"
  c.optimizer = "sgd"
  c.momentum = 0.9
  c.lr_schedule = "step"
  for key, value in recipe.items():
    c[key] = value
  if arg.parallelism in ("model", "zero"):
    c.per_worker_batch_size = c.per_worker_batch_size * c.num_workers // c.num_stages
    c.num_workers = c.num_stages
  c.log_every_steps = 50
  c.eval_every_steps = 1000
  c.checkpoint_every_steps = 1000
  if arg.smoke:  # A narrow ResNet on tiny batches.
    c.model_kwargs.width = 8
    c.per_worker_batch_size = 2
    c.eval_batch_size = 16
    shrink_for_smoke(c, num_train_steps=2)
  c.lock()
  return c
