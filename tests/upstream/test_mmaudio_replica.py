"""MMAudio (GitHub only): the declared fix of ``mmaudio.eval_utils.generate`` on a replica.

The replica is a package ``mmaudio`` written to a temporary folder: ``eval_utils.generate`` as in
hkchengrex/MMAudio@974010a026c731054592d8f777218bd9d85a6c24 (``mmaudio/eval_utils.py``, with the imports
its names resolve through, so its fingerprint is upstream's), ``FlowMatching`` (``mmaudio/model/flow_matching.py``:
Euler over ``num_steps``), a tiny ``MMAudio`` network with upstream's ``ode_wrapper`` (CFG: two
``predict_flow`` calls) and in-place ``unnormalize``, and a tiny ``FeaturesUtils`` whose encoders,
``decode`` and ``vocode`` are ``@torch.inference_mode()`` as upstream's (``mmaudio/model/utils/features_utils.py``).

Upstream's ``generate`` returns an inference tensor under ``no_grad`` and raises with grad on (the
encoders' inference tensors cannot be saved for backward); it takes no ``cache``.
Patched, ``cache=True`` is upstream bit for bit; ``cache=False`` gradients of every trainable parameter
(network, feature extractor, decoder, vocoder) and of the video inputs equal the same computation written
by hand with grad on, in float64; ``grad_steps=K`` equals it with the latent detached at the top of
step N-K; ``checkpoint_steps`` equals the plain run.
"""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

import gradpatch
from gradpatch.patching.fingerprint import fingerprint_module
from support import assert_grads_close

pytestmark = pytest.mark.usefixtures("single_thread")

FLOW_MATCHING = '''
import torch
from torchdiffeq import odeint


class FlowMatching:

    def __init__(self, min_sigma: float = 0.0, inference_mode='euler', num_steps: int = 25):
        super().__init__()
        self.min_sigma = min_sigma
        self.inference_mode = inference_mode
        self.num_steps = num_steps

    def to_data(self, fn, x0):
        return self.run_t0_to_t1(fn, x0, 0, 1)

    def run_t0_to_t1(self, fn, x0, t0, t1):
        if self.inference_mode == 'adaptive':
            return odeint(fn, x0, torch.tensor([t0, t1], device=x0.device, dtype=x0.dtype))
        elif self.inference_mode == 'euler':
            x = x0
            steps = torch.linspace(t0, t1 - self.min_sigma, self.num_steps + 1)
            for ti, t in enumerate(steps[:-1]):
                flow = fn(t, x)
                next_t = steps[ti + 1]
                dt = next_t - t
                x = x + dt * flow
        return x
'''

NETWORKS = '''
from typing import NamedTuple
import torch


class PreprocessedConditions(NamedTuple):
    clip_f: torch.Tensor
    text_f: torch.Tensor


class MMAudio(torch.nn.Module):  # tiny: the interface generate() uses, upstream's ode_wrapper and unnormalize
    latent_seq_len, latent_dim, clip_seq_len = 5, 3, 2

    def __init__(self):
        super().__init__()
        self.clip_input_proj, self.text_input_proj = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
        self.audio_input_proj, self.t_embed = torch.nn.Linear(3, 8), torch.nn.Linear(1, 8)
        self.final_layer = torch.nn.Linear(8, 3)
        self.empty_string_feat = torch.nn.Parameter(torch.randn(2, 4) * 0.3)
        self.register_buffer("latent_mean", torch.randn(1, 1, 3) * 0.1)
        self.register_buffer("latent_std", torch.rand(1, 1, 3) + 0.5)

    def get_empty_clip_sequence(self, bs):
        return torch.zeros(bs, 2, 4)

    def get_empty_sync_sequence(self, bs):
        return torch.zeros(bs, 4, 4)

    def get_empty_string_sequence(self, bs):
        return self.empty_string_feat.unsqueeze(0).expand(bs, -1, -1)

    def preprocess_conditions(self, clip_f, sync_f, text_f):
        return PreprocessedConditions(self.clip_input_proj(clip_f).mean(1) + sync_f.mean((1, 2))[:, None],
                                      self.text_input_proj(text_f).mean(1))

    def get_empty_conditions(self, bs, *, negative_text_features=None):
        text = self.get_empty_string_sequence(bs) if negative_text_features is None else negative_text_features
        return self.preprocess_conditions(self.get_empty_clip_sequence(bs), self.get_empty_sync_sequence(bs), text)

    def predict_flow(self, latent, t, conditions):
        h = self.audio_input_proj(latent) + (self.t_embed(t[:, None]) + conditions.clip_f + conditions.text_f)[:, None]
        return self.final_layer(torch.tanh(h))

    def unnormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(self.latent_std).add_(self.latent_mean)

    def ode_wrapper(self, t: torch.Tensor, latent: torch.Tensor, conditions: PreprocessedConditions,
                    empty_conditions: PreprocessedConditions, cfg_strength: float) -> torch.Tensor:
        t = t * torch.ones(len(latent), device=latent.device, dtype=latent.dtype)

        if cfg_strength < 1.0:
            return self.predict_flow(latent, t, conditions)
        else:
            return (cfg_strength * self.predict_flow(latent, t, conditions) +
                    (1 - cfg_strength) * self.predict_flow(latent, t, empty_conditions))
'''

