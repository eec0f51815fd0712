"""Every known version of the latent-diffusion family's models' methods (DDPM, LatentDiffusion and subclasses), declared once: data only.

``"Class.method"`` (``"Class.method:lifted"`` for a version whose body holds an in-body ``no_grad``) ->
``(role, {fingerprint: where that version is found}[, {fingerprint of a version fixed upstream: where}])``.
Each codebase's module in ``patches/`` names only where its classes live and which of these methods they
define (:func:`gradpatch.patches._ldm.ldm_sampling`); a version is recognised at any of them. Fingerprints
from ``python -m gradpatch.patching.fingerprint`` on the packages and snapshots named. The training,
logging and conditioning helpers (``get_input``, ``log_images``, ...) are ``@torch.no_grad()`` too: declared
so that none is left cutting the graph of a ``cache=False`` call that reaches it.
"""
from ._ldm_roles import EMA, ENTRY, INNER, LIFTED, REFUSE, STEP_BY_TIMESTEP

MODELS = {
    "DDPM.ema_scope": (EMA, {
        "516818d47320aa7d": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "c3f74c6f1df1147b": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2",
        "afccb50b09441242": "AudioLDM-training-finetuning@702a638 = stable-diffusion-sdkit 2.1.5 = "
                            "Stability-AI/stablediffusion@cf1d67a = CompVis/stable-diffusion@21f890f "
                            "= CompVis/latent-diffusion@a506df5",
    }),
    "DDPM.p_sample": (STEP_BY_TIMESTEP, {
        "55d951dfc17ebc2a": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "f3a209378c74b0da": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "5fa33bec0ae182a8": "AudioLDM-training-finetuning@702a638",
        "3471205f0f28053f": "audiosr 0.0.7 = kagayoi-audiosr 1.0.2",
        "abab388d99dfabbc": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDPM.p_sample_loop": (ENTRY, {
        "e3bcd5dbeee5d564": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies) = audioldm2 0.1.0 = "
                            "haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = kagayoi-audiosr 1.0.2 = "
                            "AudioLDM-training-finetuning@702a638 = CompVis/stable-diffusion@21f890f "
                            "= stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/latent-diffusion@a506df5",
    }),
    "DDPM.sample": (ENTRY, {
        "65121dff17f0534d": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies) = AudioLDM-training-finetuning@702a638",
        "dcb4a96c8599bb02": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7",
        "a055a63ddb4a5cf0": "kagayoi-audiosr 1.0.2",
        "0a42b13e3068607d": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDPM.log_images": (INNER, {
        "eed93ef04f3a6366": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDPM.validation_step": (INNER, {
        "788336e3fe971715": "AudioLDM-training-finetuning@702a638",
        "e5f1ec1460b49f7a": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDPM.init_from_ckpt": (INNER, {
        "611beab222b9e378": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
        "fe5c5acf54a9df62": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentDiffusion.decode_first_stage": (ENTRY, {
        "52a5254b04e9b09b": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "17cc3466967e0137": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
        "987d86812a20cf8e": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.encode_first_stage": (ENTRY, {
        "70a353ecaa2bb405": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies) = stable-diffusion-sdkit 2.1.5 = "
                            "Stability-AI/stablediffusion@cf1d67a",
        "a169a9f3b7c09e4c": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.generate_sample": (REFUSE, {
        "1a06a0aea99afeb5": "haoheliu/AudioLDM@e7665a0..73f1e9c (2023-01-30; saves files)",
        "81ef16b0e6bff025": "audioldm 0.1.1 = haoheliu/AudioLDM@7ec3062..4054cb4 = declare-lab/tango "
                            "(3 copies)",
        "fab3ebfebeb65993": "haoheliu/AudioLDM@aec8adc..fd21faf (2023-02-25..03-01)",
        "faeeadfe78c3a0fe": "haoheliu/AudioLDM@c8244f6..aee27ee (2023-02-02..02-23)",
        "c9c2f5f3024f41ba": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "2a253405e296c19e": "AudioLDM-training-finetuning@702a638",
    }),
    "LatentDiffusion.generate_sample_masked": (REFUSE, {
        "ed99071f34ec696f": "audioldm 0.1.1 = haoheliu/AudioLDM@89e38d8..4054cb4 = declare-lab/tango "
                            "(3 copies)",
    }),
    "LatentDiffusion.get_input": (INNER, {
        "3c35a123bd019eb1": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "9244524c46e38cc0": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
        "c971238ed02912d2": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentDiffusion.p_sample": (STEP_BY_TIMESTEP, {
        "e196f815c8789b72": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "7ecab5fe7f9c0840": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "5a6aae779f5d69e8": "AudioLDM-training-finetuning@702a638",
        "e4e358fbd7268a44": "audiosr 0.0.7 = kagayoi-audiosr 1.0.2",
        "adb1d047f721fa58": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.p_sample_loop": (ENTRY, {
        "a5521aa3be654c4a": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies) = audioldm2 0.1.0 = "
                            "haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = kagayoi-audiosr 1.0.2 = "
                            "AudioLDM-training-finetuning@702a638 = CompVis/stable-diffusion@21f890f "
                            "= stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.progressive_denoising": (ENTRY, {
        "e33ecb5c31e60221": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies) = audioldm2 0.1.0 = "
                            "haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = kagayoi-audiosr 1.0.2 = "
                            "AudioLDM-training-finetuning@702a638 = CompVis/stable-diffusion@21f890f "
                            "= stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.sample": (ENTRY, {
        "3480a2d7a886028b": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies) = audioldm2 0.1.0 = "
                            "haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = kagayoi-audiosr 1.0.2 = "
                            "AudioLDM-training-finetuning@702a638",
        "f1f7fa1a8735aeb7": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.sample_log": (ENTRY, {
        "4ad859a7a3178e04": "audioldm 0.1.1 = haoheliu/AudioLDM@e7665a0..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "c0842813ca23e6f1": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "28d09d81583e5c3a": "AudioLDM-training-finetuning@702a638",
        "dc1b3b56e4a80772": "audiosr 0.0.7 = kagayoi-audiosr 1.0.2",
        "0c7dfc0227c95ea0": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.decode_first_stage:lifted": (LIFTED, {
        "e4f7a6e779beb2bd": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638",
    }),
    "LatentDiffusion.encode_first_stage:lifted": (LIFTED, {
        "f1d4b5ea526b470e": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638",
    }),
    "LatentDiffusion.generate_batch": (REFUSE, {
        "ffbaae944ea9e2b8": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "018639dfb1f61985": "kagayoi-audiosr 1.0.2",
        "44f84f9fb9bb8284": "audiosr 0.0.7",
    }),
    "LatentDiffusion.on_train_batch_start": (INNER, {
        "80bc9a4a9521658d": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2",
        "68c5ec12f1ba9d1c": "AudioLDM-training-finetuning@702a638",
        "ef021d4fe66ada8f": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.get_unconditional_conditioning": (INNER, {
        "6542b0bda67b1282": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentDiffusion.log_images": (INNER, {
        "05f323c7ab13ed5a": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
        "247d7cc82c4f47db": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "LatentDiffusion.to_rgb": (INNER, {
        "9d592911e2cae0d7": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "ControlLDM.get_input": (INNER, {
        "11b4d37b8a71569b": "lllyasviel/ControlNet@ed85cd1",
    }),
    "ControlLDM.get_unconditional_conditioning": (INNER, {
        "6c81c8fcc23aae22": "lllyasviel/ControlNet@ed85cd1",
    }),
    "ControlLDM.log_images": (INNER, {
        "c5aaf17787e529ee": "lllyasviel/ControlNet@ed85cd1",
    }),
    "ControlLDM.sample_log": (ENTRY, {
        "1fd0ffa50de1ae99": "lllyasviel/ControlNet@ed85cd1",
    }),
    "LatentDepth2ImageDiffusion.get_input": (INNER, {
        "8bd72d2c030b6ef7": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentDepth2ImageDiffusion.log_images": (INNER, {
        "5803f1b358f5f022": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentFinetuneDiffusion.log_images": (INNER, {
        "b4b32928b82c5883": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentInpaintDiffusion.get_input": (INNER, {
        "713f9ed031d6b0c3": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentInpaintDiffusion.log_images": (INNER, {
        "1761a574f367544a": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentUpscaleDiffusion.get_input": (INNER, {
        "bf247bd3116c202a": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentUpscaleDiffusion.log_images": (INNER, {
        "04e8ca09043c9296": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentUpscaleFinetuneDiffusion.get_input": (INNER, {
        "f1d76bf23b71d15a": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "LatentUpscaleFinetuneDiffusion.log_images": (INNER, {
        "c22a7fc169e74394": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
}
