"""The main job on the real SmolLM2 (drafter = target), small: table, JSON fields, greedy equality on a real model."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import gin

from blockspec_jax import run
from blockspec_jax import checks as checks_lib
from blockspec_jax import cli
from blockspec_jax.eval import harness
from blockspec_jax import methods as methods_lib
from blockspec_jax import runtime
from blockspec_jax import sources
from blockspec_jax.data import prompts as prompts_lib


def test_prompt_file_rows_keep_their_licence():
  rows = prompts_lib.load_prompts()
  assert {r["task"] for r in rows} == {"code", "chat", "math"}
  assert all(r["licence"] in ("MIT", "Apache-2.0") and "==" in r["source"] for r in rows)
  assert [r["task"] for r in prompts_lib.load_prompts(limit=3)] == ["code", "chat", "math"]
  with pytest.raises(FileNotFoundError, match="build one"):
    prompts_lib.load_prompts("/nonexistent/prompts.jsonl")


def test_main_job_on_smollm2(tmp_path, capsys):
  out = tmp_path / "run.json"
  methods = ("autoregressive", "block", "greedy", "traversal@rsd_c")  # a chain rule, greedy, a tree rule and drafter
  report = run.run_job(target="smollm2-135m", drafter="smollm2-135m", num_prompts=1, gamma=3, temperatures=(0.0,),
                       methods=methods, drafter_settings={"rsd_c": {"branching": (2, 1, 1)}}, max_new_tokens=8,
                       output_json=str(out), show_text=True)
  printed = capsys.readouterr().out
  assert "block efficiency" in printed and "--- block@T=0.0 ---" in printed and "dec tok/s" in printed
  saved = json.loads(out.read_text())
  assert saved["results"] == json.loads(json.dumps(report["results"]))
  by_method = {r["method"]: r for r in report["results"]}
  assert set(by_method) == set(methods)
  assert by_method["traversal@rsd_c"]["draft_nodes"] == 6 and by_method["block"]["draft_nodes"] == 3
  for name in methods[1:]:
    r = by_method[name]
    for field in ("block_efficiency", "draft_acceptance_rate", "acceptance_per_position", "target_calls",
                  "tokens_generated", "wall_s", "tokens_per_s", "speedup", "prefill_s", "decode_s",
                  "decode_tokens_per_s", "decode_speedup"):
      assert field in r
    assert r["wall_s"] == pytest.approx(r["prefill_s"] + r["decode_s"]) and 0 < r["prefill_s"] < r["wall_s"]
    assert r["block_efficiency"] == pytest.approx(4.0)  # drafter = target at T = 0: every draft token accepted
    assert r["invalid_prob_rows"] == 0
  # block and greedy run one prefill (the model chain at γ = 3): greedy reuses block's; the RSD-C tree has its own.
  assert [by_method[m]["prefills_reused"] for m in methods] == [0, 0, 1, 0]
  assert by_method["greedy"]["prefill_s"] == by_method["block"]["prefill_s"]
  assert "counted in each" in printed
  # Greedy: the same text from every method (speculative decoding is lossless; the drafter is the target here).
  texts = report["sample_text"]
  assert len({texts[f"{m}@T=0.0"] for m in methods}) == 1
  assert len(texts["block@T=0.0"].strip()) > 0


@pytest.mark.heavy  # tests/test_scan_layers.py checks SmolLM2 scanned = unrolled bit for bit in the default run
def test_the_stacked_and_unrolled_layouts_emit_the_same_tokens(tmp_path):
  """The main job on SmolLM2 with its layers compiled once (the default) and unrolled: block verification emits the
  same token ids at T = 1 (same keys) with the same acceptance (the decoder-level equality, every path, is
  tests/test_scan_layers.py)."""
  reports = [run.run_job(target="smollm2-135m", drafter="smollm2-135m", num_prompts=1, gamma=3, temperatures=(1.0,),
                         methods=("block",), max_new_tokens=8, output_json=None, show_text=False, scan_layers=scan)
             for scan in (True, False)]
  assert reports[0]["generated_ids"] == reports[1]["generated_ids"]
  for a, b in zip(reports[0]["results"], reports[1]["results"]):
    assert (a.get("block_efficiency"), a["target_calls"]) == (b.get("block_efficiency"), b["target_calls"])
  with pytest.raises(checks_lib.UsageError, match="scan_layers must be True or False"):
    run.run_job(target="smollm2-135m", drafter="smollm2-135m", scan_layers="yes")


@pytest.mark.slow  # a second SmolLM2 main job; PrefillCache's budget rule is tested by default
def test_shared_prefills_change_no_token_and_charge_every_row(tmp_path):
  """Rows that run the same prefill share it (autoregressive decoding at both temperatures; token and block at one
  γ): the same token ids, acceptance and target calls as when every row runs its own, each shared prefill computed
  once and its time counted in every row that uses it."""
  common = dict(target="smollm2-135m", drafter="smollm2-135m", num_prompts=2, gamma=3, temperatures=(0.0, 1.0),
                methods=("autoregressive", "token", "block"), max_new_tokens=8, output_json=None, show_text=False)
  shared, own = (run.run_job(**common, share_prefills=share) for share in (True, False))
  assert shared["generated_ids"] == own["generated_ids"]
  for a, b in zip(shared["results"], own["results"]):
    assert (a.get("block_efficiency"), a["target_calls"], a.get("acceptance_per_position")) == (
        b.get("block_efficiency"), b["target_calls"], b.get("acceptance_per_position"))
    assert b["prefills_reused"] == 0
  rows = {(r["method"], r["temperature"]): r for r in shared["results"]}
  assert [r["prefills_reused"] for r in shared["results"]] == [0, 0, 2, 2, 2, 2]
  assert rows["autoregressive", 0.0]["prefill_s"] == rows["autoregressive", 1.0]["prefill_s"] > 0
  assert len({rows[m, t]["prefill_s"] for m in ("token", "block") for t in (0.0, 1.0)}) == 1
  for r in shared["results"]:
    assert r["wall_s"] == pytest.approx(r["prefill_s"] + r["decode_s"])
  with pytest.raises(checks_lib.UsageError, match="share_prefills must be True or False"):
    run.run_job(target="smollm2-135m", drafter="smollm2-135m", share_prefills=1)


def test_prefill_cache_keeps_the_newest_states_within_its_budget():
  cache = harness.PrefillCache(max_bytes=3 * 400)
  states = {k: {"cache": np.zeros((100,), np.float32) + k} for k in range(4)}  # 400 bytes each
  for k, state in states.items():
    cache.put(("p", k), state, seconds=0.5 + k)
  assert len(cache) == 3 and cache.get(("p", 0)) is None  # the oldest evicted
  state, seconds = cache.get(("p", 3))
  assert state is states[3] and seconds == 3.5 and cache.hits == 1
  cache.put(("p", 3), states[0], seconds=9.0)  # a key is measured once: the first time stays
  assert cache.get(("p", 3))[1] == 3.5
  cache.put(("big",), {"x": np.zeros((1000,), np.float32)}, seconds=1.0)  # larger than the whole budget: not kept
  assert cache.get(("big",)) is None and len(cache) == 3


def test_pair_checks():
  from blockspec_jax.models import hub
  smol = hub.load_model("smollm2-135m")
  fake = dataclasses.replace(smol, config=dataclasses.replace(smol.config, vocab_size=smol.config.vocab_size + 1))
  with pytest.raises(ValueError, match="vocabulary mismatch"):
    sources.check_pair(smol, fake)
  with pytest.raises(ValueError, match="gamma must be >= 1"):
    run.run_job(target="smollm2-135m", drafter="smollm2-135m", gamma=0)
  with pytest.raises(ValueError, match="unknown model"):
    run.run_job(target="llama-405b", drafter="smollm2-135m", num_prompts=1)


@pytest.mark.parametrize("binding,message", [
    ("run_job.gama = 6", "doesn't have a parameter named 'gama'"),
    ("run_job.gamma = -1", "gamma must be >= 1, got -1"),
    ("run_job.gamma = 2.5", "gamma must be an integer >= 1, got 2.5"),
    ("run_job.num_prompts = 0", "num_prompts must be an integer >= 1"),
    ("run_job.methods = ('blok',)", "unknown method 'blok'"),
    ("run_job.temperatures = (-1.0,)", "temperatures must be numbers >= 0"),
    ("run_job.dtype = 'float16'", "dtype must be 'float32' or 'bfloat16'"),
    ("run_job.target = 'llama-405b'", "unknown model 'llama-405b'"),
    ("run_job.drafter = '/nonexistent/model.gguf'", "does not exist"),
    ("run_job.prompts_path = '/nonexistent/p.jsonl'", "prompt file /nonexistent/p.jsonl not found"),
    ("run_job.gamma = (", "the gin configuration does not parse"),
    ("run_job.temperatures = 1.0", "temperatures must be a tuple or list, e.g. (1.0,), got 1.0"),
    ("run_job.methods = ()", "methods is empty"),
    ("run_job.temperatures = ()", "temperatures is empty"),
    ("run_job.output_json = '/proc/version/run.json'", "cannot write the folder of the report"),
    ("run_job.drafter_settings = {'k_chains': {'k': 0}}", "drafter_settings['k_chains']"),
    ("run_job.drafter_settings = {'heads': {'run': '/tmp'}}", "drafter_settings['heads']"),
    ("run_job.drafter_settings = {'heads': {'heads': '/nonexistent/run'}}", "/nonexistent/run"),
    ("run_job.drafter_settings = {'nope': {}}", "unknown drafter 'nope'"),
])
def test_command_line_mistakes_are_one_line_before_any_model_loads(binding, message, capsys, monkeypatch):
  """A user's mistake is one line on stderr and exit status 2, found before any model is loaded (minutes)."""
  from blockspec_jax.models import hub
  monkeypatch.setattr(hub, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the check"))
  gin.clear_config()
  with pytest.raises(SystemExit) as exit_info:
    run.main(["--gin_param", binding])
  gin.clear_config()
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 2
  assert len(err) == 1 and err[0].startswith("python -m blockspec_jax.run: error:") and message in err[0], err


def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line(tmp_path, capsys, monkeypatch):
  from blockspec_jax.models import hub
  monkeypatch.setattr(hub, "load_model", lambda *a, **k: pytest.fail("a model was loaded before the check"))
  bad = tmp_path / "bad.jsonl"
  bad.write_bytes(b'{"text": "fine", "task": "code"}\n{"text": "caf\xe9", "task": "code"}\n')
  gin.clear_config()
  with pytest.raises(SystemExit) as exit_info:
    run.main(["--gin_param", f"run_job.prompts_path = '{bad}'"])
  gin.clear_config()
  err = capsys.readouterr().err.strip().splitlines()
  assert exit_info.value.code == 2 and len(err) == 1
  assert f"prompt file {bad}, line 2: not valid UTF-8 (byte 0xe9 at column 14)" in err[0], err


def test_a_fault_inside_a_job_keeps_its_traceback(capsys, monkeypatch):
  """Only usage errors are one line: a ValueError raised by the program itself, once the settings have passed their
  checks, propagates with its traceback (it used to become "error: …" with exit status 2, hiding the fault)."""
  def broken(*args, **kwargs):
    raise ValueError("an internal fault")
  monkeypatch.setattr(runtime, "enable_compilation_cache", broken)
  gin.clear_config()
  try:
    with pytest.raises(ValueError, match="an internal fault"):
      run.main(["--gin_param", "run_job.target = 'smollm2-135m'", "--gin_param", "run_job.drafter = 'smollm2-135m'"])
  finally:
    gin.clear_config()
  assert "error:" not in capsys.readouterr().err


def test_missing_gin_file_and_empty_prompt_file(tmp_path, capsys):
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  for argv, message in ((["--gin_file", str(tmp_path / "nope.gin")], "Unable to open file"),
                        (["--gin_param", f"run_job.prompts_path = '{empty}'"], "no prompts in")):
    gin.clear_config()
    with pytest.raises(SystemExit) as exit_info:
      run.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
  gin.clear_config()


def test_cache_room_check_names_the_numbers():
  from blockspec_jax.models.decoder import DecoderConfig
  small = DecoderConfig.tiny(max_len=64)
  assert methods_lib.check_cache_room(40, 16, 4, small) == 61
  with pytest.raises(checks_lib.UsageError, match=r"longest prompt 50 tokens \+ 16 new \+ 5 draft slots = 71 > max_len 64"):
    methods_lib.check_cache_room(50, 16, 4, small, DecoderConfig.tiny(max_len=128))


def test_compiling_announces_the_first_call(capsys):
  import io
  stream = io.StringIO()
  with runtime.compiling("block (T = 1)", stream=stream):
    pass
  lines = stream.getvalue().splitlines()
  assert lines[0] == "compiling block (T = 1) …" and lines[1].startswith("compiled block (T = 1) in ")
  quiet = io.StringIO()
  ran = []
  with runtime.compiling("block (T = 1)", stream=quiet, when=False):
    ran.append(1)
  assert ran == [1] and quiet.getvalue() == ""  # a later (compiled) call runs its body silently


_CACHE_SCRIPT = """
import sys, jax, jax.numpy as jnp
from blockspec_jax import kernels
from blockspec_jax import checks as checks_lib
from blockspec_jax import cli
from blockspec_jax.eval import harness
from blockspec_jax import methods as methods_lib
from blockspec_jax import runtime
from blockspec_jax import sources
events = []
jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
print("dir", runtime.enable_compilation_cache(sys.argv[1], min_compile_time_s=0))
f = jax.jit(lambda x, w: jnp.tanh(kernels.linear(x, w)) * 3)
y = f(jnp.ones((2, 64)), jnp.ones((32, 64)))
print("value", float(y.sum()))
print("hits", sum(e == "/jax/compilation_cache/cache_hits" for e in events))
from jax._src import compilation_cache
print("locked", compilation_cache._cache.eviction_enabled, (cache_dir := compilation_cache._cache.path) / ".lockfile"
      in set(cache_dir.iterdir()))
"""


def test_persistent_compilation_cache_is_hit_by_a_second_process(tmp_path):
  """runtime.enable_compilation_cache: a second process loads the compiled program (custom CPU kernel included) from
  disk instead of compiling it, and computes the same numbers. Reads and writes hold the directory's file lock (a
  size limit turns it on): without it a process could load a program another one is still writing, and XLA aborts
  on the half-written executable (seen with two test workers sharing the default directory)."""
  import subprocess
  import sys
  cache = tmp_path / "jax_cache"
  runs = [subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, str(cache)], capture_output=True, text=True,
                         timeout=300) for _ in range(2)]
  outs = [dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line) for r in runs]
  assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
  assert outs[0]["dir"] == str(cache) and any(cache.iterdir())
  assert outs[0]["hits"] == "0" and int(outs[1]["hits"]) >= 1
  assert outs[0]["value"] == outs[1]["value"]
  assert outs[0]["locked"] == outs[1]["locked"] == "True True"
  assert runtime.enable_compilation_cache("off") is None


