"""AudioLCM (GitHub liuhuadai/AudioLCM = Text-to-Audio/AudioLCM, and forks): the LCM sampler.

Its ``ldm`` tree is CompVis latent diffusion plus two modules of its own, at paths only AudioLCM's
lineage uses: ``ldm.models.diffusion.scheduling_lcm`` (``LCMSampler``, the sampler its inference
scripts and ``LCM_audio.sample_log`` run) and ``ldm.models.diffusion.lcm_audio`` (``LCM_audio``).
``LCMSampler.sample``, ``lcm_sampling`` and ``step`` are ``@torch.no_grad()``: ``sample(S, batch_size,
shape, cond, cache=False, grad_steps=K, checkpoint_steps=True)`` runs through
:func:`gradpatch.differentiable`; a step is one ``self.model.apply_model`` call (the consistency
model ``self.model.unet``, guidance given as an embedding ``w_cond``: no second call), ``S`` steps.
``LCMSampler.register_buffer`` moves every schedule tensor to ``cuda`` (SD1's ``DDIMSampler`` code,
same fingerprint): replaced by the ``ldm`` fix that keeps them on the model's device (runs on CPU).
``LCM_audio.sample_log(cond, batch_size, ddim, ddim_steps, cache=False, ...)`` and
``decode_first_stage(z, cache=False)`` are the model-level entries (``@torch.no_grad()`` too). The
training loss ``lcm_losses`` computes its consistency target under ``with torch.no_grad():`` on
purpose; it is not on these paths. ``LCM_audio.sample``/``p_sample_loop`` are not declared: they call
``apply_model`` without its ``model`` argument and cannot run. The checkpoint in
``ldm.modules.diffusionmodules.util`` is CompVis V1, covered by ``patches/ldm.py``. Fingerprints: every
version of the two files in the repositories' history (2024-06 to 2025-10); tested on a replica in
``tests/upstream/test_audiolcm_replica.py`` (GitHub only: no package carries it).
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.generic.any_sampler import sampler

_SAMPLER = "ldm.models.diffusion.scheduling_lcm:LCMSampler"
_MODEL = "ldm.models.diffusion.lcm_audio:LCM_audio"
_HISTORY = ("liuhuadai/AudioLCM@4dfb84c (2024-06-01) to be5a709 = Text-to-Audio/AudioLCM@4dfb84c to 51db10c "
            "(2025-07) = mahshid1378/Audio-LCM-Model@2460ae7 = matthieu-cervera/VCI_Editing@9d0556f (2025-10)")

PATCHES = [
    Patch("audiolcm.LCMSampler.sample", f"{_SAMPLER}.sample",
          sampler(step="model.apply_model", steps="S"),
          Fingerprints({"401cbaded443310b": _HISTORY},
                       over=("LCMSampler.sample", "LCMSampler.lcm_sampling", "LCMSampler.step")),
          "audiolcm", "LCMSampler.sample(cache=False): gradients through the LCM loop; grad_steps, checkpoint_steps"),
    Patch("audiolcm.LCMSampler.register_buffer", f"{_SAMPLER}.register_buffer",
          "gradpatch.sampling.families.ldm_guards:buffers_follow_model",
          Fingerprints({"890b0198f7cc2775": "liuhuadai/AudioLCM@4dfb84c to be5a709 = Text-to-Audio/AudioLCM = "
                                            "mahshid1378/Audio-LCM-Model@2460ae7 (SD1 DDIMSampler's code)",
                        "b928c3e484b9409c": "matthieu-cervera/VCI_Editing@9d0556f (cuda when available)"}),
          "audiolcm", "sampler buffers on the model's device instead of forced CUDA (works on CPU)"),
    Patch("audiolcm.LCM_audio.sample_log", f"{_MODEL}.sample_log",
          sampler(step="apply_model", steps="ddim_steps"),
          Fingerprints({"c5123b8ac7507722": _HISTORY}),
          "audiolcm", "LCM_audio.sample_log(cache=False): LCMSampler's loop; grad_steps, checkpoint_steps"),
    Patch("audiolcm.LCM_audio.decode_first_stage", f"{_MODEL}.decode_first_stage", sampler(),
          Fingerprints({"ab7660941c49f473": _HISTORY}),
          "audiolcm", "LCM_audio.decode_first_stage(cache=False): gradients flow"),
]
