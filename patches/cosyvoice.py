"""CosyVoice 2/3 (GitHub FunAudioLLM/CosyVoice; not on PyPI with its model code): the flow decoder.

``cosyvoice.flow.flow_matching.CausalConditionalCFM.forward`` is ``@torch.inference_mode()``; the
inherited ``ConditionalCFM.solve_euler`` refills a batch-of-2 CFG buffer in place each step
(``x_in[:] = x``) and calls the estimator through ``forward_estimator``. Declared like Chatterbox's
copy (the flow-matching family): ``forward(..., cache=False, grad_steps=K, checkpoint_steps=True)``.
Recognised by fingerprint (every version of the file since CosyVoice 2, from the repository's history;
``patches/_families.py`` lists them), tested on a replica in ``tests/upstream/test_flow_matching_family.py``
and, through the shared loop shape, on Chatterbox's installable copy.

Not declared: ``ConditionalCFM.forward`` (CosyVoice 1's decoder) takes an argument named ``cache`` (the
prompt cache, passed by ``MaskedDiffWithXvec.inference``), and so does the 2025-01 to 2025-04
``CausalConditionalCFM.forward``: the patched sampler's ``cache`` keyword would capture it and break
upstream's own call. Those versions are unknown code (left alone, with a warning).
``flow.py``'s ``*.inference`` wrappers are not declared either.

The transformer encoder and decoder (``cosyvoice.transformer.encoder``/``decoder``) bind
``torch.utils.checkpoint as ckpt`` and, under ``gradient_checkpointing`` in training, call
``ckpt.checkpoint(layer.__call__, ...)`` without ``use_reentrant``: torch's reentrant default gives
the layers no parameter gradient when no input requires grad (a frozen front end, LoRA). Their ``ckpt``
becomes a stand-in whose ``checkpoint`` is non-reentrant (tested on Chatterbox's ``cp`` alias, the same
pattern, in ``tests/upstream/test_flow_matching_family.py``).
"""
from ._families import flow_matching_family, torch_checkpoint_module_default

PATCHES = flow_matching_family("cosyvoice", "cosyvoice.flow.flow_matching",
                               ("CausalConditionalCFM.forward", "ConditionalCFM.solve_euler")) + [
    torch_checkpoint_module_default(f"cosyvoice.{part}.ckpt", "cosyvoice", f"cosyvoice.transformer.{part}:ckpt",
                                    "torch reentrant default · FunAudioLLM/CosyVoice@ace7c47")
    for part in ("encoder", "decoder")
]
