"""Pure RL functions: advantages, policy losses, DelTA coefficients, rewards."""