FEATURES_UTILS = '''
import torch


class FeaturesUtils(torch.nn.Module):  # tiny: upstream's inference_mode helpers around small layers
    def __init__(self):
        super().__init__()
        self.clip_model, self.synchformer = torch.nn.Linear(6, 4), torch.nn.Linear(6, 4)
        self.text_table = torch.nn.Parameter(torch.randn(2, 4) * 0.5)
        self.decoder, self.vocoder = torch.nn.Conv1d(3, 4, 3, padding=1), torch.nn.Conv1d(4, 1, 1)

    @torch.inference_mode()
    def encode_video_with_clip(self, x: torch.Tensor, batch_size: int = -1) -> torch.Tensor:
        return self.clip_model(x)

    @torch.inference_mode()
    def encode_video_with_sync(self, x: torch.Tensor, batch_size: int = -1) -> torch.Tensor:
        return self.synchformer(x)

    @torch.inference_mode()
    def encode_text(self, text: list[str]) -> torch.Tensor:
        return self.text_table[None] * torch.tensor([[len(s)] for s in text], dtype=self.dtype)[..., None] / 10

    @torch.inference_mode()
    def vocode(self, mel: torch.Tensor) -> torch.Tensor:
        return self.vocoder(mel)

    @torch.inference_mode()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z.transpose(1, 2))

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def dtype(self):
        return next(self.parameters()).dtype
'''

EVAL_UTILS = '''
from typing import Optional

import torch

from mmaudio.model.flow_matching import FlowMatching
from mmaudio.model.networks import MMAudio
from mmaudio.model.utils.features_utils import FeaturesUtils


def generate(
    clip_video: Optional[torch.Tensor],
    sync_video: Optional[torch.Tensor],
    text: Optional[list[str]],
    *,
    negative_text: Optional[list[str]] = None,
    feature_utils: FeaturesUtils,
    net: MMAudio,
    fm: FlowMatching,
    rng: torch.Generator,
    cfg_strength: float,
    clip_batch_size_multiplier: int = 40,
    sync_batch_size_multiplier: int = 40,
    image_input: bool = False,
) -> torch.Tensor:
    device = feature_utils.device
    dtype = feature_utils.dtype

    bs = len(text)
    if clip_video is not None:
        clip_video = clip_video.to(device, dtype, non_blocking=True)
        clip_features = feature_utils.encode_video_with_clip(clip_video,
                                                             batch_size=bs *
                                                             clip_batch_size_multiplier)
        if image_input:
            clip_features = clip_features.expand(-1, net.clip_seq_len, -1)
    else:
        clip_features = net.get_empty_clip_sequence(bs)

    if sync_video is not None and not image_input:
        sync_video = sync_video.to(device, dtype, non_blocking=True)
        sync_features = feature_utils.encode_video_with_sync(sync_video,
                                                             batch_size=bs *
                                                             sync_batch_size_multiplier)
    else:
        sync_features = net.get_empty_sync_sequence(bs)

    if text is not None:
        text_features = feature_utils.encode_text(text)
    else:
        text_features = net.get_empty_string_sequence(bs)

    if negative_text is not None:
        assert len(negative_text) == bs
        negative_text_features = feature_utils.encode_text(negative_text)
    else:
        negative_text_features = net.get_empty_string_sequence(bs)

    x0 = torch.randn(bs,
                     net.latent_seq_len,
                     net.latent_dim,
                     device=device,
                     dtype=dtype,
                     generator=rng)
    preprocessed_conditions = net.preprocess_conditions(clip_features, sync_features, text_features)
    empty_conditions = net.get_empty_conditions(
        bs, negative_text_features=negative_text_features if negative_text is not None else None)

    cfg_ode_wrapper = lambda t, x: net.ode_wrapper(t, x, preprocessed_conditions, empty_conditions,
                                                   cfg_strength)
    x1 = fm.to_data(cfg_ode_wrapper, x0)
    x1 = net.unnormalize(x1)
    spec = feature_utils.decode(x1)
    audio = feature_utils.vocode(spec)
    return audio
'''

STEPS, CFG, TEXT = 4, 2.5, ["a dog barks", "rain"]


@pytest.fixture(scope="module")
def mmaudio(tmp_path_factory):
    """The replica package, imported before the patch is applied, patched by ``apply("mmaudio")``."""
    root = tmp_path_factory.mktemp("mmaudio_replica")
    files = {"mmaudio/__init__.py": "", "mmaudio/model/__init__.py": "", "mmaudio/model/utils/__init__.py": "",
             "mmaudio/model/flow_matching.py": FLOW_MATCHING, "mmaudio/model/networks.py": NETWORKS,
             "mmaudio/model/utils/features_utils.py": FEATURES_UTILS, "mmaudio/eval_utils.py": EVAL_UTILS}
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    assert "mmaudio" not in sys.modules
    sys.path.insert(0, str(root))
    try:
        eval_utils = importlib.import_module("mmaudio.eval_utils")
        upstream = eval_utils.generate
        with gradpatch.applied("mmaudio") as report:
            yield eval_utils, upstream, {r.patch: r for r in report}
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n.split(".")[0] == "mmaudio"]:
            del sys.modules[name]


