"""Role classes: what the driver calls on each Ray worker group (one module per role)."""
