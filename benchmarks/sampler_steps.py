"""Time of ``checkpoint_steps`` against its ideal, per sampler family: F5-TTS, AudioLDM DDIM, k-diffusion,
a diffusers pipeline (tiny random models from ``gradpatch.testing``; no downloads).

For each family, a ``cache=False`` call of N steps and a backward of a loss on its output, timed in
interleaved rounds (the order alternates every round) in three ways: plain (every step keeps its
graph), ``checkpoint_steps=True`` (each denoiser evaluation recomputed in backward) and, with
``--budget``, ``checkpoint_steps="budget:<half of plain's graph>"`` and, with ``--peak``,
``checkpoint_steps="peak:<halfway between every evaluation recomputed and every one kept>"`` (its
recorded calls run before the rounds). ``F`` and ``B`` are the medians
of the plain call's forward (sampling) and backward. Recomputing every evaluation once costs at most
another ``F``, so the ideal ratio of a checkpointed call to the plain one is ``(2F + B) / (F + B)``;
``x ideal`` is the measured ratio (median of per-round ratios) over it. The machine's load moves single
wall times by tens of percent: times are thread CPU time (one thread), and adjacent runs share
the load, so per-round ratios are the steadier figure.

``--compare`` also times, in the same rounds, the earlier implementations: saved-tensor hooks per
evaluation with a Python call per saved tensor in backward ("per-tensor hooks"), and one
``torch.utils.checkpoint`` per evaluation ("torch checkpoint").

``--anatomy`` times, in the same rounds, ``checkpoint_steps=True`` with each of the fast path's two
guards taken out, to show what each costs. Neither variant is safe, and neither is offered:
"no save hooks" keeps each evaluation's saved tensors in its forward graph until that graph is dropped
(under module hooks whose reference cycles keep the dropped graph, every evaluation's activations stay
until the garbage collector runs); "no graph walk" reuses the first evaluation's leaves for every later
evaluation of the call (a later evaluation reading another parameter would not get its gradient).
It also times where a recompute runs: one denoiser evaluation of the call (its inputs captured, run in
the call's context) right after a backward of another, against the same evaluation right after another
forward (interleaved pairs, median ratio). Every recompute in backward runs after a backward, torch's
checkpoint's too; the ideal counts it at the cost of the forward's evaluation, which ran after a forward.

    HF_HUB_OFFLINE=1 python benchmarks/sampler_steps.py [--steps 32] [--rounds 5] [--compare] [--anatomy] [--budget]
        [--peak]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import gradpatch  # noqa: E402


def f5(steps: int):
    from gradpatch.testing import f5_cfm, f5_inputs

    model, (cond, text) = f5_cfm().eval(), f5_inputs()

    def call(**options):
        out, _ = model.sample(cond, text, duration=100, steps=steps, cfg_strength=2.0, seed=0, cache=False, **options)
        return out.square().mean()

    return "f5_tts", "F5-TTS CFM.sample, tiny DiT, 100 frames, CFG 2.0", model, call


def audioldm(steps: int):
    from gradpatch.testing import audioldm_cond, audioldm_ldm

    model, cond = audioldm_ldm().eval(), audioldm_cond(1)

    def call(**options):
        from audioldm.latent_diffusion.ddim import DDIMSampler

        torch.manual_seed(0)
        z, _ = DDIMSampler(model).sample(steps, 1, (4, 16, 16), cond, verbose=False, unconditional_guidance_scale=2.0,
                                         unconditional_conditioning=torch.zeros_like(cond), cache=False, **options)
        return z.square().mean()

    return "audioldm", "AudioLDM DDIMSampler.sample, tiny UNet, CFG 2.0", model, call


def kdiffusion(steps: int):
    import k_diffusion
    from kdiffusion_memory import Net  # noqa: E402  (same folder)

    torch.manual_seed(0)
    model, x = k_diffusion.layers.Denoiser(Net(), sigma_data=0.5), torch.randn(2, 4, 256) * 10

    def call(**options):
        from k_diffusion import sampling

        sigmas = sampling.get_sigmas_karras(steps, 0.05, 10.0)
        return sampling.sample_euler(model, x, sigmas, disable=True, cache=False, **options).square().mean()

    return "k_diffusion", "k-diffusion sample_euler, Denoiser + conv net", model, call


def diffusers(steps: int):
    from gradpatch.testing import add_lora, stable_diffusion_pipeline

    pipe, embeds = stable_diffusion_pipeline()
    pipe.vae.requires_grad_(False)
    add_lora(pipe.unet)

    def call(**options):
        images = pipe(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=32, width=32,
                      num_inference_steps=steps, guidance_scale=2.0, output_type="latent",
                      generator=torch.Generator().manual_seed(0), cache=False, **options).images
        return images.square().mean()

    return "diffusers", "diffusers StableDiffusionPipeline (DDIM), tiny UNet + LoRA, CFG 2.0", pipe.unet, call


FAMILIES = {"f5": f5, "audioldm": audioldm, "kdiffusion": kdiffusion, "diffusers": diffusers}


@contextlib.contextmanager
def torch_runner():
    """An earlier implementation: torch's checkpoint per evaluation."""
    from gradpatch.sampling.steps import checkpoint as _step_checkpoint

    saved = _step_checkpoint.FLAT
    _step_checkpoint.FLAT = False
    try:
        yield
    finally:
        _step_checkpoint.FLAT = saved


