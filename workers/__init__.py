"""What runs inside Ray actors; imported as `rlframe.workers` (see docs/architecture.md)."""
