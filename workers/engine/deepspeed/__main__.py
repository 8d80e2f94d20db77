"""`python -m rlframe.workers.engine.deepspeed` (make install): build DeepSpeed's compiled ops once."""

from rlframe.workers.engine.deepspeed.ops import main

main()
