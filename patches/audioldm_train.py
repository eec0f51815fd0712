"""The AudioLDM training and fine-tuning repository (GitHub haoheliu/AudioLDM-training-finetuning only).

``audioldm_train.utilities.diffusion_util`` holds the V1 checkpoint, rebound by
``audioldm_train.modules.diffusionmodules.attention`` and ``openaimodel``. (A second V1 copy in
``modules/diffusionmodules/nn.py`` is imported by nothing.) No installable package carries this code:
the fix is tested on PyPI audioldm, whose checkpoint has the same fingerprint.

Native sampling (``gradpatch.sampling.ldm``, ``gradpatch.sampling.ldm_dpm_solver``) in
``audioldm_train.modules.latent_diffusion``: AudioLDM2's samplers, ``LatentDiffusion`` (in-body ``no_grad``
in ``decode_first_stage``/``encode_first_stage``) and SD1's DPM-Solver, declared as for those codebases.
Fingerprints from haoheliu/AudioLDM-training-finetuning@702a638 (the repository as of 2024-12-13). No
installable package carries this code, so the fixes are tested on the installable code with the same
fingerprint where there is one: ``ddim_sampling``, ``encode``, ``decode``, ``plms_sampling``,
``PLMSSampler.sample``, ``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/
``decode_first_stage``/``encode_first_stage`` and ``DDPM.p_sample_loop`` equal audioldm2 0.1.0's,
``DDPM.sample`` audioldm 0.1.1's, ``ema_scope`` and the ``register_buffer`` methods sdkit's or SD1's
copies' shapes. ``DDIMSampler.sample``/``p_sample_ddim``/``stochastic_encode``, ``p_sample_plms``, the
``p_sample`` methods, ``sample_log``, ``generate_sample`` and the DPM-Solver pair are hashes of their
own (small edits of the AudioLDM2 and SD1 bodies: the same roles and arguments), not tested here.
"""
from gradpatch.sampling.lift import Liftable
from gradpatch.patching.registry import Patch

from ._families import checkpoint_family
from ._ldm import DEVICE, EMA, ENTRY, INNER, LIFTED, REFUSE, STEP_BY_INDEX, STEP_BY_TIMESTEP, ldm_sampling

PATCHES = checkpoint_family("audioldm_train", "audioldm_train.utilities.diffusion_util", {
    "78fc3e61f1317c31": "V1 · haoheliu/AudioLDM-training-finetuning@f34e6fb9",
})

_M = "audioldm_train.modules.latent_diffusion"
_DDIM, _PLMS = f"{_M}.ddim:DDIMSampler", f"{_M}.plms:PLMSSampler"
_DDPM, _LDM = f"{_M}.ddpm:DDPM", f"{_M}.ddpm:LatentDiffusion"
_DPMS = f"{_M}.dpm_solver.sampler:DPMSolverSampler"
_T = "AudioLDM-training-finetuning@702a638"

PATCHES += ldm_sampling("audioldm_train", [
    (f"{_DDIM}.register_buffer", DEVICE, {"2b2f59529f4c5212": f"{_T} = Stability-AI/stablediffusion@cf1d67a"}),
    (f"{_DDIM}.sample", ENTRY, {"148af6a5a3041a5a": _T}),
    (f"{_DDIM}.encode", ENTRY, {"0911282aa5e02fb3": f"{_T} = audioldm2 0.1.0"}),
    (f"{_DDIM}.decode", ENTRY, {"6151b2dde2ccd6a0": f"{_T} = audioldm2 0.1.0"}),
    (f"{_DDIM}.stochastic_encode", ENTRY, {"9f46a3692a094530": _T}),
    (f"{_DDIM}.ddim_sampling", INNER, {"88300a195ac38551": f"{_T} = audioldm2 0.1.0"}),
    (f"{_DDIM}.p_sample_ddim", STEP_BY_INDEX, {"be8eb1568ad32320": _T}),
    (f"{_PLMS}.register_buffer", DEVICE, {"890b0198f7cc2775": f"{_T} = audioldm2 0.1.0"}),
    (f"{_PLMS}.sample", ENTRY, {"fc84eb8f72062b19": f"{_T} = audioldm2 0.1.0"}),
    (f"{_PLMS}.plms_sampling", INNER, {"f6f07c2392b8ea7b": f"{_T} = audioldm2 0.1.0"}),
    (f"{_PLMS}.p_sample_plms", STEP_BY_INDEX, {"58e65ca70a1022b2": _T}),
    (f"{_DPMS}.register_buffer", DEVICE, {"890b0198f7cc2775": f"{_T} = CompVis/stable-diffusion@21f890f"}),
    (f"{_DPMS}.sample", ENTRY, {"2cd2704987415efd": f"{_T} = CompVis/stable-diffusion@21f890f"}),
    (f"{_DDPM}.sample", ENTRY, {"65121dff17f0534d": f"{_T} = audioldm 0.1.1"}),
    (f"{_DDPM}.p_sample_loop", ENTRY, {"e3bcd5dbeee5d564": f"{_T} = audioldm2 0.1.0"}),
    (f"{_DDPM}.p_sample", STEP_BY_TIMESTEP, {"5fa33bec0ae182a8": _T}),
    (f"{_DDPM}.ema_scope", EMA, {"afccb50b09441242": f"{_T} = stable-diffusion-sdkit 2.1.5"}),
    (f"{_DDPM}.validation_step", INNER, {"788336e3fe971715": _T}),
    (f"{_DDPM}.log_images", INNER, {"eed93ef04f3a6366": f"{_T} = audioldm2 0.1.0"}),
    (f"{_LDM}.on_train_batch_start", INNER, {"68c5ec12f1ba9d1c": _T}),
    (f"{_LDM}.sample", ENTRY, {"3480a2d7a886028b": f"{_T} = audioldm2 0.1.0"}),
    (f"{_LDM}.p_sample_loop", ENTRY, {"a5521aa3be654c4a": f"{_T} = audioldm2 0.1.0"}),
    (f"{_LDM}.p_sample", STEP_BY_TIMESTEP, {"5a6aae779f5d69e8": _T}),
    (f"{_LDM}.progressive_denoising", ENTRY, {"e33ecb5c31e60221": f"{_T} = audioldm2 0.1.0"}),
    (f"{_LDM}.sample_log", ENTRY, {"28d09d81583e5c3a": _T}),
    (f"{_LDM}.decode_first_stage", LIFTED, {"e4f7a6e779beb2bd": f"{_T} = audioldm2 0.1.0"}),
    (f"{_LDM}.encode_first_stage", LIFTED, {"f1d4b5ea526b470e": f"{_T} = audioldm2 0.1.0"}),
    (f"{_LDM}.generate_sample", REFUSE, {"2a253405e296c19e": _T}),
])

PATCHES.append(Patch(
    "audioldm_train.DPM_Solver.sample", f"{_M}.dpm_solver.dpm_solver:DPM_Solver.sample",
    "gradpatch.sampling.ldm_dpm_solver:solver_sample",
    Liftable({"80d4a48b32df4647": f"{_T} = CompVis/stable-diffusion@21f890f"}), "audioldm_train",
    "runs with its in-body no_grad lifted inside a cache=False call; one step per model-function call"))
