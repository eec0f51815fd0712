"""F5-TTS (PyPI ``f5-tts``; GitHub SWivid/F5-TTS): ``CFM.sample`` cannot be differentiated.

Every version decorates ``f5_tts.model.cfm.CFM.sample`` with ``@torch.no_grad()``, calls
``self.eval()`` without restoring the caller's mode and, from 1.0.0 on, makes the backbone (DiT, UNetT,
MMDiT) reuse the first step's text embedding across ODE steps (``cache=True``). The fix (PR #1299's
interface, which is not merged) adds ``sample(..., cache=True, *, grad_steps=None,
checkpoint_steps=False)``:

* ``cache=True`` (default): the original method, untouched.
* ``cache=False``: the undecorated body with grad on, ``self.eval()`` a no-op, ``cache=False`` forced
  into the backbone's calls and its ``clear_cache()`` skipped (nothing is written to the cache), so
  gradients reach the transformer's parameters and differentiable inputs (``cond``).
* ``grad_steps=K`` / ``checkpoint_steps=True`` (with ``cache=False``): for the duration of such a call
  the module global ``odeint`` of ``f5_tts.model.cfm`` is shadowed by a wrapper that numbers the solver
  steps and runs each ODE function evaluation (one batched transformer call from 1.1.6 on, two before)
  through ``gradpatch.sampling.run.run_step``; it acts only in the caller's context, so concurrent
  ``cache=True`` calls are untouched. ``grad_steps`` needs a fixed-grid method (F5's default is
  ``euler``). See ``gradpatch/sampling/run.py``.

Recognition is by the fingerprint of ``CFM.sample`` alone, and ``cfm.py`` has been byte-identical from
1.1.16 to 1.1.22 (and at the git-only tags 1.1.18 and 1.1.19), so one fingerprint covers the end of the
1.1.6-1.1.18 family, 1.1.19 (thread-local cache) and 1.1.20-1.1.22 (lazy thread-local cache). The fix
does not depend on how the backbone stores its cache. Copies from before 2024-10-23 lived in a
top-level ``model`` package and are not targets. A version that already takes ``cache`` is
"fixed upstream" and left alone.

Out of scope: F5's own inference helpers (``f5_tts.infer.utils_infer.infer_batch_process`` and the
trainer's sample logging) call ``sample`` inside ``torch.inference_mode()``, where no graph can be
recorded; they are meant for inference, and patching them would mean replacing their bodies. Call
``model.sample(..., cache=False)`` directly (``cache=False`` under ``inference_mode`` raises).
"""
from gradpatch.patching.fingerprint import Fingerprints, has_parameter
from gradpatch.patching.patch import Patch

_SAMPLING = "gradpatch.sampling.families.ode"

SAMPLE = Fingerprints(
    known={
        # 0.x: two transformer calls (drop_audio_cond / drop_text), no text cache.
        "8e76fdebfe37a27b": "f5-tts 0.x · git SWivid/F5-TTS@c4eee0f9 (2024-10-23)",
        "dcd95c6911ac37a7": "f5-tts 0.x · git SWivid/F5-TTS@712d5277 (2024-10-31)",
        "70f540c50e0fa7d5": "f5-tts 0.x · git SWivid/F5-TTS@36a4aad6 (2024-10-31)",
        "5bed6412e2f02a15": "f5-tts 0.x · git SWivid/F5-TTS@b1809617 (2024-11-01)",
        "9151883c5614335e": "f5-tts 0.x · git SWivid/F5-TTS@5aa47660 (2024-11-26)",
        "b824b992328906f5": "f5-tts 0.x · PyPI f5-tts 0.3.4 (git 4872afef, 2025-01-07)",
        "2b1f6863e33517df": "f5-tts 0.x · PyPI f5-tts 0.6.2 (git 607b92b3, 2025-01-28)",
        # 1.0.0-1.1.5: two calls with cache=True, clear_cache() after odeint.
        "fdc19253b2ba73fc": "f5-tts 1.0.0–1.1.5 · PyPI f5-tts 1.0.0, 1.0.3, 1.0.8, 1.1.0, 1.1.4 "
                            "(git ca6e49ad 2025-03-12, d9dfbe47 2025-04-03)",
        "5392d58115d4fa6f": "f5-tts 1.0.0–1.1.5 · PyPI f5-tts 1.1.5 (use_epss; git 2e2acc6e 2025-06-04, "
                            "0914170e 2025-06-11)",
        "0ee0a3d22ed6cc07": "f5-tts git-only batch_cfg · git SWivid/F5-TTS@b1a94384 (2025-06-11)",
        # 1.1.6 on: one batched call (cfg_infer=True, cache=True).
        "442a5972be99d634": "f5-tts 1.1.6–1.1.18 · PyPI f5-tts 1.1.6–1.1.10, 1.1.15 (git b3ef4ed1 "
                            "2025-06-12 … 6b07fb03 2025-10-24)",
        "3d59b67a10d9082a": "f5-tts 1.1.16–1.1.22 · PyPI f5-tts 1.1.16, 1.1.17, 1.1.20–1.1.22 and git tags "
                            "1.1.18, 1.1.19 (cfm.py blob e001c2ec, 2026-01-25; families 1.1.6–1.1.18, "
                            "1.1.19 and 1.1.20–1.1.22 share it)",
    },
    fixed_if=has_parameter("cache"),
)

PATCHES = [
    Patch("f5_tts.sample", "f5_tts.model.cfm:CFM.sample", f"{_SAMPLING}:differentiable_sampler", SAMPLE,
          "f5_tts", "CFM.sample(cache=False): gradients through the ODE solve, caller's mode kept, "
                    "text cache bypassed; grad_steps, checkpoint_steps", "f5-tts"),
]