def test_compiled_programs_are_released_near_the_map_limit(monkeypatch):
  """runtime.release_programs_if_near_map_limit: XLA's CPU executables live in anonymous mappings for as long as the jit
  caches hold them; past half of vm.max_map_count every compiled program is dropped (the mappings go back), below
  it nothing is touched, and the results of a recompiled program are the same."""
  import chex
  import jax.numpy as jnp
  # The 30 programs share one trace counter (one definition site): traced 30 times in all, once each; a program
  # called again after its release is traced again, which chex.assert_max_traces turns into an AssertionError.
  chex.clear_trace_counter()
  fs = [jax.jit(chex.assert_max_traces(lambda x, i=i: jnp.tanh(x @ x.T + i).sum(0), n=30)) for i in range(30)]
  x = jnp.ones((8, 8))
  before = [np.asarray(f(x)) for f in fs]
  held = runtime.mapped_regions()
  assert held is not None and runtime.max_mapped_regions() is not None
  monkeypatch.setattr(runtime, "max_mapped_regions", lambda: 2 * held + 2)  # just under the threshold: kept
  assert not runtime.release_programs_if_near_map_limit()
  fs[0](x)  # kept: not traced again
  monkeypatch.setattr(runtime, "max_mapped_regions", lambda: held)  # held > half of it: released
  assert runtime.release_programs_if_near_map_limit()
  assert runtime.mapped_regions() < held - 2 * len(fs)  # each small program held a few mappings
  with pytest.raises(AssertionError, match="traced > 30 times"):
    fs[0](x)  # released: traced (and compiled) again
  chex.clear_trace_counter()
  np.testing.assert_array_equal(np.stack(before), np.stack([np.asarray(f(x)) for f in fs]))
  with pytest.raises(ValueError, match="fraction"):
    runtime.release_programs_if_near_map_limit(0)


