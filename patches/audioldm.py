"""AudioLDM (PyPI ``audioldm``; GitHub haoheliu/AudioLDM), and the identical copies tango vendors.

Checkpoint. ``audioldm.latent_diffusion.util`` defines the OpenAI/CompVis checkpoint (variant V1);
``attention`` and ``openaimodel`` rebind it, and ``BasicTransformerBlock``/``AttentionBlock`` force it on
whatever ``use_checkpoint`` says. Unpatched, freezing any parameter of a transformer block makes
``backward()`` raise "One of the differentiated Tensors does not require grad".

Native sampling (``gradpatch.sampling.families.ldm``). ``DDIMSampler.sample``/``decode``/
``stochastic_encode`` and ``LatentDiffusion.sample``/``p_sample_loop``/``progressive_denoising``/
``sample_log``/``decode_first_stage``/``encode_first_stage`` (and ``DDPM.sample``/``p_sample_loop``)
take ``cache``/``grad_steps``/``checkpoint_steps``; the decorated loops and steps they reach run
undecorated inside ``cache=False`` calls; a step is one ``p_sample_ddim`` (DDIM) or ``p_sample``
(ancestral) call. ``generate_sample*`` refuse ``cache=False``; ``ema_scope`` is guarded;
``DDIMSampler.register_buffer`` (which moves every buffer to CUDA) follows the model's device, so
sampling works on CPU. Upstream's ``DDPM.sample`` reads ``channels`` before assigning it and raises
``UnboundLocalError`` in every mode; it is patched like its siblings and still raises.

Fingerprints were computed (``python -m gradpatch.patching.fingerprint``) from PyPI audioldm 0.1.1 and from every
commit of haoheliu/AudioLDM (0d68895, 2023-01-30, to HEAD 4054cb4, 2025-06-25) and declare-lab/tango
(which vendors the package three times: @ceb8bd5 audioldm/, @bc247dd mustango/audioldm/, @6ec558c
tango2/audioldm/). Each label names the commit range over which a hash holds. PyPI audioldm 0.1.1 and
the three tango copies have the hash current at HEAD for every method except two: tango's
``ddim_sampling`` passes ``leave=False`` to tqdm (its own hash, same fix), and HEAD's
``register_buffer`` (unreleased) moves buffers to the model's device itself ("fixed upstream").
Tested against PyPI audioldm 0.1.1.
"""
from ._families import checkpoint_family
from ._ldm import ldm_sampling

PATCHES = checkpoint_family("audioldm", "audioldm.latent_diffusion.util", {
    # Same bytes in every commit of haoheliu/AudioLDM (ce91b11d, 2023-01-29, onwards; before that at
    # audioldm/model/latent_diffusion/util.py), in PyPI audioldm 0.1.1 and in declare-lab/tango's
    # audioldm/, mustango/audioldm/ and tango2/audioldm/ (ceb8bd5f, bc247ddc, 6ec558ca).
    "78fc3e61f1317c31": "V1 · audioldm 0.1.1 = haoheliu/AudioLDM@ce91b11d = declare-lab/tango@ceb8bd5f",
}, requires="audioldm<1")

_M = "audioldm"
PATCHES += ldm_sampling("audioldm", {
    f"{_M}.latent_diffusion.ddim:DDIMSampler":
        "register_buffer sample decode stochastic_encode ddim_sampling p_sample_ddim",
    f"{_M}.latent_diffusion.ddpm:DDPM": "sample p_sample_loop p_sample ema_scope",
    f"{_M}.ldm:LatentDiffusion":
        "sample p_sample_loop progressive_denoising sample_log decode_first_stage encode_first_stage "
        "get_input p_sample generate_sample generate_sample_masked",
}, requires="audioldm<1")
