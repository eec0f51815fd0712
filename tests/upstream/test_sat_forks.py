"""The stable-audio-tools forks' samplers: ThinkSound (the real ``thinksound`` 0.0.19), AudioX and
SongBloom (GitHub only: replicas).

All three ship stable-audio-tools' early ``inference/sampling.py``: ``@torch.no_grad()``
``sample_discrete_euler`` (rectified-flow Euler) and ``sample`` (v-diffusion DDIM), one
``model(x, t, **extra_args)`` evaluation per step, so upstream gives no graph and ``cache=False`` falls
through ``**extra_args`` into the model (``TypeError`` from a model that takes no such keyword).

* ThinkSound: ``ThinkSound.inference.sampling`` of the installed wheel (declared, ``patches/thinksound.py``).
* AudioX: installs its copy *as* ``stable_audio_tools``; the replica below is its two samplers as in
  ZeyueT/AudioX@ca179cc7eb2e5ec4edf4a76f485e990da0a03c4b ``stable_audio_tools/inference/sampling.py``
  (comments dropped), imported as ``stable_audio_tools.inference.sampling`` from a temporary folder and
  recognised by the declared stable-audio-tools patches.
* SongBloom: ``sample_discrete_euler``, ``sample_discrete_euler_with_temperature`` and ``sample`` as in
  tencent-ailab/SongBloom@ef78022bfee6b571037d57c56152477699381d00
  ``SongBloom/models/musicldm/inference/sampling.py`` (their loops run over plain ``zip``/``range``
  unless ``prog_bar=True``), imported under a made-up module path: the scan finds the copy
  (``patches/_families.py``, ``SAT_FORKS``).

For each sampler, in float64 (``sample`` casts the model's output to float32, as upstream does, and so
does the reference): ``cache=True`` equals upstream bit for bit with no graph; ``cache=False`` gradients
of every parameter, the noise ``x`` and a conditioning tensor passed as an extra keyword (it still
reaches the model) equal the same loop written by hand with grad on; ``grad_steps=K`` equals that loop
with ``x = x.detach()`` at the top of step N-K (the noise then gets none, except where SongBloom's
temperature step re-injects it later); ``checkpoint_steps`` equals it too, and in train mode with
dropout equals the plain ``cache=False`` run. A plain ``gradpatch.apply()`` patches all three, whether
the module was imported before or after it (``test_plain_apply_patches_every_fork``, a fresh
interpreter).
"""
from __future__ import annotations

import importlib
import json
import math
import sys
import warnings

import pytest
import torch

import gradpatch
import ThinkSound.inference.sampling as thinksound_sampling  # the real package: fails, never skips, if missing
from support import assert_grads_close, last_json, run_python

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

HEADER = "import math\nimport torch\nfrom tqdm import trange, tqdm\n\n\n" \
         "def get_alphas_sigmas(t):\n    return torch.cos(t * math.pi / 2), torch.sin(t * math.pi / 2)\n\n\n"

AUDIOX = HEADER + '''@torch.no_grad()
def sample_discrete_euler(model, x, steps, sigma_max=1, **extra_args):
    ts = x.new_ones([x.shape[0]])
    t = torch.linspace(sigma_max, 0, steps + 1)
    for t_curr, t_prev in tqdm(zip(t[:-1], t[1:])):
            t_curr_tensor = t_curr * torch.ones(
                (x.shape[0],), dtype=x.dtype, device=x.device
            )
            dt = t_prev - t_curr
            x = x + dt * model(x, t_curr_tensor, **extra_args)
    return x

@torch.no_grad()
def sample(model, x, steps, eta, **extra_args):
    ts = x.new_ones([x.shape[0]])
    t = torch.linspace(1, 0, steps + 1)[:-1]
    alphas, sigmas = get_alphas_sigmas(t)
    for i in trange(steps):
        with torch.cuda.amp.autocast():
            v = model(x, ts * t[i], **extra_args).float()
        pred = x * alphas[i] - v * sigmas[i]
        eps = x * sigmas[i] + v * alphas[i]
        if i < steps - 1:
            ddim_sigma = eta * (sigmas[i + 1]**2 / sigmas[i]**2).sqrt() * \\
                (1 - alphas[i]**2 / alphas[i + 1]**2).sqrt()
            adjusted_sigma = (sigmas[i + 1]**2 - ddim_sigma**2).sqrt()
            x = pred * alphas[i + 1] + eps * adjusted_sigma
            if eta:
                x += torch.randn_like(x) * ddim_sigma
    return pred
'''

