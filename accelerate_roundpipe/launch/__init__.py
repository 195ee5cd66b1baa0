"""Launching stock scripts on RoundPipe: `install` (swap RoundPipe's classes in under the names a script imports),
`run_script` (run a script with them swapped in: what `python -m accelerate_roundpipe.run` does), `config_file`
(the `roundpipe:` section of an accelerate config file), `cli` (the `accelerate-roundpipe` command) and `refusals`
(how a command line refuses a setting: one `prog: error: ...` line, exit status 2).
"""
