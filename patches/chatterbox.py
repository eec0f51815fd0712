"""Chatterbox (PyPI ``chatterbox-tts``; GitHub resemble-ai/chatterbox): S3Gen's token-to-mel decoder.

``chatterbox.models.s3gen.flow_matching.CausalConditionalCFM.forward`` is ``@torch.inference_mode()``;
the ``ConditionalCFM.solve_euler`` it calls builds the CFG batch by refilling buffers in place every
step (``x_in[:B] = x_in[B:] = x``) and calls ``self.estimator.forward`` directly (module hooks are
bypassed). Unwrapping alone fails in backward (a buffer saved by the estimator was overwritten by the
next step). ``forward(..., cache=False)`` runs it through :func:`gradpatch.differentiable`: the
refills are copied on write, so gradients equal those of the same loop building the batch with
``torch.cat``; ``grad_steps`` and ``checkpoint_steps`` count one ``estimator.forward`` per step. The
meanflow path (``meanflow=True``, ``basic_euler``) is covered by the same patch. The vendored Matcha
``BASECFM`` (``...s3gen.matcha.flow_matching``) is the flow-matching family's Matcha copy.

Entry points above the decoder (``CausalMaskedDiffWithXvec.inference``, ``S3Token2Mel.flow_inference``,
``ChatterboxTTS.generate``) are not declared: ``generate`` ends in numpy and a watermark. Call the
decoder, or ``gradpatch.differentiable(s3gen.flow_inference, step=s3gen.flow.decoder.estimator,
steps=...)``. Tested against chatterbox-tts 0.1.7 (installed ``--no-deps``: it pins torch 2.6).

``chatterbox.models.s3gen.xvector`` (CAMPPlus speaker encoder, ``memory_efficient=True`` by default)
binds ``torch.utils.checkpoint as cp`` and calls ``cp.checkpoint(self.bn_function, x)`` in training
without ``use_reentrant``: its ``cp`` becomes a stand-in whose ``checkpoint`` is non-reentrant.
"""
from ._families import flow_matching_family, torch_checkpoint_module_default

PATCHES = flow_matching_family("chatterbox", "chatterbox.models.s3gen.flow_matching",
                               ("CausalConditionalCFM.forward", "ConditionalCFM.solve_euler"),
                               requires="chatterbox-tts") + \
    flow_matching_family("chatterbox", "chatterbox.models.s3gen.matcha.flow_matching",
                         ("BASECFM.forward", "BASECFM.solve_euler"), requires="chatterbox-tts") + [
    torch_checkpoint_module_default("chatterbox.xvector.cp", "chatterbox", "chatterbox.models.s3gen.xvector:cp",
                                    "torch reentrant default · chatterbox-tts 0.1.7")]