SONGBLOOM = HEADER + '''@torch.no_grad()
def sample_discrete_euler(model, x, steps, sigma_max=1.0, prog_bar=False, **extra_args):
    ts = x.new_ones([x.shape[0]])
    t = torch.linspace(sigma_max, 0, steps + 1)
    iterator = tqdm(zip(t[:-1], t[1:]), total=steps) if prog_bar else zip(t[:-1], t[1:])
    for t_curr, t_prev in iterator:
            t_curr_tensor = t_curr * torch.ones(
                (x.shape[0],), dtype=x.dtype, device=x.device
            )
            dt = t_prev - t_curr
            v = model(x, t_curr_tensor, **extra_args)
            x = x + dt * v
    return x

@torch.no_grad()
def sample_discrete_euler_with_temperature(model, x, steps, temperature=1.0, sigma_max=1.0, prog_bar=False, **extra_args):
    ts = x.new_ones([x.shape[0]])
    noise = x
    t = torch.linspace(sigma_max, 0, steps + 1)
    x = torch.zeros_like(noise)
    if temperature >= sigma_max:
        x = noise
    iterator = tqdm(zip(t[:-1], t[1:]), total=steps) if prog_bar else zip(t[:-1], t[1:])
    for t_curr, t_prev in iterator:
            t_curr_tensor = t_curr * torch.ones(
                (x.shape[0],), dtype=x.dtype, device=x.device
            )
            dt = t_prev - t_curr
            v = model(x, t_curr_tensor, **extra_args)
            if  t_curr > temperature and t_prev <= temperature:
                x_0 = x - v
                x = (1-t_prev) * x_0 + t_prev * noise
            else:
                x = x + dt * v
    return x


@torch.no_grad()
def sample(model, x, steps, eta, prog_bar=False, **extra_args):
    ts = x.new_ones([x.shape[0]])
    origin_dtype = x.dtype
    t = torch.linspace(1, 0, steps + 1)[:-1]
    alphas, sigmas = get_alphas_sigmas(t)
    bar = trange if prog_bar else range
    for i in bar(steps):
        with torch.cuda.amp.autocast():
            v = model(x, ts * t[i], **extra_args).float()
        pred = x * alphas[i] - v * sigmas[i]
        eps = x * sigmas[i] + v * alphas[i]
        if i < steps - 1:
            ddim_sigma = eta * (sigmas[i + 1]**2 / sigmas[i]**2).sqrt() * \\
                (1 - alphas[i]**2 / alphas[i + 1]**2).sqrt()
            adjusted_sigma = (sigmas[i + 1]**2 - ddim_sigma**2).sqrt()
            x = pred * alphas[i + 1] + eps * adjusted_sigma
            if eta:
                x += torch.randn_like(x) * ddim_sigma
    return pred.to(origin_dtype)
'''

STEPS, TEMPERATURE = 4, 0.6  # the temperature step of SongBloom's sampler: step 1 (t from 0.75 to 0.5)
SONGBLOOM_PATH = "vendored_music.songbloom_sampling"  # any path: found by the scan


