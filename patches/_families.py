"""The families of code copied into many codebases, and declaration helpers (no logic, no torch)."""
from __future__ import annotations

from typing import Mapping

from gradpatch.patching.families import AutogradFunctionShape, Family, FunctionShape, Member
from gradpatch.patching.fingerprint import IsObject
from gradpatch.patching.patch import Patch
from gradpatch.sampling.generic.any_sampler import fix as _fixes
from gradpatch.sampling.generic.any_sampler import sampler

from ._ldm import LDM_SAMPLING

_FIX = "gradpatch.checkpointing.checkpoint"
_SUMMARY = "fixed checkpoint: frozen params, None inputs, dropout RNG, autocast, double backward"
_PAIR = ("checkpoint", "CheckpointFunction")
_MIXED = _PAIR + ("mixed_checkpoint", "MixedCheckpointFunction")

#: The OpenAI/CompVis gradient checkpoint (guided-diffusion's ``nn.py``), copied into AudioLDM,
#: latent/stable diffusion, sgm, ComfyUI and hundreds of research repositories, often as
#: ``util.py``. ``checkpoint`` is replaced (and every module that did ``from ... import
#: checkpoint`` rebound) so the policy and the no-grad fast path apply; ``CheckpointFunction`` too,
#: because upstream looks it up in its module globals at call time, which fixes callers still
#: holding the original function. sgm adds ``mixed_checkpoint`` (dict inputs), whose
#: ``MixedCheckpointFunction`` is only reached through it.
CHECKPOINT = Family(
    "openai_checkpoint",
    members=(
        Member("checkpoint", FunctionShape(("func", "inputs", "params", "flag")),
               f"{_FIX}:replace_checkpoint", _SUMMARY),
        Member("CheckpointFunction", AutogradFunctionShape(("ctx", "run_function", "length")),
               f"{_FIX}:replace_checkpoint_function", _SUMMARY, marks_copy=True),
        Member("mixed_checkpoint", FunctionShape(("func", "inputs", "params", "flag")),
               f"{_FIX}:replace_mixed_checkpoint", "fixed mixed_checkpoint (dict inputs)"),
        Member("MixedCheckpointFunction", AutogradFunctionShape(
            ("ctx", "run_function", "length_tensors", "length_non_tensors", "tensor_keys", "non_tensor_keys")),
            marks_copy=True),
    ),
    fingerprints=(
        # Every version the catalogue's declared paths name (patches/*.py say where each came from).
        (_MIXED, {"280d31d70068a93a": "V2+M (sgm, generative-models)"}),
        (_PAIR, {
            "78fc3e61f1317c31": "V1 (OpenAI/CompVis: audioldm, audioldm2, ldm SD1, guided/improved-diffusion)",
            "929fce4a31ca8b21": "V2 (V1 + CUDA autocast replay: SD2, ControlNet, ComfyUI)",
            "f4a39d1f50f6fc11": "V3 (saved tensors, filters frozen parameters: guided-diffusion-sdk)",
        }),
    ),
)

#: gradpatch.differentiable's fix with step="estimator", steps="n_timesteps", under a name of this
#: family's own: a family's copies are looked for while a patch using its fix is selected, and a user's
#: ``gradpatch.differentiable(..., step="estimator", steps="n_timesteps")`` request must not wake it.
flow_matching_sampler = getattr(_fixes, sampler(step="estimator", steps="n_timesteps").partition(":fix.")[2])
_EULER = f"{__name__}:flow_matching_sampler"
_CFM = "{}(cache=False): gradients through the Euler solve; grad_steps, checkpoint_steps"

