"""The rlframe board: a local web page (gradio) to configure, preview, launch, watch, compare, evaluate, chat
with and export runs, without writing YAML or shell.

    python -m rlframe.board                      # http://127.0.0.1:7860, workspace ./board_workspace
    python -m rlframe.board --host 0.0.0.0 --auth user:password

One module per job: forms (the train form -> `key=value` overrides), schema_help (each key's help text from
rlframe/config/), preview (validation, memory plan and command line, as `python -m rlframe.main` does them),
launcher (runs rlframe's own entry points as their own processes; stop, resume), runs (run folders read back),
datafiles and rewards (the data preview and the reward's "try it"), tools (eval, export, chat), settings,
i18n (English and Chinese labels), security (bind address, auth, uploads), app (the page).
"""
