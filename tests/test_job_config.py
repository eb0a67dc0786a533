"""The evaluation jobs' grouped settings (``blockspec_jax.job_config``): each dataclass refuses a bad field with one
:class:`UsageError` when it is built, before any model is loaded, and the main job and the suites build the same
types from their gin bindings."""

import dataclasses

import jax
import pytest

from blockspec_jax import checks
from blockspec_jax import job_config
from blockspec_jax import run
from blockspec_jax import sources
from blockspec_jax.eval import suite
from blockspec_jax.models import hub

BAD_FIELDS = [
    (job_config.Models, dict(target="llama-405b"), "unknown model 'llama-405b'"),
    (job_config.Models, dict(target="smollm2-135m", drafters=()), "give at least one drafter"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", dtype="float16"),
     "dtype must be 'float32' or 'bfloat16'"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", scan_layers="yes"),
     "scan_layers must be True or False"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", weights="int4"),
     r"weights must be one of \('dequantized', 'quantized'\), got 'int4'"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", mesh=(1,)),
     r"mesh must be \(data, model\), two positive integers, got \(1,\)"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", mesh=(1, 0)), "two positive integers"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", mesh=(1, True)), "two positive integers"),
    (job_config.Models, dict(target="smollm2-135m", drafters="smollm2-135m", mesh=(jax.device_count() + 1, 1)),
     r"x 1 \(data x model\) must cover the run's \d+ device"),
    (job_config.MethodGrid, dict(methods=("blok",)), "unknown method 'blok'"),
    (job_config.MethodGrid, dict(gammas=(0,)), "every gamma must be >= 1"),
    (job_config.MethodGrid, dict(gammas=3), r"gammas must be a tuple or list, e.g. \(3,\)"),
    (job_config.MethodGrid, dict(methods=("token",), method_gammas={"block": (2,)}), "method_gammas names"),
    (job_config.MethodGrid, dict(method_gammas=[2]), "method_gammas must map methods"),
    (job_config.MethodGrid, dict(drafter_settings={"nope": {}}), "unknown drafter 'nope'"),
    (job_config.MethodGrid, dict(verifier_settings={"nope": {}}), "unknown verifier 'nope'"),
    (job_config.SamplerSettings, dict(temperatures=(-1.0,)), "temperatures must be numbers >= 0"),
    (job_config.SamplerSettings, dict(temperatures=1.0), "temperatures must be a tuple or list"),
    (job_config.SamplerSettings, dict(top_p=1.5), "top_p must be in"),
    (job_config.SamplerSettings, dict(top_k=-1), "top_k must be a non-negative integer"),
    (job_config.DataSettings, dict(num_prompts=0), "num_prompts must be an integer >= 1"),
    (job_config.DataSettings, dict(prompts_per_task=0), "num_prompts must be an integer >= 1"),
    (job_config.DataSettings, dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1"),
    (job_config.OutputSettings, dict(output_json="/proc/version/run.json"), "cannot write the folder of the report"),
    (job_config.OutputSettings, dict(out_dir="/proc/version/suite"), "cannot write the suite's directory"),
]


@pytest.mark.parametrize("cls, fields, message", BAD_FIELDS,
                         ids=[f"{c.__name__}-{list(f)[-1]}" for c, f, _ in BAD_FIELDS])