#: The conditional flow-matching decoder of Matcha-TTS (``BASECFM``), copied and extended by
#: CosyVoice (``ConditionalCFM``/``CausalConditionalCFM``), Chatterbox's S3Gen (which vendors both),
#: Seed-VC and IndexTTS2 (``BASECFM.inference``, Seed-VC v2's ``CFM``), VoxCPM (``UnifiedCFM``) and
#: the detokenizers reusing CosyVoice's flow module. One shape throughout: a module holding the
#: velocity network as ``self.estimator``, an ``@torch.inference_mode()`` entry (``forward`` or
#: ``inference``) that draws the noise and calls an undecorated ``solve_euler``, which loops over
#: ``n_timesteps`` Euler steps with one (CFG-batched) estimator call each; the CosyVoice line refills
#: its CFG batch in place (``x_in[:] = x``) every step. Each entry is made differentiable by
#: :func:`gradpatch.differentiable` (``step="estimator"``, ``steps="n_timesteps"``); the solver is
#: hashed with the entry it serves and never replaced.
FLOW_MATCHING = Family(
    "flow_matching_cfm",
    members=(
        Member("BASECFM.forward", FunctionShape(("self", "mu", "mask", "n_timesteps")), _EULER,
               _CFM.format("BASECFM.forward")),
        Member("BASECFM.inference", FunctionShape(("self", "mu", "x_lens", "prompt", "style", "f0", "n_timesteps")),
               _EULER, _CFM.format("BASECFM.inference")),
        Member("BASECFM.solve_euler", FunctionShape(("self", "x"))),
        Member("CausalConditionalCFM.forward", FunctionShape(("self", "mu", "mask", "n_timesteps")), _EULER,
               _CFM.format("CausalConditionalCFM.forward")),
        Member("ConditionalCFM.solve_euler", FunctionShape(("self", "x", "t_span", "mu", "mask"))),
        Member("CFM.inference", FunctionShape(("self", "mu", "x_lens", "prompt", "style", "n_timesteps")), _EULER,
               _CFM.format("CFM.inference")),
        Member("CFM.solve_euler", FunctionShape(("self", "x", "x_lens", "prompt", "mu", "style", "t_span"))),
        Member("UnifiedCFM.forward", FunctionShape(("self", "mu", "n_timesteps", "patch_size", "cond")), _EULER,
               _CFM.format("UnifiedCFM.forward")),
        Member("UnifiedCFM.solve_euler", FunctionShape(("self", "x", "t_span", "mu", "cond"))),
    ),
    fingerprints=(
        (("BASECFM.forward", "BASECFM.solve_euler"), {
            "ad6f4138cedd6742": "Matcha-TTS (matcha-tts 0.0.7.2; chatterbox-tts 0.1.7 s3gen/matcha copy)"}),
        (("BASECFM.inference", "BASECFM.solve_euler"), {
            "3fc09b0fa389cdd4": "Seed-VC v1 (seed-vc 0.4.3; indextts2-inference 2.1.1 s2mel copy)"}),
        (("CausalConditionalCFM.forward", "ConditionalCFM.solve_euler"), {
            "5ff6cd30adf72440": "Chatterbox S3Gen (chatterbox-tts 0.1.7)",
            # CosyVoice 2/3, FunAudioLLM/CosyVoice cosyvoice/flow/flow_matching.py, by commit date.
            # Not listed: 437c67914012dae5 (2025-01-23 to 2025-04-16), whose CausalConditionalCFM.forward
            # takes a `cache` argument of its own, which the patched sampler's `cache` keyword would take.
            "052fd42937c23281": "CosyVoice 2 (git 3e38100, 2024-12-11)",
            "1219d24061d3db22": "CosyVoice 2 (git c693039, 2024-12-12)",
            "82d203d0a4755994": "CosyVoice 2 (git 2511a49 to 3581cae, 2024-12)",
            "de07ab99e15c170d": "CosyVoice 2 (git 77d8cf1 to 1cfc5dd 2025-01; 68100c2 2025-05-23)",
            "bcab801eb07084bc": "CosyVoice 2 (git cbfed4a to 46dfe04, 2025-05-27 to 2025-06-25)",
            "4c0edefff8736bdc": "CosyVoice 3 (git 5bc4b23 2025-12-12 to ace7c47 2026-03)",
        }),
        (("CFM.inference", "CFM.solve_euler"), {"eaf0056940c12d7d": "Seed-VC v2 (seed-vc 0.4.3)"}),
        (("UnifiedCFM.forward", "UnifiedCFM.solve_euler"), {"ee5ccd6c16d91447": "VoxCPM (voxcpm 2.0.3)"}),
    ),
)

#: F5-TTS's ``CFM.sample`` as other repositories copied it, at paths no declaration may name:
#: DiffRhythm (GitHub ASLP-lab/DiffRhythm) keeps it in a checkout's top-level ``model/cfm.py``, and a
#: declaration of ``model.cfm`` would fire on every project with such a module. Same shape as F5's
#: (``@torch.no_grad()``, ``self.eval()``, ``self.transformer`` through the module global ``odeint``),
#: so F5's fix, unchanged; found by the scan whenever F5's patch is selected (the same fix).
F5_SAMPLE = Family(
    "f5_cfm_sample",
    members=(Member("CFM.sample", FunctionShape(("self", "cond", "text", "duration")),
                    "gradpatch.sampling.families.ode:differentiable_sampler",
                    "CFM.sample(cache=False): gradients through the ODE solve, caller's mode kept; grad_steps, "
                    "checkpoint_steps"),),
    fingerprints=((("CFM.sample",), {
        # Every version of DiffRhythm's model/cfm.py in the repository's history.
        "056bf98573e13047": "DiffRhythm git 5909b2a to a6aa722 (2025-03-05 to 2025-03-13)",
        "63227f143616ee6f": "DiffRhythm git c93f59a (2025-03-17)",
        "f87169b02a46cae3": "DiffRhythm git fce85e5 (2025-05-08)",
        "af621de49b303f98": "DiffRhythm git fc54560 (2025-09-02) to 28ad63c (2025-11-27)",
    }),),
)

