"""The roles a latent-diffusion sampling method plays: each names the fix factory that serves it."""

ENTRY = "entry"
LIFTED = "lifted_entry"
INNER = "inner"
STEP_BY_INDEX = "step_by_index"
STEP_BY_TIMESTEP = "step_by_timestep"
REFUSE = "refuse_cache_false"
EMA = "guard_ema_scope"
DEVICE = "buffers_follow_model"
SOLVER = "solver_sample"

#: Where each role's fix factory lives.
FIXES = {
    **dict.fromkeys((ENTRY, LIFTED, INNER, STEP_BY_INDEX, STEP_BY_TIMESTEP), "gradpatch.sampling.families.ldm"),
    **dict.fromkeys((REFUSE, EMA, DEVICE), "gradpatch.sampling.families.ldm_guards"),
    SOLVER: "gradpatch.sampling.families.ldm_dpm_solver",
}

SUMMARIES = {
    ENTRY: "cache=False: gradients through the undecorated call, caller's mode kept; grad_steps, checkpoint_steps",
    LIFTED: "cache=False: gradients through a copy with its in-body no_grad lifted; grad_steps, checkpoint_steps",
    INNER: "runs undecorated inside a cache=False call",
    STEP_BY_INDEX: "runs undecorated inside a cache=False call; one sampling step (index = steps left)",
    STEP_BY_TIMESTEP: "runs undecorated inside a cache=False call; one sampling step (t = steps left)",
    REFUSE: "cache=False refused (ends in numpy, inside ema_scope); points at sample_log + decode_first_stage",
    EMA: "ema_scope refused during cache=False sampling; graphs across a weight swap raise in backward",
    DEVICE: "sampler buffers on the model's device instead of forced CUDA (works on CPU)",
    SOLVER: "runs with its in-body no_grad lifted inside a cache=False call; one step per model-function call",
}
