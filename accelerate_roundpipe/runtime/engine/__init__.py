"""The facade: RoundPipe, the parts it is built from, its threads, pass launch and checkpoints."""
