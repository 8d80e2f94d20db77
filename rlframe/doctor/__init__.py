"""`python -m rlframe.doctor <the arguments of rlframe.main>`: prove a run is wired right before it trains.

The checks, each a pass / warn / fail with what was measured and the fix (docs/doctor.md):

    config/     valid, model folder, memory plan                      setup_checks.py
    data/       rows read and mapped, prompt lengths vs the limit     data_checks.py
    template/   stop ids, generation prompt, append-only multi-turn   template_checks.py
    media/      image/video/audio placeholder tokens: config ids vs the processor's, counts   media_checks.py
    reward/     own answers vs corrupted ones, speed                  reward_checks.py
    live/       the real workers, once: determinism, the log-prob gap, one real step (group signal, weight
                sync checksums, the gap after the sync, the LoRA adapter, gates, timing and ETA)   live_checks.py

Everything but live/ runs without Ray (`--no-workers` stops there). The checklist goes to the console and
to <run_dir>/doctor.json (the run report shows it); the exit code is 1 when a check fails.
"""
