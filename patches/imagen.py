"""imagen-pytorch (PyPI ``imagen-pytorch``; GitHub lucidrains/imagen-pytorch): the cascade's DDPM sampler.

``Imagen.sample`` is ``@torch.no_grad()`` over ``@eval_decorator`` over ``@beartype``, and the levels it
calls, ``p_sample_loop`` and ``p_sample``, are ``@torch.no_grad()`` too. ``eval_decorator`` is not
``functools.wraps``-based (``inspect.unwrap`` stops at it); :func:`gradpatch.differentiable` sees
through it and makes its ``model.eval()``/``model.train(was_training)`` inert for the call, so the
caller's train/eval mode holds. ``sample(text_embeds=..., cache=False)`` gives gradients to every U-Net
of the cascade; ``grad_steps``/``checkpoint_steps`` are offered one stage at a time, on
``p_sample_loop(unet, shape, noise_scheduler=..., cache=False, grad_steps=K)``: a step is one
``unet.forward_with_cond_scale`` call (classifier-free guidance's two ``forward`` calls inside it),
``noise_scheduler.num_timesteps`` of them (``skip_steps`` or inpainting resamples change that count:
``grad_steps`` then raises; ``checkpoint_steps`` does not mind). The frozen T5's in-body ``no_grad``
(``t5_encode_tokenized_text``) is not on the path when ``text_embeds`` are passed in. Not declared:
``ElucidatedImagen`` (same decorators, another loop). ``import imagen_pytorch`` reads the T5 config of
``google/t5-v1_1-base`` at import (network, or a Hugging Face cache holding that ``config.json``).
Fingerprints hash each entry with the levels it calls (imagen-pytorch 2.1.0).
"""
from gradpatch.patching.fingerprint import Fingerprints
from gradpatch.patching.patch import Patch
from gradpatch.sampling.generic.any_sampler import sampler

_IMAGEN = "imagen_pytorch.imagen_pytorch:Imagen"

PATCHES = [
    Patch("imagen_pytorch.sample", f"{_IMAGEN}.sample", sampler(),
          Fingerprints({"c282b0399647948c": "imagen-pytorch 2.1.0"},
                       over=("Imagen.sample", "Imagen.p_sample_loop", "Imagen.p_sample")),
          "imagen_pytorch", "Imagen.sample(cache=False): gradients to every U-Net of the cascade",
          "imagen-pytorch"),
    Patch("imagen_pytorch.p_sample_loop", f"{_IMAGEN}.p_sample_loop",
          sampler(step="unet.forward_with_cond_scale", steps="noise_scheduler.num_timesteps"),
          Fingerprints({"b21a85de8aeb7ac3": "imagen-pytorch 2.1.0"},
                       over=("Imagen.p_sample_loop", "Imagen.p_sample")),
          "imagen_pytorch", "Imagen.p_sample_loop(cache=False): one stage; grad_steps, checkpoint_steps",
          "imagen-pytorch"),
]
