"""Imports point one way: the package's modules form layers, a module imports only its own layer or lower ones, and
no two modules import each other, directly or around a cycle. Read from the source (``ast``, every ``import``
statement, those inside functions included), so a new upward import or cycle fails here, with its file and line.

The layers, lowest first (``docs/ARCHITECTURE.md`` draws them):

0. core: ``checks``, ``paths``, ``sampling``, ``artifacts``, ``runtime``, ``contracts``, ``kernels``;
1. ``theory``, ``verify``, ``models``;
2. ``data`` (prompt sets), ``decoding``, ``drafters``;
3. ``parallel``, ``train`` (the training library);
4. ``methods``, ``sources``, ``cli``, ``job_config``, ``train.job_setup`` (what the jobs share);
5. ``eval``, ``run`` (the main job), the training jobs;
6. the entry points: ``main``, ``__main__``, ``train.__main__``.
"""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "blockspec_jax"

LAYERS = {
    "blockspec_jax": 0, "checks": 0, "paths": 0, "sampling": 0, "artifacts": 0, "runtime": 0, "contracts": 0,
    "kernels": 0,
    "theory": 1, "verify": 1, "models": 1,
    "data": 2, "decoding": 2, "drafters": 2,
    "parallel": 3, "train": 3,
    "methods": 4, "sources": 4, "cli": 4, "job_config": 4, "train.job_setup": 4,
    "eval": 5, "run": 5, "train.configurables": 5, "train.distill_job": 5, "train.sprinter_job": 5,
    "train.heads_job": 5, "train.steer_job": 5,
    "main": 6, "__main__": 6, "train.__main__": 6,
}


def modules() -> dict[str, pathlib.Path]:
  """Every module of the package by dotted name (a package by its ``__init__``)."""
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = ("blockspec_jax",) + path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def layer_of(name: str) -> int:
  """The layer of a module: its longest entry in LAYERS (``train.heads_job`` before ``train``)."""
  parts = name.split(".")[1:]
  for n in range(len(parts), 0, -1):
    key = ".".join(parts[:n])
    if key in LAYERS:
      return LAYERS[key]
  if not parts:
    return LAYERS["blockspec_jax"]
  raise AssertionError(f"module {name} has no layer: add it (or its package) to LAYERS in {__file__}")


def imports(name: str, path: pathlib.Path, known: dict) -> list[tuple[str, int]]:
  """``(imported module, line)`` of every import of a package module in ``path``. ``from a import b`` imports the
  module ``a.b`` when there is one, else ``a`` (a name defined there)."""
  is_package = path.name == "__init__.py"
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        here = here[:len(here) - node.level + 1]
        base = ".".join(here + ([base] if base else []))
      targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    else:
      continue
    for target in targets:
      while target and target not in known:
        target = target.rpartition(".")[0]
      if target and target != name and target.startswith("blockspec_jax"):
        found.append((target, node.lineno))
  return found


def graph() -> dict[str, list[tuple[str, int]]]:
  known = modules()
  return {name: imports(name, path, known) for name, path in known.items()}


def test_no_module_imports_a_higher_layer():
  upward = [f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)}) at line {line}"
            for name, edges in graph().items() for target, line in edges if layer_of(target) > layer_of(name)]
  assert not upward, "upward imports:\n" + "\n".join(sorted(set(upward)))


def cycles(edges: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w, _ in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return found


def test_no_import_cycle():
  assert cycles(graph()) == []


def test_the_checks_fail_on_an_upward_import_and_on_a_cycle():
  """The two checks can fail: an upward edge and a cycle planted in a copy of the real graph are found."""
  edges = graph()
  edges["blockspec_jax.verify.rules"] = edges["blockspec_jax.verify.rules"] + [("blockspec_jax.eval.suite", 1)]
  assert layer_of("blockspec_jax.eval.suite") > layer_of("blockspec_jax.verify.rules")
  edges["blockspec_jax.eval.suite"] = edges["blockspec_jax.eval.suite"] + [("blockspec_jax.verify.rules", 1)]
  assert any({"blockspec_jax.eval.suite", "blockspec_jax.verify.rules"} <= set(c) for c in cycles(edges))


def test_every_module_has_a_layer(capsys):
  known = modules()
  by_layer = {}
  for name in sorted(known):
    by_layer.setdefault(layer_of(name), []).append(name.removeprefix("blockspec_jax.") or "blockspec_jax")
  with capsys.disabled():
    print("\nimport layers (lowest first):")
    for layer in sorted(by_layer):
      print(f"  {layer}: {', '.join(by_layer[layer])}")
