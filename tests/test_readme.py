"""The README as a user meets it: its decoding example runs as written (the ```python block under "## Decoding" is
executed in a fresh interpreter outside the repository directory, as a user would after installing; it loads
SmolLM2-135M, downloaded from PyPI once, ~100 MB, like the other SmolLM2 tests, and decodes two short prompts with
block verification), its two set-up commands are the ones CI runs, it stays a landing page (at most 250 lines; the
measurements live in docs/results/), and no relative link in it or in docs/ points outside the repository or at a
file that is not there."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from blockspec_jax.paths import default_cache_dir

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 250


def example_env() -> dict:
  """The test's environment plus JAX's persistent compilation cache (in the directory the jobs use,
  ``$BLOCKSPEC_JAX_COMPILE_CACHE`` or ``<cache>/jax_compilation``; "off" disables it), so a rerun skips compiling the
  two 30-layer models. The example's code is unchanged by it."""
  env = dict(os.environ)
  directory = env.get("BLOCKSPEC_JAX_COMPILE_CACHE", str(default_cache_dir() / "jax_compilation"))
  if directory.strip().lower() not in ("", "0", "off", "none"):
    env.setdefault("JAX_COMPILATION_CACHE_DIR", directory)
    # a size limit makes JAX lock the shared directory (the other test worker may write to it at the same time)
    env.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
  return env


def section_code(markdown: str, heading: str, language: str = "python") -> str:
  """The first ```<language> block (```python by default) of the section ``heading``, which runs to the next heading
  of the same or a higher level. Lines inside code fences are never taken for headings (a Python comment starts with
  "# " too)."""
  level = len(heading) - len(heading.lstrip("#"))
  found = in_section = in_fence = False
  block = None
  for line in markdown.splitlines(keepends=True):
    stripped = line.strip()
    if stripped.startswith("```"):
      if in_fence and block is not None:
        return "".join(block)  # the closing fence of the block
      in_fence = not in_fence
      if in_fence and in_section and stripped == "```" + language:
        block = []
    elif in_fence:
      if block is not None:
        block.append(line)
    else:
      hashes = len(stripped) - len(stripped.lstrip("#"))
      if 0 < hashes <= level and stripped[hashes:hashes + 1] == " ":
        if in_section:
          break
        in_section = found = stripped == heading
  if block is not None:
    raise AssertionError(f"the ```python block of section {heading!r} in README.md is not closed")
  if not found:
    raise AssertionError(f"README.md has no section {heading!r}")
  raise AssertionError(f"section {heading!r} of README.md has no ```{language} block")


def test_section_code_extraction():
  text = ("# T\n\n## A\n\n```python\nx = 1\n```\n\n## Decoding\n\ntext\n\n```bash\nls\n```\n\n```python\n"
          "# a comment, not a heading\nprint(2)\n```\n\n## B\n```python\nno\n```\n")
  assert section_code(text, "## Decoding") == "# a comment, not a heading\nprint(2)\n"
  assert section_code(text, "## A") == "x = 1\n"
  with pytest.raises(AssertionError, match="no section"):
    section_code(text, "## Missing")
  with pytest.raises(AssertionError, match="no ```python block"):
    section_code("## Decoding\n\nonly prose\n\n## Next\n```python\nx\n```\n", "## Decoding")
  with pytest.raises(AssertionError, match="not closed"):
    section_code("## Decoding\n```python\nx = 1\n", "## Decoding")


def test_readme_decoding_example_runs(tmp_path):
  code = section_code(README.read_text(encoding="utf-8"), "## Decoding")
  assert "generate_speculative" in code and 'verifier="block"' in code
  script = tmp_path / "readme_decoding.py"
  script.write_text(code, encoding="utf-8")
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=example_env(), capture_output=True,
                        text=True, timeout=1800, check=False)
  assert proc.returncode == 0, f"the README's decoding example failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
  lines = proc.stdout.strip().splitlines()[-3:]  # one generated text per prompt, then the summary line
  assert len(lines) == 3, proc.stdout
  assert all(line.startswith(("'", '"')) and len(line) > 2 for line in lines[:2]), proc.stdout  # non-empty texts
  match = re.fullmatch(r"block efficiency (\d+\.\d+) over (\d+) target calls", lines[2])
  assert match is not None, proc.stdout
  assert 1.0 <= float(match.group(1)) <= 5.0 and int(match.group(2)) >= 1


def test_readme_is_a_landing_page():
  """What this is, the set-up, the quick run, the main job, the tested example, a short module map and links: the
  measured tables live in docs/results/ (the README had grown to ~1,250 lines, two thirds of them measurement notes)."""
  lines = README.read_text(encoding="utf-8").splitlines()
  assert len(lines) <= MAX_README_LINES, (
      f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move measurements to docs/results/<topic>.md "
      "and how-to detail to docs/USAGE.md")


def ci_setup_commands() -> list[str]:
  """The commands .ci/run marks as the README's set-up commands (the first command line after each marker)."""
  lines = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
  commands = []
  for i, line in enumerate(lines):
    if re.match(r"#\s*README set-up command \d", line.strip()):
      following = [rest.strip() for rest in lines[i + 1:] if rest.strip() and not rest.strip().startswith("#")
                   and not re.fullmatch(r"set [-+]\w+", rest.strip())]
      commands.append(following[0])
  return commands


def test_setup_commands_are_what_ci_runs():
  """The README's "## Set-up (two commands)" block holds exactly the two commands .ci/run runs, install first."""
  block = section_code(README.read_text(encoding="utf-8"), "## Set-up (two commands)", language="bash")
  commands = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
  assert commands == ci_setup_commands() == ['pip install -r requirements.txt -e ".[test]"', "python -m pytest -q -n 2"]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_links_stay_in_the_repository():
  """Every relative link of README.md and docs/**/*.md names a file or directory of this repository (no paths
  outside it, such as ../shared, and no page that moved away)."""
  pages = [README, *sorted((REPO / "docs").rglob("*.md"))]
  broken = []
  for page in pages:
    for target in LINK.findall(page.read_text(encoding="utf-8")):
      if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
        continue  # a URL (https:, mailto:) or an anchor on the same page
      path = (page.parent / target.split("#")[0]).resolve()
      if REPO not in path.parents and path != REPO or not path.exists():
        broken.append(f"{page.relative_to(REPO)}: {target}")
  assert broken == []


def test_console_scripts_run_what_the_readme_names():
  """``blockspec`` is the main job (``python -m blockspec_jax.run``), ``blockspec-gin`` the one gin entry point,
  ``blockspec-theory`` the theory report; each names a ``main`` that exists, and the README names all three."""
  import importlib
  import tomllib
  scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
  assert scripts == {"blockspec": "blockspec_jax.run:main", "blockspec-gin": "blockspec_jax.main:main",
                     "blockspec-theory": "blockspec_jax.__main__:main"}
  readme = README.read_text()
  for name, target in scripts.items():
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), target
    assert f"`{name}`" in readme, name
