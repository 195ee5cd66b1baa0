"""`python -m accelerate_roundpipe.run script.py ARGS` (or `accelerate launch -m accelerate_roundpipe.run ...`).

See `accelerate_roundpipe.launch.run_script`.
"""

from accelerate_roundpipe.launch.run_script import main

if __name__ == "__main__":
    main()
