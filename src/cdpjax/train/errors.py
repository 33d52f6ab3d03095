"""The trainer's errors: each message names what to do; ``EXIT_PREEMPTED``, the resumable exit."""
from __future__ import annotations


EXIT_PREEMPTED = 75


class TrainError(Exception):
  """An error whose message says what to do; the launcher prints it without a traceback."""


class CheckpointMismatchError(TrainError, ValueError):
  """A checkpoint in the workdir belongs to an incompatible config, or none is readable."""


class WorkdirError(TrainError):
  """The workdir cannot be used: not a directory, not writable, or in use."""


class NonFiniteError(TrainError, FloatingPointError):
  """The loss or the parameters stopped being finite.

  ``unsafe_from``: checkpoints of this step and later are not known to give a
  finite loss. The loss of step ``s`` is computed at ``theta_{s-1}`` (and, for
  delayed stages, ``theta_{s-2}``), the versions checkpoint ``s - 1`` holds; so
  a non-finite loss at step ``s`` makes checkpoints from ``s - 1`` on unsafe.
  """

  def __init__(self, message: str, unsafe_from: int):
    super().__init__(message)
    self.unsafe_from = unsafe_from


def first_line(e: BaseException) -> str:
  return (str(e).strip().splitlines() or [""])[0][:300]
