"""LeRobot (PyPI ``lerobot``; GitHub huggingface/lerobot): the flow-matching VLA policies and the diffusion policy.

pi0 / pi05 (``PI0Pytorch``/``PI05Pytorch.sample_actions``, ``@torch.no_grad()``) and SmolVLA
(``VLAFlowMatching.sample_actions``, called under the policy's ``@torch.no_grad()`` ``predict_action_chunk``)
compute the VLM prefix's key/value cache once, then Euler-integrate the action expert's velocity
(``lerobot.policies.common.flow_matching.euler_integrate``; before 0.6 an inline loop updating
``x_t += dt * v_t`` in place, made exact by copy on write). ``sample_actions(..., cache=False)``: gradients to
the action expert, the projections, the VLM (through the prefix cache) and to ``noise``/``state``;
``grad_steps=K`` counts Euler steps (one ``denoise_step`` each; the latent entering step N-K is detached),
``checkpoint_steps=True`` recomputes each ``denoise_step`` in backward. SmolVLA refuses ``grad_steps``
(ValueError): its ``denoise_step`` appends to the prefix's KV cache and crops it back every step, so steps
run without grad would leave the cache without the prefix's graph; SmolVLA's ``sample_actions`` is not
decorated (its policy's ``predict_action_chunk`` is, around it): ``cache=False`` adds the options.

The diffusion policy: ``DiffusionModel.conditional_sample`` (a diffusers scheduler loop, one ``self.unet``
call per step, ``self.num_inference_steps`` of them) and the policy's ``@torch.no_grad()``
``DiffusionPolicy.predict_action_chunk(batch, noise=None, cache=False)``, which reaches it through
``generate_actions``. Not declared: the policies' ``select_action`` (an action queue across calls).
Fingerprints hash each entry with the step it calls (lerobot 0.6.1, Python >= 3.12).
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.generic.any_sampler import sampler

_SAMPLE = "{}.sample_actions(cache=False): gradients through the Euler solve; grad_steps, checkpoint_steps"
_FAMILY = "gradpatch.sampling.families.lerobot"
_FLOW = f"{_FAMILY}:flow_sampler"
_POLICIES = "lerobot.policies"
_DIFFUSION = f"{_POLICIES}.diffusion.modeling_diffusion"


def _flow(name: str, module: str, cls: str, fix: str, digest: str) -> Patch:
    return Patch(f"lerobot.{name}.sample_actions", f"{_POLICIES}.{module}:{cls}.sample_actions", fix,
                 Fingerprints({digest: "lerobot 0.6.1"}, over=(f"{cls}.sample_actions", f"{cls}.denoise_step")),
                 "lerobot", _SAMPLE.format(cls), "lerobot")


PATCHES = [
    _flow("pi0", "pi0.modeling_pi0", "PI0Pytorch", _FLOW, "b233f441343cfff7"),
    _flow("pi05", "pi05.modeling_pi05", "PI05Pytorch", _FLOW, "17492aeddb735c38"),
    _flow("smolvla", "smolvla.modeling_smolvla", "VLAFlowMatching", f"{_FAMILY}:smolvla_sampler", "95f1e8f940e63aff"),
    Patch("lerobot.diffusion.conditional_sample", f"{_DIFFUSION}:DiffusionModel.conditional_sample",
          sampler(step="unet", steps="self.num_inference_steps"),
          Fingerprints({"ea841b7b86df9ded": "lerobot 0.6.1"}), "lerobot",
          "DiffusionModel.conditional_sample(cache=False): gradients through the scheduler loop; grad_steps, "
          "checkpoint_steps", "lerobot"),
    Patch("lerobot.diffusion.predict_action_chunk", f"{_DIFFUSION}:DiffusionPolicy.predict_action_chunk",
          sampler(step="diffusion.unet", steps="self.diffusion.num_inference_steps"),
          Fingerprints({"47b13794203b76d9": "lerobot 0.6.1"}, over=(
              "DiffusionPolicy.predict_action_chunk", "DiffusionModel.generate_actions")), "lerobot",
          "DiffusionPolicy.predict_action_chunk(cache=False): gradients to the U-Net and the observation "
          "encoder; grad_steps, checkpoint_steps", "lerobot"),
]
