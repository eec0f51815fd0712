"""gradpatch.differentiable for any sampler: any_sampler (the public function, torch-free), call (one call),
gradoff (the sampler's grad-off managers made inert), copy_on_write (in-place writes), coroutine (async
samplers)."""