_HEAP_SCRIPT = """
import sys
import numpy as np
from blockspec_jax import runtime
if sys.argv[1] == "fixed":
  assert runtime.limit_heap_growth(arenas=8) == {"mmap_threshold": 1 << 20, "arenas": 8}
big = np.ones(16 << 17)  # 16 MiB, mapped on its own; freeing it raises glibc's dynamic threshold to 16 MiB
del big
arrays, pins = [], []
for _ in range(40):  # 8 MiB arrays (under the raised threshold: heap), each followed by a small live block
  arrays.append(np.ones(1 << 20))
  pins.append(np.ones(1 << 14))
before = runtime.resident_gb()
del arrays
print(round((before - runtime.resident_gb()) * 1e9 / 2**20))
"""


def test_a_fixed_mmap_threshold_gives_freed_arrays_back_to_the_system():
  """runtime.limit_heap_growth (the training command calls it first): 40 freed arrays of 8 MiB between live small
  blocks stay resident under glibc's dynamic threshold once a 16 MiB array has been freed (the heap cannot shrink
  past live blocks), and go back to the system with the threshold fixed at 1 MiB. A user's MALLOC_MMAP_THRESHOLD_ or
  MALLOC_ARENA_MAX stands: that setting is not made."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  released = {}
  for mode in ("dynamic", "fixed"):
    proc = subprocess.run([sys.executable, "-c", _HEAP_SCRIPT, mode], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    released[mode] = int(proc.stdout.split()[-1])
  assert released["dynamic"] < 40 and released["fixed"] > 300, released
  for bad, message in (({"mmap_threshold": 100}, "mmap_threshold must be an integer of at least 4096"),
                       ({"arenas": 0}, "arenas must be an integer of at least 1")):
    with pytest.raises(ValueError, match=message):
      runtime.limit_heap_growth(**bad)
  script = "from blockspec_jax import runtime; print(sorted(runtime.limit_heap_growth()))"
  for var, left in (("MALLOC_MMAP_THRESHOLD_", "['arenas']"), ("MALLOC_ARENA_MAX", "['mmap_threshold']")):
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env={**env, var: "65536"},
                          timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == left, proc.stderr[-2000:]


def test_methods_name_every_registered_rule_and_drafter():
  import types

  from blockspec_jax import drafters, verify
  from blockspec_jax.models.decoder import DecoderConfig
  assert set(methods_lib.known_methods()) == {"autoregressive"} | set(verify.VERIFIERS)
  assert methods_lib.parse_method("greedy") == ("greedy", "model")
  assert methods_lib.parse_method("exact_match@ngram") == ("exact_match", "ngram")
  assert methods_lib.parse_method("spectr") == ("spectr", "k_chains")
  assert methods_lib.parse_method("traversal") == ("traversal", "rsd_c")
  for method, message in (("blok", "unknown method 'blok'"), ("block@lattice", "unknown drafter 'lattice'"),
                          ("block@beam", "not draws from q.*exact_match, greedy, mtad"),
                          ("block@rsd_s", "verifies chains"), ("rrs@rsd_c", "needs siblings drawn with replacement"),
                          ("traversal@k_chains", "needs siblings drawn without replacement")):
    with pytest.raises(checks_lib.UsageError, match=message):
      methods_lib.parse_method(method)
  model = types.SimpleNamespace(config=DecoderConfig.tiny(vocab_size=64))
  rsd_c = methods_lib.build_drafter("rsd_c", model, model, None, gamma=4)
  assert rsd_c.branching == (2, 1, 1, 1) and rsd_c.num_nodes(4) == 8
  with pytest.raises(checks_lib.UsageError, match="gamma is 4"):
    methods_lib.build_drafter("rsd_c", model, model, {"rsd_c": {"branching": (2, 2)}}, gamma=4)
  with pytest.raises(checks_lib.UsageError, match="no settings"):
    methods_lib.build_drafter("k_chains", model, model, {"k_chains": {"width": 2}}, gamma=4)
  assert isinstance(methods_lib.build_drafter("ngram", model, model, None, gamma=4), drafters.NGramDrafter)


@pytest.mark.slow  # a SmolLM2 main job per lossy rule; the rules' laws and errors are tested on tiny models by default
def test_main_job_runs_the_lossy_rules_from_gin(tmp_path, capsys):
  """gin/runs/qwen_lossy.gin's methods and settings, on SmolLM2 (drafter = target) with a zero head: the table marks
  SPRINTER and MTAD lossy, SPRINTER's γ is its cap, and its counters reach the report."""
  import numpy as np
  from blockspec_jax.train import sprinter as sprinter_train
  head = tmp_path / "head"
  sprinter_train.save_head(head, {"w_D": np.zeros(576, np.float32), "b": np.float32(0.0)})
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(["gin/runs/qwen_lossy.gin"], [
        'run_job.target = "smollm2-135m"', 'run_job.drafter = "smollm2-135m"', "run_job.num_prompts = 1",
        "run_job.max_new_tokens = 8", f"run_job.output_json = '{tmp_path / 'run.json'}'",
        f"run_job.drafter_settings = {{'sprinter': {{'head': '{head}'}}, 'beam': {{'width': 2}}}}",
        "run_job.verifier_settings = {'sprinter': {'threshold': 0.4, 'cap': 5}, 'mtad': {'tau': 0.3}}"])
    report = run.run_job(show_text=False)
  finally:
    gin.clear_config()
  printed = capsys.readouterr().out
  assert "sprinter lossy" in printed and "mtad lossy" in printed and "block lossy" not in printed
  rows = {r["method"]: r for r in report["results"]}
  assert rows["sprinter"]["gamma"] == 5 and rows["mtad"]["gamma"] == 4
  # The zero head gives 0.5 ≥ 0.4 everywhere: every segment is closed by the cap (5), none by the head.
  assert rows["sprinter"]["num_cap_flags"] == rows["sprinter"]["target_calls"] >= 1
  assert rows["sprinter"]["num_head_flags"] == 0
  assert rows["mtad"]["lossy"] and not rows["block"]["lossy"]


