"""The grad-flow doctor: which parameters meant to train got no gradient, and why.

The usual symptom of broken gradient flow is silence: a parameter with ``requires_grad=True`` ends a
step with ``grad is None`` (or all zeros) and the optimiser quietly skips it. Or the step raises deep
inside someone else's ``CheckpointFunction``. :func:`explain_grads` looks at a model after a backward
(or at the error it raised) and names the modules involved and the likely cause: a known-broken
checkpoint gradpatch has not patched, a reentrant torch checkpoint, a ``@torch.no_grad()`` sampler, or
simply a parameter the loss never reached. "Reached" means the backward wrote a gradient: one that is
exactly zero (LoRA's ``lora_A`` while ``lora_B`` is still zero) is healthy. While it watches a step
(:func:`grad_doctor`, ``gradpatch doctor``) it sees torch's reentrant checkpoint however it is called,
and patched samplers run with ``cache=True`` (no graph) inside a loss (``gradpatch/doctor/watch.py``).
:func:`grad_doctor` wraps one training step and prints the diagnosis; ``gradpatch doctor script.py`` runs a whole script that way. Under the ``budget:<size>``
checkpoint policy both also print its plan (:func:`checkpoint_plan_text`).
"""
from gradpatch.doctor.script import run_script
from gradpatch.doctor.diagnosis import checkpoint_plan_text, explain_grads, grad_doctor

__all__ = ["checkpoint_plan_text", "explain_grads", "grad_doctor", "run_script"]
