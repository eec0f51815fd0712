"""MMAudio (GitHub hkchengrex/MMAudio, package ``mmaudio``): video/text-to-audio generation cannot be
differentiated.

``mmaudio.eval_utils.generate`` encodes the conditions through ``FeaturesUtils.encode_video_with_clip``,
``encode_video_with_sync`` and ``encode_text``, and decodes through ``FeaturesUtils.decode`` and ``vocode``,
all ``@torch.inference_mode()``; between them ``FlowMatching.to_data`` solves the flow ODE (Euler,
``num_steps`` steps, one CFG-combined ``net.ode_wrapper`` call each) and ``net.unnormalize`` rescales the
latent in place. Upstream returns an inference tensor; ``cache=False`` is an unexpected keyword.

The fix is :func:`gradpatch.differentiable` (``step="net.ode_wrapper"``, ``steps="fm.num_steps"``):
``cache=True`` is upstream's call; ``cache=False`` lifts the inference_mode helpers the call reaches
(gradients reach the network, the feature extractors' and decoder's trainable parameters, the video
inputs and the latent), keeps the in-place rescale exact (copy on write), ``grad_steps=K`` (the latent
entering step N-K detached) and ``checkpoint_steps=True``. ``FlowMatching(inference_mode='adaptive')``
returns torchdiffeq's whole trajectory, which upstream's decoder refuses whatever the options; its step
count is not ``num_steps`` (``grad_steps`` would raise at the step past it). Recognised by the fingerprints of ``generate`` over the repository's history.
"""
from __future__ import annotations

from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.generic.any_sampler import sampler

GENERATE = {  # mmaudio/eval_utils.py generate, by commit date
    "df664b45baa4fa6d": "MMAudio git d3cd41f to 9b6997a (2024-12-07 to 2024-12-11) · GitHub hkchengrex/MMAudio",
    "a9e02d9b2c1cb7b7": "MMAudio git 8c375bd to 09ebcc4 (2024-12-14 to 2024-12-22) · GitHub hkchengrex/MMAudio",
    "61f32904299a6af0": "MMAudio git aab32f6 (2024-12-24) to 974010a (2026-02-23) · GitHub hkchengrex/MMAudio",
}

PATCHES = [
    Patch("mmaudio.generate", "mmaudio.eval_utils:generate", sampler(step="net.ode_wrapper", steps="fm.num_steps"),
          Fingerprints(GENERATE), "mmaudio",
          "generate(cache=False): gradients through the features, the Euler solve and the decoder (inference_mode "
          "helpers lifted); grad_steps, checkpoint_steps", "mmaudio"),
]