class Tiny(torch.nn.Module):
    """The backbone as the forks call it, ``model(x, t, **extra_args)``; it takes no other keyword, so
    a ``cache=`` falling through is upstream's ``TypeError``."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.inp, self.emb = torch.nn.Conv1d(2, 8, 3, padding=1), torch.nn.Linear(1, 8)
        self.cond, self.drop, self.out = torch.nn.Linear(3, 8), torch.nn.Dropout(dropout), torch.nn.Conv1d(8, 2, 1)

    def forward(self, x, t, cond=None):
        h = self.inp(x) + self.emb(t.reshape(-1, 1).to(x.dtype))[..., None] + self.cond(cond)[..., None]
        return self.out(self.drop(torch.tanh(h)))


def euler(model, x, first, cond, temperature=None):
    """``sample_discrete_euler`` (and SongBloom's temperature variant) by hand, grad on; the state
    entering step ``first`` detached (-1: none)."""
    t, noise = torch.linspace(1.0, 0, STEPS + 1), x
    if temperature is not None and temperature < 1.0:
        x = torch.zeros_like(noise)
    for i in range(STEPS):
        x = x.detach() if i == first else x
        v = model(x, t[i] * torch.ones((x.shape[0],), dtype=x.dtype), cond=cond)
        if temperature is not None and t[i] > temperature and t[i + 1] <= temperature:
            x = (1 - t[i + 1]) * (x - v) + t[i + 1] * noise
        else:
            x = x + (t[i + 1] - t[i]) * v
    return x


def v_ddim(model, x, first, cond):
    """``sample`` (eta 0) by hand, grad on, the model's output cast to float32 as upstream does."""
    t = torch.linspace(1, 0, STEPS + 1)[:-1]
    alphas, sigmas = torch.cos(t * math.pi / 2), torch.sin(t * math.pi / 2)
    ones = x.new_ones([x.shape[0]])
    for i in range(STEPS):
        x = x.detach() if i == first else x
        v = model(x, ones * t[i], cond=cond).float()
        pred, eps = x * alphas[i] - v * sigmas[i], x * sigmas[i] + v * alphas[i]
        if i < STEPS - 1:
            x = pred * alphas[i + 1] + eps * (sigmas[i + 1] ** 2 - 0.0).sqrt()
    return pred


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
    """``{fork: module}``, each patched: ThinkSound's declared path, AudioX's replica at the
    stable-audio-tools path, SongBloom's replica at a path no declaration names (the scan)."""
    root = tmp_path_factory.mktemp("forks")
    for path, source in [("stable_audio_tools.inference.sampling", AUDIOX), (SONGBLOOM_PATH, SONGBLOOM)]:
        *packages, leaf = path.split(".")
        folder = root.joinpath(*packages)
        folder.mkdir(parents=True)
        for depth in range(len(packages)):
            root.joinpath(*packages[:depth + 1], "__init__.py").write_text("")
        (folder / f"{leaf}.py").write_text(source)
    assert "stable_audio_tools" not in sys.modules  # the real one is tested in the background elsewhere
    sys.path.insert(0, str(root))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with gradpatch.applied("thinksound", "stable_audio_tools") as report:
                modules = {"thinksound": thinksound_sampling,
                           "audiox": importlib.import_module("stable_audio_tools.inference.sampling"),
                           "songbloom": importlib.import_module(SONGBLOOM_PATH)}
                records = {r.patch: r for r in gradpatch.report()}
                yield modules, list(report), records
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n.split(".")[0] in ("stable_audio_tools", "vendored_music")]:
            del sys.modules[name]


CASES = [(fork, name) for fork, names in [
    ("thinksound", ["sample_discrete_euler", "sample"]), ("audiox", ["sample_discrete_euler", "sample"]),
    ("songbloom", ["sample_discrete_euler", "sample_discrete_euler_with_temperature", "sample"])] for name in names]


def _setup(name):
    if name == "sample":
        return dict(args=(STEPS, 0.0), reference=v_ddim)
    if name == "sample_discrete_euler":
        return dict(args=(STEPS,), reference=lambda m, x, first, cond: euler(m, x, first, cond))
    return dict(args=(STEPS,), kwargs=dict(temperature=TEMPERATURE),
                reference=lambda m, x, first, cond: euler(m, x, first, cond, TEMPERATURE))


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 2, 6, generator=generator, dtype=torch.float64).requires_grad_(),
            torch.randn(2, 3, generator=generator, dtype=torch.float64).requires_grad_())


def _grads(out, model, x, cond):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    return list(torch.autograd.grad((out * weight).sum(), [*model.parameters(), x, cond], allow_unused=True))


