"""AudioLDM (PyPI ``audioldm``; GitHub haoheliu/AudioLDM), and the identical copy tango vendors.

``audioldm.latent_diffusion.util`` defines the OpenAI/CompVis checkpoint (variant V1); ``attention``
and ``openaimodel`` rebind it, and ``BasicTransformerBlock``/``AttentionBlock`` force it on whatever
``use_checkpoint`` says. Unpatched, freezing any parameter of a transformer block makes ``backward()``
raise "One of the differentiated Tensors does not require grad".
"""
from ._families import checkpoint_family

PATCHES = checkpoint_family(
    "audioldm",
    "audioldm.latent_diffusion.util",
    {
        "78fc3e61f1317c31": "V1 · PyPI audioldm 0.1.1 audioldm/latent_diffusion/util.py",
    },
)