def test_method_variants_and_trained_drafter_entries(tmp_path):
  """``<verifier>@<drafter>/<variant>`` runs a labelled variant of a registered drafter with its own settings, and
  ``<drafter>:<run dir>?k=v`` names a drafter with trained parts (eval.paired --drafters)."""
  import types

  from blockspec_jax import drafters
  from blockspec_jax.models.decoder import DecoderConfig
  assert methods_lib.parse_method("block@heads/ngram") == ("block", "heads/ngram")
  assert methods_lib.drafter_kind("heads/ngram") == "heads" and methods_lib.drafter_kind("model") == "model"
  with pytest.raises(checks_lib.UsageError, match="unknown drafter 'lattice'"):
    methods_lib.parse_method("block@lattice/ngram")
  target = types.SimpleNamespace(config=DecoderConfig.tiny(vocab_size=64))
  small = types.SimpleNamespace(config=DecoderConfig.tiny(vocab_size=64, num_layers=1))
  settings = {"heads": {"num_heads": 4}, "heads/ngram": {"num_heads": 4, "rescore": "ngram", "top_k": 8}}
  raw = methods_lib.build_drafter("heads", target, small, settings, gamma=4)
  rescored = methods_lib.build_drafter("heads/ngram", target, small, settings, gamma=4)
  assert isinstance(raw, drafters.HeadsDrafter) and raw.rescore == "none" and raw.target == target.config
  assert rescored.rescore == "ngram" and rescored.top_k == 8 and rescored.lm_config is None
  with pytest.raises(checks_lib.UsageError, match="gamma"):
    methods_lib.build_drafter("heads", target, small, settings, gamma=5)
  from blockspec_jax.drafters import heads as heads_lib
  from blockspec_jax.train import heads as heads_train
  heads_train.save_heads(tmp_path, heads_lib.init_heads(32, 2, jax.random.key(0)))
  assert methods_lib.trained_drafter_spec(f"heads:{tmp_path}?top_k=16&lm_weight=0.5&replay=2", job_settings=("replay",)) == (
      "heads", {"heads": str(tmp_path), "top_k": 16, "lm_weight": 0.5, "replay": 2})
  with pytest.raises(checks_lib.UsageError, match="BPD heads directory runs/h does not exist"):  # checked before loading
    methods_lib.trained_drafter_spec("heads:runs/h?rescore=pbest_ngram")
  with pytest.raises(checks_lib.UsageError, match="has no settings"):
    methods_lib.trained_drafter_spec(f"heads:{tmp_path}?replay=2")
  assert methods_lib.trained_drafter_spec("qwen2.5-coder-0.5b") is None and methods_lib.trained_drafter_spec("model:x") is None
  for bad, message in (("heads:", "directory"), ("heads:d?rescore", "key=value")):
    with pytest.raises(checks_lib.UsageError, match=message):
      methods_lib.trained_drafter_spec(bad)
  with pytest.raises(checks_lib.UsageError, match="needs trained BPD heads"):
    methods_lib.drafter_params(raw, small, target)


