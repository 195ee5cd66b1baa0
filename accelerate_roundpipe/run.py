"""`python -m accelerate_roundpipe.run script.py ARGS` (or `accelerate launch -m accelerate_roundpipe.run ...`).

See `accelerate_roundpipe.integrations.launcher`.
"""

from accelerate_roundpipe.integrations.launcher import main

if __name__ == "__main__":
    main()
