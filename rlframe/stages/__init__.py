"""The stages around RL, each a small driver on the same runtime (workers, engines, data, checkpoints):

    stage=pt    continued pre-training on text  rlframe/stages/pt.py    (packed rows, held-out perplexity)
    stage=sft   supervised fine-tuning          rlframe/stages/sft.py
    stage=dpo   DPO / IPO / SimPO / ORPO / KTO  rlframe/stages/dpo.py   (+ on-policy pairs: rlframe/pairs.py)
    stage=rm    Bradley-Terry reward model      rlframe/stages/reward_model.py
    stage=rft   rejection-sampling fine-tuning  rlframe/stages/rft.py   (sample n, keep the best, SFT; or RRHF)

`python -m rlframe.main recipe=sft_math` picks the stage from the recipe's `stage:` key.
"""
