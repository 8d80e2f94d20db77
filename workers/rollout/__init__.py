"""Rollout engines: vLLM and HF generate behind one factory."""