def test_each_settings_class_refuses_a_bad_field_before_any_model_loads(cls, fields, message, monkeypatch):
  monkeypatch.setattr(hub, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
  monkeypatch.setattr(sources, "load_models", lambda *a, **k: pytest.fail("a model was loaded"))
  with pytest.raises(checks.UsageError, match=message):
    cls(**fields)


def test_settings_are_frozen_and_normalised(tmp_path):
  models = job_config.Models(target="smollm2-135m", drafters="smollm2-135m")
  assert models.drafters == ("smollm2-135m",)
  assert models.mesh == (jax.device_count(), 1)  # by default every device over data
  assert job_config.Models(target="smollm2-135m", drafters="smollm2-135m", mesh=[1, jax.device_count()]).mesh == (
      1, jax.device_count())
  grid = job_config.MethodGrid(methods=["autoregressive", "block", "token"], gammas=[2, 4],
                               method_gammas={"block": [8]})
  assert grid.methods == ("autoregressive", "block", "token") and grid.all_gammas == (2, 4, 8)
  assert grid.gammas_of("autoregressive") == (None,) and grid.gammas_of("block") == (8,)
  assert grid.gammas_of("token") == (2, 4)
  assert job_config.SamplerSettings(temperatures=[0.0, 1.0]).temperatures == (0.0, 1.0)
  assert job_config.OutputSettings(out_dir=str(tmp_path / "s")).out_dir.is_dir()
  with pytest.raises(dataclasses.FrozenInstanceError):
    grid.gammas = (3,)


def test_the_main_job_and_the_suites_share_the_settings_types(tmp_path, monkeypatch):
  """run_job and suite_job build the same job_config dataclasses from their flat bindings and hand them on."""
  seen = {}
  monkeypatch.setattr(run, "main_job", lambda *args, **kw: seen.setdefault("run", (args, kw)))
  monkeypatch.setattr(suite, "run_suite", lambda *args, **kw: seen.setdefault("suite", (args[1:], kw)))
  run.run_job(target="smollm2-135m", drafter="smollm2-135m", gamma=3, temperatures=(0.0,), output_json=None)
  suite.suite_job(target="smollm2-135m", drafter="smollm2-135m", gammas=(2, 3), out_dir=str(tmp_path / "suite"))
  run_settings, suite_settings = seen["run"][0], seen["suite"][0]
  assert [type(s) for s in run_settings] == [type(s) for s in suite_settings] == [
      job_config.Models, job_config.MethodGrid, job_config.SamplerSettings, job_config.DataSettings,
      job_config.OutputSettings]
  assert run_settings[0] == suite_settings[0]  # the same pair of models
  assert run_settings[1].gammas == (3,) and suite_settings[1].gammas == (2, 3)
  assert seen["run"][1] == dict(share_prefills=True)
  # the fields every evaluation job has (job_config.EvalSettings) reach the same groups in every job: the main job
  # takes the sampler's filters too
  seen.clear()
  run.run_job(target="smollm2-135m", drafter="smollm2-135m", top_k=5, top_p=0.9, mesh=None, output_json=None)
  sampler = seen["run"][0][2]
  assert (sampler.top_k, sampler.top_p) == (5, 0.9)
  assert isinstance(run.RunSettings(), job_config.EvalSettings) and isinstance(suite.SuiteSettings(
      out_dir=str(tmp_path / "s2")), job_config.EvalSettings)


def test_a_bad_binding_fails_in_the_front_before_its_job_runs(tmp_path, monkeypatch):
  monkeypatch.setattr(run, "main_job", lambda *a, **k: pytest.fail("the job ran"))
  monkeypatch.setattr(suite, "run_suite", lambda *a, **k: pytest.fail("the job ran"))
  with pytest.raises(checks.UsageError, match="^gamma must be an integer >= 1, got 2.5"):
    run.run_job(target="smollm2-135m", drafter="smollm2-135m", gamma=2.5)
  with pytest.raises(checks.UsageError, match="top_p must be in"):
    suite.suite_job(target="smollm2-135m", drafter="smollm2-135m", top_p=2.0, out_dir=str(tmp_path / "s"))
  assert not (tmp_path / "s").exists()  # the sampler is checked before the directory is made


def test_the_lossy_bench_shares_the_settings_types_and_checks_its_grid(tmp_path, monkeypatch):
  from blockspec_jax.eval import bench_lossy
  seen = {}
  monkeypatch.setattr(bench_lossy, "lossy_bench", lambda *args, **kw: seen.setdefault("bench", (args, kw)))
  bench_lossy.bench_lossy_job(target="smollm2-135m", drafter="smollm2-135m", gamma=3,
                              output_json=str(tmp_path / "b.json"))
  args, kw = seen["bench"]
  assert [type(a) for a in args] == [job_config.Models, bench_lossy.LossyGrid, job_config.SamplerSettings,
                                     job_config.DataSettings, job_config.OutputSettings]
  assert args[1].gamma == 3 and [s["label"] for s in args[1].specs()][:3] == ["autoregressive", "token", "block"]
  # MTAD's official settings: the per-step beam sampler and the top-k / top-p filters reach the grid and the sampler
  seen.clear()
  bench_lossy.bench_lossy_job(target="smollm2-135m", drafter="smollm2-135m", beam_per_step=True, top_k=10, top_p=0.9,
                              output_json=str(tmp_path / "b.json"))
  args, _ = seen["bench"]
  assert args[1].drafter_settings()["beam"] == {"width": 4, "sample": True, "per_step": True}
  assert (args[2].top_k, args[2].top_p) == (10, 0.9)
  with pytest.raises(checks.UsageError, match="top_p must be in"):
    bench_lossy.bench_lossy_job(target="smollm2-135m", drafter="smollm2-135m", top_p=0.0)
  with pytest.raises(checks.UsageError, match="gamma must be >= 1"):
    bench_lossy.LossyGrid(gamma=0)
  with pytest.raises(checks.UsageError, match="verifier_settings"):
    bench_lossy.LossyGrid(cap=0)
  for bad in ((), (True, True), (1,)):
    with pytest.raises(checks.UsageError, match="sprinter_bonus must list True and/or False once each"):
      bench_lossy.LossyGrid(sprinter_bonus=bad)
