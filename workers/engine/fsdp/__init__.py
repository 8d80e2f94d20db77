"""The FSDP2 engine (`actor.strategy=fsdp`, the default): `engine.py` (FSDPEngine). It has no config
section of its own; LoRA adapters (`../lora.py`) and sharded checkpoints are its features."""
