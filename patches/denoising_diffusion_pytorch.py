"""denoising-diffusion-pytorch (PyPI ``denoising-diffusion-pytorch``; GitHub lucidrains/denoising-diffusion-pytorch).

Every level of ``GaussianDiffusion``'s sampling is decorated (``sample``, ``p_sample_loop``,
``ddim_sample``, ``p_sample``: ``@torch.inference_mode()``; the 1-D variant ``@torch.no_grad()``), so
unwrapping the entry alone is not enough. ``sample(batch_size, cache=False, grad_steps=K,
checkpoint_steps=True)`` runs through :func:`gradpatch.differentiable`, which makes every decorator the
call reaches inert: gradients reach the denoiser ``self.model`` (ancestral and DDIM sampling alike; a
step is one ``self.model`` call, ``self.sampling_timesteps`` of them). Deliberate ``no_grad`` blocks
of the training code (``p_losses``' self-conditioning, the Karras U-Nets' weight normalisation) are not
on the sampling path and stay as written. Fingerprints hash the four methods together (1.x 2.3.4).
"""
from gradpatch.sampling.generic.any_sampler import sampler
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch

_CHAIN = ("sample", "p_sample_loop", "ddim_sample", "p_sample")
_FIX = sampler(step="model", steps="self.sampling_timesteps")
_SUMMARY = "sample(cache=False): gradients through every decorated level; grad_steps, checkpoint_steps"

PATCHES = [
    Patch("denoising_diffusion_pytorch.sample", "denoising_diffusion_pytorch.denoising_diffusion_pytorch:"
          "GaussianDiffusion.sample", _FIX,
          Fingerprints({"e67d680b3eb5e27a": "denoising-diffusion-pytorch 2.3.4"},
                       over=tuple(f"GaussianDiffusion.{m}" for m in _CHAIN)),
          "denoising_diffusion_pytorch", _SUMMARY, "denoising-diffusion-pytorch"),
    Patch("denoising_diffusion_pytorch.sample_1d", "denoising_diffusion_pytorch.denoising_diffusion_pytorch_1d:"
          "GaussianDiffusion1D.sample", _FIX,
          Fingerprints({"48d0376a2ca75d54": "denoising-diffusion-pytorch 2.3.4"},
                       over=tuple(f"GaussianDiffusion1D.{m}" for m in _CHAIN)),
          "denoising_diffusion_pytorch", _SUMMARY, "denoising-diffusion-pytorch"),
]
