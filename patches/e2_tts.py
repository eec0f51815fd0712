"""E2-TTS (PyPI ``e2-tts-pytorch``; GitHub lucidrains/e2-tts-pytorch): ``E2TTS.sample`` cannot be
differentiated.

Every release (0.0.1 to 2.2.2) decorates ``e2_tts_pytorch.e2_tts.E2TTS.sample`` with
``@torch.no_grad()``, calls ``self.eval()`` without restoring the caller's mode and integrates with the
module global ``odeint`` (torchdiffeq; default method ``midpoint``). The fix is F5-TTS's (see
``patches/f5_tts.py`` and ``gradpatch/sampling/run.py``): ``sample(..., cache=True, *,
grad_steps=None, checkpoint_steps=False)``, where ``cache=True`` is the original method and
``cache=False`` the undecorated body with grad on and the caller's train/eval mode kept. E2's
transformer has no text cache, so ``cache`` only selects the mode. ``grad_steps=K`` counts solver
steps (``steps - 1`` intervals for E2's ``linspace(0, 1, steps)`` grid; midpoint evaluates twice per
step). ``cfg_null_model`` (autoguidance) is evaluated as given; its mode is not changed.

Fingerprints cover every PyPI release (25 distinct ``sample`` definitions); the in-process tests run
2.2.2. Pass ``use_vocos=False`` (or a vocoder of your own) to avoid downloading Vocos.
"""
from gradpatch.patching.fingerprint import Fingerprints, has_parameter
from gradpatch.patching.patch import Patch

_SAMPLING = "gradpatch.sampling.families.ode"

SAMPLE = Fingerprints(
    known={
        "138a925f85f29250": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.1–0.0.2 (2024-07-12)",
        "a2e9368a96feda53": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.3–0.0.6 (2024-07-12)",
        "fac0fc98ea1cf107": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.7 (2024-07-13)",
        "1e7f8173b9bd0c8d": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.8–0.0.9 (2024-07-13)",
        "3bceaf3c9adb1f72": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.10 (2024-07-13)",
        "1501d68f6d8492ef": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.11 (2024-07-13)",
        "71113eb61f2f1c25": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.12 (2024-07-13)",
        "04fc73641e05ee10": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.14 (2024-07-14)",
        "e7aed1bccd075c0d": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.15–0.0.17 (2024-07-14)",
        "ab9d792d9afbfdcf": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.18–0.0.19 (2024-07-14)",
        "f63f8bc2db769e13": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.20–0.0.21 (2024-07-14)",
        "fd792eb66dfb2615": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.22 (2024-07-14)",
        "45b4d2eb286be370": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.23–0.0.34 (2024-07-14…2024-07-18)",
        "5bf013ebbaa97705": "e2-tts 0.0.x · PyPI e2-tts-pytorch 0.0.35–0.0.41 (2024-07-19…2024-07-22)",
        "5b6b2adb0477b6ee": "e2-tts 0.x · PyPI e2-tts-pytorch 0.0.42–0.1.9 (2024-07-23…2024-07-25)",
        "4d42291f6d91599b": "e2-tts 0.x · PyPI e2-tts-pytorch 0.1.10 (2024-07-27)",
        "bc376a3ed208ee14": "e2-tts 0.x · PyPI e2-tts-pytorch 0.2.0 (2024-07-27)",
        "d2d11b190960360e": "e2-tts 0.x · PyPI e2-tts-pytorch 0.2.1–0.4.0 (2024-07-27…2024-08-16)",
        "712d8c602fed3f70": "e2-tts 0.x · PyPI e2-tts-pytorch 0.4.1–0.6.3 (2024-08-19…2024-08-27)",
        "d31061755a0e353e": "e2-tts 0.x · PyPI e2-tts-pytorch 0.7.0–0.9.7 (2024-08-28…2024-09-09)",
        "5a7714d25282fe48": "e2-tts 0.9.8–1.0.x · PyPI e2-tts-pytorch 0.9.8–1.0.0 (2024-09-09)",
        "83e27001396dbee5": "e2-tts 0.9.8–1.0.x · PyPI e2-tts-pytorch 1.0.1 (2024-09-10)",
        "ee992c57b9991660": "e2-tts 0.9.8–1.0.x · PyPI e2-tts-pytorch 1.0.2 (2024-09-10)",
        "9dfd3abc5c22c8b3": "e2-tts 1.0.4–2.1.1 · PyPI e2-tts-pytorch 1.0.4–2.1.1 (2024-09-10…2025-03-09)",
        "397b47e8304dbfa8": "e2-tts 2.2.x · PyPI e2-tts-pytorch 2.2.0–2.2.2 (2025-03-12 on)",
    },
    fixed_if=has_parameter("cache"),
)

PATCHES = [
    Patch("e2_tts.sample", "e2_tts_pytorch.e2_tts:E2TTS.sample", f"{_SAMPLING}:differentiable_sampler",
          SAMPLE, "e2_tts", "E2TTS.sample(cache=False): gradients through the ODE solve, caller's mode "
                            "kept; grad_steps, checkpoint_steps", "e2-tts-pytorch"),
]
