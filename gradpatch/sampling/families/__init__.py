"""What each catalogued sampler family adds to the contract: ode (F5/E2), functions (k-diffusion,
stable-audio-tools), ldm, ldm_guards, ldm_dpm_solver, ldm_uncovered (latent-diffusion natives), diffusers,
diffusers_run (pipelines)."""
