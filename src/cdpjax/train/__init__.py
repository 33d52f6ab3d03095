"""Training and evaluation from a config: the framework's main job.

``train_and_evaluate(config, workdir)`` builds the model, data, mesh and the
train step of ``config.parallelism`` (``data``: the update-rule engine;
``model``: the executed CDP+MP pipeline; ``zero``: the executed CDP+ZeRO
ring), resumes from the newest checkpoint in ``workdir`` and trains, ``K``
steps per compiled call (`steps_per_call`), writing ``config.json``,
``metrics.jsonl``, TensorBoard events and ``summary.json``.

Faults and misuse: the workdir is locked; a resume refuses a config change
that would change the trajectory (``RESUMABLE_KEYS`` may change) and falls
back past an unreadable checkpoint; only finite states are checkpointed; an
error waits for the save in flight and names the newest checkpoint; after a
divergence, the checkpoints whose loss is not known finite are set aside;
SIGTERM, SIGHUP and Ctrl-C checkpoint and stop (the launcher then exits
``EXIT_PREEMPTED``).

The package, one job a module: ``setup`` (what a config builds: optimizer,
stages, mesh, executor, eval), ``checkpoints`` (checkpoints, the resume policy
and the workdir), ``metrics`` (what a run logs), ``errors`` and ``loop``.
"""
from cdpjax.train.checkpoints import (RESUMABLE_KEYS, WORKDIR_LAYOUT, Checkpointer, WorkdirLock,
                                     config_changes)
from cdpjax.train.errors import (EXIT_PREEMPTED, CheckpointMismatchError, NonFiniteError,
                                 TrainError, WorkdirError)
from cdpjax.train.loop import export_models, exported, restore, train_and_evaluate
from cdpjax.train.metrics import MetricsLog
from cdpjax.train.setup import (Run, Runner, build_run, build_runner, decay_matrices,
                                learning_rate_schedule, make_eval_fn, make_mesh, make_optimizer,
                                model_kwargs, model_stage_ids, rows_spec, steps_per_call, to_global)
