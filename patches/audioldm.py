"""AudioLDM (PyPI ``audioldm``; GitHub haoheliu/AudioLDM), and the identical copies tango vendors.

``audioldm.latent_diffusion.util`` defines the OpenAI/CompVis checkpoint (variant V1); ``attention``
and ``openaimodel`` rebind it, and ``BasicTransformerBlock``/``AttentionBlock`` force it on whatever
``use_checkpoint`` says. Unpatched, freezing any parameter of a transformer block makes ``backward()``
raise "One of the differentiated Tensors does not require grad". Tested against PyPI audioldm 0.1.1.
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family("audioldm", "audioldm.latent_diffusion.util", {
    # Same bytes in every commit of haoheliu/AudioLDM (ce91b11d, 2023-01-29, onwards; before that at
    # audioldm/model/latent_diffusion/util.py), in PyPI audioldm 0.1.1 and in declare-lab/tango's
    # audioldm/, mustango/audioldm/ and tango2/audioldm/ (ceb8bd5f, bc247ddc, 6ec558ca).
    "78fc3e61f1317c31": "V1 · audioldm 0.1.1 = haoheliu/AudioLDM@ce91b11d = declare-lab/tango@ceb8bd5f",
}, requires="audioldm<1")
