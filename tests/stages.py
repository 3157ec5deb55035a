"""train_grpo.py as its main() in the test process, for the tests whose runs need one process
(tests/test_train_grpo.py, tests/test_learning.py)."""

import contextlib
import subprocess
import sys


def in_process(argv):
    """`python train_grpo.py ARGV` as its main() in this process: exit status, stdout and stderr
    as the command gives them. A fresh process spends ~13 s importing torch and transformers,
    most of a one-process round here; the single-process runs share this one. Accelerate's
    state is reset around each run, and torch uses one thread, as ENV gives launched processes."""
    import io

    import torch
    from accelerate.state import AcceleratorState

    import train_grpo

    out, err, code = io.StringIO(), io.StringIO(), 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(True)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                train_grpo.main(argv)
            except SystemExit as e:  # as the interpreter reports it: a message goes to stderr, status 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                code = 1 if isinstance(e.code, str) else e.code or 0
    finally:
        AcceleratorState._reset_state(True)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["train_grpo.py", *argv], code, out.getvalue(), err.getvalue())