@contextlib.contextmanager
def per_tensor_runner():
    """The implementation before evaluations went through the fixed checkpoint's node: saved-tensor
    hooks per evaluation, one Python call per saved tensor in backward."""
    from gradpatch.sampling.steps import checkpoint as _step_checkpoint

    recomputed = _step_checkpoint.recomputed
    _step_checkpoint.recomputed = lambda fn, args, kwargs, fast, **options: recomputed(fn, args, kwargs, False)
    try:
        yield
    finally:
        _step_checkpoint.recomputed = recomputed


@contextlib.contextmanager
def without_save_hooks():
    """Unsafe, for ``--anatomy`` only: the fast path's forward keeps what it saves in its graph."""
    from gradpatch.checkpointing import recompute

    saved = recompute.forward_saves
    recompute.forward_saves = lambda held: contextlib.nullcontext() if held is None else saved(held)
    try:
        yield
    finally:
        recompute.forward_saves = saved


@contextlib.contextmanager
def without_graph_walk():
    """Unsafe, for ``--anatomy`` only: every evaluation after the first is given the first's leaves."""
    from gradpatch.checkpointing import recompute

    walk, first = recompute.graph_walk.sources, []

    def sources(roots, start, end, inputs):
        if not first:
            first.append(walk(roots, start, end, inputs))
        return first[0]

    recompute.graph_walk.sources = sources
    try:
        yield
    finally:
        recompute.graph_walk.sources = walk


def placement(call, model, pairs: int = 30) -> float:
    """One evaluation of a checkpointed call run right after a backward, over the same evaluation run
    right after another forward: the median of ``pairs`` interleaved pairs (thread CPU time)."""
    from torch.utils._pytree import tree_flatten

    from gradpatch.sampling import run as sampling_run
    from gradpatch.sampling.steps import inputs

    captured: list = []
    init = inputs.AsWas.__init__

    def capture(self, fn, args, kwargs, *rest):
        if not captured:
            def leaf(v):
                return v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
            captured.append((fn, tuple(map(leaf, args)), {k: leaf(v) for k, v in kwargs.items()},
                             sampling_run.current.get()))
        init(self, fn, args, kwargs, *rest)

    inputs.AsWas.__init__ = capture
    try:
        call(checkpoint_steps=True).backward()
    finally:
        inputs.AsWas.__init__ = init
    model.zero_grad(set_to_none=True)
    fn, args, kwargs, run = captured[0]

    def evaluate():
        with run.active(), torch.enable_grad():
            return fn(*args, **kwargs)

    def loss(out):
        return sum(t.float().square().mean() for t in tree_flatten(out)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad)

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    ratios = []
    for i in range(pairs + 2):
        spans = {}
        for after in (("forward", "backward") if i % 2 else ("backward", "forward")):
            before = evaluate()
            if after == "backward":
                loss(before).backward()
            start = clock()
            out = evaluate()
            spans[after] = clock() - start
            del before, out
        model.zero_grad(set_to_none=True)
        if i >= 2:  # the first two warm up
            ratios.append(spans["backward"] / spans["forward"])
    return statistics.median(ratios)


def timed(call, model, options: dict, context=contextlib.nullcontext) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one call: thread CPU time (torch on one thread computes
    on the calling thread), which other processes on a shared machine disturb least."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    with context():
        start = clock()
        loss = call(**options)
        middle = clock()
        loss.backward()
        end = clock()
    model.zero_grad(set_to_none=True)
    return middle - start, end - middle


