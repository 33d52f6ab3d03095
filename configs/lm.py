"""A GPT-style byte-level language model, offline on the Python standard library's sources.

4 workers, 4 stages (embedding + block 0, block 1, block 2, block 3 + head),
CDP-v2, AdamW with warm-up and cosine decay, gradients
clipped to global norm 1 (under ``parallelism=data``; the executed timetables
update each stage on its own device and do not clip). The launcher logs the
bigram baseline of the eval split once
(``baseline/bigram_bits_per_byte``), then ``eval/bits_per_byte``:

  cdpjax-train --config configs/lm.py --workdir runs/lm
  cdpjax-train --config configs/lm.py:rule=dp,smoke --workdir runs/lm-smoke
  cdpjax-train --config configs/lm.py:parallelism=model,smoke --workdir runs/lm-mp-smoke
  cdpjax-train --config configs/lm.py:size=small --workdir runs/lm-small
  cdpjax-train --config configs/lm.py:dataset=tiny_shakespeare --workdir runs/lm-shakespeare \\
    --config.data_dir=/data/tfds

Arguments: ``rule=`` (dp, cdp-v1, cdp-v2, cdp-v2-paper), ``parallelism=``
(``data``, ``model``, ``zero``), ``size=`` (``SIZES``),
``dataset=`` (python_stdlib, tiny_shakespeare, lm1b; the tfds sets need
``python -m cdpjax.data.tfds_pipeline NAME --data_dir DIR`` first) and ``smoke``.
"""
from cdpjax import config as config_lib

SIZES = {
    # 2 min 16 s on 2 CPU cores (README), 3.15 bits per byte: 0.24 M parameters.
    "quick": dict(num_layers=4, d_model=64, num_heads=4, d_ff=256, seq_len=64, steps=600,
                  batch=16),
    # For a workstation or one accelerator: 6.5 M parameters.
    "small": dict(num_layers=8, d_model=256, num_heads=8, d_ff=1024, seq_len=256, steps=5000,
                  batch=16),
    # GPT-2 small's shape, byte-level, for accelerators: 86 M parameters.
    "base": dict(num_layers=12, d_model=768, num_heads=12, d_ff=3072, seq_len=1024, steps=20000,
                 batch=8),
}


def get_config(arg: str | None = None):
  arg = config_lib.parse_arg(arg, rule="cdp-v2", parallelism="data", size="quick",
                             dataset="python_stdlib", smoke=False)
  if arg.size not in SIZES:
    raise ValueError(f"Unknown size {arg.size!r}: use one of {', '.join(SIZES)}.")
  size = dict(SIZES[arg.size])
  c = config_lib.base_config()
  c.dataset = arg.dataset
  c.model = "transformer"
  c.model_kwargs = config_lib.ml_collections.ConfigDict(dict(
      vocab_size=256, num_layers=size["num_layers"], d_model=size["d_model"],
      num_heads=size["num_heads"], d_ff=size["d_ff"], seq_len=size["seq_len"],
      positions="learned", tie_embeddings=False, dtype="float32"))
  c.rule = arg.rule
  c.parallelism = arg.parallelism
  c.num_workers = 4
  c.num_stages = 4
  c.stages_by = "blocks"

  c.per_worker_batch_size = size["batch"]
  c.eval_batch_size = 64
  c.eval_windows = 256  # Eval windows of seq_len + 1 bytes, spread over the eval split.
  c.num_train_steps = size["steps"]
  c.optimizer = "adamw"
  # Quick: 2e-3 with 10% warm-up; CDP with 3e-3 and 5% stalls (BENCHMARKS.md).
  c.learning_rate = 2e-3 if arg.size == "quick" else 1e-3
  c.weight_decay = 0.1
  c.lr_schedule = "cosine"
  c.warmup_epochs = 0.0
  c.warmup_steps = max(1, size["steps"] // 10)
  # The executed timetables update each stage on its own device, so a clip by
  # the global norm (over every stage) does not apply there: no clipping.
  c.grad_clip_norm = 1.0 if arg.parallelism == "data" else 0.0
  c.log_every_steps = 10
  c.eval_every_steps = 50
  c.checkpoint_every_steps = 100
  if arg.smoke:  # Tiny widths and windows: seconds.
    c.model_kwargs.update(d_model=32, num_heads=2, d_ff=64, seq_len=16)
    c.per_worker_batch_size = 2
    c.eval_batch_size = 8
    c.eval_windows = 16
    c.warmup_steps = 1
    config_lib.shrink_for_smoke(c, num_train_steps=4)
  c.lock()
  return c
