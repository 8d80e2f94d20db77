"""What runs inside Ray actors; imported as `rlframe.workers` (see README, "Architecture")."""
