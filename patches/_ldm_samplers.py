"""Every known version of the latent-diffusion family's samplers' methods (DDIM, PLMS, DPM-Solver), declared once: data only.

``"Class.method"`` (``"Class.method:lifted"`` for a version whose body holds an in-body ``no_grad``) ->
``(role, {fingerprint: where that version is found}[, {fingerprint of a version fixed upstream: where}])``.
Each codebase's module in ``patches/`` names only where its classes live and which of these methods they
define (:func:`gradpatch.patches._ldm.ldm_sampling`); a version is recognised at any of them. Fingerprints
from ``python -m gradpatch.patching.fingerprint`` on the packages and snapshots named.
"""
from ._ldm_roles import DEVICE, ENTRY, INNER, SOLVER, STEP_BY_INDEX

SAMPLERS = {
    "DDIMSampler.ddim_sampling": (INNER, {
        "3dc729d70dfed2bf": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4",
        "56696c323a52dcfc": "declare-lab/tango@ceb8bd5 audioldm/, @bc247dd mustango/audioldm/, "
                            "@6ec558c tango2/audioldm/ (tqdm leave=False)",
        "88300a195ac38551": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "Stability-AI/stablediffusion@cf1d67a = stable-diffusion-sdkit 2.1.5 = "
                            "lllyasviel/ControlNet@ed85cd1",
        "fb839a0830195150": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDIMSampler.decode": (ENTRY, {
        "eb20bc6d347a0d73": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "6151b2dde2ccd6a0": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "Stability-AI/stablediffusion@cf1d67a = lllyasviel/ControlNet@ed85cd1",
        "121d67b33f0b4ad7": "CompVis/stable-diffusion@21f890f",
        "3e53d7a188c1eb9b": "stable-diffusion-sdkit 2.1.5",
    }),
    "DDIMSampler.p_sample_ddim": (STEP_BY_INDEX, {
        "7a771e2410f3352b": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "0e88abd52f764f59": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "be8eb1568ad32320": "AudioLDM-training-finetuning@702a638",
        "db4b71d42a33cc23": "audiosr 0.0.7 = kagayoi-audiosr 1.0.2",
        "e0e7187123aa0c31": "lllyasviel/ControlNet@ed85cd1",
        "114306ab3d893a69": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
        "1a96824c9eb1f804": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDIMSampler.register_buffer": (DEVICE, {
        "890b0198f7cc2775": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..8e7e477 = declare-lab/tango "
                            "(3 copies) = lllyasviel/ControlNet@ed85cd1 = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
        "3f4b78d1e34d1fff": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2",
        "2b2f59529f4c5212": "AudioLDM-training-finetuning@702a638 = "
                            "Stability-AI/stablediffusion@cf1d67a",
    }, {
        "b9d2a5ec0550e9a1": "haoheliu/AudioLDM@4054cb4 (2025-06-25, unreleased): moves to "
                            "self.model.device",
        "920459e7fe10e930": "stable-diffusion-sdkit 2.1.5: buffers already follow the model's device",
    }),
    "DDIMSampler.sample": (ENTRY, {
        "81cd664aac1147ea": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "7ca1a34f1dab2c6c": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2",
        "148af6a5a3041a5a": "AudioLDM-training-finetuning@702a638",
        "fbd4c5b88ce267f0": "lllyasviel/ControlNet@ed85cd1 = stable-diffusion-sdkit 2.1.5 = "
                            "Stability-AI/stablediffusion@cf1d67a",
        "52b6ad2bb29ace22": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "DDIMSampler.stochastic_encode": (ENTRY, {
        "56620495bcdadd57": "audioldm 0.1.1 = haoheliu/AudioLDM@0d68895..4054cb4 (HEAD) = "
                            "declare-lab/tango (3 copies)",
        "47fd9e33268d70d7": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "9f46a3692a094530": "AudioLDM-training-finetuning@702a638",
        "882c839e9f195098": "audiosr 0.0.7 = kagayoi-audiosr 1.0.2",
        "b556a97de0174ae3": "lllyasviel/ControlNet@ed85cd1 = stable-diffusion-sdkit 2.1.5 = "
                            "Stability-AI/stablediffusion@cf1d67a = CompVis/stable-diffusion@21f890f",
    }),
    "DDIMSampler.encode": (ENTRY, {
        "0911282aa5e02fb3": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "Stability-AI/stablediffusion@cf1d67a = stable-diffusion-sdkit 2.1.5",
        "bf3de183dca5fec9": "lllyasviel/ControlNet@ed85cd1",
    }),
    "PLMSSampler.p_sample_plms": (STEP_BY_INDEX, {
        "5c3282b0ca2918d9": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5",
        "58e65ca70a1022b2": "AudioLDM-training-finetuning@702a638",
        "4121f2ab875e9708": "audiosr 0.0.7 = kagayoi-audiosr 1.0.2",
        "3b180813a01cd7d2": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
        "3ff2abcd8aacdb12": "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
    }),
    "PLMSSampler.plms_sampling": (INNER, {
        "f6f07c2392b8ea7b": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
        "aad84645ba548e07": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "PLMSSampler.register_buffer": (DEVICE, {
        "890b0198f7cc2775": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
        "2b2f59529f4c5212": "Stability-AI/stablediffusion@cf1d67a",
    }, {
        "920459e7fe10e930": "stable-diffusion-sdkit 2.1.5: buffers already follow the model's device",
    }),
    "PLMSSampler.sample": (ENTRY, {
        "fc84eb8f72062b19": "audioldm2 0.1.0 = haoheliu/AudioLDM2@b5786c5 = audiosr 0.0.7 = "
                            "kagayoi-audiosr 1.0.2 = AudioLDM-training-finetuning@702a638 = "
                            "CompVis/stable-diffusion@21f890f = CompVis/latent-diffusion@a506df5",
        "e4cf24e891857d32": "stable-diffusion-sdkit 2.1.5 = Stability-AI/stablediffusion@cf1d67a",
    }),
    "DPMSolverSampler.register_buffer": (DEVICE, {
        "890b0198f7cc2775": "AudioLDM-training-finetuning@702a638 = CompVis/stable-diffusion@21f890f",
        "2b2f59529f4c5212": "Stability-AI/stablediffusion@cf1d67a",
    }, {
        "920459e7fe10e930": "stable-diffusion-sdkit 2.1.5: buffers already follow the model's device",
    }),
    "DPMSolverSampler.sample": (ENTRY, {
        "2cd2704987415efd": "AudioLDM-training-finetuning@702a638 = CompVis/stable-diffusion@21f890f",
        "1b9a2d39476e03c2": "stable-diffusion-sdkit 2.1.5",
        "7cb87b3cb416a588": "Stability-AI/stablediffusion@cf1d67a",
        "df0b06b6289208bb": "ControlNet@ed85cd1",
    }),
    "DPM_Solver.sample": (SOLVER, {
        "80d4a48b32df4647": "AudioLDM-training-finetuning@702a638 = CompVis/stable-diffusion@21f890f",
        "1b5e3a7b72346eba": "stable-diffusion-sdkit 2.1.5",
        "2a7a5ecd0d1a2b72": "Stability-AI/stablediffusion@cf1d67a",
    }),
}