_COUNTED = "gradpatch.sampling.families.functions:counted_step_sampler"
_SAT = "{}(cache=False): gradients through the sampler; grad_steps, checkpoint_steps"
SAT_FORK_PAIR = ("sample_discrete_euler", "sample")
SAT_FORK_TRIPLE = ("sample_discrete_euler", "sample_discrete_euler_with_temperature", "sample")

#: stable-audio-tools' early ``inference/sampling.py`` (rectified-flow Euler ``sample_discrete_euler`` and
#: v-diffusion DDIM ``sample``, both ``@torch.no_grad()``, one ``model(x, t, **extra_args)`` evaluation
#: per step) as its forks ship it: ThinkSound (PyPI ``thinksound``, as ``ThinkSound.inference.sampling``),
#: AudioX (GitHub ZeyueT/AudioX; installs its copy *as* ``stable_audio_tools``, so the declared
#: stable-audio-tools patches recognise it: ``patches/stable_audio_tools.py``) and SongBloom (GitHub
#: tencent-ailab/SongBloom, ``SongBloom.models.musicldm.inference.sampling``, adding
#: ``sample_discrete_euler_with_temperature`` and loops over plain ``zip``/``range`` unless
#: ``prog_bar=True``), found at any path; so is a copy of stable-audio-tools 0.0.19's own module at another
#: path (its ``sample_discrete_euler`` and ``sample``). The fix counts one evaluation per step
#: (``gradpatch/sampling/families/functions.py``, :func:`counted_step_sampler`); extra keyword arguments
#: still reach the model.
SAT_FORKS = Family(
    "stable_audio_forks",
    members=(
        Member("sample_discrete_euler", FunctionShape(("model", "x", "steps")), _COUNTED,
               _SAT.format("sample_discrete_euler")),
        Member("sample_discrete_euler_with_temperature", FunctionShape(("model", "x", "steps", "temperature")),
               _COUNTED, _SAT.format("sample_discrete_euler_with_temperature")),
        Member("sample", FunctionShape(("model", "x", "steps", "eta")), _COUNTED, _SAT.format("sample")),
    ),
    fingerprints=(
        (SAT_FORK_TRIPLE, {"20024f3b562d3f4d": "SongBloom git 0d0337b (2025-05-27) to ef78022 (2025-12-04)"}),
        (SAT_FORK_PAIR, {"0b54bf61611d9562": "ThinkSound 0.0.19 (PyPI thinksound); AudioX git 1bf5691 (2025-04-03) "
                                             "to ca179cc (2025-04-17)",
                         # vendored elsewhere (its other samplers are left as they are at such a path)
                         "a588d6c9baed9ceb": "stable-audio-tools 0.0.19 (a copy)"}),
    ),
)

FAMILIES = [CHECKPOINT, FLOW_MATCHING, F5_SAMPLE, LDM_SAMPLING, SAT_FORKS]


def checkpoint_family(upstream: str, module: str, known: Mapping[str, str], *,
                      requires: str | None = None, mixed: bool = False) -> list[Patch]:
    """The :data:`CHECKPOINT` family's patches for ``module``, a path where ``upstream`` is known
    to define it, recognised by the fingerprints ``known`` (with their provenance); ``mixed`` adds
    sgm's ``mixed_checkpoint``. Fingerprints cover all the definitions."""
    return CHECKPOINT.patches(upstream, module, known, over=_MIXED if mixed else _PAIR, requires=requires)


def flow_matching_family(upstream: str, module: str, over: tuple[str, ...], *,
                         requires: str | None = None) -> list[Patch]:
    """The :data:`FLOW_MATCHING` patches of the entries in ``over`` (an entry and its solver) that
    ``upstream`` defines in ``module``, recognised by every known fingerprint of ``over``."""
    return FLOW_MATCHING.patches(upstream, module, FLOW_MATCHING.known(over), over=over, requires=requires)


def torch_checkpoint_module_default(name: str, upstream: str, target: str, provenance: str) -> Patch:
    """``target`` (``module:alias``) is ``torch.utils.checkpoint`` bound as a module alias, whose
    ``alias.checkpoint(...)`` calls pass no ``use_reentrant``: those calls become non-reentrant."""
    return Patch(name, target, f"{_FIX}:replace_torch_checkpoint_module",
                 IsObject("torch.utils.checkpoint", provenance), upstream,
                 "torch checkpoint (module alias) made non-reentrant: gradients reach parameters when no input "
                 "requires grad")


def torch_checkpoint_default(name: str, upstream: str, module: str, provenance: str) -> Patch:
    """``module`` bound ``torch.utils.checkpoint.checkpoint`` and calls it without ``use_reentrant``:
    its calls become non-reentrant (torch's default elsewhere in the program is unchanged)."""
    return Patch(name, f"{module}:checkpoint",
                 f"{_FIX}:replace_torch_checkpoint",
                 IsObject("torch.utils.checkpoint:checkpoint", provenance), upstream,
                 "torch checkpoint made non-reentrant: gradients reach parameters when no input requires grad")