@pytest.mark.slow  # a SmolLM2 main job per target-reading drafter; test_target_reading covers them on tiny models
def test_main_job_runs_the_target_reading_drafters_from_gin(tmp_path, capsys):
  """gin/runs/qwen_read_target.gin on SmolLM2 (drafter = target): untrained BPD heads (W2 = 0: each head is the
  target's own next-token head) raw and rescored, and a zero SD² map (exactly the plain drafter, so block@steered
  emits block's tokens), all loaded from run directories as trained parts are."""
  import jax
  from blockspec_jax.drafters import heads as heads_lib, lattice, steer as steer_lib
  from blockspec_jax.models import hub
  from blockspec_jax.train import heads as heads_train, steer as steer_train
  config = hub.load_model("smollm2-135m", progress=False).config
  heads_dir, steer_dir = tmp_path / "heads", tmp_path / "steer"
  heads_train.save_heads(heads_dir, heads_lib.init_heads(config.d_model, 4, jax.random.key(0)))
  lattice.save_ngram(heads_dir, lattice.build_ngram([[1, 2, 3, 4, 5, 6] * 4], config.vocab_size, order=3))
  layers = steer_lib.default_target_layers(config.num_layers)
  steer_train.save_steer(steer_dir, steer_lib.init_steer(config.d_model, len(layers), config, rank=8),
                         {"target_layers": list(layers), "steered_layers": list(range(config.num_layers)),
                          "drafter_layers": config.num_layers,
                          "ffn_dim": config.ffn_dim})
  gin.clear_config()
  try:
    gin.parse_config_files_and_bindings(["gin/runs/qwen_read_target.gin"], [
        'run_job.target = "smollm2-135m"', 'run_job.drafter = "smollm2-135m"', "run_job.num_prompts = 1",
        "run_job.max_new_tokens = 8", f"run_job.output_json = '{tmp_path / 'run.json'}'",
        # three of the file's methods (each compiles two 30-layer programs); the others are tested on tiny models
        "run_job.methods = ('block', 'block@steered', 'block@heads/pbest_ngram')",
        f"run_job.drafter_settings = {{'steered': {{'steer': '{steer_dir}'}}, 'heads': {{'heads': '{heads_dir}'}}, "
        f"'heads/ngram': {{'heads': '{heads_dir}', 'rescore': 'ngram'}}, "
        f"'heads/pbest_ngram': {{'heads': '{heads_dir}', 'rescore': 'pbest_ngram'}}, "
        f"'heads/neural': {{'heads': '{heads_dir}', 'rescore': 'neural'}}}}"])
    report = run.run_job(show_text=False)
  finally:
    gin.clear_config()
  assert " lossy " not in capsys.readouterr().out.split("lossy: the rule")[0]  # no row is marked lossy
  rows = {r["method"]: r for r in report["results"]}
  assert set(rows) == {"block", "block@steered", "block@heads/pbest_ngram"}
  assert report["sample_text"]["block@steered@T=1.0"] == report["sample_text"]["block@T=1.0"]
  for key in ("block_efficiency", "tokens_generated", "target_calls"):
    assert rows["block@steered"][key] == rows["block"][key]
  assert all(rows[m]["invalid_prob_rows"] == 0 for m in rows)
  assert all(rows[m]["tokens_generated"] == 8 for m in rows)