def allocated_after_forward(call, options: dict) -> int:
    """Bytes still allocated after a call's forward (profiler memory events), the graph's included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = call(**options)
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.events())


def graph_bytes(call) -> int:
    """What the plain call's graph holds beyond ``checkpoint_steps=True``'s, measured at the allocator."""
    return allocated_after_forward(call, {}) - allocated_after_forward(call, {"checkpoint_steps": True})


def peak_halfway(call, model) -> str:
    """``"peak:<size>"`` halfway between the recorded peaks of every evaluation recomputed and every
    one kept (predicted), its plan recorded and checked (the calls the rounds then time are planned)."""
    from gradpatch.sampling.steps import peak

    peak.reset()
    call(checkpoint_steps="peak:1TiB").backward()
    model.zero_grad(set_to_none=True)
    peak.settle()
    (record,) = peak.records().values()
    option = f"peak:{(record['smallest_peak'] + record['largest_peak']) // 2}"
    for _ in range(peak.TRIES + 1):
        call(checkpoint_steps=option).backward()
        model.zero_grad(set_to_none=True)
    peak.settle()
    (record,) = peak.records().values()
    plan = record["plans"][int(option[5:])]
    print(f"# {option[:5]}{int(option[5:]) / 2**20:.2f}MiB: {len(plan['kept'])} of {record['evaluations']} "
          f"evaluations kept, recorded peak {(plan['realised_peak'] or 0) / 2**20:.2f} MiB (every evaluation "
          f"recomputed {record['smallest_peak'] / 2**20:.2f} MiB)")
    return option


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per family")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--compare", action="store_true", help="also time the previous implementation")
    parser.add_argument("--anatomy", action="store_true",
                        help="also time checkpoint_steps=True without each fast-path guard (unsafe; see above)")
    parser.add_argument("--budget", action="store_true", help="also time checkpoint_steps='budget:<half>'")
    parser.add_argument("--peak", action="store_true", help="also time checkpoint_steps='peak:<halfway>'")
    parser.add_argument("--quick", action="store_true", help="8 steps, 2 rounds")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 8, 2
    torch.set_num_threads(args.threads)
    print(f"cache=False forward + backward, {args.steps} steps, {args.rounds} interleaved rounds (medians), "
          f"{args.threads} thread(s), CPU, torch {torch.__version__}")
    print(f"{'family':<12}{'F s':>8}{'B s':>8}{'ideal':>7}  {'mode':<22}{'time s':>8}{'x plain':>9}{'x ideal':>9}")
    worst = 0.0
    for key in args.families:
        target, label, model, call = FAMILIES[key](args.steps)
        with gradpatch.applied(target):
            call().backward()  # warm-up
            model.zero_grad(set_to_none=True)
            modes = {"plain": ({}, contextlib.nullcontext), "checkpoint_steps": ({"checkpoint_steps": True},
                                                                                 contextlib.nullcontext)}
            if args.compare:
                modes["per-tensor hooks"] = ({"checkpoint_steps": True}, per_tensor_runner)
                modes["torch checkpoint"] = ({"checkpoint_steps": True}, torch_runner)
            if args.anatomy:
                modes["no save hooks"] = ({"checkpoint_steps": True}, without_save_hooks)
                modes["no graph walk"] = ({"checkpoint_steps": True}, without_graph_walk)
            if args.budget:
                half = graph_bytes(call) // 2
                modes[f"budget:{half / 2**20:.2f}MiB"] = ({"checkpoint_steps": f"budget:{half}"}, contextlib.nullcontext)
            if args.peak:
                option = peak_halfway(call, model)
                modes[f"peak:{int(option[5:]) / 2**20:.2f}MiB"] = ({"checkpoint_steps": option}, contextlib.nullcontext)
            after_backward = placement(call, model) if args.anatomy else None
            times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
            for i in range(args.rounds):
                order = list(modes) if i % 2 == 0 else list(reversed(modes))
                for mode in order:
                    times[mode].append(timed(call, model, *modes[mode]))
        forward = statistics.median(f for f, _ in times["plain"])
        backward = statistics.median(b for _, b in times["plain"])
        ideal = (2 * forward + backward) / (forward + backward)
        print(f"# {label}")
        for mode, runs in times.items():
            total = statistics.median(f + b for f, b in runs)
            ratio = statistics.median((f + b) / (pf + pb) for (f, b), (pf, pb) in zip(runs, times["plain"]))
            mark = f"{ratio / ideal:>9.3f}" if mode != "plain" else f"{'':>9}"
            print(f"{key:<12}{forward:>8.3f}{backward:>8.3f}{ideal:>7.3f}  {mode:<22}{total:>8.3f}{ratio:>9.3f}{mark}")
            if mode == "checkpoint_steps":
                worst = max(worst, ratio / ideal)
        if after_backward is not None:
            print(f"# one evaluation right after a backward: {after_backward:.3f}x the same evaluation right after a "
                  "forward (where every recompute runs; the ideal counts 1.000x)")
    print(f"checkpoint_steps: worst {worst:.3f}x its ideal ({'within' if worst <= 1.1 else 'OVER'} the 1.1x target)")
    return 0  # a measurement, not a check: load moves these figures (docs/benchmarks.md)


if __name__ == "__main__":
    raise SystemExit(main())
