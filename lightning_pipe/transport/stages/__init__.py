"""A stage in its process: the driver's side, the runner of each step, the host's optimizers, state and ties."""
