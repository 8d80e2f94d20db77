"""The stages around RL, each a small driver on the same runtime (workers, engines, data, checkpoints):

    stage=sft   supervised fine-tuning          rlframe/stages/sft.py
    stage=dpo   DPO / IPO / SimPO on pairs      rlframe/stages/dpo.py   (+ on-policy pairs: rlframe/pairs.py)
    stage=rm    Bradley-Terry reward model      rlframe/stages/reward_model.py

`python -m rlframe.main recipe=sft_math` picks the stage from the recipe's `stage:` key.
"""
