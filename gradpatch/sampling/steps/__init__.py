"""What run_step uses for grad_steps and checkpoint_steps: checkpoint (recompute per evaluation), budget
(checkpoint_steps="budget:<size>"), peak and peak_plan (checkpoint_steps="peak:<size>"), window and regions (where grad_steps resumes recording), odeint
(torchdiffeq solver steps)."""
