"""RL core: advantages, STARE weights, policy losses, diagnostics and the jitted update step."""
