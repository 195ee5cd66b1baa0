"""The process layouts RoundPipe runs under, as accelerate names them, and what to do instead of one process per GPU.

Kept apart from `multi_process.py` (which imports torch) so that the `accelerate-roundpipe` command can refuse a
layout without importing torch.
"""

MULTI_PROCESS_TYPES = ("MULTI_CPU", "MULTI_GPU")

ONE_PROCESS_PER_MACHINE = ("RoundPipe drives every GPU of a machine from one process: launch one process per machine "
                           "(`accelerate launch --num_machines N --num_processes N`, or `torchrun --nnodes N "
                           "--nproc-per-node 1`) and list that machine's GPUs in ROUNDPIPE_DEVICES (e.g. "
                           "'cuda:0,cuda:1'; unset means every visible GPU).")
