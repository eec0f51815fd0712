"""``checkpoint_steps="peak:<size>"`` (``gradpatch.sampling.steps.peak``) on the real tiny F5-TTS ``CFM.sample``
and AudioLDM's ``DDIMSampler.sample``: gradients equal ``checkpoint_steps=False`` over every parameter in
every phase (the recorded call, the plan's checked call, the planned call), the step's peak by torch's
``MemTracker`` (the independent measure) at or under the size at three sizes between recomputing every
evaluation and keeping every one, evaluations kept at the larger sizes; the unreachable size's error; bad
sizes; free until used."""
from __future__ import annotations

import os

import pytest
import torch

import gradpatch
from gradpatch.checkpointing.budget.peak_choice import predict
from gradpatch.sampling.steps import peak as step_peak
from gradpatch.settings import scope
from support import assert_grads_close, memtracker_peak as tracked_peak

os.environ.setdefault("TQDM_DISABLE", "1")
MiB = 2**20


class _Tracker:
    """torch's MemTracker counting every allocation of the step (its dispatch mode), without its
    per-module statistics, which refuse a root module called once per sampler step."""

    def __new__(cls):
        from torch.distributed._tools.mem_tracker import MemTracker

        class Tracker(MemTracker):
            def _pre_fw_hook(self, *args):
                pass

            _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

        return Tracker()


def memtracker_peak(model, step) -> int:
    """The step's peak by MemTracker, above what was allocated when it began."""
    step_peak.settle()  # the last call's recording off the stack before the tracker's mode goes on it
    return tracked_peak(model, step, _Tracker())


class F5:
    name = "f5_tts"

    def __init__(self):
        from gradpatch.testing import f5_cfm, f5_inputs

        self.model, (self.cond, self.text) = f5_cfm().eval(), f5_inputs()
        self.params = [p for p in self.model.parameters() if p.requires_grad]

    def step(self, option, steps: int = 12, cfg: float = 2.0, seed: int = 0) -> None:
        out, _ = self.model.sample(self.cond, self.text, duration=60, steps=steps, cfg_strength=cfg, seed=seed,
                                   cache=False, checkpoint_steps=option)
        out.square().mean().backward()


class DDIM:
    name = "audioldm"

    def __init__(self):
        from gradpatch.testing import audioldm_cond, audioldm_ldm

        self.model, self.cond = audioldm_ldm().eval(), audioldm_cond(1)
        self.params = list(self.model.model.parameters())

    def step(self, option, steps: int = 8) -> None:
        from audioldm.latent_diffusion.ddim import DDIMSampler

        torch.manual_seed(0)
        z, _ = DDIMSampler(self.model).sample(steps, 1, (4, 16, 16), self.cond, verbose=False,
                                              unconditional_guidance_scale=2.0,
                                              unconditional_conditioning=torch.zeros_like(self.cond), cache=False,
                                              checkpoint_steps=option)
        z.square().mean().backward()


def grads(family, option) -> list:
    family.model.zero_grad(set_to_none=True)
    family.step(option)
    got = [None if p.grad is None else p.grad.clone() for p in family.params]
    family.model.zero_grad(set_to_none=True)
    return got


@pytest.fixture
def fresh():
    step_peak.reset()
    yield
    step_peak.reset()