@pytest.fixture
def float64():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def test_records_say_where_each_fork_was_found(forks):
    modules, report, records = forks
    for name in ("sample_discrete_euler", "sample"):
        assert records[f"thinksound.{name}"].status == "applied"
        assert records[f"thinksound.{name}"].variant.startswith("ThinkSound 0.0.19")
        assert records[f"stable_audio_tools.{name}"].status == "applied"
        assert records[f"stable_audio_tools.{name}"].variant.startswith("AudioX git 1bf5691")
    for name in ("sample_rk4", "sample_flow_dpmpp", "sample_flow_pingpong"):  # AudioX has none of these
        assert records[f"stable_audio_tools.{name}"].status == "skipped", records[f"stable_audio_tools.{name}"]
    for name in ("sample_discrete_euler", "sample_discrete_euler_with_temperature", "sample"):
        record = records[f"{SONGBLOOM_PATH}.{name}"]
        assert (record.status, record.target) == ("applied", f"{SONGBLOOM_PATH}:{name}")
        assert record.variant.startswith("SongBloom git 0d0337b")
        assert "gradpatch" in getattr(modules["songbloom"], name).__code__.co_filename


@pytest.mark.parametrize("fork, name", CASES, ids=[f"{f}.{n}" for f, n in CASES])
def test_upstream_gives_no_graph_and_passes_cache_to_the_model(forks, float64, fork, name):
    setup = _setup(name)
    upstream = getattr(forks[0][fork], name).__wrapped__
    model, (x, cond) = Tiny(), _inputs()
    assert upstream(model, x, *setup["args"], cond=cond, **setup.get("kwargs", {})).grad_fn is None
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache'"):
        upstream(model, x, *setup["args"], cond=cond, cache=False, **setup.get("kwargs", {}))


OPTIONS = [{}, {"grad_steps": 1}, {"grad_steps": 3}, {"checkpoint_steps": True},
           {"grad_steps": 2, "checkpoint_steps": True}]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "grad_steps=1", "grad_steps=3", "checkpoint_steps",
                                                  "grad_steps=2+checkpoint_steps"])
@pytest.mark.parametrize("fork, name", CASES, ids=[f"{f}.{n}" for f, n in CASES])
def test_gradients_equal_the_hand_written_loop(forks, float64, fork, name, options):
    setup, sampler = _setup(name), getattr(forks[0][fork], name)
    torch.manual_seed(0)
    model, (x, cond) = Tiny().eval(), _inputs()
    out = sampler(model, x, *setup["args"], cond=cond, cache=False, **setup.get("kwargs", {}), **options)
    first = STEPS - options["grad_steps"] if "grad_steps" in options else -1
    want = _grads(setup["reference"](model, x, first, cond), model, x, cond)
    got = _grads(out, model, x, cond)
    assert_grads_close(got, want, rtol=1e-6)
    assert all(w is not None and w.any() for w in want[:-2] + [want[-1]])  # every parameter, the conditioning
    if not options:
        assert want[-2] is not None and want[-2].any()  # and the noise
    if options.get("grad_steps", STEPS) < STEPS - 1 or name != "sample_discrete_euler_with_temperature":
        if "grad_steps" in options:  # detached before step N-K; nothing re-injects the noise after it
            assert got[-2] is None


@pytest.mark.parametrize("fork, name", CASES, ids=[f"{f}.{n}" for f, n in CASES])
def test_cache_true_is_upstream_bitwise_and_checkpoint_keeps_train_mode(forks, float64, fork, name):
    setup, sampler = _setup(name), getattr(forks[0][fork], name)
    model, (x, cond) = Tiny(dropout=0.2).train(), _inputs()
    torch.manual_seed(5)
    got = sampler(model, x, *setup["args"], cond=cond, **setup.get("kwargs", {}))
    torch.manual_seed(5)
    want = sampler.__wrapped__(model, x, *setup["args"], cond=cond, **setup.get("kwargs", {}))
    assert torch.equal(got, want) and got.grad_fn is None
    runs = []
    for options in ({}, {"checkpoint_steps": True}):
        torch.manual_seed(7)
        out = sampler(model, x, *setup["args"], cond=cond, cache=False, **setup.get("kwargs", {}), **options)
        runs.append(_grads(out, model, x, cond))
    assert model.training
    assert_grads_close(runs[1], runs[0], rtol=1e-7)


def test_grad_steps_refuses_a_non_integer_steps(forks):
    model, (x, cond) = Tiny().double(), _inputs()
    with pytest.raises(ValueError, match="not an integer"):
        forks[0]["songbloom"].sample_discrete_euler(model, x, 4.0, cond=cond, cache=False, grad_steps=1)


