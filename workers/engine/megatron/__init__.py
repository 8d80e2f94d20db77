"""The Megatron-core engine (`actor.strategy=megatron`): `settings.py` (the `megatron:` section and its
checks; cheap to import), `engine.py` (MegatronEngine), `convert.py` (HF <-> Megatron weights)."""
