"""The command lines of the jobs: a user's mistake is one line (:func:`cli_errors`), gin files and bindings are parsed
into one (:func:`parse_gin`), every gin entry point has the same flags (:func:`gin_parser`, :func:`gin_main`), an
argparse command is also a gin job with the parser's own settings and defaults (:func:`argparse_gin_job`), and a
multi-host run is joined when the environment asks (:func:`join_multihost_from_env`).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from typing import Sequence

from blockspec_jax.checks import UsageError

__all__ = ["cli_errors", "parse_gin", "gin_parser", "gin_main", "argv_from_settings", "argparse_gin_job",
           "add_gin_search_path", "bound_jobs", "MULTIHOST_ENV_VAR", "join_multihost_from_env"]


@contextlib.contextmanager
def cli_errors(prog: str):
  """Run a command-line job: a :class:`UsageError` (a setting, name, path or file of the user's that cannot work,
  including a gin configuration that does not parse: :func:`parse_gin`) or a missing file becomes one line
  ``<prog>: error: …`` on stderr and exit status 2. Every other exception is a fault of the program, not of its
  input, and keeps its traceback."""
  try:
    yield
  except (UsageError, FileNotFoundError) as e:
    _fail(prog, e)


def parse_gin(files: Sequence[str], bindings: Sequence[str]) -> None:
  """``gin.parse_config_files_and_bindings(files, bindings)`` with the gin search path set (:func:`add_gin_search_path`);
  whatever the parse raises (a syntax error, an unknown configurable or setting, a missing file, a bad value) is a
  :class:`UsageError` naming the gin configuration, since nothing has run yet."""
  import gin
  add_gin_search_path()
  try:
    gin.parse_config_files_and_bindings(files, bindings)
  except Exception as e:  # noqa: BLE001  (any failure to parse is the configuration's)
    message = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, SyntaxError) and e.lineno is not None and str(e.lineno) not in message:
      message += f" (line {e.lineno}: {(e.text or '').strip()!r})"
    raise UsageError(f"the gin configuration does not parse: {type(e).__name__}: {message}") from None


def _fail(prog: str, e: BaseException):
  # The first line says what is wrong; gin appends where it was raised ("In call to configurable …") below it.
  message = str(e).strip().splitlines()
  print(f"{prog}: error: {message[0] if message else type(e).__name__}", file=sys.stderr)
  raise SystemExit(2)


def gin_parser(prog: str, description: str, workdir: bool = False):
  """The command line of every gin entry point: ``--gin_file`` and ``--gin_param``, both repeatable (t5x's flags),
  and with ``workdir`` a ``--workdir`` for training runs."""
  import argparse
  parser = argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=[], help="a gin file (repeatable; later files win)")
  parser.add_argument("--gin_param", action="append", default=[], help='one binding, e.g. "suite.gammas = (2, 4)"')
  if workdir:
    parser.add_argument("--workdir", help="training jobs: the run's folder (default results/train/<gin file stem>)")
  return parser


def gin_main(prog: str, description: str, job, argv=None) -> int:
  """A gin-configured job's command line (:func:`gin_parser`), then ``job()``; usage and configuration errors print
  one line (:func:`cli_errors`)."""
  parser = gin_parser(prog, description)
  args = parser.parse_args(argv)
  with cli_errors(parser.prog):
    join_multihost_from_env()
    parse_gin(args.gin_file, args.gin_param)
    job()
  return 0


def _gin_options(parser) -> dict:
  """The options of an argparse ``parser`` a gin job exposes: every visible option by its ``dest``."""
  import argparse
  return {a.dest: a for a in parser._actions
          if a.option_strings and a.dest != "help" and a.help != argparse.SUPPRESS}


def argv_from_settings(parser, settings: dict) -> list[str]:
  """The command line that gives ``parser`` the option values ``settings`` (``dest`` -> value): a flag for a
  ``store_true`` option bound True, the items of a sequence as separate words for ``nargs`` options and joined with
  commas otherwise (the comma-separated lists of our commands), ``str(value)`` for the rest; None leaves an option
  at its default. Unknown names are a :class:`UsageError` listing the known ones."""
  import argparse
  options = _gin_options(parser)
  unknown = sorted(set(settings) - set(options))
  if unknown:
    raise UsageError(f"{parser.prog}: unknown settings {unknown}; known: {', '.join(options)}")
  argv = []
  for dest, value in settings.items():
    action = options[dest]
    flag = action.option_strings[-1]
    if value is None:
      continue
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
      if not isinstance(value, bool):
        raise UsageError(f"{parser.prog}: {dest} is a switch; bind True or False, got {value!r}")
      if value != action.default:
        argv.append(flag)
    elif action.nargs not in (None, "?"):
      argv += [flag, *map(str, value if isinstance(value, (list, tuple)) else [value])]
    else:
      argv += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
  return argv


def argparse_gin_job(name: str, build_parser, main):
  """Register the argparse command ``main(argv)`` (options from ``build_parser()``) as the gin job ``name``.

  Its settings are the parser's options by ``dest`` (``paired.num_prompts = 12``, ``bench_peer.gammas = (2, 4)``)
  and their defaults are the parser's, so the command line and the gin job share one definition of both. Calling the
  configurable turns the bound settings back into a command line (:func:`argv_from_settings`) and runs ``main``, so
  the command's own checks and derived defaults apply unchanged; it returns what ``main`` returns."""
  import inspect
  import gin
  parser = build_parser()

  def job(**settings):
    return main(argv_from_settings(parser, settings))

  job.__name__ = job.__qualname__ = name
  job.__doc__ = f"The gin job of ``{parser.prog}``: one keyword per option (its dest), the parser's defaults."
  job.__signature__ = inspect.Signature([inspect.Parameter(dest, inspect.Parameter.KEYWORD_ONLY, default=None)
                                         for dest in _gin_options(parser)])
  return gin.configurable(name)(job)


def add_gin_search_path() -> None:
  """Let ``include 'gin/…'`` and ``--gin_file gin/…`` resolve from any working directory (the repository root, when
  the package sits in it, as with an editable install), besides the working directory itself."""
  import gin
  root = pathlib.Path(__file__).resolve().parents[1]
  if (root / "gin").is_dir() and str(root) not in gin.config._LOCATION_PREFIXES:
    gin.add_config_file_search_path(str(root))


def bound_jobs(names) -> list[str]:
  """Which of the configurable jobs ``names`` the parsed gin configuration binds settings of (in ``names`` order):
  how an entry point tells what its gin files ask it to run."""
  return [name for name in names if _bindings(name)]


def _bindings(name: str) -> dict:
  """gin's bindings of configurable ``name``; none for a name gin does not know in this process (a job whose module
  was not imported has no bindings: gin refuses bindings of unknown names when it parses)."""
  import gin
  try:
    return gin.get_bindings(name)
  except ValueError:
    return {}


MULTIHOST_ENV_VAR = "BLOCKSPEC_JAX_MULTIHOST"


def join_multihost_from_env() -> bool:
  """With ``$BLOCKSPEC_JAX_MULTIHOST=1`` (set on every worker by ``launch/tpu_vm.sh`` and ``launch/gpu_vm.sh`` for a
  slice of several hosts), join the multi-host run (``parallel.initialize_multihost``: ``jax.distributed`` reads the
  coordinator from the TPU environment, or from ``$JAX_COORDINATOR_ADDRESS``, ``$JAX_NUM_PROCESSES`` and
  ``$JAX_PROCESS_ID`` on GPU hosts) before any computation; True if it did. Unset or ``0``: nothing (one host)."""
  value = os.environ.get(MULTIHOST_ENV_VAR, "0").strip()
  if value in ("", "0"):
    return False
  if value != "1":
    raise UsageError(f"${MULTIHOST_ENV_VAR} must be 0 or 1, got {value!r}")
  from blockspec_jax import parallel
  kwargs = {}
  for name, key, cast in (("JAX_COORDINATOR_ADDRESS", "coordinator_address", str),
                          ("JAX_NUM_PROCESSES", "num_processes", int), ("JAX_PROCESS_ID", "process_id", int)):
    if os.environ.get(name):
      try:
        kwargs[key] = cast(os.environ[name])
      except ValueError:
        raise UsageError(f"${name} must be an integer, got {os.environ[name]!r}") from None
  parallel.initialize_multihost(**kwargs)
  return True