@pytest.fixture
def float64():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def build(eval_utils, dropout=False):
    from mmaudio.model.flow_matching import FlowMatching
    from mmaudio.model.networks import MMAudio
    from mmaudio.model.utils.features_utils import FeaturesUtils

    torch.manual_seed(0)
    net, features = MMAudio(), FeaturesUtils()
    generator = torch.Generator().manual_seed(1)
    clip = torch.randn(2, 2, 6, generator=generator).requires_grad_()
    sync = torch.randn(2, 4, 6, generator=generator).requires_grad_()
    return net, features, FlowMatching(num_steps=STEPS), clip, sync


def call(fn, net, features, fm, clip, sync, **options):
    return fn(clip, sync, TEXT, negative_text=["quiet", "no"], feature_utils=features, net=net, fm=fm,
              rng=torch.Generator().manual_seed(2), cfg_strength=CFG, **options)


def reference(net, features, fm, clip, sync, first=-1):
    """``generate`` by hand with grad on: no inference_mode, the Euler loop written out, the latent
    entering step ``first`` detached (-1: none), ``unnormalize`` out of place."""
    clip_f, sync_f = features.clip_model(clip), features.synchformer(sync)
    text = features.text_table[None] * torch.tensor([[len(s)] for s in TEXT])[..., None] / 10
    negative = features.text_table[None] * torch.tensor([[len(s)] for s in ["quiet", "no"]])[..., None] / 10
    x = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(2))
    conditions = net.preprocess_conditions(clip_f, sync_f, text)
    empty = net.preprocess_conditions(torch.zeros(2, 2, 4), torch.zeros(2, 4, 4), negative)
    ts = torch.linspace(0, 1, STEPS + 1)
    for i in range(STEPS):
        x = x.detach() if i == first else x
        t = ts[i] * torch.ones(2)
        flow = CFG * net.predict_flow(x, t, conditions) + (1 - CFG) * net.predict_flow(x, t, empty)
        x = x + (ts[i + 1] - ts[i]) * flow
    x = x * net.latent_std + net.latent_mean
    return features.vocoder(features.decoder(x.transpose(1, 2)))


def tensors(net, features, clip, sync):
    return [*net.parameters(), *features.parameters(), clip, sync]


def grads(out, inputs):
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    return list(torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True))


def test_the_replica_is_upstreams_generate(mmaudio):
    eval_utils, upstream, records = mmaudio
    assert fingerprint_module(eval_utils, ["generate"]) == "61f32904299a6af0"
    record = records["mmaudio.generate"]
    assert record.status == "applied" and record.variant.startswith("MMAudio git aab32f6")


def test_upstream_gives_no_graph_and_takes_no_cache(mmaudio, float64):
    eval_utils, upstream, _ = mmaudio
    net, features, fm, clip, sync = build(eval_utils)
    with torch.no_grad():
        assert call(upstream, net, features, fm, clip, sync).is_inference()
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        call(upstream, net, features, fm, clip, sync)  # grad on: the encoders' inference tensors meet the network
    with pytest.raises(TypeError, match="unexpected keyword argument 'cache'"):
        call(upstream, net, features, fm, clip, sync, cache=False)


OPTIONS = [{}, {"grad_steps": 1}, {"grad_steps": 3}, {"checkpoint_steps": True}, {"grad_steps": 2, "checkpoint_steps": True}]


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "grad_steps=1", "grad_steps=3", "checkpoint_steps",
                                                  "grad_steps=2+checkpoint_steps"])
def test_declared_fix_gives_the_hand_written_gradients(mmaudio, float64, options):
    eval_utils, _, _ = mmaudio
    net, features, fm, clip, sync = build(eval_utils)
    inputs = tensors(net, features, clip, sync)
    got = grads(call(eval_utils.generate, net, features, fm, clip, sync, cache=False, **options), inputs)
    first = STEPS - options["grad_steps"] if "grad_steps" in options else -1
    want = grads(reference(net, features, fm, clip, sync, first), inputs)
    assert_grads_close(got, want, rtol=1e-7)
    used = [w for w, p in zip(want, inputs) if p is not net.empty_string_feat]  # negative_text stands in for it
    assert all(w is not None and w.any() for w in used), [w is None for w in used]  # parameters, video inputs


def test_cache_true_is_upstream_bitwise(mmaudio, float64):
    eval_utils, upstream, _ = mmaudio
    net, features, fm, clip, sync = build(eval_utils)
    with torch.no_grad():
        got = call(eval_utils.generate, net, features, fm, clip, sync)
        want = call(upstream, net, features, fm, clip, sync)
    assert torch.equal(got, want) and got.is_inference()
