"""The AudioLDM training and fine-tuning repository (GitHub haoheliu/AudioLDM-training-finetuning only).

``audioldm_train.utilities.diffusion_util`` holds the V1 checkpoint, rebound by
``audioldm_train.modules.diffusionmodules.attention`` and ``openaimodel``. (A second V1 copy in
``modules/diffusionmodules/nn.py`` is imported by nothing.) No installable package carries this code:
the fix is tested on PyPI audioldm, whose checkpoint has the same fingerprint.
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family("audioldm_train", "audioldm_train.utilities.diffusion_util", {
    "78fc3e61f1317c31": "V1 · haoheliu/AudioLDM-training-finetuning@f34e6fb9",
})
