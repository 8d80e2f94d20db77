"""The rlframe board: a local web page (gradio) to configure, preview, launch, watch, compare, evaluate, chat
with and export runs, without writing YAML or shell.

    python -m rlframe.board                      # prints: log in: http://127.0.0.1:7860/?token=...
    python -m rlframe.board --auth-file ~/.board-password   # a chosen password besides the token

One module per job: forms (the train form -> `key=value` overrides), schema_help (each key's help text from
rlframe/config/), preview (validation, memory plan and command line, as `python -m rlframe.main` does them),
launcher (runs rlframe's own entry points as their own processes; stop, resume), runs (run folders read back),
datafiles and rewards (the data preview and the reward's "try it"), tools (eval, export, chat), settings,
i18n (English and Chinese labels), login (the login and the Host/Origin guard in front of every route), security
(bind address, uploads, confined paths, checked commands), app (the page).
"""