PLAIN_APPLY = r"""
import importlib, json, sys, warnings
warnings.simplefilter("ignore")
import torch
sys.path.insert(0, sys.argv[1])
early = importlib.import_module("early_vendor.sampling")   # SongBloom's copy, imported before apply()
import ThinkSound.inference.sampling as thinksound         # and ThinkSound
import gradpatch
gradpatch.apply()
late = importlib.import_module("late_vendor.sampling")     # imported after it
audiox = importlib.import_module("stable_audio_tools.inference.sampling")
net = torch.nn.Conv1d(2, 2, 1)
model = lambda x, t, scale=1.0: torch.tanh(net(x)) * scale
x = torch.randn(1, 2, 4)
result = {}
for key, fn in [("early", early.sample_discrete_euler_with_temperature), ("late", late.sample),
                ("thinksound", thinksound.sample), ("audiox", audiox.sample_discrete_euler)]:
    args = (3,) if "euler" in fn.__name__ else (3, 0.0)
    out = fn(model, x, *args, scale=2.0, cache=False, grad_steps=1)
    result[key] = [out.grad_fn is not None, "gradpatch" in fn.__code__.co_filename]
result["statuses"] = sorted({str(r.status) for r in gradpatch.report() if r.patch.split(".")[0] in
                             ("early_vendor", "late_vendor", "thinksound")})
print(json.dumps(result))
"""


def test_plain_apply_patches_every_fork(tmp_path):
    for package, source in [("early_vendor", SONGBLOOM), ("late_vendor", SONGBLOOM)]:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "sampling.py").write_text(source)
    (tmp_path / "stable_audio_tools" / "inference").mkdir(parents=True)
    (tmp_path / "stable_audio_tools" / "__init__.py").write_text("")
    (tmp_path / "stable_audio_tools" / "inference" / "__init__.py").write_text("")
    (tmp_path / "stable_audio_tools" / "inference" / "sampling.py").write_text(AUDIOX)
    result = last_json(run_python(PLAIN_APPLY.replace("sys.argv[1]", json.dumps(str(tmp_path)))))
    assert result == {"early": [True, True], "late": [True, True], "thinksound": [True, True],
                      "audiox": [True, True], "statuses": ["applied"]}


@pytest.mark.slow
def test_a_copy_of_stable_audio_tools_0_0_19_elsewhere_is_found(tmp_path, float64):
    """stable-audio-tools 0.0.19's own ``inference/sampling.py`` (from its PyPI wheel) vendored under
    another name: the scan recognises its ``sample_discrete_euler`` and ``sample``; N is ``steps``, or
    ``len(sigmas) - 1`` where ``sample_rf`` passes ``sigmas``."""
    from support import pypi_release

    release = pypi_release("stable-audio-tools==0.0.19")
    if isinstance(release, str):
        pytest.skip(release)
    (tmp_path / "vendored_sat").mkdir()
    (tmp_path / "vendored_sat" / "__init__.py").write_text("")
    source = (release / "stable_audio_tools" / "inference" / "sampling.py").read_text()
    (tmp_path / "vendored_sat" / "sampling.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with gradpatch.applied("thinksound"):
                sampling = importlib.import_module("vendored_sat.sampling")
                records = {r.patch: r for r in gradpatch.report()}
                for name in ("sample_discrete_euler", "sample"):
                    assert records[f"vendored_sat.sampling.{name}"].status == "applied"
                    assert records[f"vendored_sat.sampling.{name}"].variant == "stable-audio-tools 0.0.19 (a copy)"
                torch.manual_seed(0)
                model, (x, cond) = Tiny().eval(), _inputs()
                want = _grads(euler(model, x, STEPS - 2, cond), model, x, cond)
                for how in ({"steps": STEPS}, {"sigmas": torch.linspace(1.0, 0, STEPS + 1)}):
                    out = sampling.sample_discrete_euler(model, x, **how, cond=cond, cache=False, grad_steps=2)
                    assert_grads_close(_grads(out, model, x, cond), want, rtol=1e-6)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n.split(".")[0] == "vendored_sat"]:
            del sys.modules[name]