def test_multihost_is_joined_only_when_asked(monkeypatch):
  """cli.join_multihost_from_env (every gin entry point runs it first): $BLOCKSPEC_JAX_MULTIHOST=1 joins with the
  coordinator, process count and id from $JAX_* when given (the GPU launcher sets them; TPU slices auto-detect),
  unset or 0 does nothing, anything else is a one-line usage error."""
  from blockspec_jax import parallel
  calls = []
  monkeypatch.setattr(parallel, "initialize_multihost", lambda **kw: calls.append(kw))
  for name in ("BLOCKSPEC_JAX_MULTIHOST", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(name, raising=False)
  assert not cli.join_multihost_from_env()
  monkeypatch.setenv("BLOCKSPEC_JAX_MULTIHOST", "0")
  assert not cli.join_multihost_from_env() and calls == []
  monkeypatch.setenv("BLOCKSPEC_JAX_MULTIHOST", "1")
  assert cli.join_multihost_from_env() and calls == [{}]
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "gpu-0:8476")
  monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
  monkeypatch.setenv("JAX_PROCESS_ID", "1")
  assert cli.join_multihost_from_env()
  assert calls[-1] == dict(coordinator_address="gpu-0:8476", num_processes=2, process_id=1)
  monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
  with pytest.raises(checks_lib.UsageError, match="JAX_NUM_PROCESSES must be an integer"):
    cli.join_multihost_from_env()
  monkeypatch.setenv("BLOCKSPEC_JAX_MULTIHOST", "yes")
  with pytest.raises(checks_lib.UsageError, match="must be 0 or 1"):
    cli.join_multihost_from_env()
  assert runtime.is_main_process()
