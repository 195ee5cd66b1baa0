"""Launching stock scripts on RoundPipe: `install` (swap RoundPipe's classes in under the names a script imports),
`run_script` (run a script with them swapped in: what `python -m accelerate_roundpipe.run` does), `config_file`
(the `roundpipe:` section of an accelerate config file) and `cli` (the `accelerate-roundpipe` command).
"""