def states(monkeypatch) -> list:
    """The :class:`StepPeak` of each call, in order."""
    made: list = []
    real = step_peak.StepPeak

    def recorded(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(step_peak, "StepPeak", recorded)
    return made


@pytest.mark.parametrize("family", [F5, DDIM], ids=["f5", "audioldm-ddim"])
def test_peak_within_size_gradients_exact_in_every_phase(single_thread, fresh, monkeypatch, family):
    made = states(monkeypatch)
    with gradpatch.applied(family.name):
        run = family()
        grads(run, False)  # warm-up: first-use allocations
        want = grads(run, False)
        smallest = memtracker_peak(run.model, lambda: run.step(True))
        # Every evaluation kept as peak: keeps one: gradpatch's block checkpoints inside it plain (as its
        # recompute runs them). AudioLDM's transformer blocks are checkpointed in the plain call, which
        # keeps about a third of that per evaluation (31.6 MiB for the call, 74.3 with them plain): sizes
        # up to the plain call's peak leave room for two of its 9.3 MiB evaluations, not three.
        with scope(checkpoint_policy="never"):
            largest = memtracker_peak(run.model, lambda: run.step(False))
        assert largest > 2 * smallest, (smallest, largest)
        kept = {}
        for fraction in (0.2, 0.5, 0.8):
            size = int(smallest + fraction * (largest - smallest))
            option = f"peak:{size}"
            step_peak.reset()
            phases = []
            while not phases or phases[-1] != "planned":  # recorded, checked (again where over), planned
                assert_grads_close(grads(run, option), want, rtol=1e-5)
                phases.append(made[-1].phase)
                assert made[-1].kept + made[-1].recomputed == len(made[-1].evaluations)
                assert len(phases) <= 2 + step_peak.TRIES, phases
            assert phases[0] == "recording" and made[-len(phases)].kept == 0
            tracked = memtracker_peak(run.model, lambda: run.step(option))
            state = made[-1]
            assert state.phase == "planned"
            assert tracked <= size, (fraction, tracked / MiB, size / MiB, state)
            assert state.predicted == pytest.approx(tracked, rel=0.02), (fraction, state.predicted / MiB, tracked / MiB)
            # What fits is kept: one more (the latest not kept) is predicted over the size.
            record_ = state.record
            more = max(set(range(len(record_.costs))) - state.keep, default=None)
            if more is not None:
                added = [c if i in state.keep | {more} else 0 for i, c in enumerate(record_.costs)]
                assert predict(record_.levels, record_.occurrences, added) > size, (fraction, state)
            (record,) = step_peak.records().values()
            assert record["smallest_peak"] == pytest.approx(smallest, rel=0.05)
            assert record["plans"][size]["realised_peak"] <= size
            kept[fraction] = state.kept
        assert kept[0.5] >= 1 and kept[0.8] > kept[0.5] >= kept[0.2], kept


def test_plan_keeps_the_latest_evaluations_that_fit_and_learns_from_a_checked_call():
    """Four evaluations recorded recomputed: each forward's working set 10, the latent chain 1 per step,
    each recompute in backward holds its graph (40) above what is left. A kept graph counts from its
    forward's end (the interval after it) to its recompute's start, the spans by the recorder's rule: the
    last is kept for free (its graph alive where its recompute's would be), one more costs 40 over what
    is alive in the last's backward (the latest is kept); a checked call over its size plans with less
    room."""
    from gradpatch.checkpointing.budget.timeline import Recording
    from gradpatch.sampling.steps.peak_plan import Record

    recording = Recording()
    recording.marks = [(k, i) for i in range(4) for k in "FE"] + [("R", i) for i in reversed(range(4))]
    recording.calls = list(range(4))
    levels = [0, 10, 1, 11, 2, 12, 3, 13, 5, 50, 48, 46, 44]
    record = Record.of([((0, 4), "x", 40)] + [((i, 4), "x", None) for i in range(1, 4)], levels,
                       recording.occurrences())
    assert [tuple(o) for o in record.occurrences] == [(0, 2, 12), (1, 4, 11), (2, 6, 10), (3, 8, 9)]
    assert record.costs == [40] * 4 and record.floor == 50 and record.ceiling == 50 + 3 * 40  # the last one's backward, the others kept
    assert record.plan(50).keep == {3} and record.plan(50).predicted == 50  # free: at the floor
    plan = record.plan(93)
    assert plan.keep == {2, 3} and plan.predicted == 90 and plan.realised is None
    assert record.plan(89).keep == {3}
    assert record.plan(49).keep == frozenset() and record.plan(49).realised == 50  # below the floor: as recorded
    record.check(93, 98)  # the checked call peaked over: the plan made again with the 8 its prediction (90) missed
    assert record.plans[93].keep == {3} and record.plans[93].margin == 8
    record.check(93, 60)
    assert record.plans[93].realised == 60


def test_unreachable_size_raises_with_the_smallest_peak(single_thread, fresh, monkeypatch):
    made = states(monkeypatch)
    with gradpatch.applied("f5_tts"):
        run = F5()
        want = grads(run, False)
        assert_grads_close(grads(run, "peak:1KiB"), want, rtol=1e-5)  # recorded: every evaluation recomputed
        assert made[-1].phase == "recording"
        with pytest.raises(step_peak.PeakUnreachable,
                           match=r"no plan keeps this sampler call's step within 0\.00 MiB; the smallest peak "
                                 r"reachable is \d+\.\d\d MiB, with every denoiser evaluation recomputed .* "
                                 r"Use peak:\d+MiB or more") as error:
            run.step("peak:1KiB")
        assert isinstance(error.value, ValueError)
        need = int(str(error.value).split("Use peak:")[1].split("MiB")[0])
        (record,) = step_peak.records().values()
        assert record["smallest_peak"] <= need * MiB
        assert_grads_close(grads(run, f"peak:{need}MiB"), want, rtol=1e-5)  # what it says works
        assert made[-1].phase in ("checking", "planned")


def test_another_call_is_recorded_again(single_thread, fresh, monkeypatch):
    """Another step count is another key; another seed the same one."""
    made = states(monkeypatch)
    with gradpatch.applied("f5_tts"):
        run = F5()
        for steps, seed in ((6, 0), (6, 1), (8, 0), (8, 0)):
            run.model.zero_grad(set_to_none=True)
            run.step(False, steps, seed=seed)
            want = [p.grad.clone() for p in run.params]
            run.model.zero_grad(set_to_none=True)
            run.step("peak:1GiB", steps, seed=seed)
            assert_grads_close([p.grad for p in run.params], want, rtol=1e-5)
        run.model.zero_grad(set_to_none=True)
        assert [s.phase for s in made] == ["recording", "checking", "recording", "checking"]
        assert made[1].kept == 6 and made[3].kept == 8  # 1 GiB: every evaluation kept
        assert len(step_peak.records()) == 2


def test_a_call_that_differs_from_its_record_recomputes_from_there_and_is_recorded_again(fresh, monkeypatch):
    """The same key (the step count in a tensor) with more evaluations than recorded: those past the
    record recomputed, gradients exact, the key recorded again; fewer: the kept ones that remain."""
    made = states(monkeypatch)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

    def sample(net, x, n):
        for _ in range(int(n)):
            x = x + 0.1 * net(x)
        return x

    sampler = gradpatch.differentiable(sample, step="net")
    x = torch.randn(4, 8)
    for n, phase in ((3, "recording"), (3, "checking"), (5, "planned"), (5, "recording"), (2, "checking")):
        want = torch.autograd.grad(sampler(net, x, torch.tensor(n)).square().sum(), list(net.parameters()))
        got = torch.autograd.grad(sampler(net, x, torch.tensor(n), checkpoint_steps="peak:1GiB").square().sum(),
                                  list(net.parameters()))
        assert_grads_close(got, want, rtol=1e-5)
        assert made[-1].phase == phase
    assert [(s.kept, s.recomputed, s.diverged) for s in made] == \
        [(0, 3, False), (3, 0, False), (3, 2, True), (0, 5, False), (2, 0, True)]


@pytest.mark.parametrize("value, error, message", [
    ("peak:lots", ValueError, "checkpoint_steps='peak:lots': 'lots' is not a size: write bytes"),
    ("peak:-1MiB", ValueError, "checkpoint_steps='peak:-1MiB': '-1MiB' is not a size"),
    ("fast", TypeError, r"checkpoint_steps must be True or False, or a string 'budget:<size>' \('budget:512MiB'\) "
                        r"or 'peak:<size>' \('peak:6GiB'\)"),
])
def test_bad_sizes_say_what_to_write(single_thread, value, error, message):
    from gradpatch.sampling.options import step_budget, step_peak as peak_bytes

    assert peak_bytes(" peak:40MiB ") == 40 * MiB and step_budget("peak:40MiB") is None
    assert peak_bytes("budget:1MiB") is None and peak_bytes(True) is None
    with gradpatch.applied("f5_tts"):
        run = F5()
        with pytest.raises(error, match=message):
            run.step(value)
        with pytest.raises(ValueError, match="Pass cache=False as well"):
            run.model.sample(run.cond, run.text, duration=12, steps=2, checkpoint_steps="peak:1MiB")


def test_free_until_used():
    from support import run_python

    result = run_python("import sys, gradpatch, gradpatch.sampling.options as o\n"
                        "assert o.step_peak('peak:1MiB') == 2**20\n"
                        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('gradpatch.sampling.steps')))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
