"""Every launcher command the docs show parses and validates as written.

The commands of README.md, docs/*.md (in code blocks) and the module
docstrings of configs/*.py and src/cdpjax/*.py are collected, continuation
lines joined, and each is parsed by its own launcher's absl flags (unknown
flags, bad ``--config.KEY=VALUE`` overrides and missing required flags fail)
and its config validated as the launcher would, without training: the
commands that train at smoke size are run by test_train, test_lm and
test_multihost.
"""
import ast
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCHERS = {"cdpjax-train": "cdpjax.main", "cdpjax-compile": "cdpjax.compile_main",
             "cdpjax-sample": "cdpjax.sample", "cdpjax-export": "cdpjax.export"}
START = re.compile(r"(?:^|&&\s*|^srun\s+|--command=\")(cdpjax-(?:train|compile|sample|export)\b.*)$")


def _text_blocks():
  """(source, text) for each markdown code block and each module docstring."""
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    for block in re.findall(r"^ *```[a-z]*\n(.*?)^ *```", path.read_text(), re.M | re.S):
      yield path.relative_to(ROOT).as_posix(), block
  for path in [*sorted((ROOT / "configs").glob("*.py")),
               *sorted((ROOT / "src" / "cdpjax").glob("*.py"))]:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    if doc:
      yield path.relative_to(ROOT).as_posix(), doc


def documented_commands() -> list[tuple[str, list[str]]]:
  """(source, argv) of every documented cdpjax-* command."""
  commands = []
  for source, text in _text_blocks():
    lines = iter(text.splitlines())
    for line in lines:
      match = START.search(line.strip())
      if not match:
        continue
      command = match.group(1)
      while command.rstrip().endswith("\\"):
        command = command.rstrip()[:-1] + " " + next(lines).strip()
      if command.count('"') % 2:  # The end of a `gcloud ... --command="..."` wrapper.
        command = command.rstrip().removesuffix('"')
      commands.append((source, shlex.split(command, comments=True)))
  return commands


# Run in a subprocess per launcher: each defines its flags on absl's global FLAGS.
_CHECK = r"""
import importlib, json, sys
from absl import flags
launcher, commands = sys.argv[1], json.loads(sys.stdin.read())
module = importlib.import_module(launcher)
from cdpjax import aot, config as config_lib
errors = []
for argv in commands:
  try:
    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:
      delattr(flags.FLAGS, name)  # The previous command's overrides.
    sys.argv = argv  # ml_collections reads the --config.KEY overrides from sys.argv.
    flags.FLAGS(argv)
    if "config" in flags.FLAGS:
      config_lib.validate(flags.FLAGS["config"].value)
    if "topology" in flags.FLAGS:
      aot.parse_topology(flags.FLAGS.topology)
  except Exception as e:  # pylint: disable=broad-except
    errors.append(f"{' '.join(argv)}: {type(e).__name__}: {e}")
print(json.dumps(errors))
"""


def test_the_docs_show_commands_of_every_launcher_and_config():
  commands = documented_commands()
  sources = {source for source, _ in commands}
  assert {"README.md", "docs/multihost.md", "src/cdpjax/main.py", "src/cdpjax/compile_main.py",
          *(f"configs/{p.name}" for p in (ROOT / "configs").glob("*.py"))} <= sources
  assert {argv[0] for _, argv in commands} == set(LAUNCHERS)
  assert len(commands) >= 30
  # Continuations are joined: the README's random-delay command keeps its last flags.
  assert ["cdpjax-train", "--config", "configs/digits.py:rule=random", "--config.max_delay=4",
          "--config.delay_distribution=geometric", "--workdir", "runs/digits-random"] in [
              argv for _, argv in commands]


def test_every_documented_command_parses_and_validates():
  by_launcher = {}
  for _, argv in documented_commands():
    by_launcher.setdefault(argv[0], []).append(argv)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  for name, commands in by_launcher.items():
    result = subprocess.run([sys.executable, "-c", _CHECK, LAUNCHERS[name]], cwd=ROOT, env=env,
                            input=json.dumps(commands), capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert not errors, "\n".join(errors)
