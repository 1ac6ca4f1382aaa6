"""Several GPUs over torchrun: DDP, FSDP2 and a sharded optimizer, each on top of the workload's
best single-GPU step, measured as the ladder measures one GPU.

- ``strategies``: what each strategy wraps, and the ladder step it goes on top of;
- ``request``: what a job measures, as the worker's command line, validated before launch;
- ``train``: one measurement on one rank (the ladder's session and loop, each rank's rows);
- ``worker``: the torchrun entry point (``python -m hwlib.distributed.worker``);
- ``launch``: torchrun as a subprocess, bounded in time, with the failing rank's error;
- ``comm``: all-reduce bus bandwidth and exposed communication from a profiler trace;
- ``scaling``: world sizes, weak and strong efficiency rows, figures and prose.
"""

# ``launch`` (the function) stays in its module: re-exported here it would hide the module of that name.
from .launch import LaunchError, LaunchResult, LaunchTimeout, RankFailed, Rendezvous, torchrun_argv
from .request import SCALINGS, STUDY, Request
from .strategies import STRATEGIES, Options, base_step

__all__ = ["LaunchError", "LaunchResult", "LaunchTimeout", "Options", "RankFailed", "Rendezvous",
           "Request", "SCALINGS", "STRATEGIES", "base_step", "torchrun_argv"]
