"""What run_step uses for grad_steps and checkpoint_steps: checkpoint (recompute per evaluation), budget
(checkpoint_steps="budget:<size>"), window and regions (where grad_steps resumes recording), odeint
(torchdiffeq solver steps)."""
