"""openai/guided-diffusion (V1, GitHub) and the fork PyPI ``guided-diffusion-sdk`` ships (V3).

``guided_diffusion.nn`` defines the checkpoint, rebound by ``guided_diffusion.unet``, whose
``AttentionBlock`` always checkpoints. V3 saves tensors properly and filters parameters that do not
require grad, so frozen parameters work; but it does not replay the dropout RNG or CPU autocast, fails
on ``None`` inputs, raises for a trainable parameter the block does not use, and drops second-order
terms, so it is replaced too. Tested against guided-diffusion-sdk 1.0.0.

The sampling loops: ``GaussianDiffusion.p_sample_loop_progressive`` and
``ddim_sample_loop_progressive`` are generators whose ``with th.no_grad():`` block wraps the ``yield``,
so the consumer's loop body runs without grad too; ``p_sample_loop``/``ddim_sample_loop`` consume them.
All four take ``cache=False`` (:func:`gradpatch.differentiable`; the generators stay generators and the
caller's grad mode holds between items): gradients reach the ``model`` argument's parameters and
``noise``; a step is one ``model`` call, ``self.num_timesteps`` of them, so ``grad_steps`` refuses
``skip_timesteps`` (fewer steps: the count does not match). Classifier guidance (``cond_fn``) computes
its gradient with ``th.autograd.grad`` without ``create_graph``: it enters the sample as a constant.
Only the sdk's copies are declared (openai/guided-diffusion's differ: fingerprints in the survey).
"""
from gradpatch.sampling.generic.any_sampler import sampler
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch

from ._families import checkpoint_family

_LOOP = sampler(step="model", steps="self.num_timesteps")
_SDK = "guided-diffusion-sdk 1.0.0"


def _loop(method: str, over: tuple[str, ...], fingerprint: str) -> Patch:
    return Patch(f"guided_diffusion.{method}", f"guided_diffusion.gaussian_diffusion:GaussianDiffusion.{method}",
                 _LOOP, Fingerprints({fingerprint: _SDK}, over=tuple(f"GaussianDiffusion.{m}" for m in over)),
                 "guided_diffusion", f"{method}(cache=False): gradients through the sampling loop; grad_steps, "
                 "checkpoint_steps", "guided-diffusion-sdk<2")

PATCHES = checkpoint_family("guided_diffusion", "guided_diffusion.nn", {
    # The `th` alias normalises away: openai/guided-diffusion@aca3097a hashes like AudioLDM's copy.
    "78fc3e61f1317c31": "V1 · openai/guided-diffusion@aca3097a",
    "f4a39d1f50f6fc11": "V3 · guided-diffusion-sdk 1.0.0",
}, requires="guided-diffusion-sdk<2") + [
    _loop("p_sample_loop", ("p_sample_loop", "p_sample_loop_progressive"), "874ad5d0eaa1ccea"),
    _loop("p_sample_loop_progressive", ("p_sample_loop_progressive",), "61a1d8aaa94512db"),
    _loop("ddim_sample_loop", ("ddim_sample_loop", "ddim_sample_loop_progressive"), "e8d2b9cbe1886321"),
    _loop("ddim_sample_loop_progressive", ("ddim_sample_loop_progressive",), "31cc879d7a6a569f"),
]
